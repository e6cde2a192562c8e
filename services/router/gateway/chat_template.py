"""Chat messages -> prompt token ids, through the model tokenizer's own chat template."""

from __future__ import annotations

from typing import Any

from jinja2.exceptions import TemplateError

from services.router.gateway.errors import bad_request


class ChatTemplate:
    """Renders `[{"role", "content"}]` with add_generation_prompt, so the model answers as the assistant."""

    def __init__(self, tokenizer: Any, max_context: int = 0):
        self._tokenizer = tokenizer
        self.max_context = max_context  # the model's context, in tokens (0: unknown)

    @property
    def is_available(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the rendered conversation; a template that rejects the messages is a 400."""
        if not self.is_available:
            raise bad_request("messages", "the model's tokenizer has no chat template; use /v1/completions")
        try:
            encoded = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)
        except (TemplateError, ValueError) as exc:
            raise bad_request("messages", f"the chat template rejected the messages: {exc}")
        return list(encoded["input_ids"])
