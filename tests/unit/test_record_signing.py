"""record_signing: the MAC binds a record to its kind and Redis key; the key comes from one place; a reader
with a key drops what does not verify, logging each key once and counting every drop."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from distserve.config import ConfigError
from distserve.record_signing import (KEY_ENV, KEY_FILE_ENV, KV_HANDLE, WORKER, RecordSigner, load_key, sign, verify,
                                      write_key_file)

KEY = b"k" * 64
OTHER_KEY = b"o" * 64
RECORD_KEY = "distserve:worker:prefill:prefill-10.0.0.1-50070"
PAYLOAD = b'{"address":"10.0.0.1:50070","role":"prefill","worker_id":"prefill-10.0.0.1-50070"}'


def test_a_signed_record_verifies_and_the_mac_is_hex_sha256():
    mac = sign(KEY, WORKER, RECORD_KEY, PAYLOAD)
    assert len(mac) == 64 and int(mac, 16) >= 0
    assert verify(KEY, WORKER, RECORD_KEY, PAYLOAD, mac)
    assert verify(KEY, WORKER, RECORD_KEY, PAYLOAD, mac.encode()), "as Redis returns it: bytes"


def test_a_wrong_key_does_not_verify():
    assert not verify(OTHER_KEY, WORKER, RECORD_KEY, PAYLOAD, sign(KEY, WORKER, RECORD_KEY, PAYLOAD))


def test_a_record_moved_to_another_id_or_kind_does_not_verify():
    mac = sign(KEY, WORKER, RECORD_KEY, PAYLOAD)
    assert not verify(KEY, WORKER, "distserve:worker:prefill:prefill-10.0.0.9-50070", PAYLOAD, mac)
    assert not verify(KEY, WORKER, "distserve:worker:decode:prefill-10.0.0.1-50070", PAYLOAD, mac)
    assert not verify(KEY, KV_HANDLE, RECORD_KEY, PAYLOAD, mac)


def test_the_parts_are_length_prefixed_so_shifting_bytes_between_them_does_not_verify():
    mac = sign(KEY, WORKER, "distserve:kv:ab", b"cd")
    assert not verify(KEY, WORKER, "distserve:kv:a", b"bcd", mac)


@pytest.mark.parametrize("mac", [None, "", b""])
def test_a_missing_mac_does_not_verify(mac):
    assert not verify(KEY, WORKER, RECORD_KEY, PAYLOAD, mac)


def test_a_tampered_payload_does_not_verify():
    mac = sign(KEY, WORKER, RECORD_KEY, PAYLOAD)
    assert not verify(KEY, WORKER, RECORD_KEY, PAYLOAD.replace(b"10.0.0.1:50070", b"10.6.6.6:50070"), mac)


def test_the_key_comes_from_the_variable_or_the_file_and_neither_is_none(tmp_path):
    path = write_key_file(tmp_path / "run" / "registry.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(load_key({KEY_FILE_ENV: str(path)})) == 64
    assert load_key({KEY_ENV: " " + "x" * 40 + "\n"}) == b"x" * 40
    assert load_key({}) is None and load_key({KEY_ENV: "", KEY_FILE_ENV: ""}) is None
    assert write_key_file(path).read_text() != load_key({KEY_FILE_ENV: str(path)}).decode(), "fresh per run"


def test_both_set_is_an_error_naming_them(tmp_path):
    path = write_key_file(tmp_path / "registry.key")
    with pytest.raises(ConfigError) as both:
        load_key({KEY_ENV: "x" * 40, KEY_FILE_ENV: str(path)})
    assert KEY_ENV in str(both.value) and KEY_FILE_ENV in str(both.value)


def test_a_short_key_or_an_unreadable_file_is_an_error_naming_the_variable(tmp_path):
    with pytest.raises(ConfigError, match=f"^{KEY_ENV}: .* at least 32"):
        load_key({KEY_ENV: "short"})
    with pytest.raises(ConfigError, match=f"^{KEY_FILE_ENV}: cannot read"):
        load_key({KEY_FILE_ENV: str(tmp_path / "missing.key")})
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(ConfigError, match=f"^{KEY_FILE_ENV}: "):
        load_key({KEY_FILE_ENV: str(tmp_path / "empty.key")})


def test_a_signer_without_a_key_writes_no_mac_and_accepts_everything():
    signer = RecordSigner(None)
    assert not signer.is_signing and signer.mac(WORKER, RECORD_KEY, PAYLOAD) is None
    assert signer.accepts(WORKER, RECORD_KEY, PAYLOAD, None)
    assert signer.accepts(WORKER, RECORD_KEY, PAYLOAD, "not-a-mac")


def test_a_signer_with_a_key_drops_bad_records_logging_each_key_once_and_counting_each(caplog):
    rejected = []
    signer = RecordSigner(KEY, rejected.append)
    good = signer.mac(WORKER, RECORD_KEY, PAYLOAD)
    assert signer.accepts(WORKER, RECORD_KEY, PAYLOAD, good)
    with caplog.at_level(logging.WARNING, logger="distserve.record_signing"):
        for _ in range(5):  # a router's refresh reads the same forged record again and again
            assert not signer.accepts(WORKER, RECORD_KEY, PAYLOAD, None)
            assert not signer.accepts(KV_HANDLE, "distserve:kv:h1", PAYLOAD, good)
    assert rejected == [WORKER, KV_HANDLE] * 5
    assert [r.getMessage() for r in caplog.records] == [
        f"ignoring {RECORD_KEY}: its signature is missing (forged or rewritten by a Redis writer without the "
        "registry key)",
        "ignoring distserve:kv:h1: its signature is wrong (forged or rewritten by a Redis writer without the "
        "registry key)"]


def test_a_flood_of_forged_keys_stops_being_logged_one_by_one(caplog):
    signer = RecordSigner(KEY)
    with caplog.at_level(logging.WARNING, logger="distserve.record_signing"):
        for i in range(500):
            signer.accepts(WORKER, f"distserve:worker:prefill:forged-{i}", PAYLOAD, None)
    assert len(caplog.records) == 101 and "no longer logged one by one" in caplog.records[-1].getMessage()


def test_the_launcher_hands_its_children_a_fresh_key_file_unless_a_key_is_configured(tmp_path, monkeypatch):
    from distserve.launcher import Cluster, ClusterSpec

    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    first = Cluster(ClusterSpec(model="m", log_dir=str(tmp_path / "run-1")))
    second = Cluster(ClusterSpec(model="m", log_dir=str(tmp_path / "run-2")))
    path = Path(first.registry_key_file)
    assert path.parent == (tmp_path / "run-1").resolve() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert first.registry_key_env == {KEY_FILE_ENV: str(path)}
    assert load_key(first.registry_key_env) != load_key(second.registry_key_env), "one key per run"

    configured = Cluster(ClusterSpec(model="m", log_dir=str(tmp_path / "run-3"), env={KEY_ENV: "y" * 40}))
    assert configured.registry_key_env == {} and configured.registry_key_file == ""
    assert not (tmp_path / "run-3" / "registry.key").exists()


def test_a_process_without_a_key_warns_once_that_records_are_unsigned(monkeypatch, caplog):
    from distserve.record_signing import process_signer

    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    process_signer.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="distserve.record_signing"):
            signers = {id(process_signer()) for _ in range(3)}  # every registry and store in the process
        assert len(signers) == 1 and not process_signer().is_signing
        assert [r.getMessage().split(":")[0] for r in caplog.records] == ["registry records in Redis are unsigned"]
    finally:
        process_signer.cache_clear()
