"""The store's port: picked outside the kernel's ephemeral range, never mistaken for a self-connection.

On an H200 machine a run failed with EADDRINUSE hosting the transport store: the engine's probe
of ``host:port`` (before rank 0 listened) had been given that very port as its own local port and
connected to itself. These tests use real sockets on loopback.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from disagg.errors import TransportError
from disagg.transport import group as tg

HOST = "127.0.0.1"


class _Clock:
    """``time.monotonic`` and ``time.sleep`` of a clock that only sleeping advances."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _self_connected_socket() -> socket.socket:
    """A TCP socket connected to itself: bound to a port, then connected to that same port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((HOST, 0))
    s.connect(s.getsockname())  # simultaneous open with itself (Linux allows it)
    return s


def test_store_ports_lie_outside_the_ephemeral_range_and_are_not_handed_twice() -> None:
    lo, hi = tg._ephemeral_ports()
    ports = [tg.pick_free_port(HOST) for _ in range(30)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert not lo <= port <= hi, (port, lo, hi)
        with socket.socket() as s:
            s.bind((HOST, port))  # free when handed out


def test_a_self_connection_is_told_apart_from_a_listener() -> None:
    s = _self_connected_socket()
    try:
        assert tg._self_connected(s)
    finally:
        s.close()
    with socket.socket() as server:
        server.bind((HOST, 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            assert not tg._self_connected(client)


def test_the_store_probe_keeps_waiting_through_a_self_connection(monkeypatch) -> None:
    # Every probe comes back connected to itself, as the kernel did once: no store is up, so the
    # wait must end in TransportError, not return as if rank 0 were listening.
    probes = []

    def probe(*args, **kwargs) -> socket.socket:
        probes.append(_self_connected_socket())
        return probes[-1]

    monkeypatch.setattr(tg.socket, "create_connection", probe)
    # Its own clock, advanced by its sleeps: how often it probes does not depend on how busy the machine is.
    clock = _Clock()
    monkeypatch.setattr(tg, "time", clock)
    with pytest.raises(TransportError, match="missing ranks: \\[0\\]"):
        tg._await_store(HOST, 1, clock.monotonic() + 0.5, 0.5, "probe")
    assert clock.monotonic() >= 0.5
    assert 2 <= len(probes) <= 20  # it kept probing, at its pace, until the deadline


def test_rank_zero_hosts_its_store_once_a_port_held_for_a_moment_is_free() -> None:
    port = tg.pick_free_port(HOST)
    holder = socket.socket()
    holder.bind((HOST, port))
    holder.listen()
    threading.Timer(1.0, holder.close).start()
    t0 = time.monotonic()
    grp = tg.create_group(host=HOST, port=port, rank=0, world_size=1, backend="gloo", timeout_s=20,
                          group_name="ports-held-briefly")
    try:
        assert time.monotonic() - t0 >= 0.9  # it waited for the holder instead of failing
    finally:
        grp.destroy()


def test_rank_zero_names_a_port_that_stays_in_use() -> None:
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(TransportError, match=f"could not host the store.*{port}"):
            tg.create_group(host=HOST, port=port, rank=0, world_size=1, backend="gloo", timeout_s=20,
                            group_name="ports-held")
