"""Bad block ids at `start_read` (real NIXL, one process): each is refused with a
`ConfigError` naming the argument and the value before anything is posted, and a valid read
still works afterwards."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvrdma import descriptors
from kvrdma.config import load_kv_transfer_config
from kvrdma.errors import ConfigError
from kvrdma.testing import synthetic
from kvrdma.testing.synthetic import CacheSpec, ModelShape, fill, make_caches, verify
from kvrdma.worker import Worker

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(120)

SHAPE = ModelShape(num_layers=2, num_kv_heads=4, head_dim=8)
BLOCKS = 16
BAD = [
    [5.5],
    np.array([7.9]),
    [True],
    np.array([True]),
    ["8"],
    ["x"],
    [[8]],
    None,
    [None],
]


def _worker(engine: str, role: str) -> tuple[Worker, CacheSpec, dict[str, torch.Tensor]]:
    spec = CacheSpec(SHAPE, "split_kv", "HND", 0, 1, 16, BLOCKS)
    caches, _ = make_caches(spec)
    fill(spec, caches)
    config = load_kv_transfer_config(
        {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine}, environ={}
    )
    w = Worker.create(config, tp_rank=0, tp_size=1, total_num_kv_heads=SHAPE.num_kv_heads)
    w.register_kv_caches(caches, cache_layout="split_kv", block_size=16)
    return w, spec, caches  # type: ignore[return-value]


def test_bad_block_ids_are_refused_and_a_valid_read_still_works() -> None:
    d, spec, caches = _worker("D", "kv_consumer")
    p, _, _ = _worker("P", "kv_producer")
    try:
        d.add_remote({0: p.metadata})
        p.hold("r", [2, 7, 8])
        for i, bad in enumerate(BAD):
            for which in ("local_block_ids", "remote_block_ids"):
                local, remote = (bad, [2]) if which == "local_block_ids" else ([5], bad)
                with pytest.raises(ConfigError, match=f"^{which}: expected") as exc:
                    d.start_read(f"bad{i}-{which}", local, remote, "P")
                assert repr(bad)[:20] in str(exc.value)
                assert d.consumer is not None and not d.consumer.inflight
        _read_verified(d, p, spec, caches, [2, 7, 8])
    finally:
        d.close()
        p.close()


def _read_verified(
    d: Worker, p: Worker, spec: CacheSpec, caches: dict[str, torch.Tensor], remote: list[int]
) -> None:
    """D reads `remote` of P into its zeroed blocks 0, 1, 2: reported valid, byte-exact."""
    for _, _, view in synthetic.attention_views(spec, caches):
        view[:3] = 0
    d.start_read("r", [0, 1, 2], remote, "P")
    end = time.monotonic() + 30
    out = d.get_finished()
    while "r" not in out.finished_recving:
        assert time.monotonic() < end, "the valid read did not finish"
        p.get_finished()
        out = d.get_finished()
    assert out.invalid_block_ids == {}
    assert verify(spec, caches, [0, 1, 2], remote, 16) == 0


@pytest.mark.parametrize("small", [True, False], ids=["lists", "numpy"])
def test_a_local_block_named_twice_is_refused_and_a_remote_one_read_twice_is_not(
    small: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two remote blocks landing in one local block leave whichever NIXL wrote last: a
    caller's bug, refused before anything is posted; one remote block read into two local
    blocks is a plain copy."""
    if not small:
        monkeypatch.setattr(descriptors, "SMALL_REQUEST", 0)
    d, spec, caches = _worker("D", "kv_consumer")
    p, _, _ = _worker("P", "kv_producer")
    try:
        d.add_remote({0: p.metadata})
        p.hold("r", [7, 7, 8])
        with pytest.raises(ConfigError, match=r"^local_block_ids: .* got \[4\] more than once"):
            d.start_read("dup", [4, 1, 4], [2, 7, 8], "P")
        assert d.consumer is not None and not d.consumer.inflight
        _read_verified(d, p, spec, caches, [7, 7, 8])
    finally:
        d.close()
        p.close()
