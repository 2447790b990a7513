"""PHALANX_STATUS_ADDRESS and the launcher's flag: parsed once, errors that say the fix."""

from __future__ import annotations

import pytest

from phalanx.status.counters import Counters
from phalanx.status.settings import ADDRESS_ENV, SERVED_BY_ENV, StatusSettings, parse_address


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:8265", ("127.0.0.1", 8265)), ("[::1]:80", ("::1", 80)), (" node-3:0 ", ("node-3", 0))],
)
def test_addresses(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["8265", "host:", ":8265", "host:port", "host:70000"])
def test_a_malformed_address_is_refused(text):
    with pytest.raises(ValueError, match=r"PHALANX_STATUS_ADDRESS must be HOST:PORT .* Received: "):
        parse_address(text)


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    assert StatusSettings.from_env() is None


def test_the_chief_serves_by_default_and_the_token_is_never_shown(monkeypatch):
    monkeypatch.setenv(ADDRESS_ENV, "10.0.0.5:8265")
    monkeypatch.delenv(SERVED_BY_ENV, raising=False)
    monkeypatch.setenv("PHALANX_CLUSTER_TOKEN", "a-secret-of-some-length")
    settings = StatusSettings.from_env()
    assert settings == StatusSettings("10.0.0.5", 8265, "chief", "a-secret-of-some-length")
    assert settings.address == "10.0.0.5:8265"
    assert "a-secret" not in repr(settings)


def test_an_unknown_server_is_refused(monkeypatch):
    monkeypatch.setenv(ADDRESS_ENV, "127.0.0.1:8265")
    monkeypatch.setenv(SERVED_BY_ENV, "worker")
    with pytest.raises(ValueError, match=r"PHALANX_STATUS_SERVED_BY must be one of \['chief', 'launcher'\]"):
        StatusSettings.from_env()


def test_the_chief_needs_a_fixed_port(monkeypatch):
    monkeypatch.setenv(ADDRESS_ENV, "127.0.0.1:0")
    monkeypatch.delenv(SERVED_BY_ENV, raising=False)
    with pytest.raises(ValueError, match="needs a fixed port: every task reports there"):
        StatusSettings.from_env()


def test_the_step_count_must_be_positive():
    counters = Counters()
    with pytest.raises(ValueError, match=r"must be >= 1 or None. Received: 0"):
        counters.expect_steps(0)
    counters.expect_steps(None)
    counters.expect_steps(10)
    assert counters.reading().total_steps == 10
