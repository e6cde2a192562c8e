"""benchmarks/paper_repro helpers: scaled prompts stay within OPT's context; the 90% crossing."""

from __future__ import annotations

import pytest

from benchmarks.paper_repro import MAX_CONTEXT, fleets, scaled_trace
from benchmarks.paper_repro_crosscheck import crossing
from distserve.planner.goodput import Trace, Workload


def test_scaled_prompts_grow_and_stay_within_the_context():
    workload = Workload("chat", max_context=MAX_CONTEXT)
    base, doubled = Trace.draw(workload, 200, 0), scaled_trace(workload, 200, 0, 2.0)
    assert doubled.unit_arrivals == base.unit_arrivals
    assert all(n_in + n_out <= MAX_CONTEXT for n_in, n_out in doubled.lengths)
    assert [o for _, o in doubled.lengths] == [o for _, o in base.lengths]
    short = [(a, b) for a, b in zip(base.lengths, doubled.lengths) if 2 * a[0] + a[1] <= MAX_CONTEXT]
    assert short and all(b[0] == 2 * a[0] for a, b in short)


def test_the_crossing_interpolates_between_the_last_pass_and_the_first_miss():
    assert crossing([(1, 0.95), (2, 0.92), (3, 0.86)]) == pytest.approx(2 + 0.02 / 0.06)
    assert crossing([(1, 0.80), (2, 0.70)]) == 0.0
    assert crossing([(1, 0.99), (2, 0.95)]) == 2


def test_the_paper_fleets_count_their_gpus():
    gpus = {name: config.devices for name, config in fleets("fitted").items()}
    assert gpus["distserve (prefill TP2 + decode TP1, 3 GPUs)"] == 3
    assert gpus["vllm (paper's baseline: 1 GPU, no chunked prefill)"] == 1
    assert len(fleets("roofline")) == len(gpus) - 1  # the roofline has one engine: no engine-matched baseline
