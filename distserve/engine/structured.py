"""Structured output: grammars that constrain which tokens a sequence may draw (xgrammar underneath).

Lifecycle of one constrained request:
  router: GrammarCompiler.check(spec) -> 400 (InvalidGrammar) or admit
  prefill worker: state = compiler.matcher(spec); mask_logits(logits, [state]); sample; state.accept(token)
  decode worker (or after migration): state = compiler.matcher(spec); state.accept_all(tokens so far);
      then per step: mask_logits(logits [B, V], states) -> sample -> state.accept(token)
      -> if state.is_terminated: finish the sequence with reason "stop".

Kinds (StructuredSpec.kind):
- json_schema: value is the schema's JSON text. Strict (OpenAI's sense): an object schema that does not
  say `additionalProperties` allows no other properties. What xgrammar's converter knows is enforced
  (types, enum/const, properties/required, items/prefixItems, min/maxItems, min/maxLength, pattern,
  format, number bounds, anyOf/oneOf/allOf, $ref/$defs); an unsupported type or a broken schema is an
  InvalidGrammar, but keywords it does not know (`not`, say) are ignored, not refused.
- json_object: any JSON object (not any JSON value, as xgrammar's builtin grammar would allow).
- regex: the whole output matches the regex (xgrammar's regex dialect, close to ECMAScript).
- choice: the output is exactly one of the strings.
- grammar: an EBNF (GBNF) grammar whose start rule is named `root`.

Whitespace: JSON is generated with no free whitespace (xgrammar `any_whitespace=False`): separators are
fixed as ", " and ": ", with no newlines or indentation. A model with free whitespace can (and a random-
weights one does) emit whitespace forever between tokens and never close the object; this way every
byte of JSON output is structure or content.

Stop tokens: the TokenizerInfo is built with the model's stop (EOS) token ids, so a grammar allows them
exactly where the output is complete, and nowhere else. Drawing one terminates the state
(`is_terminated`); the engine then ends the sequence with finish reason "stop". Where the output is
complete and nothing can follow (a choice fully written), the stop tokens are the only allowed tokens.
So for a constrained sequence the engine must: stop on `is_terminated` even with ignore_eos; not ban the
stop tokens for min_tokens (a row with every token banned has nothing to draw); and never mask or accept
for a terminated state (both raise TokenRejected). A sequence cut by max_tokens ends "length", its output
incomplete.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable

import torch
import xgrammar as xgr

from distserve.segmented_lru import SegmentedLru

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# A spec's text (all of a choice's strings together) is at most this long: compiling grows with it, and
# no real schema, regex or grammar comes near (OpenAI caps a schema's properties at 5,000 in total).
MAX_SPEC_CHARS = 64 * 1024
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'  # how xgrammar prints a bounded string's character class
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'
# xgrammar's errors start with "[12:00:00] /project/cpp/file.cc:123: " and sometimes "Check failed: ... is false: ".
_NATIVE_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


class InvalidGrammar(ValueError):
    """A spec that cannot be compiled. The message starts with the kind ("regex: ..."), fit for a 400."""


class TokenRejected(ValueError):
    """accept() of a token the grammar does not allow here (or of any token after termination)."""


@dataclasses.dataclass(frozen=True)
class StructuredSpec:
    """What a request's output must follow; hashable, so it keys the compiled-grammar cache."""

    kind: str
    """One of KINDS."""
    value: str | tuple[str, ...] = ""
    """json_schema: the schema's JSON text; regex: the pattern; grammar: EBNF with rule `root`;
    choice: the strings (a tuple); json_object: unused ("")."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidGrammar(f"kind: must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value or not all(isinstance(c, str) for c in self.value):
                raise InvalidGrammar(f"choice: must be a non-empty tuple of strings, got {self.value!r}")
        elif not isinstance(self.value, str):
            raise InvalidGrammar(f"{self.kind}: must be a string, got {type(self.value).__name__}")
        elif self.kind != "json_object" and not self.value.strip():
            raise InvalidGrammar(f"{self.kind}: must not be empty")
        size = sum(map(len, self.value)) if self.kind == "choice" else len(self.value)
        if size > MAX_SPEC_CHARS:
            raise InvalidGrammar(f"{self.kind}: at most {MAX_SPEC_CHARS} characters, got {size}")


def choice_ebnf(choices: Iterable[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`. JSON string escapes are EBNF string escapes
    (\\", \\\\, \\n, \\uXXXX), so json.dumps quotes each choice safely, whatever characters it holds."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def json_schema_ebnf(schema: str, strict: bool) -> str:
    r"""The EBNF of a JSON schema, without free whitespace, with JSON's string rule for bounded strings.

    xgrammar 0.2.9 writes a string with minLength/maxLength as `"\"" chars{m,n} "\""` with
    `chars ::= [^\"\\\r\n]`, which lets control characters (U+0000-U+001F but CR and LF, a tab
    or \x18 say) into the string; JSON forbids them raw, so the output would not parse. Unbounded
    strings exclude them; this makes bounded ones do the same (a random-logits test caught it).
    """
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
    return grammar.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


def json_schema_problem(schema: str) -> str:
    """Why `schema` (JSON text) cannot become a grammar, in the words a compile would use; "" when it can.
    Needs no tokenizer: the HTTP gateway checks tool schemas with it before any model sees them."""
    try:
        json_schema_ebnf(schema, strict=True)
    except (RuntimeError, ValueError, TypeError) as e:
        return _native_message(e)
    return ""


class GrammarCompiler:
    """Per process (worker or router): the tokenizer's vocabulary in xgrammar's form, and a segmented LRU
    cache of compiled grammars keyed by spec (a flood of distinct specs churns only the entries seen once;
    see distserve.segmented_lru). Thread-safe; compiling the same spec twice at once is harmless."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], *,
                 max_cached: int = 256, max_threads: int = 2):
        """tokenizer: a Hugging Face tokenizer. vocab_size: the model's logits width (may exceed
        len(tokenizer); the extra ids are never allowed). stop_token_ids: the model's EOS ids, the only
        ids that end a constrained sequence; empty: xgrammar's guess from the tokenizer."""
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        # Our own LRU below holds compiled grammars; xgrammar's cache would keep a second copy.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads, cache_enabled=False)
        self._cache: SegmentedLru[StructuredSpec, xgr.CompiledGrammar] = SegmentedLru(
            max_cached, probation_capacity=max(1, max_cached // 4))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids the grammars allow where the output is complete (what xgrammar actually uses)."""
        return tuple(self._info.stop_token_ids)

    def cached_specs(self) -> tuple[StructuredSpec, ...]:
        """The specs whose compiled grammars are cached: those seen once, then those seen again, each least
        recently used first."""
        return self._cache.keys()

    def check(self, spec: StructuredSpec) -> None:
        """Compiles spec (cached) or raises InvalidGrammar."""
        self.compiled(spec)

    def matcher(self, spec: StructuredSpec | xgr.CompiledGrammar) -> GrammarState:
        """A fresh state at the start of a grammar: spec's (compiled here, or cached), or one compiled()
        returned earlier, which never compiles. Raises InvalidGrammar."""
        compiled = spec if isinstance(spec, xgr.CompiledGrammar) else self.compiled(spec)
        return GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size)

    def compiled(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        """spec's compiled grammar, from the cache or compiled now (in the calling thread). Raises
        InvalidGrammar; failures are not cached."""
        compiled = self._cache.get(spec)
        if compiled is None:
            compiled = self._compile(spec)
            self._cache.put(spec, compiled)
        return compiled

    def _compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json_schema":
                json.loads(spec.value)  # Python's message is clearer than xgrammar's for broken JSON
                return self._compiler.compile_grammar(json_schema_ebnf(spec.value, strict=True))
            if spec.kind == "json_object":
                # strict off: an object without listed properties may hold any properties
                return self._compiler.compile_grammar(json_schema_ebnf(_JSON_OBJECT_SCHEMA, strict=False))
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return self._compiler.compile_grammar(choice_ebnf(spec.value))
            return self._compiler.compile_grammar(spec.value, root_rule_name="root")
        except json.JSONDecodeError as e:
            raise InvalidGrammar(f"{spec.kind}: not valid JSON: {e}") from e
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError from its C++ checks
            raise InvalidGrammar(f"{spec.kind}: {_native_message(e)}") from e


def _native_message(error: Exception) -> str:
    return _NATIVE_PREFIX.sub("", str(error)).strip() or type(error).__name__


class GrammarState:
    """One sequence's position in its grammar. Not thread-safe; one per sequence (n completions: n states)."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete and the sequence should stop ("stop")."""
        return self._matcher.is_terminated()

    @property
    def is_complete(self) -> bool:
        """The output so far is a complete match (the grammar now allows a stop token)."""
        return self._matcher.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into bitmask[row] (int32 [B, ceil(V/32)], 1 bit = allowed).
        Must not be called once terminated (the sequence has ended)."""
        if self.is_terminated:
            raise TokenRejected("the grammar has terminated; the sequence should have stopped")
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def allowed_mask(self) -> torch.Tensor:
        """bool [V]: which tokens may come next (for tests and inspection; the engine uses mask_logits)."""
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [ceil(V/32), 32]
        return bits.flatten()[: self.vocab_size].bool()

    def accept(self, token_id: int) -> None:
        """Advances past token_id; raises TokenRejected if the grammar does not allow it here."""
        if not self._matcher.accept_token(int(token_id)):
            raise TokenRejected(f"token {token_id} is not allowed by the grammar after "
                                f"{self.num_accepted} tokens")
        self.num_accepted += 1

    def accept_all(self, token_ids: Iterable[int]) -> None:
        """accept() each token in order: rebuilds the state of a sequence that already has output (a decode
        worker after the prefill worker's first token, or after migration)."""
        for token_id in token_ids:
            self.accept(token_id)


def mask_logits(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """logits: [B, V] float32, in place: each row's tokens that its state forbids become -inf; rows whose
    state is None are untouched. One bitmask [B, ceil(V/32)] for the batch, applied in one call."""
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return
    if len(states) != logits.shape[0]:
        raise ValueError(f"{len(states)} states for {logits.shape[0]} rows of logits")
    vocab_size = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
    for i in rows:
        if states[i].vocab_size != vocab_size:
            raise ValueError(f"grammar vocab_size {states[i].vocab_size} != logits width {vocab_size}")
        states[i].fill_bitmask(bitmask, i)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
