"""The secret `launch` gives the tasks of a local cluster: the user's, or a fresh one, with or
without ps tasks (it authenticates the rendezvous store and the TLS ring too)."""

from __future__ import annotations

import io

import pytest

from phalanx.cluster.launcher import launch

_SCRIPT = """
import os, sys, pathlib
token = os.environ.get("PHALANX_CLUSTER_TOKEN", "")
pathlib.Path(sys.argv[1], os.environ["TF_CONFIG"][-40:].replace("/", "_")).write_text(token)
"""


def _tokens(tmp_path, monkeypatch, **env):
    script = tmp_path / "task.py"
    script.write_text(_SCRIPT)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN", raising=False)
    code = launch(str(script), workers=2, args=[str(out_dir)], timeout=60, out=io.StringIO(), env=env or None)
    assert code == 0
    return {p.read_text() for p in out_dir.iterdir()}, len(list(out_dir.iterdir()))


def test_workers_without_ps_get_one_fresh_secret(tmp_path, monkeypatch):
    tokens, count = _tokens(tmp_path, monkeypatch)
    assert count == 2
    assert len(tokens) == 1  # the same on every task
    (token,) = tokens
    assert len(token) == 32


def test_the_users_secret_is_kept_and_a_weak_one_refused(tmp_path, monkeypatch):
    tokens, _ = _tokens(tmp_path, monkeypatch, PHALANX_CLUSTER_TOKEN="the-users-own-secret-0123456789")
    assert tokens == {"the-users-own-secret-0123456789"}
    weak = tmp_path / "weak"
    weak.mkdir()
    with pytest.raises(ValueError, match="PHALANX_CLUSTER_TOKEN"):
        _tokens(weak, monkeypatch, PHALANX_CLUSTER_TOKEN="short")
    assert not (weak / "out").exists() or not list((weak / "out").iterdir())  # nothing started
