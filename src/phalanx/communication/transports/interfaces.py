"""Which network interface holds a task's address: gloo binds the address the cluster gives.

gloo's default device binds the address the machine's host name resolves to, and where the
name does not resolve (common in containers) it falls back to 127.0.0.1 ("Unable to resolve
hostname ... Using the loopback address as fallback") and advertises that to its peers, whose
connects are refused: a multi-machine job hangs at start-up. torch's only way to choose gloo's
device for the process groups it creates is ``GLOO_SOCKET_IFNAME``, read when a group is made.
So, as TF binds the address ``TF_CONFIG`` gives a task, `bind_gloo_to` sets
``GLOO_SOCKET_IFNAME`` to the interface that holds the task's own address from the cluster
spec, unless the user set it (a user's ``GLOO_SOCKET_IFNAME`` always wins).

gloo then binds the first address of that interface (IPv4 before IPv6): the task's address
unless the interface holds several of the same family.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket

__all__ = ["GLOO_INTERFACE_ENV", "bind_gloo_to", "interface_addresses", "interface_holding", "strip_brackets"]

log = logging.getLogger("phalanx")

GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_IfAddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p),
    ("ifa_netmask", ctypes.c_void_p),
    ("ifa_ifu", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]

# struct sockaddr_in: family (2 bytes), port (2), address (4);
# struct sockaddr_in6: family (2), port (2), flowinfo (4), address (16), scope id (4)
_LAYOUT = {socket.AF_INET: (4, 4), socket.AF_INET6: (8, 16)}


def strip_brackets(host: str) -> str:
    """``"[::1]"`` → ``"::1"``; other hosts unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def interface_addresses() -> list[tuple[str, str]]:
    """Every (interface, IP address) of this machine, in ``getifaddrs`` order (Linux, BSD, macOS).

    Returns:
        ``[("lo", "127.0.0.1"), ("eth0", "10.0.0.2"), ("lo", "::1"), ...]``; empty where
        ``getifaddrs`` is not available.
    """
    path = ctypes.util.find_library("c")
    if path is None:
        return []
    libc = ctypes.CDLL(path, use_errno=True)
    if not hasattr(libc, "getifaddrs"):
        return []
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found: list[tuple[str, str]] = []
    try:
        node = head
        while node:
            entry = node.contents
            address = _address(entry.ifa_addr)
            if address is not None and entry.ifa_name is not None:
                found.append((entry.ifa_name.decode(errors="replace"), address))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


def _address(sockaddr: int | None) -> str | None:
    if not sockaddr:
        return None
    family = ctypes.c_ushort.from_address(sockaddr).value
    if family not in _LAYOUT:
        return None
    offset, size = _LAYOUT[socket.AddressFamily(family)]
    raw = ctypes.string_at(sockaddr + offset, size)
    return socket.inet_ntop(family, raw)


def _own_addresses(host: str) -> set[str]:
    """The IP addresses ``host`` stands for (itself if it is one); empty if it does not resolve."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    if host.endswith(".invalid"):  # reserved never to resolve (torchrun's placeholder tasks)
        return set()
    try:
        return {
            str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        }
    except OSError:
        return set()


def interface_holding(host: str) -> str | None:
    """The interface of this machine that holds ``host`` (an IP address or a name), or None.

    A name is resolved; None when it does not resolve or no interface holds its addresses
    (an address behind NAT, or another machine's).
    """
    wanted = {str(ipaddress.ip_address(a)) for a in _own_addresses(strip_brackets(host))}
    for name, address in interface_addresses():
        if str(ipaddress.ip_address(address.split("%")[0])) in wanted:
            return name
    return None


def bind_gloo_to(host: str | None) -> str | None:
    """Points gloo's device at the interface holding ``host`` (this task's address).

    Sets ``GLOO_SOCKET_IFNAME`` for this process (and so for every gloo group created after,
    the user's included) unless the user set it. Called by `WorkerGroup` before it creates
    its process groups.

    Args:
        host: This task's host from the cluster spec (``"10.0.0.2"``, ``"[fd00::2]"``, a
            name), or None when the cluster does not know it (torchrun's other ranks).

    Returns:
        The interface gloo uses: the user's ``GLOO_SOCKET_IFNAME``, the one found, or None
        (gloo's default device: the address the host name resolves to).
    """
    chosen = os.environ.get(GLOO_INTERFACE_ENV, "").strip()
    if chosen:
        return chosen
    if host is None:
        return None
    interface = interface_holding(host)
    if interface is None:
        log.info(
            "This task's address %s is not on any interface of this machine; gloo binds the address "
            "the host name resolves to (set %s to choose an interface).",
            host,
            GLOO_INTERFACE_ENV,
        )
        return None
    os.environ[GLOO_INTERFACE_ENV] = interface
    log.info("gloo binds interface %s, which holds this task's address %s.", interface, host)
    return interface
