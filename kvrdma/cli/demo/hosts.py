"""`kvrdma demo --hosts N`: the engines on N "hosts", network namespaces on this machine
(`kvrdma.testing.netns`; needs root).

Host 0 is the prefill pod: every P rank and the engine's sidecar (`kvrdma agent`), which the
ranks publish to over the host's loopback and D ranks handshake with on the host's address.
Hosts 1..N-1 share the D ranks round-robin. Every rank runs UCX over TCP on the host's
testbed interface. `--netem SPEC` shapes every host's link (a clear error where the kernel
has no netem), `--loss PCT` loses packets at random with nftables; `--fault partition` cuts
host 0 off mid-run (see `faults`).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from kvrdma.errors import ConfigError
from kvrdma.testing.netns import Host, NetnsBed, unavailable_reason
from kvrdma.testing.sidecar import SidecarProcess

__all__ = ["DemoHosts", "check_options"]

_NEEDS_LOCAL = {
    "metrics_port": "--metrics-port (the ranks' metrics are on their hosts' loopback)",
    "stages": "--stages",
}


def check_options(args: argparse.Namespace) -> None:
    """Refuse --hosts/--netem/--fault partition combinations that cannot work."""
    hosts = args.hosts
    if not hosts:
        if args.netem or args.loss:
            flag = "--netem" if args.netem else "--loss"
            raise ConfigError(f"{flag} shapes the links between hosts: it needs --hosts N")
        if args.fault == "partition":
            raise ConfigError("--fault partition cuts a link between hosts: it needs --hosts N")
        return
    if not 2 <= hosts <= 1 + args.d_tp:
        raise ConfigError(
            f"--hosts: expected 2..{1 + args.d_tp} (one prefill host, and no decode host "
            f"without a D rank at --d-tp {args.d_tp}), got {hosts}"
        )
    for name, what in _NEEDS_LOCAL.items():
        if getattr(args, name):
            raise ConfigError(f"--hosts: {what} is not supported across hosts")
    if args.fault == "corrupt-handshake":
        raise ConfigError("--hosts: --fault corrupt-handshake needs the local handshake proxy")
    if not 0 <= args.loss <= 100:
        raise ConfigError(f"--loss: expected a percentage 0..100, got {args.loss}")
    reason = unavailable_reason()
    if reason:
        raise ConfigError(f"--hosts {hosts}: cannot create network namespaces: {reason}")


class DemoHosts:
    """The testbed and the P engine's sidecar of one demo run; `close()` removes both."""

    def __init__(self, n: int, p_engine: str, p_tp: int, netem: str = "", loss: int = 0) -> None:
        self.bed = NetnsBed(n)
        self.sidecar: SidecarProcess | None = None
        try:
            for h in self.bed.hosts:
                try:
                    if netem:
                        self.bed.netem(h, netem)
                    if loss:
                        self.bed.drop(h, loss)
                except ConfigError as exc:  # NetemUnavailable included: say which flag
                    flag = f"--netem {netem!r}" if netem else f"--loss {loss}"
                    raise ConfigError(f"{flag}: {exc}") from None
            log = os.path.join(tempfile.gettempdir(), f"{self.bed.tag}-sidecar.log")
            self.sidecar = SidecarProcess(self.p_host, p_engine, ranks=p_tp, log=log)
        except BaseException:
            self.close()
            raise

    @property
    def p_host(self) -> Host:
        return self.bed.hosts[0]

    def host_of(self, role: str, rank: int) -> Host:
        if role == "P":
            return self.p_host
        return self.bed.hosts[1 + rank % (len(self.bed.hosts) - 1)]

    def env(self, role: str, rank: int) -> dict[str, str]:
        return self.bed.env(self.host_of(role, rank))

    @property
    def port(self) -> int:
        assert self.sidecar is not None
        return self.sidecar.port

    @property
    def publish_address(self) -> str:
        assert self.sidecar is not None
        return self.sidecar.publish_address

    def set_p_link(self, up: bool) -> None:
        """Cut the prefill host off from every decode host, or join it again."""
        self.bed.partition(self.p_host, cut=not up)

    def describe(self) -> str:
        where = ", ".join(f"{h.netns}={h.address}" for h in self.bed.hosts)
        return f"hosts: {where} (P + sidecar on {self.p_host.address}; UCX over TCP)"

    def close(self) -> None:
        if self.sidecar is not None:
            self.sidecar.close()
            self.sidecar = None
        self.bed.close()
