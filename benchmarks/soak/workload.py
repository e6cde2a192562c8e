"""The soak's requests: what each one asks the gateway, drawn from one seeded RNG.

Every request is short (prompt 8-64 tokens, max_tokens 4-32) and is a completion
(prompt as token ids, so its length is exact) or a chat (words, about the same
length), streamed or not. A share comes from the reference pool: fixed greedy
and seeded-sampling requests whose answers were taken before any fault, so the
soak can check they never change. A few are cancelled by the client on purpose:
closed after the first chunk (`cancel`) or before any byte came back (`disconnect`).
"""

from __future__ import annotations

import dataclasses
import random

VOCAB = (3, 4000)  # token ids drawn from here: past the tiny model's special tokens (0-2)
WORDS = ("the", "fox", "system", "cache", "token", "worker", "router", "decode", "prefill", "serving",
         "quick", "brown", "galaxy", "time", "upon", "once", "model", "stream", "request", "answer")
SHARE_GREEDY_POOL = 0.30
SHARE_SEEDED_POOL = 0.05
SHARE_CANCEL = 0.03  # streaming ones only
SHARE_DISCONNECT = 0.02


@dataclasses.dataclass(frozen=True)
class Planned:
    """One request of the soak."""

    index: int
    endpoint: str  # "completions" | "chat"
    body: dict  # the JSON body, without model/stream (added when sent)
    stream: bool
    action: str = "normal"  # "normal" | "cancel" (close after the first chunk) | "disconnect" (before any byte)
    reference_key: str = ""  # a reference pool entry whose answer this one must repeat ("": none)


def _completion(rng: random.Random, sampling: dict) -> tuple[str, dict]:
    prompt = [rng.randrange(*VOCAB) for _ in range(rng.randint(8, 64))]
    return "completions", {"prompt": prompt, "max_tokens": rng.randint(4, 32), **sampling}


def _chat(rng: random.Random, sampling: dict) -> tuple[str, dict]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    return "chat", {"messages": [{"role": "user", "content": words}], "max_tokens": rng.randint(4, 32), **sampling}


def _draw(rng: random.Random, sampling: dict) -> tuple[str, dict]:
    return (_completion if rng.random() < 0.6 else _chat)(rng, sampling)


def reference_pool(rng: random.Random, num_greedy: int = 24, num_seeded: int = 8) -> dict[str, tuple[str, dict]]:
    """Fixed requests by key: greedy ones and seeded-sampling ones (same answer every time)."""
    pool = {f"greedy-{i}": _draw(rng, {"temperature": 0}) for i in range(num_greedy)}
    for i in range(num_seeded):
        pool[f"seeded-{i}"] = _draw(rng, {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**31)})
    return pool


def plan(rng: random.Random, index: int, pool: dict[str, tuple[str, dict]]) -> Planned:
    """Request number `index` of the soak."""
    stream = rng.random() < 0.5
    draw = rng.random()
    key = ""
    if draw < SHARE_GREEDY_POOL:
        key = rng.choice([k for k in pool if k.startswith("greedy")])
    elif draw < SHARE_GREEDY_POOL + SHARE_SEEDED_POOL:
        key = rng.choice([k for k in pool if k.startswith("seeded")])
    endpoint, body = pool[key] if key else _draw(rng, {"temperature": rng.choice([0, 0.7, 1.0])})
    action = rng.random()
    if stream and action < SHARE_CANCEL:
        return Planned(index, endpoint, body, stream, "cancel")
    if action > 1 - SHARE_DISCONNECT:
        return Planned(index, endpoint, body, stream, "disconnect")
    return Planned(index, endpoint, body, stream, reference_key=key)
