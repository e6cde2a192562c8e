"""Chat messages -> prompt text or token ids, through the chat template.

The template is the gateway's `--chat-template` when given, else the model
tokenizer's own. Per-request `chat_template_kwargs` reach the template as extra
variables (e.g. `enable_thinking`), as in vLLM; names that apply_chat_template
itself takes are refused, so a request cannot turn rendering into something else.
"""

from __future__ import annotations

from typing import Any

from jinja2.exceptions import TemplateError, TemplateSyntaxError

from distserve.config import ConfigError
from services.router.gateway.errors import bad_request
from services.router.gateway.json_fields import show

KWARGS_FIELD = "chat_template_kwargs"
# apply_chat_template's own parameters, and the template variables it sets itself.
_RESERVED_KWARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
NO_TEMPLATE = ("the model's tokenizer has no chat template: start the gateway (or `distserve up`) with "
               "--chat-template FILE_OR_STRING, or use /v1/completions")


def chat_template_kwargs(value: Any) -> dict[str, Any]:
    """A request's chat_template_kwargs (null: none) -> template variables; a 400 naming the field when it is
    not an object or sets a reserved name."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(KWARGS_FIELD, f"must be an object, got {show(value)}")
    reserved = sorted(set(value) & _RESERVED_KWARGS)
    if reserved:
        raise bad_request(f"{KWARGS_FIELD}.{reserved[0]}", "is set by the server, not by chat_template_kwargs")
    return value


class ChatTemplate:
    """Renders `[{"role", "content"}]` conversations, by default with add_generation_prompt, so the model answers
    as the assistant.

    `template` (the gateway's --chat-template text) overrides the tokenizer's; its syntax is checked here, at
    start-up, raising ConfigError naming chat_template."""

    def __init__(self, tokenizer: Any, max_context: int = 0, template: str | None = None):
        self.tokenizer = tokenizer  # also the gateway's, for token texts
        self._template = template or None
        self.max_context = max_context  # the model's context, in tokens (0: unknown)
        if self._template is not None:
            self._check_syntax()

    @property
    def is_available(self) -> bool:
        return bool(self._template or getattr(self.tokenizer, "chat_template", None))

    def render(self, messages: list[dict[str, str]], kwargs: dict[str, Any] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
        """The conversation as prompt text (tokenize it without adding special tokens); a template that rejects
        the messages is a 400."""
        return self._apply(messages, kwargs, tokenize=False, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message)

    def encode(self, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered conversation (and the tools the model may call: the template shows them to
        it), with the generation prompt; a rejected one is a 400."""
        return list(self._apply(messages, kwargs, tokenize=True, return_dict=True, tools=tools,
                                add_generation_prompt=True)["input_ids"])

    @property
    def source(self) -> str:
        """The template's Jinja text ("" when there is none, or several by name)."""
        text = self._template or getattr(self.tokenizer, "chat_template", None)
        return text if isinstance(text, str) else ""

    def _apply(self, messages: list[dict[str, str]], kwargs: dict[str, Any] | None, **options: Any) -> Any:
        if not self.is_available:
            raise bad_request("messages", NO_TEMPLATE)
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self._template, **options,
                                                       **(kwargs or {}))
        except (TemplateError, ValueError, TypeError) as exc:  # TypeError: a template misusing a kwarg's value
            raise bad_request("messages", f"the chat template rejected the messages: {exc}")

    def _check_syntax(self) -> None:
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=self._template,
                                                tokenize=False)
        except TemplateSyntaxError as exc:
            raise ConfigError(f"chat_template: not a valid Jinja template: {exc}") from exc
        except (TemplateError, ValueError, TypeError):
            pass  # valid, but it rejects this conversation (e.g. it wants a system message first)
