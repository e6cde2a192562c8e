"""The side-by-side summary: one table per round and the median of each metric over the rounds."""

from __future__ import annotations

import json

from benchmarks.peer.summarize import summary


def write(folder, system: str, dtype: str, rate: str, ttft: float, tokens_per_s: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{system}_{dtype}_rate{rate}.json").write_text(json.dumps(
        {"median_ttft_ms": ttft, "output_throughput": tokens_per_s, "completed": 50}))


def test_one_folder_gives_one_table_with_the_peer_first(tmp_path):
    write(tmp_path, "distserve", "bfloat16", "4", 80.0, 230.0)
    write(tmp_path, "vllm", "bfloat16", "4", 72.0, 235.0)
    lines = summary(tmp_path).splitlines()
    assert len(lines) == 4 and "round" not in summary(tmp_path)
    assert lines[2].startswith("| bfloat16 | 4 | vllm | 72.0 |") and lines[3].startswith("| bfloat16 | 4 | distserve | 80.0 |")


def test_rounds_give_each_round_and_the_median_of_every_metric(tmp_path):
    for round_no, (ours, peer) in enumerate([(90.0, 70.0), (60.0, 75.0), (100.0, 71.0)], start=1):
        write(tmp_path / f"round{round_no}", "distserve", "float32", "inf", ours, ours * 2)
        write(tmp_path / f"round{round_no}", "vllm", "float32", "inf", peer, peer * 2)
    write(tmp_path / "round3", "distserve-turns", "float32", "inf", 1.0, 1.0)  # not in every round: no median
    text = summary(tmp_path)
    assert [line for line in text.splitlines() if line.startswith("###")] == [
        "### round1", "### round2", "### round3", "### median of 3 rounds"]
    median = text.split("### median of 3 rounds")[1].strip().splitlines()
    assert median[2].startswith("| float32 | inf | vllm | 71.0 | - | - | - | 142.0 | - | 50 |")
    assert median[3].startswith("| float32 | inf | distserve | 90.0 | - | - | - | 180.0 | - | 50 |")
    assert len(median) == 4
