"""Model shape arguments and weights, read straight from a Hugging Face folder's config and safetensors.

transformers supplies only the config parsing (and the rotary-embedding maths, so every RoPE scaling
variant it knows stays exact); the weights are read with safetensors into plain tensors. Projections
that share an input are fused once at load: q/k/v into one matrix, gate/up into another, so a layer
runs three matmuls on its input instead of five.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from distserve.engine.host_memory import HugePageArena
from distserve.engine.linear import Linear
from distserve.model_spec import head_dim, num_kv_heads, text_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The shape of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    sliding_window: int | None  # keys further back than this are not attended (Mistral); None: off
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config) -> "ModelArgs":
        text = text_config(config)
        if text.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model: model_type {text.model_type!r} is not supported; one of {SUPPORTED_MODEL_TYPES}")
        window = getattr(text, "sliding_window", None)
        if text.model_type == "qwen2" and not getattr(text, "use_sliding_window", False):
            window = None
        return cls(
            model_type=text.model_type,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=num_kv_heads(text),
            head_dim=head_dim(text),
            rms_norm_eps=text.rms_norm_eps,
            hidden_act=text.hidden_act,
            sliding_window=window,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


@dataclasses.dataclass
class LayerWeights:
    qkv: Linear  # hidden -> (H + 2 * Hkv) * D, with Qwen2's bias
    o: Linear  # H * D -> hidden
    gate_up: Linear  # hidden -> 2 * I
    down: Linear  # I -> hidden
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor  # [hidden]

    @property
    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]


@dataclasses.dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Linear  # hidden -> V (a copy of the embedding when tied)

    @property
    def linears(self) -> list[Linear]:
        """Every matmul a decode step runs: the lm_head, then each layer's."""
        return [self.lm_head] + [linear for layer in self.layers for linear in layer.linears]

    @property
    def num_bytes(self) -> int:
        """Bytes a decode step streams: every matrix but the embedding (read one row per token)."""
        return sum(linear.num_bytes for linear in self.linears)


def _safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors weights in {folder}")
    return files


def read_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by name, with the `model.` prefix dropped."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _safetensor_files(Path(folder)):
        for name, tensor in load_file(str(path)).items():
            state[name.removeprefix("model.")] = tensor
    return state


def load_weights(folder: str, args: ModelArgs, dtype: torch.dtype, device: str) -> ModelWeights:
    """Reads, fuses and casts the weights; raises ValueError naming a missing tensor. On CPU the
    matrices live on huge pages (host_memory: small-batch decode streams them faster from there)."""
    state = read_state_dict(folder)
    arena = HugePageArena() if torch.device(device).type == "cpu" else None

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"model: weight {name!r} missing from {folder}")
        return state.pop(name).to(device=device, dtype=dtype)

    def optional(name: str) -> torch.Tensor | None:
        return take(name) if name in state else None

    def matrix(*names: str) -> torch.Tensor:
        """The named weights stacked along dim 0 (a fused projection), in the arena on CPU."""
        parts = [take(name) for name in names]
        if arena is None:
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        return torch.cat(parts, out=arena.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype))

    layers = []
    for i in range(args.num_layers):
        p = f"layers.{i}."
        biases = [optional(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
        layers.append(LayerWeights(
            qkv=Linear(matrix(*[p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
                       torch.cat(biases) if all(b is not None for b in biases) else None),
            o=Linear(matrix(p + "self_attn.o_proj.weight")),
            gate_up=Linear(matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
            down=Linear(matrix(p + "mlp.down_proj.weight")),
            input_norm=take(p + "input_layernorm.weight"),
            post_attention_norm=take(p + "post_attention_layernorm.weight"),
        ))
    embed = matrix("embed_tokens.weight")
    if "lm_head.weight" in state:
        lm_head = matrix("lm_head.weight")
    elif args.tie_word_embeddings:
        lm_head = embed
    else:
        raise ValueError(f"model: weight 'lm_head.weight' missing from {folder}")
    return ModelWeights(embed=embed, layers=layers, norm=take("norm.weight"), lm_head=Linear(lm_head))
