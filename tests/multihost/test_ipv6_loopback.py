"""An IPv6 cluster (``[::1]:port``) on this machine: no root needed, so it runs in every tier run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from multihost.cluster import SCRIPTS, base_env, tf_config
from phalanx.communication.transports.interfaces import interface_addresses
from support import oracle

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(("lo", "::1") not in interface_addresses(), reason="no IPv6 loopback address here"),
]


def _free_ipv6_ports(count):
    sockets = [socket.socket(socket.AF_INET6) for _ in range(count)]
    for s in sockets:
        s.bind(("::1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_two_workers_on_ipv6_loopback_reproduce_the_trajectory(tmp_path):
    cluster = {"worker": [f"[::1]:{port}" for port in _free_ipv6_ports(2)]}
    script = [sys.executable, str(SCRIPTS / "ctl_oracle.py"), str(tmp_path), "64"]
    workers = [
        subprocess.Popen(
            script,
            env=base_env(TF_CONFIG=tf_config(cluster, "worker", i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        outputs = [w.communicate(timeout=120)[0].decode() for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert [w.returncode for w in workers] == [0, 0], outputs
    ref, _ = oracle.reference("ctl_mirrored")
    for rank in range(2):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result["gloo_interface"] == "lo"  # the interface holding ::1
        assert result["shared_memory"]  # one machine: the workers see each other's /dev/shm
        np.testing.assert_allclose(result["losses"], ref["losses"][:2], **oracle.LOSS_TOL)
