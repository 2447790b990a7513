"""TerminationConfig's checks and TerminationNotice's two ways of hearing a notice."""

import os
import signal
import threading
import time

import pytest

from phalanx.checkpoint.failure_handling.termination import (
    RESTART_EXIT_CODE,
    TerminationConfig,
    TerminationNotice,
)


def test_defaults_are_sigterm_exit_42_and_no_grace_period():
    config = TerminationConfig()
    assert config.termination_watcher_fn is None
    assert config.save_fn is None
    assert config.grace_period == 0.0
    with pytest.raises(SystemExit) as exited:
        config.exit_fn()
    assert exited.value.code == RESTART_EXIT_CODE == 42
    assert "grace_period=0" in repr(config)


@pytest.mark.parametrize("grace", [-1, "10", True, float("nan")])
def test_a_bad_grace_period_is_refused(grace):
    with pytest.raises(ValueError, match="grace_period must be a non-negative number"):
        TerminationConfig(grace_period=grace)


@pytest.mark.parametrize("name", ["termination_watcher_fn", "exit_fn", "save_fn"])
def test_functions_must_be_callable(name):
    with pytest.raises(TypeError, match=f"{name} must be callable"):
        TerminationConfig(**{name: 3})


def test_sigterm_is_recorded_and_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    notice = TerminationNotice(None)
    notice.start()
    try:
        assert not notice.received
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not notice.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert notice.received
        assert notice.reason == "received SIGTERM"
        assert notice.received_at is not None
    finally:
        notice.stop()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_sigterm_goes_to_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    notice = TerminationNotice(None)
    notice.start()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM]
        assert notice.received
    finally:
        notice.stop()
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_needs_the_main_thread():
    errors = []

    def start():
        try:
            TerminationNotice(None).start()
        except ValueError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    assert errors
    assert "must be created on the main thread" in errors[0]
    assert "termination_watcher_fn" in errors[0]


def test_a_watcher_function_is_polled_until_it_returns_true():
    calls = []
    notice = TerminationNotice(lambda: calls.append(1) or len(calls) >= 3, poll_seconds=0.01)
    notice.start()
    deadline = time.monotonic() + 10
    while not notice.received and time.monotonic() < deadline:
        time.sleep(0.01)
    notice.stop()
    assert notice.received
    assert len(calls) == 3
    assert notice.reason == "its termination_watcher_fn returned True"


def test_a_watcher_function_that_raises_is_kept_for_the_training_thread():
    def broken():
        raise OSError("metadata server unreachable")

    notice = TerminationNotice(broken, poll_seconds=0.01)
    notice.start()
    deadline = time.monotonic() + 10
    while notice.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    notice.stop()
    assert isinstance(notice.error, OSError)
    assert not notice.received
