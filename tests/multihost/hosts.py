"""Simulated hosts on one Linux machine: namespaces on a private bridge (the multihost tier's harness).

Each `Host` is what a separate machine looks like to a program:

* its own **network namespace** with one interface ``eth0`` holding a 10.x (or IPv6 ULA)
  address, plugged into a bridge that lives in a dedicated "switch" namespace, so nothing
  touches the root namespace's network and traffic only flows between the hosts of one
  `SimulatedHosts`;
* its own **host name** (UTS namespace), which resolves nowhere: no ``/etc/hosts`` entry and
  no DNS reachable from the namespace (the case that hangs gloo's default device);
* a private **/dev/shm** (a tmpfs in its own mount namespace) and its own **PID namespace**.
  The rest of the file system (the repository, /tmp, the virtual environment) is shared.

A host is a long-lived ``sleep`` that is PID 1 of the host's PID namespace; `Host.run` enters
its namespaces with ``nsenter``, so two processes on one host share its host name, /dev/shm
and PIDs, as on a real machine. Killing PID 1 ends every process of the host.

Requires root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux); `missing_tools`
says what is absent. Link faults: `Host.cut` / `Host.heal` take the host's cable out and put
it back (``ip link set ... down/up`` on both ends); `Host.shape` limits its bandwidth with
``tc qdisc ... tbf`` on both directions.

Example::

    with SimulatedHosts(2) as hosts:
        p = hosts[1].run([sys.executable, "-c", "import socket; print(socket.gethostname())"])
        code, output = p.wait(30)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

__all__ = ["Host", "HostProcess", "SimulatedHosts", "missing_tools", "sent_bytes"]

_TOOLS = ("ip", "unshare", "nsenter", "tc")


def missing_tools() -> str | None:
    """Why simulated hosts cannot be made here (not root, a tool missing), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth pairs, tmpfs mounts)"
    absent = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if absent:
        return f"simulated hosts need {', '.join(absent)} (iproute2 / util-linux)"
    return None


def sent_bytes() -> int:
    """Bytes this process's network namespace has sent on every interface but lo
    (``/proc/net/dev``): what a task on a simulated host put on its link."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.read().splitlines()[2:]:
            name, counters = line.split(":", 1)
            if name.strip() != "lo":
                total += int(counters.split()[8])
    return total


def _sh(command: str) -> str:
    """Runs a setup command (words separated by spaces); raises with its stderr when it fails."""
    done = subprocess.run(command.split(), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


class HostProcess:
    """A process running on a `Host`; its output lines are collected, prefixed with its name."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.name = name
        self._lines: list[str] = []
        self._popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"output-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._popen.stdout is not None
        for raw in self._popen.stdout:
            self._lines.append(f"[{self.name}] {raw.decode(errors='replace').rstrip()}")

    @property
    def output(self) -> str:
        """Every line printed so far (stdout and stderr), each prefixed ``[name] ``."""
        return "\n".join(self._lines)

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait(self, timeout: float) -> tuple[int | None, str]:
        """(exit code, output) once it ended; (None, output) if it still runs after ``timeout``."""
        try:
            code: int | None = self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        else:
            self._reader.join(5)
        return code, self.output

    def kill(self) -> None:
        """SIGKILLs the process (``nsenter``) and its session on the host."""
        if self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._popen.pid, signal.SIGKILL)
            self._popen.wait(10)
        self._reader.join(5)


