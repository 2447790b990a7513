"""PSClient's fan-out over the ps tasks: one call per ps task, in parallel, the first on the
calling thread."""

from __future__ import annotations

import threading

import pytest

from phalanx.ps.variables import PSClient


class _Unused:
    """Stands in for an RpcClient that `_each_ps` never touches (the work is given)."""

    name = "ps:? (unused)"

    def close(self) -> None:
        pass


def test_the_first_call_runs_on_the_calling_thread_and_the_others_on_the_pool():
    client = PSClient([_Unused(), _Unused(), _Unused()])
    try:
        threads = client._each_ps({ps: threading.current_thread for ps in (2, 0, 1)})
        assert sorted(threads) == [0, 1, 2]
        assert threads[2] is threading.current_thread()
        assert threads[0] is not threading.current_thread()
        assert threads[1] is not threading.current_thread()
        assert client._each_ps({}) == {}
    finally:
        client.close()


def test_the_first_error_is_raised_after_the_calls_started():
    client = PSClient([_Unused(), _Unused()])
    ran = threading.Event()

    def fails():
        raise KeyError("no variable 'w' on ps:0")

    try:
        with pytest.raises(KeyError, match="no variable 'w'"):
            client._each_ps({0: fails, 1: ran.set})
        assert ran.wait(10)  # the other ps task's call was sent all the same
        with pytest.raises(KeyError, match="no variable 'w'"):
            client._each_ps({1: lambda: None, 0: fails})  # from the pool thread too
    finally:
        client.close()
