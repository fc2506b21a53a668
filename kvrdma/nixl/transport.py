"""What UCX can carry a NIXL agent's transfers over, from its settings and the devices this
process sees (pure: reads the environment and /sys, never loads UCX).

UCX picks a transport per peer at connection time and says nothing when RDMA is unavailable:
with `UCX_TLS` unset it quietly runs over TCP. `describe()` names what the settings leave
possible ("rdma" only when an RDMA transport is allowed and an RDMA device is visible and
selected), so a deployment that meant RDMA and got TCP shows it in logs and metrics.
`device_problems()` explains a `UCX_NET_DEVICES` that UCX refuses (a name that is no device
here, or a device that is down).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TransportInfo", "describe", "device_problems", "net_devices"]

# UCX transport names (and aliases) that use an RDMA device
_RDMA_TLS = frozenset(
    {"rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5",
     "dc", "dc_x", "dc_mlx5", "ib", "srd"}
)  # fmt: skip
_TCP_TLS = frozenset({"tcp"})
_RDMA = "/sys/class/infiniband"
_SIOCGIFFLAGS = 0x8913
_IFF_UP, _IFF_RUNNING = 0x1, 0x40


@dataclass(frozen=True)
class TransportInfo:
    """`kind`: "rdma", "tcp" or "other" (e.g. shared memory only); `why` says why not RDMA."""

    kind: str
    tls: str
    devices: str
    why: str = ""


def _allows(tls: str, names: frozenset[str]) -> bool:
    """Whether a `UCX_TLS` value lets UCX use any transport in `names`."""
    raw = tls.strip()
    if not raw or raw == "all":
        return True
    excluded = raw.startswith("^")
    listed = {t.strip() for t in raw.lstrip("^").split(",") if t.strip()}
    return not (listed >= names) if excluded else bool(listed & names)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def net_devices() -> dict[str, bool]:
    """This network namespace's interfaces and whether each is up and running (from the
    kernel, not /sys, which shows the namespace it was mounted in)."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            out[name] = False
            with contextlib.suppress(OSError):
                req = struct.pack("16sH", name.encode(), 0)
                flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, req)[:18])[1]
                out[name] = flags & (_IFF_UP | _IFF_RUNNING) == _IFF_UP | _IFF_RUNNING
    return out


def describe(environ: Mapping[str, str] | None = None, sys_root: str = "") -> TransportInfo:
    """The transport UCX can use under `environ`'s `UCX_TLS` and `UCX_NET_DEVICES`."""
    env = os.environ if environ is None else environ
    tls = env.get("UCX_TLS", "").strip()
    devices = env.get("UCX_NET_DEVICES", "").strip()
    chosen = [d.strip() for d in devices.split(",") if d.strip()]
    rdma_devs = _listdir(sys_root + _RDMA)
    if chosen and "all" not in chosen:
        rdma_devs = [d for d in rdma_devs if any(c.split(":")[0] == d for c in chosen)]
    tcp = _allows(tls, _TCP_TLS)
    other = "tcp" if tcp else "other"
    if not _allows(tls, _RDMA_TLS):
        return TransportInfo(other, tls, devices, f"UCX_TLS={tls!r} allows no RDMA transport")
    if not rdma_devs:
        why = (
            f"UCX_NET_DEVICES={devices!r} selects no RDMA device"
            if chosen and "all" not in chosen and _listdir(sys_root + _RDMA)
            else f"no RDMA device visible ({_RDMA} is empty)"
        )
        return TransportInfo(other, tls, devices, why)
    return TransportInfo("rdma", tls, devices)


def device_problems(
    environ: Mapping[str, str] | None = None,
    sys_root: str = "",
    nets: Mapping[str, bool] | None = None,
) -> list[str]:
    """Why UCX cannot use the devices `UCX_NET_DEVICES` names here ([] when it names none or
    they look usable); `nets`: interface -> up (default `net_devices()`)."""
    env = os.environ if environ is None else environ
    devices = env.get("UCX_NET_DEVICES", "").strip()
    if not devices:
        return []
    nets = net_devices() if nets is None else nets
    rdmas = _listdir(sys_root + _RDMA)
    problems = []
    for entry in (d.strip() for d in devices.split(",")):
        name = entry.split(":")[0]
        if not entry or entry == "all":
            continue
        if ":" in entry and name not in rdmas:
            problems.append(f"{entry!r} is not an RDMA device here (have: {rdmas or 'none'})")
        elif ":" not in entry and name not in nets:
            problems.append(f"{entry!r} is not a network device here (have: {sorted(nets)})")
        elif ":" not in entry and not nets[name]:
            problems.append(f"{entry!r} is down (its link is down or it was never set up)")
    return problems
