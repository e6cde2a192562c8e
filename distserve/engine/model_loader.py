"""Resolve the --model argument and load a Hugging Face causal LM from disk."""

from __future__ import annotations

from pathlib import Path

from distserve.engine.default_model import PRESETS, ensure_default_model
from distserve.engine.model_spec import DTYPES


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


def load_model(path: str, dtype: str, device: str):
    """Loads the weights for inference. SDPA attention keeps CPU and CUDA on one path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], attn_implementation="sdpa"
    )
    return model.to(device).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
