"""The harness itself: each simulated host looks like a machine of its own, and is removed after."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from multihost.cluster import base_env

pytestmark = pytest.mark.multihost

LOOK_AROUND = """
import json, os, socket, sys
try:
    socket.getaddrinfo(socket.gethostname(), None)
    resolves = True
except OSError:
    resolves = False
open("/dev/shm/written-by-" + socket.gethostname(), "w").close()
try:
    socket.create_connection((sys.argv[1], 22222), timeout=3).close()
    reached = True
except OSError:
    reached = False
print(json.dumps({"hostname": socket.gethostname(), "resolves": resolves, "pid": os.getpid(),
                  "shm": sorted(os.listdir("/dev/shm")), "reached": reached}))
"""

LISTEN = """
import socket
s = socket.create_server(("", 22222), family=socket.AF_INET6, dualstack_ipv6=True)
print("listening", flush=True)
while True:
    s.accept()[0].close()
"""


def _look_around(host, peer_address):
    code, output = host.run([sys.executable, "-c", LOOK_AROUND, peer_address], base_env()).wait(60)
    assert code == 0, output
    return json.loads(output.splitlines()[-1].split("] ", 1)[1])


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
def test_hosts_have_their_own_names_memory_pids_and_cables(make_hosts, ipv6):
    hosts = make_hosts(2, ipv6=ipv6)
    listener = hosts[1].run([sys.executable, "-c", LISTEN], base_env())
    while "listening" not in listener.output:
        assert listener.poll() is None, listener.output
        time.sleep(0.05)
    seen = _look_around(hosts[0], hosts[1].address)
    assert seen["hostname"] == hosts[0].hostname
    assert not seen["resolves"]  # no /etc/hosts entry, no DNS: the case gloo's default device trips on
    assert seen["pid"] < 100  # its own PID namespace
    assert seen["reached"]
    other = _look_around(hosts[1], hosts[0].address)
    assert other["shm"] == [f"written-by-{hosts[1].hostname}"]  # a private /dev/shm each

    hosts[1].cut()
    assert not _look_around(hosts[0], hosts[1].address)["reached"]
    hosts[1].heal()
    assert _look_around(hosts[0], hosts[1].address)["reached"]


def test_closing_removes_every_namespace_and_process(make_hosts):
    hosts = make_hosts(2)
    sleeper = hosts[0].run(["sleep", "600"])
    names = [h.netns for h in hosts] + [hosts.switch]
    hosts.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [name for name in names if name in listed]
    assert sleeper.poll() is not None
