"""The GPU suite: `bash scripts/gpu_check.sh` runs it on a machine with a CUDA device; `.ci/run` never does
(scripts/test.sh ignores this folder). Without a CUDA device every test here fails, loudly: a suite that
skipped would pass a machine it never ran on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distserve.launcher import Cluster, ClusterSpec
from tests.cluster_helpers import DECODE_TEST_ARGS, PREFILL_TEST_ARGS, assert_clean, wait_for_workers


@pytest.fixture(autouse=True)
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA device: run `bash scripts/gpu_check.sh` on a GPU machine", pytrace=False)
    return torch.device("cuda")


@pytest.fixture(scope="module")
def gpu_fleet(tiny_model_path, tmp_path_factory):
    """1 prefill + 1 decode worker of the tiny model in fp32, as `distserve up --gpus 0` starts them: both
    on GPU 0, half its memory fraction each (distserve.gpu_placement), spilling off."""
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA device", pytrace=False)
    free_ports = {f.name: 0 for f in dataclasses.fields(ClusterSpec) if f.name.endswith("_port")}
    spec = ClusterSpec(model=tiny_model_path, num_prefill=1, num_decode=1, **free_ports, gateway_port=None,
                       log_dir=str(tmp_path_factory.mktemp("gpu-logs")), gpus="0", gpu_memory_fraction=0.5,
                       prefill_args=PREFILL_TEST_ARGS, decode_args=DECODE_TEST_ARGS,
                       env={"DISTSERVE_DTYPE": "float32"})
    cluster = Cluster(spec).start()
    wait_for_workers(cluster, 1, 1, timeout_s=120)
    yield cluster
    assert_clean(cluster)
    cluster.stop()
