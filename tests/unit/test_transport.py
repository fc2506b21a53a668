"""kvrdma.nixl.transport: what UCX's settings and the visible devices leave, and why a
`UCX_NET_DEVICES` is unusable (pure: a fake /sys and interface table)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrdma.nixl.transport import describe, device_problems, net_devices


@pytest.fixture
def rdma_root(tmp_path: Path) -> str:
    """A /sys with one RDMA device, mlx5_0."""
    (tmp_path / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
    return str(tmp_path)


@pytest.mark.parametrize(
    ("env", "kind", "why"),
    [
        ({}, "rdma", ""),
        ({"UCX_TLS": "rc,tcp"}, "rdma", ""),
        ({"UCX_TLS": "tcp"}, "tcp", "UCX_TLS='tcp' allows no RDMA transport"),
        ({"UCX_TLS": "^rc,ud,dc,rc_x,ud_x,dc_x,rc_v,ud_v,rc_verbs,ud_verbs,rc_mlx5,ud_mlx5,"
                     "dc_mlx5,ib,srd"}, "tcp", "allows no RDMA transport"),
        ({"UCX_TLS": "shm"}, "other", "allows no RDMA transport"),
        ({"UCX_NET_DEVICES": "eth0"}, "tcp", "UCX_NET_DEVICES='eth0' selects no RDMA device"),
        ({"UCX_NET_DEVICES": "mlx5_0:1"}, "rdma", ""),
    ],
)  # fmt: skip
def test_describe_with_an_rdma_device(
    rdma_root: str, env: dict[str, str], kind: str, why: str
) -> None:
    info = describe(env, sys_root=rdma_root)
    assert info.kind == kind
    assert why in info.why and bool(info.why) == bool(why)


def test_describe_without_rdma_devices_is_tcp_and_says_why(tmp_path: Path) -> None:
    """The silent fallback: RDMA asked for, no device to do it with."""
    info = describe({"UCX_TLS": "rc,tcp"}, sys_root=str(tmp_path))
    assert info.kind == "tcp"
    assert info.why == "no RDMA device visible (/sys/class/infiniband is empty)"


def test_device_problems_name_the_device_and_what_exists(rdma_root: str) -> None:
    nets = {"lo": True, "eth0": True, "eth1": False}
    env = {"UCX_NET_DEVICES": "eth0,eth9,eth1,mlx5_1:1,mlx5_0:1"}
    assert device_problems(env, sys_root=rdma_root, nets=nets) == [
        "'eth9' is not a network device here (have: ['eth0', 'eth1', 'lo'])",
        "'eth1' is down (its link is down or it was never set up)",
        "'mlx5_1:1' is not an RDMA device here (have: ['mlx5_0'])",
    ]
    assert device_problems({}, sys_root=rdma_root, nets=nets) == []
    assert device_problems({"UCX_NET_DEVICES": "all"}, sys_root=rdma_root, nets=nets) == []


def test_net_devices_lists_this_namespace_with_loopback_up() -> None:
    assert net_devices().get("lo") is True
