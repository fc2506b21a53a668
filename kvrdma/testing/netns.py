"""Hosts on one machine: network namespaces joined by veth links, for tests and `kvrdma demo
--hosts N`.

`NetnsBed(n)` creates `n` namespaces ("hosts"), each with loopback up and one interface
(`Host.device`) holding `Host.address`, a veth to a bridge (the "switch") in a namespace of its
own, so nothing is added to the caller's namespace. Names carry
the creating process's pid, so `sweep_stale()` (run by every new testbed) removes namespaces a
killed run left behind; `close()` (also at exit) removes the testbed's own.

A process joins a host with `enter(host)` before it loads UCX or opens a socket; `run_in()` is
that, as the entry point of a spawned child. `env(host)` is the UCX environment of a rank
there: TCP only (no shared memory between "hosts" that share one kernel) on the host's device.

Faults act on a host's link: `partition(host, cut=True)` (the switch drops its frames while
every interface stays up, as when the fabric between hosts fails), `set_link(host, up=False)`
(the host's own interface down), `rate_limit` (tbf) and
`netem` (delay, loss, reordering), which raises `NetemUnavailable` where the kernel has no
sch_netem; `drop` loses a share of a host's packets at random with nftables, which works
without it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvrdma.errors import ConfigError
from kvrdma.testing.ucx import tcp_only

__all__ = [
    "Host",
    "NetemUnavailable",
    "NetnsBed",
    "enter",
    "netem_missing",
    "run_in",
    "sweep_stale",
    "unavailable_reason",
]

PREFIX = "kvrdma-"  # every namespace a testbed creates: kvrdma-<pid>-<n>-<host>
DEVICE = "eth0"  # the interface each host reaches the others by
_NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 1 << 19, 2
_IP_TIMEOUT_S = 10.0  # one `ip`/`tc` command; they return in milliseconds when healthy
_counter = itertools.count()


class NetemUnavailable(ConfigError):
    """The kernel refuses the netem qdisc (no sch_netem module)."""


@dataclass(frozen=True)
class Host:
    """One namespace of a testbed: its name, index and the address others reach it at."""

    netns: str
    index: int
    address: str
    device: str = DEVICE


def _run(
    *argv: str, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv, input=stdin, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise OSError(f"{' '.join(argv)!r} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str:
    """Why this process cannot build a testbed ("" when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as CI does)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the iproute2 tools `ip` and `tc` are not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    _run("ip", "netns", "delete", probe, check=False)
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete testbed namespaces whose creating process is gone; returns their names."""
    listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
    gone = []
    for line in listing:
        name = line.split(" ", 1)[0]
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
            _run("ip", "netns", "delete", name, check=False)
            gone.append(name)
    return gone


def enter(host: Host | str, *, sysfs: bool = True) -> None:
    """Move the calling thread (and threads it starts later) into `host`'s namespace.

    With `sysfs` (a process that is still single-threaded: a fresh child) it also gets a
    mount namespace of its own with /sys mounted afresh, as `ip netns exec` does: UCX finds
    its devices under /sys/class/net, which otherwise lists the namespace /sys was mounted in.
    """
    name = host.netns if isinstance(host, Host) else host
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"{_NETNS_DIR}/{name}", os.O_RDONLY)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), f"setns into network namespace {name!r}")
    finally:
        os.close(fd)
    if not sysfs:
        return
    _check(libc.unshare(_CLONE_NEWNS), "unshare the mount namespace")
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "make / a slave mount")
    _check(libc.umount2(b"/sys", _MNT_DETACH), "unmount /sys")
    _check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs on /sys")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def run_in(
    conn: Any, host: Host, env: Mapping[str, str], target: Callable[..., Any], *args: Any
) -> Any:
    """Child entry point: join `host`, add `env`, then `target(conn, *args)`."""
    enter(host)
    os.environ.update(env)
    return target(conn, *args)


def netem_missing() -> str:
    """Why netem cannot shape a testbed link here ("" when it can)."""
    with NetnsBed(2) as bed:
        try:
            bed.netem(bed.hosts[0], "delay 1ms")
        except NetemUnavailable as exc:
            return str(exc)
    return ""


class NetnsBed:
    """`n` hosts on one bridge; removed by `close()` or at exit."""

    def __init__(self, n: int, *, subnet: str = "10.233.0.0/24") -> None:
        if n < 2:
            raise ConfigError(f"a testbed needs at least 2 hosts, got {n}")
        net = ipaddress.ip_network(subnet)
        if n + 1 >= net.num_addresses:
            raise ConfigError(f"subnet {subnet} has no room for {n} hosts")
        sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.prefixlen = net.prefixlen
        self.hosts = [
            Host(f"{self.tag}-h{i}", i, str(net.network_address + i + 1)) for i in range(n)
        ]
        self.switch = f"{self.tag}-sw"
        self._made: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- building ----------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        for h in self.hosts:
            self._add_ns(h.netns)
        self._add_ns(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            port = f"p{h.index}"
            _run("ip", "-n", self.switch, "link", "add", port, "type", "veth",
                 "peer", "name", DEVICE, "netns", h.netns)  # fmt: skip
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
        for h in self.hosts:
            self.ip(h, "addr", "add", f"{h.address}/{self.prefixlen}", "dev", h.device)
            self.ip(h, "link", "set", h.device, "up")

    def add_interface(self, host: Host, peer: Host, device: str, address: str) -> None:
        """A second link between `host` and `peer`: `device` on both ends, `address` on
        `host`'s end and the next address on `peer`'s (a /30 of their own)."""
        addr = ipaddress.ip_address(address)
        _run("ip", "-n", host.netns, "link", "add", device, "type", "veth",
             "peer", "name", device, "netns", peer.netns)  # fmt: skip
        for h, a in ((host, addr), (peer, addr + 1)):
            self.ip(h, "addr", "add", f"{a}/30", "dev", device)
            self.ip(h, "link", "set", device, "up")

    # ---- using -------------------------------------------------------------------------
    def ip(self, host: Host, *argv: str) -> str:
        """`ip ARGV` inside `host`; its stdout."""
        return _run("ip", "-n", host.netns, *argv).stdout

    def env(self, host: Host, device: str = "") -> dict[str, str]:
        """The UCX environment of a rank on `host`: TCP only, over `device` (default its
        testbed interface)."""
        return {"UCX_TLS": tcp_only(), "UCX_NET_DEVICES": device or host.device}

    def set_link(self, host: Host, *, up: bool) -> None:
        """Bring `host`'s interface down (its own NIC fails: no carrier on either end) or up."""
        self.ip(host, "link", "set", host.device, "up" if up else "down")

    def partition(self, host: Host, *, cut: bool) -> None:
        """Cut `host` off from every other host, or join it again: its switch port stops
        (or resumes) forwarding. Interfaces keep their carrier, so nothing on either side sees
        a link go down: connections time out as they would across a failed fabric."""
        state = "disabled" if cut else "forwarding"
        _run("ip", "netns", "exec", self.switch, "bridge", "link", "set", "dev", f"p{host.index}",
             "state", state)  # fmt: skip

    def rate_limit(
        self, host: Host, rate: str, *, burst: str = "32kb", latency: str = "50ms"
    ) -> None:
        """Cap what `host` sends with a token bucket (tbf), e.g. rate="20mbit"."""
        self._qdisc(host, "tbf", "rate", rate, "burst", burst, "latency", latency)

    def netem(self, host: Host, spec: str) -> None:
        """Shape what `host` sends with netem, e.g. "delay 5ms 1ms loss 1%"; raises
        `NetemUnavailable` where the kernel lacks it and `ConfigError` for a bad `spec`."""
        self._qdisc(host, "netem", *spec.split())

    def drop(self, host: Host, percent: int) -> None:
        """Lose `percent` % of the packets reaching `host` over its link, at random (nftables;
        0 stops it): its peers' sends succeed and are lost on the way, as on a lossy link;
        its loopback is spared. Raises `NetemUnavailable` where `nft` is missing or the
        kernel refuses the rule."""
        if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
            raise ConfigError(f"drop: expected a whole percentage 0..100, got {percent!r}")
        if shutil.which("nft") is None:
            raise NetemUnavailable("drop: the nftables tool `nft` is not installed")
        nft = ("ip", "netns", "exec", host.netns, "nft")
        _run(*nft, "delete", "table", "inet", "kvrdma_loss", check=False)
        if percent == 0:
            return
        rules = (
            "table inet kvrdma_loss {\n  chain in {\n    type filter hook input priority 0;\n"
            f'    iifname "{host.device}" numgen random mod 100 < {percent} drop\n  }}\n}}\n'
        )
        proc = _run(*nft, "-f", "-", check=False, stdin=rules)
        if proc.returncode != 0:
            raise NetemUnavailable(f"drop: nftables refused a random-loss rule: {proc.stderr}")

    def clear_qdisc(self, host: Host) -> None:
        _run("tc", "-n", host.netns, "qdisc", "del", "dev", host.device, "root", check=False)

    def _qdisc(self, host: Host, kind: str, *params: str) -> None:
        argv = ("tc", "-n", host.netns, "qdisc", "replace", "dev", host.device, "root", kind)
        proc = _run(*argv, *params, check=False)
        if proc.returncode == 0:
            return
        err = proc.stderr.strip()
        if "unknown" in err.lower() and "qdisc" in err.lower():
            raise NetemUnavailable(
                f"tc qdisc {kind}: this kernel has no {kind} scheduler (sch_{kind} not built or "
                f"not loadable; `modprobe sch_{kind}` as root may help): {err}"
            )
        raise ConfigError(f"tc qdisc {kind} {' '.join(params)!r} refused: {err}")

    def close(self) -> None:
        """Delete every namespace of the testbed (their interfaces go with them); idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        for name in reversed(self._made):
            _run("ip", "netns", "delete", name, check=False)

    def __enter__(self) -> NetnsBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