class Host:
    """One simulated machine (see the module docstring); made by `SimulatedHosts`."""

    def __init__(self, switch: str, netns: str, index: int, hostname: str, address: str, prefix_len: int):
        self.index, self.hostname, self.address = index, hostname, address
        self.netns, self._switch = netns, switch
        self._port = f"p{index}"  # this host's end of the cable, in the switch namespace
        self._prefix_len = prefix_len
        self._init: subprocess.Popen[bytes] | None = None
        self.pid = 0  # PID 1 of the host's PID namespace, as the root namespace numbers it
        self.processes: list[HostProcess] = []

    @property
    def url_host(self) -> str:
        """The address as a URL spells it (``10.0.0.1`` or ``[fd00::1]``)."""
        return f"[{self.address}]" if ":" in self.address else self.address

    def _plug_in(self) -> None:
        sw, ns, port = self._switch, self.netns, self._port
        _sh(f"ip netns add {ns}")
        _sh(f"ip -n {sw} link add {port} type veth peer name eth0 netns {ns}")
        _sh(f"ip -n {sw} link set {port} master br0 up")
        self._add_address()
        _sh(f"ip -n {ns} link set lo up")
        _sh(f"ip -n {ns} link set eth0 up")

    def _add_address(self) -> None:
        # IPv6: nodad makes it usable at once; the link-local address comes after it
        family, nodad = ("-6", "nodad") if ":" in self.address else ("-4", "")
        _sh(f"ip -n {self.netns} {family} addr add {self.address}/{self._prefix_len} dev eth0 {nodad}")

    def _boot(self) -> None:
        """Starts PID 1 of the host: its own host name, PID namespace and /dev/shm."""
        script = (
            f"hostname {self.hostname} && mount -t tmpfs -o size=1g tmpfs /dev/shm && exec sleep infinity"
        )
        unshare = f"ip netns exec {self.netns} unshare --uts --mount --pid --fork --mount-proc --kill-child"
        self._init = subprocess.Popen(
            [*unshare.split(), "sh", "-c", script], stdin=subprocess.DEVNULL, start_new_session=True
        )
        children = f"/proc/{self._init.pid}/task/{self._init.pid}/children"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # unshare's child is the host's PID 1
            text: list[str] = []
            with contextlib.suppress(OSError), open(children) as f:
                text = f.read().split()
            if text and self._booted(int(text[0])):
                self.pid = int(text[0])
                return
            if self._init.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"host {self.hostname} did not start (unshare exited {self._init.poll()})")

    @staticmethod
    def _booted(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().startswith(b"sleep")
        except OSError:
            return False

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        cwd: str | None = None,
    ) -> HostProcess:
        """Starts ``argv`` on this host with exactly ``env`` (default: this process's environment).

        Args:
            argv: The command.
            env: Its environment (e.g. with ``TF_CONFIG``).
            name: The output prefix (default: the host name).
            cwd: Its working directory (default: this process's).
        """
        enter = f"nsenter --target {self.pid} --net --uts --mount --pid".split()
        command = [*enter, f"--wd={cwd or os.getcwd()}", "--", *argv]
        process = HostProcess(name or self.hostname, command, os.environ if env is None else env)
        self.processes.append(process)
        return process

    def cut(self) -> None:
        """Takes the host's cable out: both ends of its link go down (packets are dropped)."""
        _sh(f"ip -n {self._switch} link set {self._port} down")
        _sh(f"ip -n {self.netns} link set eth0 down")

    def heal(self) -> None:
        """Puts the cable back (undoes `cut`)."""
        _sh(f"ip -n {self.netns} link set eth0 up")
        _sh(f"ip -n {self._switch} link set {self._port} up")
        if ":" in self.address:  # an interface that went down drops its IPv6 addresses
            with contextlib.suppress(RuntimeError):
                self._add_address()

    def shape(self, rate: str) -> None:
        """Limits the host's link to ``rate`` (``"1gbit"``) in both directions (token bucket)."""
        for netns, dev in ((self.netns, "eth0"), (self._switch, self._port)):
            tbf = f"tbf rate {rate} burst 256kb latency 50ms"
            _sh(f"ip netns exec {netns} tc qdisc replace dev {dev} root {tbf}")

    def shut_down(self) -> None:
        """Ends every process of the host (PID 1 takes its PID namespace with it)."""
        for process in self.processes:
            process.kill()
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self._init is not None and self._init.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._init.pid, signal.SIGKILL)
            self._init.wait(10)


class SimulatedHosts:
    """``count`` simulated hosts on a private bridge; a context manager that removes them all.

    Args:
        count: How many hosts.
        ipv6: Give the hosts IPv6 ULA addresses (``fd..::1``) instead of 10.x ones.

    Raises:
        RuntimeError: Not root, a tool is missing, or a setup command failed (whatever was
            made is removed first).
    """

    def __init__(self, count: int, ipv6: bool = False) -> None:
        reason = missing_tools()
        if reason is not None:
            raise RuntimeError(reason)
        # unique per run: several sessions share the machine
        self.tag = f"phx{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self._made_switch = False
        try:
            self._build(count, ipv6)
        except BaseException:
            self.close()
            raise

    def _build(self, count: int, ipv6: bool) -> None:
        _sh(f"ip netns add {self.switch}")
        self._made_switch = True
        _sh(f"ip -n {self.switch} link add br0 type bridge")
        _sh(f"ip -n {self.switch} link set br0 up")
        subnet = secrets.randbelow(250) + 1
        for i in range(count):
            address = f"fd00:{subnet:x}::{i + 1}" if ipv6 else f"10.{subnet}.0.{i + 1}"
            host = Host(
                self.switch, f"{self.tag}-h{i}", i, f"{self.tag}-host{i}", address, 64 if ipv6 else 24
            )
            self.hosts.append(host)
            host._plug_in()
            host._boot()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> SimulatedHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends every host's processes and deletes every namespace (and so every link) made."""
        for host in self.hosts:
            host.shut_down()
        for netns in [h.netns for h in self.hosts] + ([self.switch] if self._made_switch else []):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
        self.hosts, self._made_switch = [], False
