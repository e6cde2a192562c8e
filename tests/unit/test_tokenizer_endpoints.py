"""POST /tokenize and /detokenize in-process: the gateway app in front of an in-process gRPC server that serves
the router's own Tokenize/Detokenize methods (the rest of the router is not needed for them).

The whole system is in tests/integration/test_tokenize.py.
"""

from __future__ import annotations

import copy

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from distserve.engine.model_loader import load_tokenizer
from distserve.launcher import free_port
from distserve.v1 import router_pb2_grpc
from services.router.gateway.app import create_app
from services.router.gateway.chat_template import ChatTemplate
from services.router.gateway.config import GatewayConfig
from services.router.server import RouterServicer
from services.router.validation import MAX_CHARS_PER_TOKEN

MODEL = "distserve-tiny"
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
PROMPT = "def héllo():\n    return 1"


class TokenizerRouter(router_pb2_grpc.RouterServiceServicer):
    """The router servicer's Tokenize and Detokenize, with only the state they use."""

    Tokenize = RouterServicer.Tokenize
    Detokenize = RouterServicer.Detokenize

    def __init__(self, tokenizer, spec):
        self._tokenizer, self._spec = tokenizer, spec


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


@pytest.fixture
async def router_address(tokenizer, spec):
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(TokenizerRouter(tokenizer, spec), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def gateway(router_address: str, template: ChatTemplate) -> TestClient:
    config = GatewayConfig(router_address=router_address, redis_url=f"redis://127.0.0.1:{free_port()}/0", api_key=KEY)
    return TestClient(TestServer(create_app(config, template, MODEL)))


@pytest.fixture
async def client(router_address, tokenizer, spec):
    async with await gateway(router_address, ChatTemplate(tokenizer, spec.max_context)) as test_client:
        yield test_client


async def post(client: TestClient, path: str, body: dict, status: int = 200) -> dict:
    reply = await client.post(path, json=body, headers=AUTH)
    assert reply.status == status, await reply.text()
    return await reply.json()


async def test_tokenize_a_prompt_as_vllm(client, tokenizer, spec):
    ids = tokenizer(PROMPT)["input_ids"]
    assert await post(client, "/tokenize", {"model": MODEL, "prompt": PROMPT}) == {
        "count": len(ids), "max_model_len": spec.max_context, "tokens": ids, "token_strs": None}
    got = await post(client, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True})
    assert got["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])


async def test_tokenize_a_chat_as_chat_completions_would(client, tokenizer):
    got = await post(client, "/tokenize", {"model": MODEL, "messages": CHAT})
    assert got["tokens"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]
    got = await post(client, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert got["tokens"] == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    open_turn = CHAT + [{"role": "assistant", "content": "def sort("}]
    got = await post(client, "/tokenize", {"messages": open_turn, "add_generation_prompt": False,
                                           "continue_final_message": True, "return_token_strs": True})
    assert "".join(got["token_strs"]).endswith("Ġsort(")


async def test_detokenize_round_trips(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"] + [tokenizer.eos_token_id]
    assert await post(client, "/detokenize", {"model": MODEL, "tokens": ids}) == {"prompt": PROMPT + "<|eos|>"}
    assert await post(client, "/detokenize", {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 1}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "x" * (2048 * MAX_CHARS_PER_TOKEN + 1)}, "prompt"),  # the router's check
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"messages": CHAT, "prompt": "x"}, "prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * (2048 * MAX_CHARS_PER_TOKEN)}]}, "messages"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2**31]}, "tokens"),
    ("/detokenize", {"tokens": [1, 4096]}, "tokens"),  # the router's check: outside the vocabulary
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])
async def test_bad_input_is_a_400_naming_the_field(client, path, body, param):
    error = (await post(client, path, body, 400))["error"]
    assert error["param"] == param and error["message"].startswith(param) and error["type"] == "invalid_request_error"


async def test_another_model_is_404_and_the_key_is_required(client):
    assert (await post(client, "/tokenize", {"model": "other", "prompt": "x"}, 404))["error"]["param"] == "model"
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        reply = await client.post(path, json=body)
        assert reply.status == 401 and (await reply.json())["error"]["code"] == "invalid_api_key"


async def test_without_any_chat_template_the_400_names_the_flag(router_address, tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    async with await gateway(router_address, ChatTemplate(bare)) as no_template:
        error = (await post(no_template, "/tokenize", {"messages": CHAT}, 400))["error"]
        assert error["param"] == "messages" and "--chat-template" in error["message"]
        assert (await post(no_template, "/tokenize", {"prompt": PROMPT}))["tokens"] == tokenizer(PROMPT)["input_ids"]


async def test_a_router_that_is_down_is_503(tokenizer):
    async with await gateway(f"127.0.0.1:{free_port()}", ChatTemplate(tokenizer)) as down:
        assert (await post(down, "/detokenize", {"tokens": [1]}, 503))["error"]["code"] == "service_unavailable"
