"""The `curve` overlay: both containers of every kvrdma pod get the CURVE keys, read-only."""

from __future__ import annotations

import pytest
from test_k8s_manifests import K8S, _render, container, deployments, env_values, pod_spec

pytestmark = pytest.mark.timeout(180)

MOUNT = "/etc/kvrdma/curve"


def test_curve_overlay_gives_agent_and_engine_the_keys_read_only() -> None:
    objs = list(_render(K8S / "overlays" / "curve", False))
    deps = deployments(objs)
    assert set(deps) == {"prefill", "decode"}
    for role, dep in deps.items():
        spec = pod_spec(dep)
        volumes = {v["name"]: v for v in spec["volumes"]}
        secret = volumes["kvrdma-curve"]["secret"]
        assert secret["secretName"] == "kvrdma-curve", role
        assert secret["defaultMode"] & 0o007 == 0, f"{role}: keys readable by any user"
        agent = container(dep, "kvrdma-agent")
        agent_gid = agent["securityContext"]["runAsGroup"]
        assert spec["securityContext"]["fsGroup"] == agent_gid, f"{role}: agent cannot read"
        for name in ("kvrdma-agent", "engine"):
            c = container(dep, name)
            assert env_values(c)["KVRDMA_CURVE_DIR"] == MOUNT, (role, name)
            mounts = [m for m in c["volumeMounts"] if m["name"] == "kvrdma-curve"]
            assert mounts == [{"name": "kvrdma-curve", "mountPath": MOUNT, "readOnly": True}]
        # the base's own settings survive the patch
        assert env_values(container(dep, "kvrdma-agent"))["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
