"""parse_config (flags, env vars, precedence, bools) and each service config's field validation."""

from __future__ import annotations

import dataclasses
import os

import pytest

from distserve.config import ConfigError, parse_config, setting
from services.decode.config import DecodeConfig
from services.kvbroker.config import KvBrokerConfig
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig

PREFIX = "DISTSERVE_PREFILL_"


@dataclasses.dataclass(frozen=True)
class Toggles:
    """A config with a bool field; the services have none yet."""

    verbose: bool = setting(False, "log more")
    name: str = setting("x", "a name", env="DISTSERVE_TEST_SHARED_NAME")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No DISTSERVE_* variable from the caller's shell leaks into these tests."""
    for name in [n for n in os.environ if n.startswith("DISTSERVE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_no_flags_no_env_gives_the_defaults():
    assert parse_config(PrefillConfig, [], PREFIX) == PrefillConfig()


def test_flags_are_converted_to_the_field_types():
    config = parse_config(PrefillConfig, ["--port", "6000", "--max-batch-tokens", "512", "--kv-lease-s", "2.5",
                                          "--worker-id", "p0"], PREFIX)
    assert (config.port, config.max_batch_tokens, config.kv_lease_s, config.worker_id) == (6000, 512, 2.5, "p0")


def test_env_vars_use_the_prefix_or_the_shared_name(clean_env):
    clean_env.setenv("DISTSERVE_PREFILL_PORT", "6001")
    clean_env.setenv("DISTSERVE_PREFILL_HEARTBEAT_S", "0.5")
    clean_env.setenv("DISTSERVE_REDIS_URL", "redis://elsewhere:1/2")
    clean_env.setenv("DISTSERVE_PREFILL_MODEL", "ignored: model reads DISTSERVE_MODEL")
    config = parse_config(PrefillConfig, [], PREFIX)
    assert (config.port, config.heartbeat_s, config.redis_url) == (6001, 0.5, "redis://elsewhere:1/2")
    assert config.model == PrefillConfig().model


def test_shared_env_var_reaches_every_service(clean_env):
    clean_env.setenv("DISTSERVE_REDIS_URL", "redis://shared:7/0")
    for cls, prefix in [(DecodeConfig, "DISTSERVE_DECODE_"), (KvBrokerConfig, "DISTSERVE_KVBROKER_"),
                        (RouterConfig, "DISTSERVE_ROUTER_")]:
        assert parse_config(cls, [], prefix).redis_url == "redis://shared:7/0"


def test_flag_beats_env_beats_default(clean_env):
    clean_env.setenv("DISTSERVE_PREFILL_PORT", "6001")
    clean_env.setenv("DISTSERVE_PREFILL_MAX_BATCH_TOKENS", "100")
    config = parse_config(PrefillConfig, ["--port", "6002"], PREFIX)
    assert (config.port, config.max_batch_tokens, config.dtype) == (6002, 100, PrefillConfig().dtype)


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                         ("0", False), ("False", False), ("no", False), ("off", False)])
def test_bool_parsing_from_env_and_flag(clean_env, text, value):
    assert parse_config(Toggles, ["--verbose", text], "T_").verbose is value
    clean_env.setenv("T_VERBOSE", text)
    assert parse_config(Toggles, [], "T_").verbose is value


def test_bad_env_value_raises_config_error_naming_the_field(clean_env):
    clean_env.setenv("T_VERBOSE", "maybe")
    with pytest.raises(ConfigError, match=r"^verbose: "):
        parse_config(Toggles, [], "T_")
    clean_env.setenv("DISTSERVE_PREFILL_PORT", "eighty")
    with pytest.raises(ConfigError, match=r"^port: "):
        parse_config(PrefillConfig, [], PREFIX)


def test_bad_flag_value_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        parse_config(PrefillConfig, ["--port", "eighty"], PREFIX)
    assert exc.value.code == 2


def test_help_names_each_flags_env_var(capsys):
    with pytest.raises(SystemExit):
        parse_config(Toggles, ["--help"], "T_")
    help_text = capsys.readouterr().out
    assert "--verbose" in help_text and "T_VERBOSE" in help_text
    assert "DISTSERVE_TEST_SHARED_NAME" in help_text


def test_parse_config_validates_the_result():
    with pytest.raises(ConfigError, match=r"^port: "):
        parse_config(PrefillConfig, ["--port", "70000"], PREFIX)


@pytest.mark.parametrize("cls, kwargs, field", [
    (PrefillConfig, {"port": 65536}, "port"),
    (PrefillConfig, {"port": -1}, "port"),
    (PrefillConfig, {"dtype": "float64"}, "dtype"),
    (PrefillConfig, {"max_batch_tokens": -1}, "max_batch_tokens"),
    (PrefillConfig, {"kv_lease_s": 0.0}, "kv_lease_s"),
    (PrefillConfig, {"heartbeat_s": 3.0, "lease_s": 3.0}, "heartbeat_s"),
    (PrefillConfig, {"heartbeat_s": 0.0}, "heartbeat_s"),
    (DecodeConfig, {"port": 65536}, "port"),
    (DecodeConfig, {"dtype": "int8"}, "dtype"),
    (DecodeConfig, {"block_size": 0}, "block_size"),
    (DecodeConfig, {"kv_cache_mb": 0}, "kv_cache_mb"),
    (DecodeConfig, {"max_running": 0}, "max_running"),
    (DecodeConfig, {"nice": 20}, "nice"),
    (DecodeConfig, {"nice": -1}, "nice"),
    (DecodeConfig, {"heartbeat_s": 5.0}, "heartbeat_s"),
    (KvBrokerConfig, {"port": 100000}, "port"),
    (KvBrokerConfig, {"default_lease_s": 0.0}, "default_lease_s"),
    (KvBrokerConfig, {"claim_lease_s": -1.0}, "claim_lease_s"),
    (RouterConfig, {"port": -5}, "port"),
    (RouterConfig, {"request_timeout_s": 0.0}, "request_timeout_s"),
    (RouterConfig, {"registry_refresh_s": -0.5}, "registry_refresh_s"),
])
def test_invalid_setting_raises_config_error_naming_the_field(cls, kwargs, field):
    with pytest.raises(ConfigError) as exc:
        cls(**kwargs)
    assert str(exc.value).startswith(f"{field}: ")
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, KvBrokerConfig, RouterConfig])
def test_defaults_are_valid_and_every_field_has_help(cls):
    cls()
    assert all(f.metadata.get("help") for f in dataclasses.fields(cls))


def test_worker_id_defaults_to_role_host_port():
    assert PrefillConfig(advertise_host="h", port=7).resolved_worker_id == "prefill-h-7"
    assert DecodeConfig(advertise_host="h", port=8).resolved_worker_id == "decode-h-8"
    assert DecodeConfig(worker_id="d1").resolved_worker_id == "d1"
