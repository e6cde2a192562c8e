"""`distserve up --gpus`: each worker its own GPU in start order, memory shares split among workers dealt
to one GPU, and the KV cache sized from that share (CPU-only: the sizing reads a fake device)."""

from __future__ import annotations

import types

import pytest

from distserve.config import ConfigError
from distserve.engine.device_memory import MIB, activation_reserve_bytes, kv_cache_budget_mb
from distserve.gpu_placement import GpuShare, parse_gpu_list, plan_gpus
from distserve.launcher import Cluster, ClusterSpec, plan_worker_gpus
from distserve.worker_config import WorkerConfig

GIB = 1024 * MIB


@pytest.mark.parametrize("text, gpus", [("0", [0]), ("0,1", [0, 1]), (" 2, 3 ", [2, 3])])
def test_gpu_lists_parse(text, gpus):
    assert parse_gpu_list(text) == gpus


@pytest.mark.parametrize("text", ["", "a", "0,0", "-1", "0;1"])
def test_a_bad_gpu_list_is_refused_naming_the_flag(text):
    with pytest.raises(ConfigError, match="^gpus: "):
        parse_gpu_list(text)


def test_as_many_gpus_as_workers_give_each_its_own_with_the_whole_fraction():
    plan = plan_gpus(["prefill-0", "decode-0", "decode-1"], [0, 1, 2], 0.9)
    assert plan == {"prefill-0": GpuShare("0", 0.9), "decode-0": GpuShare("1", 0.9), "decode-1": GpuShare("2", 0.9)}


def test_workers_sharing_a_gpu_split_its_fraction():
    plan = plan_gpus(["prefill-0", "decode-0"], [3], 0.8)  # one GPU: the stated half-and-half split
    assert plan == {"prefill-0": GpuShare("3", 0.4), "decode-0": GpuShare("3", 0.4)}
    uneven = plan_gpus(["prefill-0", "prefill-1", "decode-0"], [0, 1], 0.9)  # round-robin: GPU 0 gets two
    assert uneven == {"prefill-0": GpuShare("0", 0.45), "prefill-1": GpuShare("1", 0.9),
                      "decode-0": GpuShare("0", 0.45)}


def test_inside_an_allocation_gpus_count_within_it():
    """Under a scheduler's CUDA_VISIBLE_DEVICES=2,3 (or UUIDs), --gpus 0,1 means those two, and nothing beyond."""
    plan = plan_gpus(["prefill-0", "decode-0"], [0, 1], 0.9, visible="2,3")
    assert plan == {"prefill-0": GpuShare("2", 0.9), "decode-0": GpuShare("3", 0.9)}
    assert plan_gpus(["decode-0"], [1], 0.9, visible="GPU-a, GPU-b")["decode-0"].gpu == "GPU-b"
    with pytest.raises(ConfigError, match="^gpus: 2 is beyond the 2 GPU"):
        plan_gpus(["prefill-0"], [2], 0.9, visible="2,3")


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_zero_to_one_is_refused(fraction):
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        plan_gpus(["prefill-0"], [0], fraction)


def test_a_worker_sees_only_its_gpu_as_cuda():
    assert GpuShare("2", 0.45).env() == {"CUDA_VISIBLE_DEVICES": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                         "DISTSERVE_DEVICE": "cuda", "DISTSERVE_GPU_MEMORY_FRACTION": "0.45"}


def test_the_launcher_starts_each_worker_on_its_gpu_and_the_control_plane_on_none(monkeypatch, tmp_path):
    spawned = {}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def fake_spawn(self, name, argv, env=None):
        spawned[name] = env or {}
        return types.SimpleNamespace()

    monkeypatch.setattr(Cluster, "_spawn", fake_spawn)
    spec = ClusterSpec(model="m", num_prefill=1, num_decode=2, gpus="0,1", gpu_memory_fraction=0.8,
                       log_dir=str(tmp_path))
    assert plan_worker_gpus(spec) == {"prefill-0": GpuShare("0", 0.4), "decode-0": GpuShare("1", 0.8),
                                      "decode-1": GpuShare("0", 0.4)}
    cluster = Cluster(spec)
    for name, module in (("prefill-0", "services.prefill"), ("decode-1", "services.decode"),
                         ("router", "services.router")):
        cluster.start_service(name, module, "127.0.0.1:1", [], metrics_port=2)
    assert spawned["prefill-0"]["CUDA_VISIBLE_DEVICES"] == "0" and spawned["decode-1"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert spawned["decode-1"]["DISTSERVE_GPU_MEMORY_FRACTION"] == "0.4"
    assert "CUDA_VISIBLE_DEVICES" not in spawned["router"]
    assert plan_worker_gpus(ClusterSpec(model="m")) == {}


def test_the_kv_cache_gets_what_the_fraction_leaves_after_weights_and_activations():
    device = lambda: (80 * GIB, 2 * GIB)  # noqa: E731  total, and what this worker's weights hold
    assert kv_cache_budget_mb(1024, "cuda", 0.5, lambda: GIB, memory=device) == (40 - 2 - 1) * 1024
    assert kv_cache_budget_mb(1024, "cuda:0", 0.25, lambda: 0, memory=device) == 18 * 1024
    assert kv_cache_budget_mb(1024, "cuda", 0.0, lambda: GIB, memory=device) == 1024  # 0: the configured size
    assert kv_cache_budget_mb(1024, "cpu", 0.9, lambda: GIB, memory=device) == 1024  # the CPU keeps its setting
    with pytest.raises(ConfigError, match="^gpu_memory_fraction: .* leaves no room"):
        kv_cache_budget_mb(1024, "cuda", 0.03, lambda: GIB, memory=device)


def test_the_activation_reserve_grows_with_the_step_and_the_model():
    small = types.SimpleNamespace(hidden_size=512, intermediate_size=1536, vocab_size=32000)
    large = types.SimpleNamespace(hidden_size=2048, intermediate_size=8192, vocab_size=128256)
    assert 0 < activation_reserve_bytes(small, 64, 2) < activation_reserve_bytes(small, 8192, 2)
    assert activation_reserve_bytes(small, 8192, 2) < activation_reserve_bytes(large, 8192, 2) < 2 * GIB


@pytest.mark.parametrize("fraction", [-0.5, 1.01])
def test_a_worker_refuses_a_fraction_outside_zero_to_one(fraction):
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        WorkerConfig(gpu_memory_fraction=fraction)
