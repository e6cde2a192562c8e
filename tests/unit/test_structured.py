"""Structured output on the tiny model's tokenizer: random logits through the grammar masks.

Random logits are the hard case: they pick among allowed tokens almost uniformly, so any hole in a
mask shows up as output that does not parse. Every grammar here has bounded output (maxLength, enum,
maxItems, integer bounds, bounded regex repeats): only then does a random walk through it reach the
end, and the stop token, within MAX_TOKENS; an unbounded string would run to the length limit.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from distserve.engine.structured import (
    GrammarCompiler,
    GrammarState,
    InvalidGrammar,
    StructuredSpec,
    TokenRejected,
    mask_logits,
)

VOCAB = 4100  # logits width wider than the tokenizer's 4096 ids: the padding must never be allowed
EOS = 1
MAX_TOKENS = 300
TRIALS = 4

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -10, "maximum": 10},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["x", "y"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
    },
    "required": ["id", "point", "flags"],
}


def check_person(value):
    assert set(value) == {"name", "age", "role", "active"}  # strict: no other properties
    assert isinstance(value["name"], str) and 1 <= len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert value["role"] in ("admin", "user", "guest")
    assert type(value["active"]) is bool


def check_tags(value):
    assert isinstance(value, list) and 1 <= len(value) <= 3
    assert all(isinstance(tag, str) and len(tag) <= 6 for tag in value)


def check_nested(value):
    assert set(value) == {"id", "point", "flags"}
    assert type(value["id"]) is int and -10 <= value["id"] <= 10
    assert set(value["point"]) == {"x", "y"} and all(0 <= value["point"][k] <= 9 for k in "xy")
    assert len(value["flags"]) <= 4 and all(type(f) is bool for f in value["flags"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, (EOS,))


def generate(state: GrammarState, seed: int) -> list[int]:
    """Masks random logits, draws, accepts, until the grammar terminates or MAX_TOKENS."""
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    while not state.is_terminated and len(tokens) < MAX_TOKENS:
        logits = torch.randn(1, VOCAB, generator=generator) * 3
        mask_logits(logits, [state])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
        state.accept(token)
        tokens.append(token)
    return tokens


def generate_text(compiler, tokenizer, spec: StructuredSpec, seed: int) -> str:
    state = compiler.matcher(spec)
    tokens = generate(state, seed)
    assert state.is_terminated, f"no stop after {MAX_TOKENS} tokens: {tokenizer.decode(tokens)!r}"
    assert tokens[-1] == EOS and EOS not in tokens[:-1]
    return tokenizer.decode(tokens[:-1])


@pytest.mark.parametrize("schema, check", [(PERSON, check_person), (TAGS, check_tags), (NESTED, check_nested)],
                         ids=["person", "tags", "nested"])
def test_json_schema_outputs_validate(compiler, tokenizer, schema, check):
    for seed in range(TRIALS):
        text = generate_text(compiler, tokenizer, StructuredSpec("json_schema", json.dumps(schema)), seed)
        check(json.loads(text))
        assert "\n" not in text and "  " not in text  # no free whitespace


def test_json_object_is_an_object(compiler, tokenizer):
    spec = StructuredSpec("json_object")
    for seed in range(TRIALS):
        state = compiler.matcher(spec)
        tokens = generate(state, seed)
        text = tokenizer.decode([t for t in tokens if t != EOS])
        assert text.startswith("{")
        if state.is_terminated:  # any object may run to the length limit; a finished one must parse
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("pattern", [r"[a-z]{1,6}@[a-z]{2,5}\.(com|org)", r"-?(0|[1-9][0-9]{0,3})", r"(ab|c){1,4}x?"])
def test_regex_outputs_fullmatch(compiler, tokenizer, pattern):
    for seed in range(TRIALS):
        text = generate_text(compiler, tokenizer, StructuredSpec("regex", pattern), seed)
        assert re.fullmatch(pattern, text), text


def test_choice_is_one_of_the_strings(compiler, tokenizer):
    choices = ("yes", "no", 'say "hi"\\n', "naïve\tcafé", "line\nbreak", "no way")  # prefixes, quotes, escapes
    seen = set()
    for seed in range(12):
        text = generate_text(compiler, tokenizer, StructuredSpec("choice", choices), seed)
        assert text in choices
        seen.add(text)
    assert len(seen) > 1


def test_gbnf_grammar(compiler, tokenizer):
    grammar = r'''
root ::= greeting " " name ("!" | ".")
greeting ::= "hello" | "hi" | "good " ("morning" | "night")
name ::= [A-Z] [a-z]{0,7}
'''
    for seed in range(TRIALS):
        text = generate_text(compiler, tokenizer, StructuredSpec("grammar", grammar), seed)
        assert re.fullmatch(r"(hello|hi|good (morning|night)) [A-Z][a-z]{0,7}[!.]", text), text


@pytest.mark.parametrize("spec, message", [
    (("json_schema", "{not json"), "json_schema: not valid JSON"),
    (("json_schema", '{"type": "banana"}'), "json_schema: Unsupported type"),
    (("regex", "(ab"), "regex: Regex parsing error"),
    (("regex", "[z-a]"), "regex: "),
    (("grammar", 'root ::= item\nitme ::= "x"'), 'grammar: EBNF parser error at line 1, column 10: Rule "item"'),
    (("grammar", 'start ::= "x"'), 'grammar: EBNF parser error at line 1, column 1: The root rule'),
])
def test_invalid_specs_raise_invalid_grammar(compiler, spec, message):
    with pytest.raises(InvalidGrammar) as error:
        compiler.check(StructuredSpec(*spec))
    assert str(error.value).startswith(message), str(error.value)
    assert ".cc:" not in str(error.value)  # xgrammar's source location is not for clients


@pytest.mark.parametrize("kind, value, message", [
    ("yaml", "x", "kind: must be one of"),
    ("choice", (), "choice: must be a non-empty tuple"),
    ("choice", ["a"], "choice: must be a non-empty tuple"),
    ("regex", "", "regex: must not be empty"),
    ("grammar", ("root",), "grammar: must be a string"),
    ("regex", "a" * (64 * 1024 + 1), "regex: at most 65536 characters, got 65537"),
    ("choice", ("x" * 40000, "y" * 40000), "choice: at most 65536 characters, got 80000"),
])
def test_malformed_spec_is_refused(kind, value, message):
    with pytest.raises(InvalidGrammar, match=f"^{re.escape(message)}"):
        StructuredSpec(kind, value)


def test_stop_tokens_only_where_complete(compiler, tokenizer):
    assert compiler.stop_token_ids == (EOS,)
    state = compiler.matcher(StructuredSpec("choice", ("yes", "yesterday")))
    assert not state.allowed_mask()[EOS]
    state.accept_all(tokenizer.encode("yes"))
    mask = state.allowed_mask()
    assert mask[EOS] and mask.sum() > 1  # "yes" is complete, "yesterday" may go on
    state.accept_all(tokenizer.encode("terday"))
    assert state.allowed_mask().nonzero().flatten().tolist() == [EOS]  # nothing else can follow
    assert not state.is_terminated and state.is_complete
    state.accept(EOS)
    assert state.is_terminated
    with pytest.raises(TokenRejected):
        state.accept(EOS)
    with pytest.raises(TokenRejected):
        mask_logits(torch.zeros(1, VOCAB), [state])


def test_stop_token_ids_are_the_callers(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, (2, 7))
    assert compiler.stop_token_ids == (2, 7)
    state = compiler.matcher(StructuredSpec("regex", "a"))
    state.accept_all(tokenizer.encode("a"))
    allowed = state.allowed_mask().nonzero().flatten().tolist()
    assert allowed == [2, 7]


def test_special_and_padding_ids_never_allowed(compiler):
    mask = compiler.matcher(StructuredSpec("json_object")).allowed_mask()
    assert mask.shape == (VOCAB,)
    assert not mask[[0, 1, 2]].any() and not mask[4096:].any()


def test_rejected_token_raises(compiler, tokenizer):
    state = compiler.matcher(StructuredSpec("regex", "[0-9]+"))
    with pytest.raises(TokenRejected, match="not allowed by the grammar after 0 tokens"):
        state.accept(tokenizer.encode("x")[0])
    state.accept(tokenizer.encode("4")[0])  # a rejected token leaves the state where it was


def test_replay_gives_the_same_masks_as_stepping(compiler):
    spec = StructuredSpec("json_schema", json.dumps(PERSON))
    stepped = compiler.matcher(spec)
    tokens = generate(stepped, seed=11)[:-1]  # up to (not including) the stop token
    for cut in (1, len(tokens) // 2, len(tokens)):
        walked = compiler.matcher(spec)
        for token in tokens[:cut]:
            walked.allowed_mask()  # stepping reads a mask before each token, as the engine does
            walked.accept(token)
        replayed = compiler.matcher(spec)
        replayed.accept_all(tokens[:cut])
        assert torch.equal(replayed.allowed_mask(), walked.allowed_mask())
        assert replayed.num_accepted == cut


def test_batched_mask_leaves_none_rows_untouched(compiler, tokenizer):
    json_state = compiler.matcher(StructuredSpec("json_schema", json.dumps(PERSON)))
    json_state.accept_all(tokenizer.encode('{"name": "'))
    regex_state = compiler.matcher(StructuredSpec("regex", "[0-9]{3}"))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    mask_logits(logits, [json_state, None, regex_state, None])
    assert torch.equal(logits[1], original[1]) and torch.equal(logits[3], original[3])
    for row, state in ((0, json_state), (2, regex_state)):
        allowed = state.allowed_mask()
        assert torch.equal(logits[row][allowed], original[row][allowed])
        assert torch.isneginf(logits[row][~allowed]).all()
    assert not torch.equal(*(logit.isfinite() for logit in (logits[0], logits[2])))  # rows got their own masks


def test_all_none_is_a_no_op_and_sizes_are_checked(compiler):
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    mask_logits(logits, [None, None])
    assert torch.equal(logits, original)
    state = compiler.matcher(StructuredSpec("regex", "a"))
    with pytest.raises(ValueError, match="states for"):
        mask_logits(logits, [state])
    with pytest.raises(ValueError, match="logits width"):
        mask_logits(torch.randn(1, VOCAB + 32), [state])


def test_compiled_grammars_are_cached_and_one_off_specs_cannot_flush_repeated_ones(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), max_cached=4)  # 1 entry for specs seen once
    hot = StructuredSpec("regex", "a+")
    compiler.check(hot)
    compiler.check(hot)  # seen twice: protected
    for pattern in ("b+", "c+", "d+", "e+"):  # a flood of one-off specs
        compiler.check(StructuredSpec("regex", pattern))
    assert hot in compiler.cached_specs()
    assert compiler.compiled(hot) is compiler.compiled(hot)  # a hit compiles nothing
    assert len(compiler.cached_specs()) == 2  # hot, and the last one-off spec
    with pytest.raises(InvalidGrammar):
        compiler.check(StructuredSpec("regex", "(("))
    assert StructuredSpec("regex", "((") not in compiler.cached_specs()  # failures are not cached


def test_a_compiled_grammar_makes_matchers_without_its_spec(compiler):
    compiled = compiler.compiled(StructuredSpec("choice", ("yes", "no")))
    first, second = compiler.matcher(compiled), compiler.matcher(compiled)
    assert first is not second and first.allowed_mask().equal(second.allowed_mask())


def test_bounded_strings_exclude_control_characters(compiler, tokenizer):
    """xgrammar's own bounded-string rule lets raw control characters into a JSON string; ours must not."""
    state = compiler.matcher(StructuredSpec("json_schema", json.dumps(PERSON)))
    state.accept_all(tokenizer.encode('{"name": "'))
    allowed = state.allowed_mask().nonzero().flatten().tolist()
    texts = [tokenizer.decode([token]) for token in allowed]
    assert len(texts) > 100
    assert not [text for text in texts if any(ord(ch) < 0x20 for ch in text)]
