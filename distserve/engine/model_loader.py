"""Resolve the --model argument and load a Hugging Face causal LM from disk. Imports no torch until a
model is loaded: the router and gateway resolve paths and load tokenizers through it."""

from __future__ import annotations

from pathlib import Path

from distserve.engine.default_model import PRESETS, ensure_default_model


def resolve_model_path(model: str) -> str:
    """`default:<preset>` (or empty) builds the local default model; anything else is a folder."""
    if not model or model.startswith("default"):
        preset = model.partition(":")[2] or "small"
        if preset not in PRESETS:
            raise ValueError(f"model: unknown default preset {preset!r}; one of {sorted(PRESETS)}")
        return str(ensure_default_model(preset))
    if not (Path(model) / "config.json").exists():
        raise ValueError(f"model: {model!r} is not a Hugging Face model folder (no config.json)")
    return model


def load_engine_model(path: str, dtype: str, device: str):
    """Our own forward (distserve.engine.model) with the folder's weights: what the workers serve."""
    from transformers import AutoConfig

    from distserve.engine.dtype import torch_dtype
    from distserve.engine.model import LlamaModel, rope_tables
    from distserve.engine.weights import ModelArgs, load_weights

    config = AutoConfig.from_pretrained(path)
    args = ModelArgs.from_config(config)
    torch_dtype = torch_dtype(dtype)
    cos, sin = rope_tables(config, config.max_position_embeddings, torch_dtype, device)
    return LlamaModel(args, load_weights(path, args, torch_dtype, device), cos, sin)


def load_model(path: str, dtype: str, device: str):
    """Loads the transformers model: the reference our engine is tested against."""
    from transformers import AutoModelForCausalLM

    from distserve.engine.dtype import torch_dtype

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), attn_implementation="sdpa"
    )
    return model.to(device).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
