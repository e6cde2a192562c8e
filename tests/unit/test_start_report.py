"""What `distserve up` says while it starts: each child starting and ready with its time, the CPU kernel build
announced only when there is one to do, and a child that failed with the last lines of its log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distserve import cli, launcher
from distserve.engine import cpu_kernels
from distserve.launcher import Cluster, ClusterSpec, ManagedProcess, StartReport


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_child_gets_a_ready_or_failed_row_with_the_seconds_since_it_started():
    lines, clock = [], FakeClock()
    report = StartReport(lines.append, clock)
    report.starting("redis")
    clock.now += 0.14
    report.ready("redis", "127.0.0.1:6390")
    report.starting("colocated-0")
    report.starting("gateway")
    clock.now += 12.3
    report.ready("gateway", "http://127.0.0.1:8000")
    report.failed("colocated-0", "exited with code 1")
    assert lines == ["starting redis ...",
                     "ready    redis        127.0.0.1:6390             0.1 s",
                     "starting colocated-0 ...",
                     "starting gateway ...",
                     "ready    gateway      http://127.0.0.1:8000     12.3 s",
                     "failed   colocated-0  exited with code 1        12.3 s"]


def test_the_kernel_build_is_announced_then_timed():
    lines, clock = [], FakeClock()
    report = StartReport(lines.append, clock)
    report.building_kernels()
    clock.now += 31.26
    report.kernels_built()
    assert lines == ["building CPU kernels for this machine (once; 30 s to a few minutes) ...",
                     "built    CPU kernels                            31.3 s"]


def test_without_a_callback_the_start_says_nothing():
    report = StartReport()
    report.starting("redis")
    report.ready("redis", "127.0.0.1:6390")  # no error, no output


@pytest.fixture
def lines() -> list[str]:
    """What cluster_of_one has reported."""
    return []


@pytest.fixture
def cluster_of_one(tmp_path, lines) -> Cluster:
    """A Cluster (nothing started) of one prefill and one decode worker that reports into `lines`."""
    return Cluster(ClusterSpec(model="unused", log_dir=str(tmp_path)), lines.append)


@pytest.fixture
def unbuilt_kernels(monkeypatch) -> list[Path]:
    """No kernel build on this machine, and a build that succeeds at once: the log path of each build run."""
    builds = []
    monkeypatch.setattr(cpu_kernels, "is_built", lambda: False)
    monkeypatch.setattr(launcher, "build_cpu_kernels", lambda env, log_path: builds.append(log_path) or True)
    return builds


def test_a_machine_without_the_kernels_builds_them_first_and_says_so(cluster_of_one, lines, unbuilt_kernels):
    cluster_of_one._build_cpu_kernels()
    assert unbuilt_kernels == [cluster_of_one.log_dir / "cpu-kernels.log"]
    assert lines[0].startswith("building CPU kernels")
    assert lines[1].startswith("built    CPU kernels") and lines[1].endswith(" s")


def test_a_failed_kernel_build_says_the_workers_use_the_torch_path(cluster_of_one, lines, unbuilt_kernels, monkeypatch):
    monkeypatch.setattr(launcher, "build_cpu_kernels", lambda env, log_path: False)
    cluster_of_one._build_cpu_kernels()
    assert lines[1].startswith("failed   CPU kernels  not built")
    assert "torch path" in lines[2] and "cpu-kernels.log" in lines[2]


@pytest.mark.parametrize("env", [{"DISTSERVE_CPU_KERNELS": "0"}, {"DISTSERVE_DEVICE": "cuda"}])
def test_no_build_for_workers_that_do_not_use_the_kernels(tmp_path, unbuilt_kernels, env):
    lines = []
    Cluster(ClusterSpec(model="unused", log_dir=str(tmp_path), env=env), lines.append)._build_cpu_kernels()
    assert unbuilt_kernels == [] and lines == []


def test_built_kernels_are_not_built_again(cluster_of_one, lines, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "is_built", lambda: True)
    monkeypatch.setattr(launcher, "build_cpu_kernels", lambda env, log_path: pytest.fail("built again"))
    cluster_of_one._build_cpu_kernels()
    assert lines == []


def test_is_built_looks_for_the_library_of_the_current_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not cpu_kernels.is_built()
    directory = cpu_kernels.kernels_build_directory()
    directory.mkdir(parents=True)
    (directory / f"{directory.name}.so").write_bytes(b"")
    assert cpu_kernels.is_built()


def test_a_failed_child_is_reported_and_its_error_ends_with_its_last_log_lines(cluster_of_one, lines):
    log_path = cluster_of_one.log_dir / "decode-0.log"
    log_path.write_text("".join(f"line {i}\n" for i in range(100)))
    popen = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    popen.wait()
    cluster_of_one.report.starting("decode-0")
    child = ManagedProcess("decode-0", popen, log_path, [], {})
    with pytest.raises(launcher.StartError) as error:
        cluster_of_one._ensure_running(child)
    assert lines[-1].startswith("failed   decode-0     exited with code 3")
    message = str(error.value).splitlines()
    assert message[0] == f"decode-0 exited with code 3; the last lines of its log {log_path}:"
    assert message[1:] == [f"  line {i}" for i in range(60, 100)]


def test_free_ports_leaves_every_port_to_the_launcher():
    spec = cli._on_free_ports(ClusterSpec(model="unused", gateway_port=None))
    ports = {name: value for name, value in vars(spec).items() if name.endswith("_port")}
    assert ports.pop("gateway_port") is None and set(ports.values()) == {0}
    assert cli._on_free_ports(ClusterSpec(model="unused")).gateway_port == 0


@pytest.mark.parametrize("flags, env", [([], None), (["--no-prefix-caching"], "0"), (["--prefix-caching"], None)])
def test_up_turns_prefix_caching_off_for_every_worker_only_when_asked(tiny_model_path, flags, env):
    import argparse

    parser = argparse.ArgumentParser()
    cli._add_cluster_args(parser)
    spec = cli._spec(parser.parse_args(["--model", tiny_model_path, *flags]))
    assert spec.env.get("DISTSERVE_PREFIX_CACHING") == env  # unset: the workers' default (on) or the caller's env
