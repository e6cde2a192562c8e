"""benchmarks/slo_map: runs re-judged against other targets, goodput per repeat, the decisive winner."""

from __future__ import annotations

import json

import pytest

from benchmarks.slo_map import judge_cell, repeat_goodputs


def request(ttft_s: float, tpot_s: float, stall_s: float, ok: bool = True) -> dict:
    return {"arrival_s": 0.0, "input_len": 100, "output_len": 10, "ttft_s": ttft_s, "tpot_s": tpot_s,
            "itl_p99_s": stall_s, "max_stall_s": stall_s, "e2e_s": ttft_s + 9 * tpot_s, "ok": ok, "error": ""}


def results(per_rate: dict[float, list[list[dict]]]) -> dict:
    """results.json of a run: for each rate, its repeats' requests, pooled in repeat order."""
    num_prompts = len(next(iter(per_rate.values()))[0])
    return {"workload": {"num_prompts": num_prompts, "input_len": 100, "output_len": 10},
            "rates": [{"rate": rate, "requests": [r for repeat in repeats for r in repeat]}
                      for rate, repeats in per_rate.items()]}


FAST, STALLED = request(0.1, 0.02, 0.03), request(0.1, 0.02, 0.5)
SLOW_FIRST, LATE_FIRST = request(5.0, 0.02, 0.03), request(3.0, 0.02, 0.03)


def test_each_repeat_is_judged_on_its_own_requests_against_the_targets_given():
    run = results({1.0: [[FAST] * 10, [FAST] * 10], 2.0: [[FAST] * 10, [FAST] * 8 + [SLOW_FIRST] * 2]})
    # repeat 1 meets at both rates (a lower bound: 2.0); repeat 2 drops to 80% at 2.0: 1 + (1 - .9) / (1 - .8)
    assert repeat_goodputs(run, 4000, 100, None) == pytest.approx([2.0, 1.5])
    late = results({1.0: [[LATE_FIRST] * 10], 2.0: [[LATE_FIRST] * 10]})
    assert repeat_goodputs(late, 4000, 100, None) == [2.0] and repeat_goodputs(late, 1000, 100, None) == [0.0]
    stalls = results({1.0: [[FAST] * 9 + [STALLED]], 2.0: [[STALLED] * 10]})
    assert repeat_goodputs(stalls, 4000, 100, None) == [2.0]
    assert repeat_goodputs(stalls, 4000, 100, 150) == [pytest.approx(1.0)]  # 90% at 1.0, 0% at 2.0


def test_a_cell_names_its_winner_and_says_whether_the_spreads_part(tmp_path):
    cell = tmp_path / "in100_out10"
    runs = {"1p1d-nospill": results({1.0: [[FAST] * 10] * 2, 2.0: [[FAST] * 10] * 2}),
            "2c": results({1.0: [[FAST] * 10] * 2, 2.0: [[STALLED] * 10] * 2})}
    for name, run in runs.items():
        (cell / name).mkdir(parents=True)
        (cell / name / "results.json").write_text(json.dumps(run))
    rows = {row["targets"]: row for row in judge_cell(cell)["rows"]}
    stall = rows["stall 150ms"]
    assert stall["winner"] == "1p1d-nospill" and stall["decisive"]
    assert stall["disaggregated_over_2c"] == pytest.approx(2.0 / 1.1)  # 2c: 100% at 1, 0% at 2: 1 + 0.1
    loose = rows["loose"]  # no stall target: both meet everything, a tie
    assert loose["median"] == {"1p1d-nospill": 2.0, "2c": 2.0} and loose["winner"] is None and not loose["decisive"]
