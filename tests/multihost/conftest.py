"""The multihost tier: simulated hosts (tests/multihost/hosts.py), root only, skipped elsewhere.

Run it alone with ``python -m pytest -q tests/multihost`` (a few minutes).
"""

from __future__ import annotations

import pytest

from multihost.hosts import SimulatedHosts, missing_tools


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multihost: runs tasks on simulated hosts (network namespaces; root)")


@pytest.fixture
def make_hosts():
    """``make_hosts(count, ipv6=False) -> SimulatedHosts``; every host is removed after the test,
    also when it fails. Skips the test where hosts cannot be simulated (not root, no iproute2)."""
    reason = missing_tools()
    if reason is not None:
        pytest.skip(reason)
    made: list[SimulatedHosts] = []

    def make(count: int, ipv6: bool = False) -> SimulatedHosts:
        try:
            hosts = SimulatedHosts(count, ipv6=ipv6)
        except RuntimeError as exc:
            if "Operation not permitted" in str(exc):  # root without CAP_NET_ADMIN / CAP_SYS_ADMIN
                pytest.skip(f"simulated hosts need network and mount namespaces: {exc}")
            raise
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.close()
