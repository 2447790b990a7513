"""phalanx.settings: the one reader of PHALANX_* variables, its parsing, and its docs table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from phalanx import settings
from phalanx.settings import KNOBS, Settings

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "phalanx"
# Modules that write PHALANX_* variables for the tasks they start (never read a knob).
WRITERS = {"cluster/launcher.py", "cluster/_processes.py", "cluster/elastic.py"}


def _constants(tree: ast.Module) -> dict[str, str]:
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    found[target.id] = node.value.value
    return found


def _environ_reads(tree: ast.Module) -> list[ast.expr]:
    """The keys of ``os.environ.get(k)``, ``os.getenv(k)`` and ``os.environ[k]`` loads."""
    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "environ.get"):
                keys.append(node.args[0])
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) in ("os.environ", "environ")
        ):
            keys.append(node.slice)
    return keys


def phalanx_reads(sources: dict[str, str]) -> list[str]:
    """The ``PHALANX_*`` reads of the environment in ``sources`` (path -> text), by path."""
    trees = {relative: ast.parse(text) for relative, text in sources.items()}
    names = {name: value for tree in trees.values() for name, value in _constants(tree).items()}
    offenders = []
    for relative, tree in trees.items():
        if relative == "settings.py" or relative in WRITERS:
            continue
        for key in _environ_reads(tree):
            text = key.value if isinstance(key, ast.Constant) else names.get(getattr(key, "id", ""), "")
            if isinstance(text, str) and text.startswith("PHALANX_"):
                offenders.append(f"{relative}: {ast.unparse(key)}")
    return offenders


def test_no_module_but_settings_reads_a_phalanx_variable():
    offenders = phalanx_reads({p.relative_to(SRC).as_posix(): p.read_text() for p in SRC.rglob("*.py")})
    assert not offenders, f"read PHALANX_* through phalanx.settings instead: {offenders}"


def test_every_knob_has_one_row_in_the_configuration_docs():
    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(PHALANX_\w+)` \| ([^|]+) \|", text, re.M))
    assert set(rows) == {k.name for k in KNOBS}
    for knob in KNOBS:
        shown = f"`{knob.default}`" if knob.default else "unset"
        assert rows[knob.name].strip() == shown, knob.name


def test_every_variable_named_in_src_is_a_knob():
    named = set()
    for path in SRC.rglob("*.py"):
        named |= set(re.findall(r"\bPHALANX_[A-Z][A-Z_]*[A-Z]\b", path.read_text()))
    assert named <= {k.name for k in KNOBS}, named - {k.name for k in KNOBS}


def test_defaults_apply_when_unset():
    knobs = Settings({})
    assert knobs.heartbeat_timeout == 10.0
    assert knobs.join_timeout == 120.0
    assert knobs.collectives == "auto"
    assert knobs.shared_memory is True
    assert knobs.shm_two_shot is None
    assert knobs.collective_check is True
    assert knobs.gloo_connections == 2
    assert knobs.max_message_bytes == 1 << 30
    assert knobs.ps_data_path == "auto"
    assert knobs.cluster_token == ""
    assert knobs.timeline == ""


def test_values_are_parsed():
    knobs = Settings(
        {
            "PHALANX_HEARTBEAT_TIMEOUT_SECONDS": " 2.5 ",
            "PHALANX_COLLECTIVES": "TLS",
            "PHALANX_SHARED_MEMORY": "off",
            "PHALANX_SHM_TWO_SHOT": "1",
            "PHALANX_COLLECTIVE_CHECK": "no",
            "PHALANX_GLOO_CONNECTIONS": "4",
            "PHALANX_INSECURE_TRANSPORT": "yes",
            "UNRELATED": "x",
        }
    )
    assert knobs.heartbeat_timeout == 2.5
    assert knobs.collectives == "tls"
    assert knobs.shared_memory is False
    assert knobs.shm_two_shot is True
    assert knobs.collective_check is False
    assert knobs.gloo_connections == 4
    assert knobs.insecure_transport is True


@pytest.mark.parametrize(
    ("name", "value", "field", "message"),
    [
        ("PHALANX_HEARTBEAT_TIMEOUT_SECONDS", "ten", "heartbeat_timeout", "must be a positive number"),
        ("PHALANX_JOIN_TIMEOUT_SECONDS", "-1", "join_timeout", "must be a positive number"),
        ("PHALANX_COLLECTIVES", "ring", "collectives", "must be auto, tls or gloo"),
        ("PHALANX_COLLECTIVE_CHECK", "maybe", "collective_check", "must be 1 or 0"),
        ("PHALANX_STALL_INSPECTOR", "2", "stall_inspector", "must be 1 or 0"),
        ("PHALANX_DISTRIBUTED_DEBUG", "LOUD", "distributed_debug", "must be OFF, INFO or DETAIL"),
        ("PHALANX_INSECURE_TRANSPORT", "sure", "insecure_transport", "must be 1 \\(plaintext"),
        ("PHALANX_MAX_MESSAGE_BYTES", "12", "max_message_bytes", "must be a number of bytes"),
        ("PHALANX_GLOO_CONNECTIONS", "9", "gloo_connections", "whole number from 1 to 8"),
        ("PHALANX_PS_DATA_PATH", "udp", "ps_data_path", "must be auto, stream or grpc"),
        ("PHALANX_PS_PICKLE_CACHE", "yes", "ps_pickle_cache", "must be 0 or 1"),
        ("PHALANX_TIMELINE_FLUSH_SECONDS", "0", "timeline_flush_seconds", "must be a positive number"),
    ],
)
def test_a_malformed_value_names_its_variable_where_it_is_used(name, value, field, message):
    knobs = Settings({name: value})
    with pytest.raises(ValueError, match=message) as raised:
        getattr(knobs, field)
    assert name in str(raised.value)


def test_current_follows_the_environment(monkeypatch):
    monkeypatch.delenv("PHALANX_GLOO_CONNECTIONS", raising=False)
    before = settings.current()
    assert settings.current() is before  # no change, the same snapshot
    monkeypatch.setenv("PHALANX_GLOO_CONNECTIONS", "3")
    assert settings.current().gloo_connections == 3
    monkeypatch.setenv("PHALANX_GLOO_CONNECTIONS", "1")
    assert settings.current().gloo_connections == 1


def test_the_token_is_never_shown():
    knobs = Settings({"PHALANX_CLUSTER_TOKEN": "s3cret-s3cret-s3cret", "PHALANX_COLLECTIVES": "gloo"})
    assert "s3cret" not in repr(knobs)
    assert knobs.cluster_token == "s3cret-s3cret-s3cret"
