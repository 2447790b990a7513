"""PSClient's fan-out over the ps tasks: one call per ps task, in parallel, the first on the
calling thread."""

from __future__ import annotations

import threading

import pytest

from phalanx.ps.rpc.errors import TaskUnavailableError
from phalanx.ps.variables import PSClient, _Call


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


class _Begins:
    """Stands in for an RpcClient with `begin`: records when each call leaves and is awaited."""

    def __init__(self, name: str, log: list[str], fail: Exception | None = None) -> None:
        self.name, self._log, self._fail = name, log, fail

    def begin(self, method, header, tensors):  # noqa: ANN001, ANN201 - RpcClient.begin's
        self._log.append(f"sent {self.name}")

        def wait():  # noqa: ANN202
            self._log.append(f"awaited {self.name}")
            if self._fail is not None:
                raise self._fail
            return {"method": method, **header}, list(tensors)

        return wait

    def close(self) -> None:
        pass


def test_every_call_of_a_round_is_sent_before_any_reply_is_awaited():
    log: list[str] = []
    client = PSClient([_Begins("ps:0", log), _Begins("ps:1", log)])
    try:
        replies = client._calls({0: _Call("read", {"names": ["a"]}), 1: _Call("read", {"names": ["b"]})})
    finally:
        client.close()
    assert log == ["sent ps:0", "sent ps:1", "awaited ps:0", "awaited ps:1"]
    assert replies[0] == ({"method": "read", "names": ["a"]}, [])
    assert replies[1] == ({"method": "read", "names": ["b"]}, [])


def test_a_failed_call_is_raised_once_every_other_reply_came():
    log: list[str] = []
    lost = TaskUnavailableError("ps:0 closed its data-path connection")
    client = PSClient([_Begins("ps:0", log, fail=lost), _Begins("ps:1", log)])
    try:
        with pytest.raises(TaskUnavailableError, match="ps:0 closed"):
            client._calls({0: _Call("read", {}), 1: _Call("read", {})})
    finally:
        client.close()
    assert log == ["sent ps:0", "sent ps:1", "awaited ps:0", "awaited ps:1"]
