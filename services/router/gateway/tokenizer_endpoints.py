"""POST /tokenize and POST /detokenize, in vLLM's shapes, through the router's Tokenize and Detokenize.

/tokenize takes one of two bodies:
  completion form {model?, prompt, add_special_tokens=true, return_token_strs=false}
  chat form {model?, messages, add_generation_prompt=true, continue_final_message=false,
             add_special_tokens=false, return_token_strs=false, chat_template_kwargs?}
and answers {count, max_model_len, tokens, token_strs (null unless asked)}. The chat
form is rendered to text with the gateway's chat template, then tokenized by the
router without special tokens by default, as the chat template's text already has
them: the same ids /v1/chat/completions sends.
/detokenize takes {model?, tokens} and answers {prompt}, special tokens included.
`model`, when given, must be the served model. Bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from distserve.v1 import router_pb2
from services.router.gateway.chat_template import KWARGS_FIELD, ChatTemplate, chat_template_kwargs
from services.router.gateway.errors import bad_request
from services.router.gateway.json_fields import Body, check_int_list, parse_json_object
from services.router.gateway.openai_protocol import chat_message, check_model
from services.router.gateway.router_client import RouterClient
from services.router.validation import THREAD_TOKENIZE_CHARS

PATHS = ("/tokenize", "/detokenize")
COMPLETION_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message",
                         "add_special_tokens", "return_token_strs", KWARGS_FIELD})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


class TokenizerEndpoints:
    """The two handlers; `router` returns the gateway's router client (it exists once the app has started)."""

    def __init__(self, template: ChatTemplate, served_model_name: str, router: Callable[[], RouterClient]):
        self._template = template
        self._served_model_name = served_model_name
        self._router = router

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)]

    async def tokenize(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = parse_json_object(raw)
        if "messages" in body.names():
            prompt_field = "messages"
            if len(raw) > THREAD_TOKENIZE_CHARS:  # rendering a long conversation: keep other streams flowing
                call = await asyncio.to_thread(self.chat_request, body)
            else:
                call = self.chat_request(body)
        else:
            prompt_field, call = "prompt", self.completion_request(body)
        reply = await self._router().tokenize(call, {"text": prompt_field})
        return web.json_response({"count": len(reply.token_ids), "max_model_len": reply.max_model_len,
                                  "tokens": list(reply.token_ids),
                                  "token_strs": list(reply.token_strs) if call.return_token_strs else None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = parse_json_object(await request.read())
        self._check_body(body, DETOKENIZE_FIELDS)
        tokens = body.get_list("tokens")
        if tokens is None:
            raise bad_request("tokens", "is required")
        check_int_list("tokens", tokens)
        reply = await self._router().detokenize(router_pb2.DetokenizeRequest(token_ids=tokens),
                                                {"token_ids": "tokens"})
        return web.json_response({"prompt": reply.text})

    def completion_request(self, body: Body) -> router_pb2.TokenizeRequest:
        """The completion form's body -> the router's TokenizeRequest."""
        self._check_body(body, COMPLETION_FIELDS)
        prompt = body.get_str("prompt")
        if prompt is None:
            raise bad_request("prompt", "is required (or send `messages` to tokenize a chat)")
        return router_pb2.TokenizeRequest(text=prompt, add_special_tokens=_flag(body, "add_special_tokens", True),
                                          return_token_strs=_flag(body, "return_token_strs", False))

    def chat_request(self, body: Body) -> router_pb2.TokenizeRequest:
        """The chat form's body -> the router's TokenizeRequest for the rendered conversation."""
        self._check_body(body, CHAT_FIELDS)
        messages = [chat_message(i, m) for i, m in enumerate(body.get_list("messages") or [])]
        if not messages:
            raise bad_request("messages", "must not be empty")
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        continue_final_message = _flag(body, "continue_final_message", False)
        if add_generation_prompt and continue_final_message:
            raise bad_request("continue_final_message", "cannot be true with add_generation_prompt true "
                                                        "(set add_generation_prompt to false)")
        text = self._template.render(messages, chat_template_kwargs(body.raw(KWARGS_FIELD)),
                                     add_generation_prompt, continue_final_message)
        return router_pb2.TokenizeRequest(text=text, add_special_tokens=_flag(body, "add_special_tokens", False),
                                          return_token_strs=_flag(body, "return_token_strs", False))

    def _check_body(self, body: Body, allowed: frozenset[str]) -> None:
        """Unknown fields are 400s (a typo must not silently change the answer); a given model must be ours."""
        unknown = next((name for name in body.names() if name not in allowed), None)
        if unknown is not None:
            raise bad_request(unknown, "unrecognized request argument")
        model = body.get_str("model")
        if model is not None:
            check_model(model, self._served_model_name)


def _flag(body: Body, name: str, default: bool) -> bool:
    value = body.get_bool(name)
    return default if value is None else value
