"""The default model: a small Llama built locally, so nothing is downloaded.

The weights come from a fixed seed and the tokenizer is a byte-level BPE trained
on the Python standard library's source text. Both are written once as an
ordinary Hugging Face folder (safetensors + tokenizer files) and then loaded
through the same code path as any user model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

# Role-tagged turns; with tools, a Hermes-style system block and <tool_call> / <tool_response> turns (the
# format Qwen2.5 and Hermes use, so the gateway's hermes parser reads the calls). Without tools it renders
# exactly as it always has, so prompts (and cached prefixes) do not change. HF renders with trim_blocks,
# which eats a newline written right after a tag: those newlines are written as {{ '\n' }}.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}<|tool|>\n<tool_response>\n{{ message['content'] }}\n</tool_response>\n"
    "{% elif message['role'] == 'assistant' and message.tool_calls is defined and message.tool_calls %}"
    "<|assistant|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls %}<tool_call>\n{\"name\": {{ call.function.name | tojson }}, "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}{{ '\\n' }}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """Architecture of a locally built default model."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_context: int
    corpus_bytes: int  # how much stdlib text trains the tokenizer


PRESETS = {
    # Demo and benchmarks.
    "small": ModelPreset("distserve-small", 32000, 512, 8, 8, 4, 1408, 4096, 12_000_000),
    # Tests on 2 CPU cores.
    "tiny": ModelPreset("distserve-tiny", 4096, 64, 2, 4, 2, 128, 2048, 2_000_000),
}


def default_cache_dir() -> Path:
    base = os.environ.get("DISTSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "distserve"
    )
    return Path(base) / "models"


def ensure_default_model(preset: str = "small", cache_dir: Path | None = None) -> Path:
    """Returns the folder of the preset model, building it on first use."""
    spec = PRESETS[preset]
    folder = (cache_dir or default_cache_dir()) / spec.name
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        _update_chat_template(folder)
        return folder
    log.info("building default model %s in %s", spec.name, folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    _build_tokenizer(spec).save_pretrained(tmp)
    _build_model(spec).save_pretrained(tmp, safe_serialization=True)
    try:
        tmp.rename(folder)  # atomic: concurrent builders race harmlessly
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _update_chat_template(folder: Path) -> None:
    """A folder built with an older template (before tools) gets the current one: the folder is ours."""
    path = folder / "chat_template.jinja"
    try:
        if path.read_text(encoding="utf-8") != CHAT_TEMPLATE:
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            tmp.write_text(CHAT_TEMPLATE, encoding="utf-8")
            tmp.replace(path)  # atomic: a concurrent reader sees one template or the other
    except OSError:
        pass  # not writable, or saved another way: the folder keeps what it has


def _corpus(max_bytes: int):
    """Yields the stdlib's .py files in a fixed order, up to max_bytes of text."""
    stdlib = Path(os.__file__).parent
    total = 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def _build_tokenizer(spec: ModelPreset):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.corpus_bytes), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_context
    return fast


def _build_model(spec: ModelPreset):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_context,
        bos_token_id=SPECIAL_TOKENS.index("<|bos|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|eos|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|pad|>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()
