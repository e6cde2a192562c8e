"""`python -m distserve.bench` against the real system's gateway: every request answered, results and charts written."""

from __future__ import annotations

import json
import subprocess
import sys

from distserve.launcher import free_port

MODEL = "distserve-tiny"


def bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distserve.bench", *argv], check=False, capture_output=True,
                          text=True, timeout=120)


def test_bench_against_the_gateway(cluster, tiny_model_path, tmp_path):
    out = tmp_path / "disagg"
    done = bench("--url", cluster.gateway_url, "--model", MODEL, "--tokenizer", tiny_model_path, "--rates", "4,inf",
                 "--num-prompts", "6", "--input-len", "16", "--output-len", "8", "--out", str(out))
    assert done.returncode == 0, done.stderr
    doc = json.loads((out / "results.json").read_text())
    assert (doc["label"], doc["model"], doc["url"]) == ("disagg", MODEL, cluster.gateway_url)
    assert [r["rate"] for r in doc["rates"]] == [4.0, "inf"]
    for rate in doc["rates"]:
        assert (rate["num_requests"], rate["num_ok"]) == (6, 6)
        assert 0.0 <= rate["attainment"] <= 1.0
        for request in rate["requests"]:
            assert request["ok"] and request["error"] == "", request
            assert (request["input_len"], request["output_len"]) == (16, 8)  # ignore_eos: exactly 8 tokens
            assert 0 < request["ttft_s"] <= request["e2e_s"]
            assert request["tpot_s"] >= 0
        assert rate["output_throughput"] > 0
    assert isinstance(doc["goodput_rps"], float) and isinstance(doc["goodput_is_lower_bound"], bool)
    assert (out / "attainment.png").stat().st_size > 0 and (out / "latency_cdf.png").stat().st_size > 0
    assert "goodput:" in done.stdout


def test_bench_against_a_closed_port_fails_before_the_run(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    done = bench("--url", url, "--rates", "1", "--num-prompts", "2", "--out", str(tmp_path))
    assert done.returncode != 0
    assert done.stderr.strip() == f"error: cannot reach {url}: Connection refused"
    assert not (tmp_path / "results.json").exists()
