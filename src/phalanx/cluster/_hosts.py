"""Host names in task addresses: their syntax, their spelling-independent identity, resolution.

A task's host is a DNS name (letters, digits, ``-`` and ``_`` in dot-separated labels), an
IPv4 address, or an IPv6 address in brackets (``[::1]``), as in a URL. Two addresses are the
same task slot when they name the same IP addresses and port, whatever the spelling
(``localhost:2222`` and ``127.0.0.1:2222`` are one slot where localhost is 127.0.0.1).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading

__all__ = ["RESOLVE_TIMEOUT_SECONDS", "canonical_host", "host_syntax_error", "resolve_host"]

RESOLVE_TIMEOUT_SECONDS = 10.0
# RFC 1123 labels, plus '_' (Docker Compose service names use it); 253 characters in all.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_DNS_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?", re.ASCII)


def host_syntax_error(host: str) -> str | None:
    """Why ``host`` (as split from ``host:port``) is not a valid host, or None if it is."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return "is in brackets but is not an IPv6 address"
        return None
    if ":" in host:
        return "is an IPv6 address without brackets (the port would be ambiguous)"
    if len(host) > 253 or not _DNS_NAME.fullmatch(host):
        return "is neither a DNS name (letters, digits, '-', '_' in dot-separated labels) nor an IP address"
    return None


def canonical_host(host: str) -> str:
    """One spelling per host: an IP address in its compressed form, a name in lower case
    without a trailing dot, brackets removed. Needs no network."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return bare.lower().rstrip(".")


def resolve_host(host: str, timeout: float | None = None) -> set[str]:
    """The IP addresses ``host`` names (an IP address names itself).

    Args:
        host: A host as split from ``host:port`` (IPv6 in brackets or not).
        timeout: Seconds to wait for the name resolver (default `RESOLVE_TIMEOUT_SECONDS`).

    Raises:
        OSError: The name does not resolve (``socket.gaierror``), or resolving took longer
            than ``timeout`` seconds (``TimeoutError``).
    """
    bare = canonical_host(host)
    try:
        return {str(ipaddress.ip_address(bare))}
    except ValueError:
        pass
    if bare == "invalid" or bare.endswith(".invalid"):  # RFC 6761: never resolves (placeholders)
        raise socket.gaierror(socket.EAI_NONAME, "a name under .invalid never resolves")
    found: dict[str, object] = {}

    def lookup() -> None:
        try:
            found["infos"] = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            found["error"] = exc

    # getaddrinfo has no timeout of its own: a thread that is abandoned if the resolver hangs.
    thread = threading.Thread(target=lookup, name=f"phalanx-resolve-{bare}", daemon=True)
    thread.start()
    limit = RESOLVE_TIMEOUT_SECONDS if timeout is None else timeout
    thread.join(limit)
    if thread.is_alive():
        raise TimeoutError(f"no answer from the name resolver within {limit:g}s")
    error = found.get("error")
    if isinstance(error, OSError):
        raise error
    infos = found["infos"]
    assert isinstance(infos, list)
    return {canonical_host(str(info[4][0]).split("%", 1)[0]) for info in infos}
