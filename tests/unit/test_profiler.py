"""`distserve profile` on the tiny model: the shapes it plans, and the profile it writes."""

from __future__ import annotations

import argparse

import pytest

from distserve.planner.profile import Profile
from distserve.planner.profile_cli import add_arguments, child_argv, default_out_name, run
from distserve.planner.profile_steps import step_plan
from distserve.planner.profile_transfer import MAX_BYTES, MIN_BYTES, transfer_token_counts
from distserve.planner.profiler import ProfileSettings, fit_errors, kv_capacity_tokens, measure_profile
from services.decode.config import DecodeConfig

GENEROUS_ERROR = 2.0  # |predicted / measured - 1| on a 1-repeat smoke profile of a model this small


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _check(profile: Profile, expect_groups: set[str]) -> None:
    assert all(c >= 0 for c in profile.step_coeffs)
    errors = fit_errors(profile)
    assert set(errors) == expect_groups
    assert all(error.max < GENEROUS_ERROR for error in errors.values()), errors
    assert profile.max_batch_tokens > 0 and profile.cores_per_worker >= 1


@pytest.fixture(scope="module")
def quick_profile(tiny_model_path) -> Profile:
    return measure_profile(ProfileSettings(model=tiny_model_path, dtype="float32", quick=True, repeats=1,
                                           transfer=False))


def test_quick_profile_fits_prefill_decode_and_mixed_steps(quick_profile, tiny_model_path, tmp_path):
    from transformers import AutoConfig

    _check(quick_profile, {"prefill", "decode", "mixed"})
    config = AutoConfig.from_pretrained(tiny_model_path)
    head_dim = config.hidden_size // config.num_attention_heads
    assert quick_profile.kv_bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert quick_profile.transfer_samples == [] and quick_profile.transfer_time(10**9) == 0.0  # not measured: free
    quick_profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == quick_profile


def test_the_cli_measures_in_a_pinned_child_with_ucx_transfers(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "profiles" / "tiny.json"
    assert run(_parse("--model", tiny_model_path, "--dtype", "bfloat16", "--cpus", "0", "--quick",
                      "--out", str(out))) == 0
    profile = Profile.load(out)
    _check(profile, {"prefill", "decode", "mixed", "transfer"})
    assert (profile.dtype, profile.cores_per_worker, profile.model) == ("bfloat16", 1, "distserve-tiny")
    assert profile.transfer_latency_s >= 0 and profile.transfer_bytes_per_s > 0
    assert all(b >= MIN_BYTES for b, _ in profile.transfer_samples)
    assert "transfer" in out.with_suffix(".fit.txt").read_text()


def test_a_bad_core_list_is_an_error_naming_cpus(capsys):
    assert run(_parse("--cpus", "1-0", "--quick")) == 2
    assert "cpus" in capsys.readouterr().err


def test_the_child_gets_every_option_back():
    args = _parse("--model", "m", "--dtype", "float32", "--cpus", "0-1", "--quick", "--no-transfer",
                  "--max-tokens", "64", "--repeats", "5", "--out", "x.json")
    again = _parse(*child_argv(args))
    assert again.in_process and not args.in_process
    assert {**vars(again), "in_process": False} == vars(args)


def test_plan_respects_the_token_cap_and_the_context():
    plan = step_plan(quick=False, max_tokens=256, max_context=1024)
    assert all(s.num_tokens - len(s.decode_contexts) <= 256 for s in plan.prefill + plan.mixed)
    assert all(n + p <= 1024 for s in plan.prefill for n, p in s.chunks)
    assert all(c < 1024 for s in plan.decode + plan.mixed for c in s.decode_contexts)
    assert any(p > 0 for s in plan.prefill for _, p in s.chunks), "chunks at a position are measured"
    many = [s for s in plan.prefill if len(s.chunks) > 1]
    assert many and {s.num_tokens for s in many} <= {s.num_tokens for s in plan.prefill if len(s.chunks) == 1}
    assert {len(s.decode_contexts) for s in plan.decode} == {1, 2, 4, 8, 16, 32, 64}


def test_transfer_sizes_span_64k_to_64m():
    counts = transfer_token_counts(8192)
    assert counts[0] * 8192 == MIN_BYTES and counts[-1] * 8192 == MAX_BYTES


def test_capacity_matches_the_decode_workers_default_cache():
    defaults = DecodeConfig()
    settings = ProfileSettings(model="default", dtype="float32")
    assert (settings.kv_cache_mb, settings.block_size) == (defaults.kv_cache_mb, defaults.block_size)
    assert kv_capacity_tokens(8192, 1024, 16) == 1024 * 1024 * 1024 // 8192
    assert kv_capacity_tokens(10**9, 1, 16) == 16  # at least one block, as the worker sizes it


def test_default_file_name():
    assert default_out_name("default:small", "bfloat16", "cpu", 2) == "profile-small-bfloat16-cpu-2core.json"
    assert default_out_name("llama-3", "float32", "cuda", 1) == "profile-llama-3-float32-cuda-1core.json"
