"""The bench's HTTP driver and CLI against an in-process fake OpenAI server (SSE parsing, TTFT, clear errors)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from distserve.bench import cli
from distserve.bench.client import (
    BenchRequest,
    Endpoint,
    EndpointError,
    list_models,
    open_session,
    pick_model,
    run_rate,
    send_one,
)
from distserve.launcher import free_port

FIRST_TOKEN_DELAY_S = 0.05


def chunk(text: str) -> bytes:
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FakeServer:
    """An OpenAI-ish server in its own thread. `mode` picks how completions answer; `bodies` records requests."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.mode == "http_error":
            return web.json_response({"error": {"message": "prompt: too long", "type": "invalid_request_error"}},
                                     status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": keep-alive comment\n\n" + chunk(""))  # held-back text: not the first token
        await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        for i in range(body["max_tokens"]):
            await response.write(chunk(f"t{i}"))
            if self.mode == "inband_error" and i == 1:
                await response.write(b'data: {"error": {"message": "decode worker lost", "code": 500}}\n\n')
                break
            if self.mode == "cut" and i == 1:
                return response  # no [DONE]
        if self.mode == "ok":
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    def start(self) -> None:
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._started.wait(10), "fake server did not start"

    def _serve(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/v1/models", self.models), web.post("/v1/completions", self.completions)])
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def server():
    fake = FakeServer()
    fake.start()
    yield fake
    fake.stop()


async def test_records_ttft_at_first_content_and_tokens_from_usage(server):
    endpoint = Endpoint(server.url, "fake", api_key="sk-test")
    async with open_session() as session:
        record = await send_one(session, endpoint, BenchRequest([5, 6, 7], 4), arrival_s=1.5)
    assert record.ok and record.error == ""
    assert (record.arrival_s, record.input_len, record.output_len) == (1.5, 3, 4)
    assert FIRST_TOKEN_DELAY_S <= record.ttft_s <= record.e2e_s  # the empty first chunk is not a token
    assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 3)
    assert len(record.token_gaps_s) == 3 and all(gap >= 0 for gap in record.token_gaps_s)  # one per later token
    assert server.bodies[0] == {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 4, "min_tokens": 4,
                                "ignore_eos": True, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}
    assert server.headers[0]["Authorization"] == "Bearer sk-test"


@pytest.mark.parametrize("mode, error, output_len", [
    ("http_error", "HTTP 400: prompt: too long", 0),
    ("inband_error", "decode worker lost", 2),
    ("cut", "stream ended before [DONE]", 2),
])
async def test_failures_are_recorded_with_their_reason(server, mode, error, output_len):
    server.mode = mode
    async with open_session() as session:
        record = await send_one(session, Endpoint(server.url, "fake"), BenchRequest([5] * 8, 6), arrival_s=0.0)
    assert not record.ok and record.error == error
    assert record.output_len == output_len and record.e2e_s is None and record.tpot_s is None
    assert "Authorization" not in server.headers[0]


async def test_run_rate_sends_everything_and_keeps_request_order(server):
    server.mode = "no_usage"  # token count falls back to content chunks
    requests = [BenchRequest([3] * n, n) for n in (1, 2, 3, 4)]
    async with open_session() as session:
        records, duration_s = await run_rate(session, Endpoint(server.url, "fake"), requests, [0.0, 0.0, 0.01, 0.02])
    assert [(r.input_len, r.output_len, r.ok) for r in records] == [(1, 1, True), (2, 2, True), (3, 3, True),
                                                                    (4, 4, True)]
    assert records[0].tpot_s is None  # one output token
    assert duration_s >= max(r.e2e_s for r in records)


async def test_model_check_names_the_served_models(server):
    async with open_session() as session:
        cards = await list_models(session, server.url)
    assert pick_model(server.url, cards, None)["id"] == "fake"
    with pytest.raises(EndpointError, match=r"^model 'nope' is not served at http://127.0.0.1:\d+; served: \['fake'\]$"):
        pick_model(server.url, cards, "nope")


