"""distserve.transfer.ucx_devices: UCX_NET_DEVICES leaves out every IP interface but the advertised one."""

from __future__ import annotations

from distserve.transfer import ucx_devices
from distserve.transfer.ucx_devices import excluded_devices, interface_addresses

INTERFACES = {"lo": {"127.0.0.1", "::1"}, "eth0": {"10.0.0.5"}, "docker0": {"172.17.0.1"}}


def test_only_the_interface_holding_the_advertised_address_is_left_in():
    assert excluded_devices("127.0.0.1", INTERFACES) == "^docker0,eth0"
    assert excluded_devices("10.0.0.5", INTERFACES) == "^docker0,lo"
    assert excluded_devices("localhost", INTERFACES) == "^docker0,eth0"  # a name: its addresses


def test_nothing_is_left_out_for_a_wildcard_an_address_no_interface_holds_or_a_lone_interface():
    assert excluded_devices("0.0.0.0", INTERFACES) is None
    assert excluded_devices("", INTERFACES) is None
    assert excluded_devices("203.0.113.9", INTERFACES) is None  # behind NAT: UCX chooses, as before
    assert excluded_devices("no-such-host.invalid", INTERFACES) is None
    assert excluded_devices("127.0.0.1", {"lo": {"127.0.0.1"}}) is None


def test_this_machines_loopback_is_found_and_an_operators_setting_wins(monkeypatch):
    assert "127.0.0.1" in interface_addresses()["lo"]
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_0:1")
    ucx_devices.restrict_to_advertised("127.0.0.1")
    assert ucx_devices.os.environ["UCX_NET_DEVICES"] == "mlx5_0:1"
    monkeypatch.delenv("UCX_NET_DEVICES")  # (monkeypatch removes what the call below sets, at teardown)
    ucx_devices.restrict_to_advertised("127.0.0.1")
    assert ucx_devices.os.environ.get("UCX_NET_DEVICES") == excluded_devices("127.0.0.1", interface_addresses())
