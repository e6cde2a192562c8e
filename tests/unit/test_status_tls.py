"""`distserve status` health-checks a TLS cluster with the certificates the launcher gave its children."""

from __future__ import annotations

from distserve.grpc_server import TlsConfig
from distserve.status import tls_from_state


def test_tls_settings_round_trip_through_the_state_file_as_paths():
    tls = TlsConfig(tls_cert="/certs/node.pem", tls_key="/certs/node.key", tls_ca="/certs/ca.pem",
                    tls_server_name="distserve")
    state = {"tls": tls.tls_env()}
    assert tls_from_state(state) == tls
    assert all(value.startswith("/certs/") or value == "distserve" for value in state["tls"].values())


def test_a_plaintext_cluster_or_an_older_state_file_checks_in_plaintext():
    assert not tls_from_state({"tls": {}}).is_tls
    assert not tls_from_state({}).is_tls
