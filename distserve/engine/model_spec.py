"""What the serving system needs to know about a model, read from its config."""

from __future__ import annotations

import dataclasses

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    def from_config(cls, config) -> "ModelSpec":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        eos = text.eos_token_id if hasattr(text, "eos_token_id") else config.eos_token_id
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            num_layers=text.num_hidden_layers,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            max_context=text.max_position_embeddings,
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


def load_model_spec(path: str) -> ModelSpec:
    from transformers import AutoConfig

    return ModelSpec.from_config(AutoConfig.from_pretrained(path))
