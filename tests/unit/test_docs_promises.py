"""The README's and docs' statements about behaviour name what the code does."""

from __future__ import annotations

import re
from pathlib import Path

from kvrdma import config
from kvrdma.types import Outcome
from tests.unit.vllm_config_cases import VLLM_EXTRA_KEYS

ROOT = Path(__file__).resolve().parents[2]


def _text(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


# every way a read can end other than success that reports all its blocks invalid (CORRUPT
# reports only the affected blocks, and is stated with integrity mode)
_WHOLE_READ_FAILURES = {o.value for o in Outcome} - {Outcome.SUCCESS.value, Outcome.CORRUPT.value}


def test_readme_names_every_reason_a_read_fails() -> None:
    listed = re.search(r"\(`FinishedOutput\.failures`: ([^)]*)\)", _text("README.md"))
    assert listed, "README: no list of failure reasons after `FinishedOutput.failures`"
    assert set(re.findall(r"`(\w+)`", listed[1])) == _WHOLE_READ_FAILURES


def test_failures_md_names_every_reason_a_read_fails() -> None:
    listed = re.search(r"a `FailureReason` in `failures`\s+\(([^)]*)\)", _text("docs/failures.md"))
    assert listed, "docs/failures.md: no list of outcomes after `FailureReason`"
    names = re.findall(r"`(?:Outcome\.)?([A-Z_]+)`", listed[1])
    assert {n.lower() for n in names} == _WHOLE_READ_FAILURES


def test_vllm_md_lists_exactly_kvrdmas_own_extra_keys() -> None:
    own_keys = r"kvrdma's own\s+`kv_connector_extra_config`\s+keys[^:]*:([^.]*)\."
    listed = re.search(own_keys, _text("docs/vllm.md"))
    assert listed, "docs/vllm.md: no list of kvrdma's own kv_connector_extra_config keys"
    own = set(config._EXTRA_CHECKS) - VLLM_EXTRA_KEYS
    assert set(re.findall(r"`(\w+)`", listed[1])) == own


def test_k8s_readme_lists_every_overlay() -> None:
    tree = re.search(r"  overlays/\n((?:    .*\n)+)", _text("deploy/k8s/README.md"))
    assert tree, "deploy/k8s/README.md: no overlays/ in the directory tree"
    listed = set(re.findall(r"^    ([\w-]+)/", tree[1], re.M))
    assert listed == {p.name for p in (ROOT / "deploy/k8s/overlays").iterdir() if p.is_dir()}


def test_curve_secret_is_made_in_the_manifests_namespace() -> None:
    """The pods mount the Secret from their own namespace (the kustomize base's)."""
    namespace = re.search(r"^namespace: (\S+)$", _text("deploy/k8s/base/kustomization.yaml"), re.M)
    assert namespace
    for path in ("README.md", "deploy/k8s/README.md"):
        for command in re.findall(r"kubectl[^`\n]*create secret[^`\n]*", _text(path)):
            assert f"-n {namespace[1]} " in command, f"{path}: `{command}`"
