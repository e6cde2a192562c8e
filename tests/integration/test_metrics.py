"""Every service serves Prometheus /metrics that parse, with vLLM's names and buckets, and move with requests."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from distserve.metrics import TTFT_BUCKETS
from tests.builders import generate, token_request

SERVICES = ("gateway", "router", "kvbroker", "prefill-0", "prefill-1", "decode-0", "decode-1")


def scrape(cluster, name: str) -> dict[str, float]:
    """Samples by 'name{label=value,...}'."""
    url = cluster.gateway_url + "/metrics" if name == "gateway" else cluster.processes[name].metrics_url
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def total(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix + "{"))


def test_metrics_parse_and_move(cluster):
    before = {name: scrape(cluster, name) for name in SERVICES}
    prompt = list(range(100, 150))
    generate(cluster.router_address, token_request(prompt, max_tokens=5, ignore_eos=True))
    body = json.dumps({"model": Path(cluster.spec.model).name, "prompt": prompt, "max_tokens": 5,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(cluster.gateway_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200
    after = {name: scrape(cluster, name) for name in SERVICES}

    assert after["gateway"].get('distserve:http_requests_total{path=/v1/completions,status=200}', 0) - \
        before["gateway"].get('distserve:http_requests_total{path=/v1/completions,status=200}', 0) == 1

    router_delta = lambda key: total(after["router"], key) - total(before["router"], key)  # noqa: E731
    assert router_delta("distserve:request_success_total") == 2
    assert router_delta("distserve:prompt_tokens_total") == 2 * len(prompt)
    assert router_delta("distserve:generation_tokens_total") == 10
    assert router_delta("distserve:time_to_first_token_seconds_count") == 2
    assert router_delta("distserve:e2e_request_latency_seconds_count") == 2
    assert router_delta("distserve:inter_token_latency_seconds_count") == 8

    def summed(names, key):
        return sum(total(after[n], key) - total(before[n], key) for n in names)

    prefills, decodes = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")
    assert summed(prefills, "distserve:prompt_tokens_total") == 2 * len(prompt)
    assert summed(prefills, "distserve:request_prefill_time_seconds_count") == 2
    assert summed(prefills, "distserve:kv_transfer_bytes_total") > 0
    assert summed(decodes, "distserve:kv_transfer_bytes_total") == summed(prefills, "distserve:kv_transfer_bytes_total")
    assert summed(decodes, "distserve:generation_tokens_total") == 2 * 4  # the first token comes from prefill
    assert summed(decodes, "distserve:request_success_total") == 2
    assert total(after["kvbroker"], "distserve:kv_handle_operations_total") - \
        total(before["kvbroker"], "distserve:kv_handle_operations_total") == 6  # register, claim, release x2
    for name in decodes:
        assert "distserve:kv_cache_usage_perc{}" in after[name]

    edges = sorted(float(k.split("le=")[1].rstrip("}")) for k in after["router"]
                   if k.startswith("distserve:time_to_first_token_seconds_bucket{"))
    assert edges[:-1] == TTFT_BUCKETS and edges[-1] == float("inf")
