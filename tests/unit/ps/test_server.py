"""phalanx.Server: what a worker or ps task runs (real gRPC on 127.0.0.1)."""

from __future__ import annotations

import pytest

from phalanx.server import Server


def test_server_errors(ps_2workers_1ps):
    spec = ps_2workers_1ps.spec
    with pytest.raises(ValueError, match="chief runs the training program"):
        Server(spec, "chief", 0)
    with pytest.raises(ValueError, match="gRPC only"):
        Server(spec, "worker", 0, protocol="mpi")
    with pytest.raises(ValueError, match="cannot listen"):
        Server(spec, "worker", 0)  # its port is taken by the running worker
    server = ps_2workers_1ps.servers[("worker", 1)]
    assert server.target == f"grpc://{spec['worker'][1]}"
    assert not server.join(timeout=0.01)
