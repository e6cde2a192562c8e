"""Tokenize and Detokenize: the router's tokenizer, as it applies it to text prompts, for clients.

Sizes are bounded as for a Generate prompt (services.router.validation): a text
longer than max_context * MAX_CHARS_PER_TOKEN characters is refused before it is
tokenized, and at most max_context token ids are decoded, each in the model's
vocabulary. A text that tokenizes to more tokens than the context is still
answered (the client learns `max_model_len` from the reply, as with vLLM).
Bad input raises InvalidRequest naming the request field.
"""

from __future__ import annotations

import asyncio

from distserve.model_spec import ModelSpec
from distserve.v1 import router_pb2
from services.router.validation import MAX_CHARS_PER_TOKEN, THREAD_TOKENIZE_CHARS, check


def tokenize(request: router_pb2.TokenizeRequest, tokenizer, spec: ModelSpec) -> router_pb2.TokenizeResponse:
    """The text's token ids (and their strings when asked); special tokens (e.g. BOS) added unless
    add_special_tokens is false."""
    _check_text_size(request.text, spec)
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
    ids = list(tokenizer(request.text, add_special_tokens=add_special)["input_ids"])
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else []
    return router_pb2.TokenizeResponse(token_ids=ids, token_strs=strs, max_model_len=spec.max_context)


def detokenize(request: router_pb2.DetokenizeRequest, tokenizer, spec: ModelSpec) -> router_pb2.DetokenizeResponse:
    """The text of the token ids, special tokens included (as vLLM's /detokenize)."""
    ids = list(request.token_ids)
    check(len(ids) <= spec.max_context, "token_ids",
          f"at most {spec.max_context} token ids (the model's context), got {len(ids)}")
    bad = next((t for t in ids if not 0 <= t < spec.vocab_size), None)
    check(bad is None, "token_ids", f"token id {bad} is outside the vocabulary [0, {spec.vocab_size})")
    return router_pb2.DetokenizeResponse(text=tokenizer.decode(ids))


async def tokenize_async(request: router_pb2.TokenizeRequest, tokenizer,
                         spec: ModelSpec) -> router_pb2.TokenizeResponse:
    """tokenize, in a worker thread for texts over THREAD_TOKENIZE_CHARS, so other streams keep flowing;
    an oversized text is refused first, on the loop."""
    _check_text_size(request.text, spec)
    if len(request.text) > THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(tokenize, request, tokenizer, spec)
    return tokenize(request, tokenizer, spec)


async def detokenize_async(request: router_pb2.DetokenizeRequest, tokenizer,
                           spec: ModelSpec) -> router_pb2.DetokenizeResponse:
    """detokenize, in a worker thread for more than THREAD_TOKENIZE_CHARS / 4 ids."""
    if len(request.token_ids) > THREAD_TOKENIZE_CHARS // 4:
        return await asyncio.to_thread(detokenize, request, tokenizer, spec)
    return detokenize(request, tokenizer, spec)


def _check_text_size(text: str, spec: ModelSpec) -> None:
    max_chars = spec.max_context * MAX_CHARS_PER_TOKEN
    check(len(text) <= max_chars, "text", f"{len(text)} characters cannot fit the model's context of "
                                          f"{spec.max_context} tokens (at most {max_chars} characters)")
