"""Ports for services that listen on port + rank: a run of free ports below
the kernel's ephemeral range."""

import socket

import pytest

from appliance.server import local
from appliance.server.local import free_port_run


def test_a_run_is_free_and_below_the_ephemeral_range():
    start = free_port_run(4)
    assert 10000 <= start and start + 4 <= local._ephemeral_low()
    held = []
    try:
        for port in range(start, start + 4):
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", port))
    finally:
        for s in held:
            s.close()


def test_a_run_skips_a_port_in_use(monkeypatch):
    """With one port of a narrow window taken, the run found avoids it."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        monkeypatch.setattr(local, "_ephemeral_low", lambda: port + 3)
        # a run of 2 may start at port - 2, port - 1 or port: only the first avoids it
        assert free_port_run(2, low=port - 2) == port - 2
    finally:
        taken.close()


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert local._ephemeral_low(str(f)) == 40000
    assert local._ephemeral_low(str(tmp_path / "missing")) == 32768


def test_no_room_is_an_error(monkeypatch):
    monkeypatch.setattr(local, "_ephemeral_low", lambda: 10010)
    with pytest.raises(RuntimeError, match="no room for 20 ports"):
        free_port_run(20)
