"""Ports for services started on the side are drawn where neither the kernel nor Ray hands ports out."""

from __future__ import annotations

import socket

from app.ports import RAY_WORKER_PORTS_MAX, ephemeral_range, free_port


def test_a_free_port_is_outside_the_kernels_ephemeral_range_and_rays_worker_ports():
    low, _ = ephemeral_range()
    for _ in range(50):
        port = free_port()
        assert RAY_WORKER_PORTS_MAX < port < low


def test_a_free_port_can_be_bound_and_a_bound_one_is_never_returned():
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert all(free_port() != port for _ in range(200))
