"""The security tier's fixtures (helpers in tests/security/helpers.py)."""

from __future__ import annotations

import pytest

from security.helpers import Launcher


@pytest.fixture
def launcher(tmp_path):
    """``launcher(args, env=None, clean=False)`` starts ``phalanx launch args``; leftovers fail
    the test."""
    started: list[Launcher] = []

    def start(args: list, env: dict[str, str] | None = None, clean: bool = False) -> Launcher:
        started.append(Launcher([str(a) for a in args], tmp_path, env, clean))
        return started[-1]

    yield start
    leaked = [pid for launch in started for pid in launch.kill_leftovers()]
    assert not leaked, f"processes outlived their test (killed now): {leaked}"
