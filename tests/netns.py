"""Network namespaces for the overlay's partition tests and `make reliability` (root only).

A `Lab` is N member namespaces on one bridge, the bridge in a namespace of its own, so nothing
is attached to this machine's own network and no packet can leave the lab:

    {prefix}br   bridges br0 (the network) and br1 (the far side of a partition), no address
       |  p0 p1 … (veth ends)
    {prefix}m0   eth0 10.78.0.10/24, lo       one member (ingress or node) per namespace
    {prefix}m1   eth0 10.78.0.11/24, lo
    …

`partition(far)` moves the far members' bridge ports onto br1: each side still reaches its own
members, nothing crosses. `heal()` moves them back. Processes run inside a member with
`ip netns exec` (`Place.argv`); this process reaches a member's sockets from a thread that
entered its namespace (`Place.call`, the setns(2) that `ip netns exec` does), so polling a
registry costs no process start.

Names start with "otr-<pid>-". `close()` kills every process inside the lab and deletes its
namespaces; a lab whose creator died without closing it is removed by the next Lab.
The technique is tests/natlab.py's, without its NAT.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import shutil
import signal
import subprocess
import time
from typing import Callable, List, Optional

PREFIX = "otr-"
SUBNET = "10.78.0"                  # 10.78.0.10 + i: a private range, reachable only inside the lab
FIRST_HOST = 10
CLONE_NEWNET = 0x40000000           # setns(2) flag: join a network namespace


def unavailable() -> Optional[str]:
    """Why a Lab cannot be built here (not root, no `ip`, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (make sysdeps)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def ip(*args: str) -> None:
    """One `ip` command; a failure raises with its message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def enter(netns: str) -> None:
    """Move the calling thread into network namespace `netns` (its later sockets live there)."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Place:
    """Where a member runs and its sockets live: this machine's loopback, one namespace of a
    Lab, or (`isolated`) a namespace of each process's own. `argv` wraps a command to run
    there; `call` runs a function with its network."""

    def __init__(self, host: str, netns: Optional[str] = None, prefix: Optional[List[str]] = None):
        self.host = host
        self.netns = netns
        self.prefix = ["ip", "netns", "exec", netns] if netns else list(prefix or [])
        self._thread = None
        if netns:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, initializer=enter, initargs=(netns,))

    def argv(self, argv: List[str]) -> List[str]:
        return self.prefix + list(argv)

    def call(self, fn: Callable, *args, timeout: float = 30.0):
        if self._thread is None:
            return fn(*args)
        return self._thread.submit(fn, *args).result(timeout)

    def enter(self) -> None:
        """Move the calling thread here (for a thread of its own, e.g. a load generator)."""
        if self.netns:
            enter(self.netns)

    def port(self, wanted: int) -> int:
        """`wanted` in a namespace of its own; on loopback, a port free for TCP and UDP."""
        return wanted if self.netns else free_port_pair()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


LOOPBACK = Place("127.0.0.1")


def isolated() -> Optional[Place]:
    """A place where each process gets a fresh network namespace with only loopback (unshare;
    as a user, inside a user namespace): a name it resolves or a packet it sends reaches no one
    outside, and its sockets cannot be reached from here either (read its log). None where
    unshare is refused."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    prefix = ["unshare", *userns, "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "isolated"]
    try:
        works = subprocess.run(prefix + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        works = False
    return Place("127.0.0.1", prefix=prefix) if works else None


def free_port_pair() -> int:
    """A loopback port free for both TCP and UDP (gossip binds both), below the ephemeral range."""
    from fake_engine import free_port_pair as pair
    return pair()


class Lab:
    """`n` member namespaces on one bridge. Use as a context manager: it always cleans up."""

    def __init__(self, n: int):
        self.tag = f"{PREFIX}{os.getpid()}-"
        self.bridge = self.tag + "br"
        self.names = [f"{self.tag}m{i}" for i in range(n)]
        self.places: List[Place] = []
        self.far: List[int] = []
        sweep_orphans()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        ip("netns", "add", self.bridge)
        ip("-n", self.bridge, "link", "set", "lo", "up")
        for br in ("br0", "br1"):
            ip("-n", self.bridge, "link", "add", br, "type", "bridge")   # STP off: ports forward at once
            ip("-n", self.bridge, "link", "set", br, "up")
        for i, name in enumerate(self.names):
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", self.bridge, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("-n", self.bridge, "link", "set", f"p{i}", "master", "br0", "up")
            host = f"{SUBNET}.{FIRST_HOST + i}"
            ip("-n", name, "addr", "add", f"{host}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            self.places.append(Place(host, name))

    def partition(self, far: List[int]) -> None:
        """Cut members `far` off from the others (each side still reaches its own)."""
        for i in far:
            ip("-n", self.bridge, "link", "set", f"p{i}", "master", "br1")
        self.far = list(far)

    def heal(self) -> None:
        for i in self.far:
            ip("-n", self.bridge, "link", "set", f"p{i}", "master", "br0")
        self.far = []

    def close(self) -> None:
        for place in self.places:
            place.close()
        remove([self.bridge] + self.names)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def existing() -> List[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def remove(names: List[str]) -> None:
    """Kill every process inside the namespaces `names` (TERM, then KILL), then delete them."""
    present = [n for n in names if n in set(existing())]
    for sig, pause in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 0.2)):
        pids = []
        for name in present:
            done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10)
            pids += [int(p) for p in done.stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids:
            time.sleep(pause)
    for name in present:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def sweep_orphans(prefix: str = PREFIX) -> None:
    """Remove labs named `prefix`<pid>-… left by a process that no longer exists (a run killed
    before its cleanup)."""
    stale = []
    for name in existing():
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            stale.append(name)
    if stale:
        remove(stale)
