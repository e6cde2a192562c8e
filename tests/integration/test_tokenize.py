"""Tokenize and Detokenize against the real system: the router's RPCs, the gateway's /tokenize and /detokenize,
and --chat-template on a model folder without a chat template, checked with the openai SDK.

Token ids are compared with transformers' AutoTokenizer on the same folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from transformers import AutoTokenizer

from distserve.model_spec import load_model_spec
from distserve.launcher import free_port
from distserve.v1 import router_pb2, router_pb2_grpc
from tests.builders import generate, token_request

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # ✓"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def router(cluster):
    with grpc.insecure_channel(cluster.router_address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


async def post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json()


def test_router_tokenize_and_detokenize_match_transformers(router, tokenizer, tiny_model_path):
    reply = router.Tokenize(router_pb2.TokenizeRequest(text=PROMPT, return_token_strs=True), timeout=30)
    assert list(reply.token_ids) == tokenizer(PROMPT)["input_ids"]
    assert list(reply.token_strs) == tokenizer.convert_ids_to_tokens(tokenizer(PROMPT)["input_ids"])
    assert reply.max_model_len == load_model_spec(tiny_model_path).max_context
    reply = router.Tokenize(router_pb2.TokenizeRequest(text=PROMPT, add_special_tokens=False), timeout=30)
    assert list(reply.token_ids) == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids = tokenizer(PROMPT)["input_ids"] + [tokenizer.eos_token_id]
    assert router.Detokenize(router_pb2.DetokenizeRequest(token_ids=ids), timeout=30).text == tokenizer.decode(ids)


def test_router_refuses_bad_input_naming_the_field(router, tokenizer):
    with pytest.raises(grpc.RpcError) as caught:
        router.Detokenize(router_pb2.DetokenizeRequest(token_ids=[1, len(tokenizer)]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("token_ids:")
    with pytest.raises(grpc.RpcError) as caught:
        router.Tokenize(router_pb2.TokenizeRequest(text="x" * 10**6), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("text:")


async def test_gateway_tokenize_and_detokenize_match_transformers(cluster, tokenizer, tiny_model_path):
    status, got = await post(cluster.gateway_url + "/tokenize", {"model": "distserve-tiny", "prompt": PROMPT,
                                                                  "return_token_strs": True})
    ids = tokenizer(PROMPT)["input_ids"]
    assert status == 200 and got == {"count": len(ids), "max_model_len": load_model_spec(tiny_model_path).max_context,
                                     "tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    status, got = await post(cluster.gateway_url + "/tokenize", {"messages": CHAT})
    assert status == 200 and got["tokens"] == tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    status, got = await post(cluster.gateway_url + "/detokenize", {"tokens": ids})
    assert (status, got) == (200, {"prompt": tokenizer.decode(ids)})
    status, got = await post(cluster.gateway_url + "/detokenize", {"tokens": [len(tokenizer)]})
    assert status == 400 and got["error"]["param"] == "tokens"


@pytest.fixture(scope="module")
def bare_model(tiny_model_path, tmp_path_factory) -> Path:
    """The tiny model's folder without its chat template."""
    folder = tmp_path_factory.mktemp("bare") / "distserve-tiny-bare"
    shutil.copytree(tiny_model_path, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    assert not AutoTokenizer.from_pretrained(folder).chat_template
    return folder


def start_gateway(cluster, model: Path, log_path: Path, *args: str):
    """A gateway process for `model`, in front of the cluster's router; (process, its URL) once it answers."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DISTSERVE_ROUTER_ADDRESS": cluster.router_address,
           "DISTSERVE_REDIS_URL": cluster.redis_url, "DISTSERVE_MODEL": str(model)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "services.router.gateway", "--port", str(port), *args],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url + "/version", timeout=1):
                return process, url
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"gateway did not start:\n{log_path.read_text(errors='replace')[-3000:]}")


@pytest.fixture(scope="module")
def gateways(cluster, bare_model, tmp_path_factory):
    """Two gateways on the template-less folder: one with --chat-template FILE, one without."""
    logs = tmp_path_factory.mktemp("gateway-logs")
    (logs / "template.jinja").write_text(TEMPLATE)
    with_flag = start_gateway(cluster, bare_model, logs / "with.log", "--chat-template", str(logs / "template.jinja"))
    try:
        without = start_gateway(cluster, bare_model, logs / "without.log")
    except BaseException:
        with_flag[0].kill()
        raise
    yield with_flag[1], without[1]
    for process, _ in (with_flag, without):
        process.terminate()
        process.wait(30)


def test_chat_template_flag_serves_chat_on_a_model_without_one(cluster, gateways, bare_model):
    url, _ = gateways
    bare = AutoTokenizer.from_pretrained(bare_model)
    ids = bare.apply_chat_template(CHAT, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="any", max_retries=0)
    reply = sdk.chat.completions.create(model=bare_model.name, messages=CHAT, max_tokens=8, temperature=0)
    reference = generate(cluster.router_address, token_request(ids, max_tokens=8))
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == reference.text and reference.text


async def test_chat_template_flag_is_used_by_tokenize(gateways, bare_model):
    url, _ = gateways
    bare = AutoTokenizer.from_pretrained(bare_model)
    status, got = await post(url + "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert status == 200 and got["tokens"] == bare.apply_chat_template(CHAT, chat_template=TEMPLATE, tokenize=True,
                                                                       return_dict=True)["input_ids"]


async def test_without_the_flag_chat_is_a_400_naming_it(gateways, bare_model, tokenizer):
    _, url = gateways
    sdk = openai.OpenAI(base_url=url + "/v1", api_key="any", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=bare_model.name, messages=CHAT, max_tokens=4)
    assert "--chat-template" in caught.value.message and caught.value.body["param"] == "messages"
    status, got = await post(url + "/tokenize", {"messages": CHAT})
    assert status == 400 and "--chat-template" in got["error"]["message"]
    status, got = await post(url + "/tokenize", {"prompt": PROMPT})  # text still works
    assert status == 200 and got["tokens"] == tokenizer(PROMPT)["input_ids"]
