"""n > 1 and best_of through the whole system: one prefill, n sequences sharing the prompt's KV blocks on a
decode worker. Completion i equals a single request seeded seed + i (so sharing changes no token), and
best_of returns the completions with the highest cumulative logprob."""

from __future__ import annotations

import openai
import pytest

from tests.builders import generate, token_request

MODEL = "distserve-tiny"
PROMPT_IDS = list(range(40, 90))  # 50 tokens: full shared blocks and a partial one copied per completion
SEED = 11


def by_index(answer) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for message in answer.messages:
        tokens.setdefault(message.index, []).extend(message.token_ids)
    return tokens


def test_each_completion_equals_a_single_request_seeded_seed_plus_its_index(cluster):
    request = token_request(PROMPT_IDS, max_tokens=12, temperature=0.9, seed=SEED, ignore_eos=True)
    request.n = 3
    many = by_index(generate(cluster.router_address, request))
    singles = [generate(cluster.router_address, token_request(PROMPT_IDS, max_tokens=12, temperature=0.9,
                                                              seed=SEED + i, ignore_eos=True)).token_ids
               for i in range(3)]
    assert [many[i] for i in range(3)] == singles
    assert len({tuple(t) for t in singles}) == 3  # distinct


def test_greedy_completions_are_all_the_greedy_answer_with_usage_per_completion(cluster):
    request = token_request(PROMPT_IDS, max_tokens=6, ignore_eos=True)
    request.n = 2
    answer = generate(cluster.router_address, request)
    single = generate(cluster.router_address, token_request(PROMPT_IDS, max_tokens=6, ignore_eos=True)).token_ids
    assert by_index(answer) == {0: single, 1: single}
    finals = [m for m in answer.messages if m.finish_reason]
    assert sorted(m.index for m in finals) == [0, 1]
    assert all(m.usage.completion_tokens == 6 and m.usage.prompt_tokens == len(PROMPT_IDS) for m in finals)


def test_stop_strings_end_each_completion_on_its_own(cluster, tiny_model_path):
    from distserve.engine.model_loader import load_tokenizer
    request = token_request(PROMPT_IDS, max_tokens=16, temperature=1.0, seed=SEED, ignore_eos=True)
    request.n = 3
    free = by_index(generate(cluster.router_address, request))
    tokenizer = load_tokenizer(tiny_model_path)
    stop = tokenizer.decode(free[1][4:6])  # text completion 1 produces mid-way
    request.sampling.stop.append(stop)
    answer = generate(cluster.router_address, request)
    text = {i: "".join(m.text for m in answer.messages if m.index == i) for i in range(3)}
    assert stop not in text[1] and len(by_index(answer)[1]) <= 6
    assert {m.index for m in answer.messages if m.finish_reason} == {0, 1, 2}


def test_sdk_n3_gives_three_distinct_seeded_choices_stable_across_runs(cluster):
    sdk = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="any", max_retries=0)
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=SEED, n=3,
                  extra_body={"ignore_eos": True})
    first, second = sdk.completions.create(**kwargs), sdk.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3
    assert first.usage.completion_tokens == 30
    streamed: dict[int, str] = {}
    for chunk in sdk.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == texts


def test_sdk_chat_n2(cluster):
    sdk = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="any", max_retries=0)
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                        temperature=1.0, seed=SEED, n=2)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.message.role == "assistant" for c in reply.choices)


def test_best_of_returns_the_completions_with_the_highest_cumulative_logprob(cluster):
    sdk = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="any", max_retries=0)
    kwargs = dict(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, temperature=1.0, seed=SEED,
                  extra_body={"ignore_eos": True})
    candidates = sdk.completions.create(n=4, logprobs=0, **kwargs).choices
    score = {c.text: sum(c.logprobs.token_logprobs) for c in candidates}
    best = sdk.completions.create(n=2, best_of=4, **kwargs)
    ranked = sorted(score, key=score.get, reverse=True)
    assert [c.text for c in sorted(best.choices, key=lambda c: c.index)] == ranked[:2]
    assert all(c.logprobs is None for c in best.choices)  # computed to rank them, not asked for
    assert best.usage.completion_tokens == 32  # all 4 generated completions, as OpenAI bills best_of


def test_n_out_of_range_is_a_400_naming_it(cluster):
    sdk = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="any", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, n=17)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, n=3, best_of=2)
    assert info.value.body["param"] == "best_of"