def test_cli_unreachable_url_fails_before_the_run(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["--url", url, "--out", str(tmp_path / "r"), "--num-prompts", "2"]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [f"error: cannot reach {url}: Connection refused"]
    assert not (tmp_path / "r" / "results.json").exists()


def test_cli_wrong_model(server, tmp_path, capsys):
    assert cli.main(["--url", server.url, "--model", "nope", "--out", str(tmp_path)]) != 0
    assert capsys.readouterr().err.strip() == f"error: model 'nope' is not served at {server.url}; served: ['fake']"
    assert server.bodies == []


def test_cli_bad_rates_name_the_flag(tmp_path, capsys):
    assert cli.main(["--rates", "1,0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: --rates: ")


def test_cli_run_writes_results_charts_and_compares(server, tmp_path, capsys):
    out = tmp_path / "disagg"
    argv = ["--url", server.url, "--rates", "inf,20", "--num-prompts", "3", "--input-len", "5-9", "--output-len", "3",
            "--out", str(out), "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000"]
    assert cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert (doc["label"], doc["model"], doc["url"]) == ("disagg", "fake", server.url)
    assert doc["workload"] == {"name": "fixed", "input_len": "5-9", "output_len": "3", "num_prompts": 3, "seed": 0,
                               "prefix_len": 0, "repeats": 1}
    assert [r["rate"] for r in doc["rates"]] == ["inf", 20.0]  # run in the given order
    assert all(r["attainment"] == 1.0 and r["num_ok"] == 3 for r in doc["rates"])
    assert (doc["goodput_rps"], doc["goodput_is_lower_bound"]) == (20.0, True)
    # the same prompt lengths at every rate, never the same prompts (a prefix cache must not help)
    first, second = server.bodies[:3], server.bodies[3:]
    assert sorted(len(b["prompt"]) for b in first) == sorted(len(b["prompt"]) for b in second)
    assert not {str(b["prompt"]) for b in first} & {str(b["prompt"]) for b in second}
    assert (out / "attainment.png").stat().st_size > 0 and (out / "latency_cdf.png").stat().st_size > 0
    assert "goodput: >= 20.00 req/s" in capsys.readouterr().out

    assert cli.main(["--compare", str(out), str(out), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert printed.count(">= 20.00") == 2 and (tmp_path / "cmp" / "attainment.png").stat().st_size > 0
    assert cli.main(["--compare", str(out)]) == 0  # no --out: the table only
    assert capsys.readouterr().out.splitlines()[1].split() == ["disagg", ">=", "20.00", "5000/5000"]


def test_cli_repeats_send_new_prompts_each_time_and_record_each_ones_attainment(server, tmp_path, capsys):
    out = tmp_path / "repeated"
    argv = ["--url", server.url, "--rates", "20", "--num-prompts", "3", "--input-len", "5", "--output-len", "3",
            "--repeats", "2", "--out", str(out), "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000"]
    assert cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    (rate,) = doc["rates"]
    assert rate["num_requests"] == 6 and [r["attainment"] for r in rate["repeats"]] == [1.0, 1.0]
    assert doc["goodput_repeats_rps"] == [20.0, 20.0]
    assert len({str(b["prompt"]) for b in server.bodies}) == 6  # every repeat's prompts are new
    printed = capsys.readouterr().out
    assert "(100-100% over 2 repeats)" in printed and "per repeat 20.00-20.00" in printed
    assert cli.main(["--repeats", "0", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error: --repeats: ")


def test_cli_auto_rates_double_from_the_start_while_the_slos_hold(server, tmp_path):
    out = tmp_path / "auto"
    argv = ["--url", server.url, "--rates", "auto", "--auto-start", "64", "--num-prompts", "3", "--input-len", "5",
            "--output-len", "3", "--out", str(out), "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000"]
    assert cli.main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert [r["rate"] for r in doc["rates"]] == [64.0, 128.0, 256.0]  # 512 is past the search's ceiling
    assert (doc["goodput_rps"], doc["goodput_is_lower_bound"]) == (256.0, True)
