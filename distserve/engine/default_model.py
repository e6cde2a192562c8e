"""The default models: Llama and Qwen2 presets built locally, so nothing is downloaded.

`small` (the default) and `tiny` are small Llamas; `qwen-0.5b-shape` and `llama-1b-shape` have the
configs of Qwen2.5-0.5B and Llama-3.2-1B. The weights come from a fixed seed and the tokenizer is a
byte-level BPE trained on the Python standard library's source text. Both are written once as an
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


ARCHITECTURES = ("llama", "qwen2")  # transformers' model_type of each family a preset can build
DTYPES = ("float32", "bfloat16")  # how the weights are saved (the checkpoint's torch_dtype)


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """Architecture of a locally built default model."""

    name: str
    vocab_size: int
    """Rows of the embedding (and of the tied or untied lm_head): the model's logits width."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_context: int
    corpus_bytes: int  # how much stdlib text trains the tokenizer
    architecture: str = "llama"
    """One of ARCHITECTURES. qwen2 has a bias on q, k and v (built into the family), llama none."""
    tokenizer_vocab_size: int | None = None
    """Tokens the BPE learns; None: vocab_size. Smaller gives the real checkpoints' layout (Qwen2.5 pads
    151,665 tokens to 151,936 rows): the ids past it never come from the tokenizer, but the model, whose
    weights are random, generates them, and they decode to no text."""
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """transformers' rope_parameters beyond rope_theta (e.g. Llama 3's {"rope_type": "llama3", ...}, which
    replaces rope_type "default"); None: plain RoPE."""
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    """lm_head shares the embedding matrix (saved once), as every current small model does."""
    dtype: str = "float32"
    """One of DTYPES: the saved weights' dtype. bfloat16 halves a large preset's disk and build time, as
    the real checkpoints ship; loading upcasts exactly, so float32 runs see the same values."""

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture: {self.architecture!r} is not one of {ARCHITECTURES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {DTYPES}")
        if not 0 < self.num_tokenizer_tokens <= self.vocab_size:
            raise ValueError(f"tokenizer_vocab_size: must be in (0, vocab_size={self.vocab_size}], "
                             f"got {self.tokenizer_vocab_size}")

    @property
    def num_tokenizer_tokens(self) -> int:
        return self.tokenizer_vocab_size or self.vocab_size


# The real models' configs (Qwen2.5-0.5B, Llama-3.2-1B) with random weights and the small preset's
# tokenizer: the shapes users serve, for tests and benchmarks. Their contexts too (32k, 128k): a worker
# holds only RoPE tables ([P, 64], 16-64 MiB) by it, and llama3 scaling wants more than its original 8192.
# transformers loads every qwen2 folder's tokenizer as Qwen2Tokenizer: Qwen's pre-tokenizer (digits one
# by one) over the same BPE, plus <|endoftext|> as the unknown token at id 32000; vLLM loads it alike.
QWEN_0_5B_SHAPE = ModelPreset(
    "distserve-qwen-0.5b-shape", vocab_size=151_936, hidden_size=896, num_layers=24, num_heads=14,
    num_kv_heads=2, intermediate_size=4864, max_context=32768, corpus_bytes=12_000_000,
    architecture="qwen2", tokenizer_vocab_size=32000, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_embeddings=True, dtype="bfloat16")
LLAMA_1B_SHAPE = ModelPreset(
    "distserve-llama-1b-shape", vocab_size=128_256, hidden_size=2048, num_layers=16, num_heads=32,
    num_kv_heads=8, intermediate_size=8192, max_context=131072, corpus_bytes=12_000_000,
    architecture="llama", tokenizer_vocab_size=32000, rope_theta=500_000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    rms_norm_eps=1e-5, tie_embeddings=True, dtype="bfloat16")

PRESETS = {
    # Demo and benchmarks.
    "small": ModelPreset("distserve-small", 32000, 512, 8, 8, 4, 1408, 4096, 12_000_000),
    # Tests on 2 CPU cores.
    "tiny": ModelPreset("distserve-tiny", 4096, 64, 2, 4, 2, 128, 2048, 2_000_000),
    # Shapes users serve (issue 41): Qwen2 with GQA 7:1 and qkv bias; Llama 3 with GQA 4:1 and llama3 RoPE.
    "qwen-0.5b-shape": QWEN_0_5B_SHAPE,
    "llama-1b-shape": LLAMA_1B_SHAPE,
}
MODEL_HELP = f"HF model folder, or default[:{'|'.join(PRESETS)}]"  # the --model flags' help


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
    build_model(spec).save_pretrained(tmp, safe_serialization=True)
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
        vocab_size=spec.num_tokenizer_tokens,
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


def preset_config(spec: ModelPreset):
    """The transformers config of a preset (Qwen2Config or LlamaConfig)."""
    from transformers import LlamaConfig, Qwen2Config

    config_class = Qwen2Config if spec.architecture == "qwen2" else LlamaConfig
    return config_class(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_context,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta, **(spec.rope_scaling or {})},
        rms_norm_eps=spec.rms_norm_eps,
        bos_token_id=SPECIAL_TOKENS.index("<|bos|>"),
        eos_token_id=SPECIAL_TOKENS.index("<|eos|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|pad|>"),
        tie_word_embeddings=spec.tie_embeddings,
        torch_dtype=spec.dtype,
    )


def build_model(spec: ModelPreset):
    """The preset's transformers model with random weights: transformers' own init (normal, std 0.02)
    from seed 0, in the preset's dtype, so every build gives the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    config = preset_config(spec)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype)).eval()
