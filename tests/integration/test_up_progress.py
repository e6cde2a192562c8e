"""`distserve up` as a user runs it, a real process: it says each child is ready, with its time, and when a child
fails to start, it shows that child's last log lines."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

CHILDREN = ["redis", "kvbroker", "prefill-0", "decode-0", "router", "gateway"]
START_TIMEOUT_S = 240


@pytest.fixture(autouse=True)
def system_is_clean_after():
    """These tests start their own `distserve up`; the session's cluster is not needed (overrides conftest's)."""
    yield


def up_argv(model: str, tmp_path) -> list[str]:
    return [sys.executable, "-m", "distserve.cli", "up", "--model", model, "--free-ports",
            "--log-dir", str(tmp_path / "logs"), "--state-file", str(tmp_path / "up.json")]


class Lines:
    """The lines a stream has written so far, read by a thread."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, process: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.lines:
            assert process.poll() is None, f"`distserve up` exited with {process.returncode}:\n" + "\n".join(self.lines)
            assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s:\n" + "\n".join(self.lines)
            time.sleep(0.2)

    def joined(self) -> list[str]:
        self._reader.join(timeout=30)
        return self.lines


def test_up_says_when_each_child_starts_and_is_ready_with_its_time(tiny_model_path, tmp_path):
    up = subprocess.Popen(up_argv(tiny_model_path, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
    output = Lines(up.stdout)
    try:
        output.wait_for("ready; Ctrl-C stops everything", up, START_TIMEOUT_S)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    lines = output.joined()
    for name in CHILDREN:
        assert f"starting {name} ..." in lines, lines
        ready = [line for line in lines if re.fullmatch(rf"ready +{re.escape(name)} +\S+ +\d+\.\d s", line)]
        assert len(ready) == 1, (name, lines)
        assert lines.index(f"starting {name} ...") < lines.index(ready[0])
    assert not any(line.startswith(("starting colocated", "failed")) for line in lines), lines


def test_a_child_that_fails_to_start_is_shown_with_its_last_log_lines(tiny_model_path, tmp_path):
    env = {**os.environ, "DISTSERVE_DECODE_KV_CACHE_MB": "lots"}  # only the decode worker reads it
    up = subprocess.run(up_argv(tiny_model_path, tmp_path), capture_output=True, text=True, env=env,
                        timeout=START_TIMEOUT_S)
    assert up.returncode == 1, up.stdout + up.stderr
    assert re.search(r"^failed +decode-0 +exited with code 1 +\d+\.\d s$", up.stdout, re.MULTILINE), up.stdout
    log_path = tmp_path / "logs" / "decode-0.log"
    assert up.stderr.startswith(f"error: decode-0 exited with code 1; the last lines of its log {log_path}:\n")
    assert "kv_cache_mb: invalid literal for int()" in up.stderr
    assert f"  {log_path.read_text().splitlines()[-1]}" in up.stderr.splitlines()  # its log's last line, indented
    assert "ready; Ctrl-C stops everything" not in up.stdout  # the start ended there
