"""Every ``PHALANX_*`` knob in one place: its name, default and meaning, and the one reader.

Configuration is passed as objects (`CommunicationOptions`, strategy and coordinator arguments);
the environment only supplies their defaults. This module is the only one that reads a
``PHALANX_*`` variable (the launcher also *writes* them, for the tasks it starts). Each knob has
one name, one default and one row in docs/configuration.md, which a test compares with `KNOBS`.

`current()` is a snapshot of the variables, taken again only when one of them changed (tests
and programs that set a variable before making a strategy see it), and each typed field parses
its variable on first use, so a malformed value fails where it is used, naming the variable::

    from phalanx import settings
    settings.current().heartbeat_timeout   # 10.0, or PHALANX_HEARTBEAT_TIMEOUT_SECONDS
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["KNOBS", "Knob", "Settings", "current", "positive_seconds"]

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


@dataclass(frozen=True)
class Knob:
    """One ``PHALANX_*`` variable: its name, its default as text ("" = unset) and meaning."""

    name: str
    default: str
    meaning: str


KNOBS: tuple[Knob, ...] = (
    # security
    Knob(
        "PHALANX_CLUSTER_TOKEN",
        "",
        "the cluster's shared secret: authenticates every task, derives the TLS CA",
    ),
    Knob(
        "PHALANX_INSECURE_TRANSPORT",
        "0",
        "1: plaintext gRPC and gloo between machines (trusted networks only)",
    ),
    Knob("PHALANX_TLS_CA_FILE", "", "your own CA certificate (PEM) instead of the token's cluster CA"),
    Knob("PHALANX_TLS_CERT_FILE", "", "this task's certificate (PEM), with PHALANX_TLS_CA_FILE"),
    Knob("PHALANX_TLS_KEY_FILE", "", "this task's private key (PEM), with PHALANX_TLS_CERT_FILE"),
    Knob("PHALANX_MAX_MESSAGE_BYTES", str(1 << 30), "the largest gRPC message a task sends or accepts"),
    # multi-worker collectives
    Knob("PHALANX_COLLECTIVES", "auto", "auto (TLS ring between machines with a token), tls or gloo"),
    Knob("PHALANX_SHARED_MEMORY", "1", "0: never the same-machine shared-memory transport"),
    Knob(
        "PHALANX_SHM_TWO_SHOT", "", "1/0: force the shared-memory two-shot all-reduce on/off (else by cores)"
    ),
    Knob(
        "PHALANX_GLOO_CONNECTIONS", "2", "gloo connections between each pair of workers per interface (1-8)"
    ),
    Knob("PHALANX_COLLECTIVE_CHECK", "1", "0: collectives carry no signature code"),
    Knob("PHALANX_JOIN_TIMEOUT_SECONDS", "120", "how long workers wait for each other to join the group"),
    Knob(
        "PHALANX_HEARTBEAT_TIMEOUT_SECONDS",
        "10",
        "a peer (worker, or a PS worker for the chief) silent this long is lost",
    ),
    Knob(
        "PHALANX_STALL_INSPECTOR", "1", "0: no stall inspector (mismatched collectives wait for the deadline)"
    ),
    Knob(
        "PHALANX_STALL_TIMEOUT_SECONDS",
        "30",
        "a worker alone in a collective this long is named, and the job fails",
    ),
    Knob(
        "PHALANX_STALL_WARNING_SECONDS",
        "",
        "warn after this long alone in a collective (default: min(10, timeout / 3))",
    ),
    Knob(
        "PHALANX_DISTRIBUTED_DEBUG",
        "OFF",
        "OFF, INFO or DETAIL (DETAIL checks the shapes of every collective)",
    ),
    # elastic jobs (the launcher sets them)
    Knob("PHALANX_MIN_WORKERS", "", "an elastic job: it goes on while at least this many workers are left"),
    Knob("PHALANX_ELASTIC_STORE", "", "host:port of the store that outlives every worker of an elastic job"),
    Knob("PHALANX_ELASTIC_INCARNATION", "0", "how many times the launcher restarted this task"),
    Knob(
        "PHALANX_ELASTIC_DEAD_SECONDS", "3", "seconds without a beacon after which an elastic member is lost"
    ),
    # parameter-server training
    Knob("PHALANX_CLOSURE_TIMEOUT_SECONDS", "3600", "one scheduled function on a worker that still answers"),
    Knob(
        "PHALANX_WAIT_TIMEOUT_SECONDS",
        "",
        "join()/fetch() with no timeout (default: the longest deadline + 60 s)",
    ),
    Knob("PHALANX_PS_CALL_TIMEOUT_SECONDS", "60", "one call to a ps task (read, write, push)"),
    Knob("PHALANX_PS_DATA_PATH", "auto", "auto (data path, shared memory on one machine), stream or grpc"),
    Knob("PHALANX_PS_PICKLE_CACHE", "1", "0: pickle every scheduled function again (for A/B measurements)"),
    # watching a job (docs/status_page.md)
    Knob(
        "PHALANX_STATUS_ADDRESS",
        "",
        "HOST:PORT where the chief serves the status page; every task reports there",
    ),
    Knob(
        "PHALANX_STATUS_SERVED_BY",
        "chief",
        "chief, or launcher (phalanx launch --status sets it: it serves the page)",
    ),
    # tracing
    Knob("PHALANX_TIMELINE", "", "write a Chrome trace of every task to this path (one file per task)"),
    Knob(
        "PHALANX_TIMELINE_FLUSH_SECONDS", "5", "how often the timeline file is rewritten while events arrive"
    ),
)
_NAMES = tuple(knob.name for knob in KNOBS)
_DEFAULTS = {knob.name: knob.default for knob in KNOBS}


def positive_seconds(name: str, text: str) -> float:
    """``text`` (the value of variable ``name``) as a positive number of seconds.

    Raises:
        ValueError: It is not a positive number.
    """
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds. Received: {name}={text!r}.")
    return value


class Settings:
    """A snapshot of the ``PHALANX_*`` variables; each field parses its variable on first use.

    Args:
        environ: The variables (default: ``os.environ``); only ``PHALANX_*`` ones are kept.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        source = os.environ if environ is None else environ
        self._given = {name: source[name] for name in _NAMES if name in source}

    def __repr__(self) -> str:  # never shows a secret
        shown = {k: ("<set>" if k == "PHALANX_CLUSTER_TOKEN" else v) for k, v in self._given.items()}
        return f"Settings({shown})"

    def text(self, name: str) -> str:
        """Variable ``name`` stripped, or its default ("" when it has none)."""
        return self._given.get(name, "").strip() or _DEFAULTS[name]

    def is_set(self, name: str) -> bool:
        """Whether variable ``name`` is set to something other than blanks."""
        return bool(self._given.get(name, "").strip())

    def seconds(self, name: str, default: float | None = None) -> float:
        """Variable ``name`` as positive seconds (``default``, else the knob's, when unset).

        Raises:
            ValueError: It is set but not a positive number.
        """
        if self.is_set(name):
            return positive_seconds(name, self._given[name].strip())
        return float(default if default is not None else _DEFAULTS[name])

    def switch(self, name: str) -> bool:
        """Variable ``name`` as on (1/true/on/yes) or off (0/false/off/no).

        Raises:
            ValueError: Another value (a typo must not silently flip a check).
        """
        text = self.text(name).lower()
        if text not in _TRUE + _FALSE:
            raise ValueError(f"{name} must be 1 or 0. Received: {name}={text!r}.")
        return text in _TRUE

    def choice(self, name: str, choices: tuple[str, ...], hint: str) -> str:
        """Variable ``name`` (lower case), one of ``choices``.

        Raises:
            ValueError: Another value.
        """
        text = self.text(name).lower()
        if text not in choices:
            raise ValueError(
                f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}. Received: {name}={text!r}. "
                f"HINT: {hint}"
            )
        return text

    # -- typed fields, one per knob that code reads --------------------------------------------

    @property
    def cluster_token(self) -> str:
        """``PHALANX_CLUSTER_TOKEN`` as given ("" when unset; `phalanx.security.token` checks it)."""
        return self._given.get("PHALANX_CLUSTER_TOKEN", "")

    @functools.cached_property
    def heartbeat_timeout(self) -> float:
        """``PHALANX_HEARTBEAT_TIMEOUT_SECONDS``."""
        return self.seconds("PHALANX_HEARTBEAT_TIMEOUT_SECONDS")

    @functools.cached_property
    def join_timeout(self) -> float:
        """``PHALANX_JOIN_TIMEOUT_SECONDS``."""
        return self.seconds("PHALANX_JOIN_TIMEOUT_SECONDS")

    @functools.cached_property
    def collectives(self) -> str:
        """``PHALANX_COLLECTIVES``: "auto", "tls" or "gloo"."""
        return self.choice(
            "PHALANX_COLLECTIVES",
            ("auto", "tls", "gloo"),
            "unset it (auto: TLS between machines when PHALANX_CLUSTER_TOKEN is set); see docs/security.md.",
        )

    @property
    def shared_memory(self) -> bool:
        """``PHALANX_SHARED_MEMORY`` (anything but 0/false/off/no allows the transport)."""
        return self.text("PHALANX_SHARED_MEMORY").lower() not in _FALSE

    @property
    def shm_two_shot(self) -> bool | None:
        """``PHALANX_SHM_TWO_SHOT`` forced on or off; None: decide by cores."""
        text = self.text("PHALANX_SHM_TWO_SHOT")
        return (text == "1") if text in ("0", "1") else None

    @functools.cached_property
    def collective_check(self) -> bool:
        """``PHALANX_COLLECTIVE_CHECK``."""
        return self.switch("PHALANX_COLLECTIVE_CHECK")

    @functools.cached_property
    def stall_inspector(self) -> bool:
        """``PHALANX_STALL_INSPECTOR``."""
        return self.switch("PHALANX_STALL_INSPECTOR")

    @functools.cached_property
    def distributed_debug(self) -> str:
        """``PHALANX_DISTRIBUTED_DEBUG``: "OFF", "INFO" or "DETAIL"."""
        name = "PHALANX_DISTRIBUTED_DEBUG"
        level = self.text(name).upper()
        if level not in ("OFF", "INFO", "DETAIL"):
            raise ValueError(
                f"{name} must be OFF, INFO or DETAIL. Received: {name}={level!r}. HINT: "
                "DETAIL checks the kind, shapes and dtypes of every collective across workers."
            )
        return level

    @functools.cached_property
    def insecure_transport(self) -> bool:
        """``PHALANX_INSECURE_TRANSPORT`` asks for plaintext ("1", "true", "yes")."""
        name = "PHALANX_INSECURE_TRANSPORT"
        text = self._given.get(name, "").strip().lower()
        if text in ("", "0", "false", "no"):
            return False
        if text in ("1", "true", "yes"):
            return True
        raise ValueError(
            f"{name} must be 1 (plaintext, for trusted networks only) or 0/unset (mutual TLS). "
            f"Received: {name}={text!r}. HINT: unset it; see docs/security.md."
        )

    @functools.cached_property
    def max_message_bytes(self) -> int:
        """``PHALANX_MAX_MESSAGE_BYTES``: from 1 MiB to 2 GiB - 1 (gRPC's limit)."""
        name, limit = "PHALANX_MAX_MESSAGE_BYTES", (1 << 31) - 1
        text = self.text(name)
        value = int(text) if text.isdigit() else 0
        if not (1 << 20) <= value <= limit:
            raise ValueError(
                f"{name} must be a number of bytes from {1 << 20} (1 MiB) to {limit} (gRPC's "
                f"limit). Received: {name}={text!r}. HINT: e.g. {name}={limit}."
            )
        return value

    @functools.cached_property
    def gloo_connections(self) -> int:
        """``PHALANX_GLOO_CONNECTIONS``: a whole number from 1 to 8."""
        name, default = "PHALANX_GLOO_CONNECTIONS", int(_DEFAULTS["PHALANX_GLOO_CONNECTIONS"])
        raw = self.text(name)
        if not raw.isdigit() or not 1 <= int(raw) <= 8:
            raise ValueError(
                f"{name} must be a whole number from 1 to 8. Received: "
                f"{raw!r}. HINT: unset it for {default}, or set 1 for torch's one connection."
            )
        return int(raw)

    @functools.cached_property
    def ps_data_path(self) -> str:
        """``PHALANX_PS_DATA_PATH``: "auto", "stream" or "grpc"."""
        return self.choice("PHALANX_PS_DATA_PATH", ("auto", "stream", "grpc"), "unset it (auto).")

    @functools.cached_property
    def ps_pickle_cache(self) -> bool:
        """``PHALANX_PS_PICKLE_CACHE``: 1 (reuse picklings) or 0."""
        name = "PHALANX_PS_PICKLE_CACHE"
        value = self.text(name)
        if value not in ("0", "1"):
            raise ValueError(
                f"{name} must be 0 or 1. Received: {value!r}. HINT: unset it (the default, 1) "
                "or set 0 to pickle every scheduled closure again."
            )
        return value == "1"

    @property
    def timeline(self) -> str:
        """``PHALANX_TIMELINE``: the trace's path ("" when tracing is off)."""
        return self.text("PHALANX_TIMELINE")

    @functools.cached_property
    def timeline_flush_seconds(self) -> float:
        """``PHALANX_TIMELINE_FLUSH_SECONDS``."""
        return self.seconds("PHALANX_TIMELINE_FLUSH_SECONDS")

    @property
    def tls_files(self) -> dict[str, str]:
        """The ``PHALANX_TLS_*_FILE`` variables that are set, by name."""
        names = ("PHALANX_TLS_CA_FILE", "PHALANX_TLS_CERT_FILE", "PHALANX_TLS_KEY_FILE")
        return {name: self._given[name] for name in names if self.is_set(name)}


_current: tuple[tuple[str | None, ...], Settings] | None = None


def current() -> Settings:
    """The settings of the environment as it is now (a new snapshot only after a change)."""
    global _current
    key = tuple(os.environ.get(name) for name in _NAMES)
    if _current is None or _current[0] != key:
        _current = (key, Settings())
    return _current[1]
