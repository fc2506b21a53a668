"""A read whose landing step raises (integrity check, permute or staging: a device out of
memory, say) fails with every local block invalid, and costs no other read its report: the
decoder's step goes on. Real NIXL agents in this process."""

from __future__ import annotations

import time

import pytest

from kvrdma.integrity import LandedChecksums
from kvrdma.testing.synthetic import CacheSpec, ModelShape, verify
from kvrdma.types import FinishedOutput, Outcome
from tests.integration.worker_pair import local_worker

pytest.importorskip("nixl")

SPEC = CacheSpec(
    ModelShape(num_layers=2, num_kv_heads=4, head_dim=8), "split_kv", "HND", 0, 1, 16, 32
)


@pytest.mark.timeout(60)
def test_a_read_whose_landing_raises_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    on = {"integrity_checksums": True}  # its check is a landing step that can raise
    d, caches = local_worker(SPEC, "D", "kv_consumer", time.monotonic, **on)
    p, _ = local_worker(SPEC, "P", "kv_producer", time.monotonic, **on)
    try:
        d.add_remote({0: p.metadata})
        check, calls = LandedChecksums.bad_blocks, []

        def first_raises(self: LandedChecksums, *args: object) -> list[int]:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("CUDA out of memory (injected)")
            return check(self, *args)

        monkeypatch.setattr(LandedChecksums, "bad_blocks", first_raises)
        for rid, ids in (("a", [1, 2]), ("b", [3, 4])):
            p.hold(rid, ids)
            d.start_read(rid, ids, ids, "P")
        out, end = FinishedOutput(), time.monotonic() + 20.0
        while out.finished_recving != {"a", "b"}:
            assert time.monotonic() < end, f"not both reported: {out}"
            p.get_finished()
            got = d.get_finished()
            out.finished_recving |= got.finished_recving
            out.invalid_block_ids.update(got.invalid_block_ids)
            out.failures.update(got.failures)
        (failed,) = out.failures
        ok = ({"a", "b"} - {failed}).pop()
        assert out.failures[failed].outcome is Outcome.FAILED
        assert "CUDA out of memory" in (out.failures[failed].error or "")
        assert out.invalid_block_ids[failed] == ({1, 2} if failed == "a" else {3, 4})
        ids = [1, 2] if ok == "a" else [3, 4]
        assert ok not in out.invalid_block_ids and verify(SPEC, caches, ids, ids, 16) == 0
    finally:
        d.close()
        p.close()
