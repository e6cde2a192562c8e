"""What the serving system needs to know about a model, read from its config (torch-free: the router
and gateway use it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape facts of a causal LM; enough to size KV buffers and validate requests."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_config(cls, config, generation_config=None) -> "ModelSpec":
        """From a transformers config; EOS ids are the union of the model's and its generation config's
        (instruct models list their end-of-turn tokens, e.g. Llama 3's <|eot_id|>, only in the latter)."""
        text = text_config(config)
        eos_ids = _as_ids(getattr(text, "eos_token_id", None)) + _as_ids(getattr(config, "eos_token_id", None))
        if generation_config is not None:
            eos_ids += _as_ids(generation_config.eos_token_id)
        return cls(
            num_layers=text.num_hidden_layers,
            num_kv_heads=num_kv_heads(text),
            head_dim=head_dim(text),
            vocab_size=text.vocab_size,
            max_context=text.max_position_embeddings,
            eos_token_ids=tuple(sorted(set(eos_ids))),
        )

    def kv_format(self, dtype: str) -> str:
        """Names the KV layout and dtype: a prefill worker's KV fits only a decode worker of the same format."""
        return f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}:{dtype}"

    def kv_bytes_per_token(self, dtype) -> int:
        """dtype: a torch.dtype (anything with `itemsize`)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def text_config(config):
    """The language model's part of a transformers config (multimodal configs nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_kv_heads(text) -> int:
    return getattr(text, "num_key_value_heads", None) or text.num_attention_heads


def head_dim(text) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def load_model_spec(path: str) -> ModelSpec:
    from transformers import AutoConfig, GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # the folder has no generation_config.json
        generation_config = None
    return ModelSpec.from_config(AutoConfig.from_pretrained(path), generation_config)


def prompt_error(tokens, spec: ModelSpec) -> str | None:
    """Why a prompt cannot be served, or None. The router checks first; this guards workers' direct callers."""
    if not tokens:
        return "prompt_token_ids: must not be empty"
    if len(tokens) >= spec.max_context:
        return f"prompt_token_ids: {len(tokens)} tokens leave no room in the context of {spec.max_context}"
    bad = next((t for t in tokens if not 0 <= t < spec.vocab_size), None)
    if bad is not None:
        return f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {spec.vocab_size})"
    return None
