"""--dtype auto: bfloat16 where the hardware has it, float32 elsewhere; explicit names pass through."""

from __future__ import annotations

import pytest

from distserve.config import ConfigError, parse_config
from distserve.engine import dtype
from distserve.engine.dtype import DTYPE_CHOICES, DTYPE_NAMES, cpu_flags, resolve_dtype, torch_dtype
from services.decode.config import DecodeConfig
from services.prefill.config import PrefillConfig


@pytest.fixture
def flags(monkeypatch):
    """Sets the CPU flags resolve_dtype sees; a CUDA device must not read them."""
    def set_flags(*names: str) -> None:
        monkeypatch.setattr(dtype, "cpu_flags", lambda: set(names))
    return set_flags


@pytest.mark.parametrize("cpu, expected", [
    (("fpu", "avx2", "avx512f"), "float32"),
    (("fpu", "avx512f", "avx512_bf16"), "bfloat16"),
    (("fpu", "amx_tile", "amx_bf16"), "bfloat16"),
    ((), "float32"),
])
def test_auto_on_cpu_follows_the_bf16_flags(flags, cpu, expected):
    flags(*cpu)
    assert resolve_dtype("auto", "cpu") == expected


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_auto_on_cuda_is_bfloat16(flags, device):
    flags()
    assert resolve_dtype("auto", device) == "bfloat16"


def test_auto_on_other_devices_is_float32(flags):
    flags("avx512_bf16")
    assert resolve_dtype("auto", "mps") == "float32"


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_explicit_names_pass_through(flags, name):
    flags("amx_bf16")
    assert resolve_dtype(name, "cpu") == name
    assert resolve_dtype(name, "cuda") == name


def test_cpu_flags_reads_proc_cpuinfo(monkeypatch, tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nflags\t\t: fpu sse avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(fake if path == "/proc/cpuinfo" else path,
                                                                          *a, **k))
    assert cpu_flags() == {"fpu", "sse", "avx512_bf16"}


@pytest.mark.parametrize("cls, prefix", [(PrefillConfig, "DISTSERVE_PREFILL_"), (DecodeConfig, "DISTSERVE_DECODE_")])
def test_worker_dtype_defaults_to_auto_and_validates(monkeypatch, cls, prefix):
    monkeypatch.delenv("DISTSERVE_DTYPE", raising=False)
    assert parse_config(cls, [], prefix).dtype == "auto"
    assert set(DTYPE_CHOICES) == {"auto", *DTYPE_NAMES}
    for name in DTYPE_CHOICES:
        assert cls(dtype=name).dtype == name
    with pytest.raises(ConfigError, match=r"^dtype: .*'auto'"):
        cls(dtype="float64")


def test_torch_dtype_names_torch_dtypes_and_refuses_others():
    import torch

    assert [torch_dtype(name) for name in DTYPE_NAMES] == [torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ValueError, match="float64"):
        torch_dtype("float64")
