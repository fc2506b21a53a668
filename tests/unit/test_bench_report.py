"""The benchmark report (pure logic): tables from result rows, the generated README block,
and the calibration sweep's grid."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import SWEEP, table, target
from benchmarks.report import BEGIN, END, render, write_readme

ROWS = [
    {
        "layout": "split_kv",
        "block_bytes": 16 * 1024,
        "kvrdma": {"gbps": {"median": 7.25}},
        "ratio": {"paired_median": 0.981, "paired_ci95": [0.95, 1.002]},
        "sweep": [1.5, 2.5],
        "ratios": {"a/b": {"paired_median": None}},
    }
]


def test_table_walks_paths_and_formats_cells() -> None:
    t = table(
        "T",
        ROWS,
        "layout: layout; block: block_bytes|size; GB/s: kvrdma.gbps.median; "
        "ratio: ratio|ratio; second: sweep.1; a over b: ratios.a/b|ratio; none: missing",
    )
    assert t["columns"] == ["layout", "block", "GB/s", "ratio", "second", "a over b", "none"]
    assert t["rows"] == [["split_kv", "16 KiB", "7.25", "0.981 [0.950–1.002]", "2.5", "–", "–"]]


def _doc(quick: bool) -> dict[str, object]:
    env = {"git": {"commit": "abc1234", "kvrdma_dirty": False}, "cpu_count": 2}
    env |= {"cpu_model": "cpu", "memory_gib": 8, "python": "3.11", "torch": "2"}
    env |= {"nixl": {"nixl": "1.5"}, "ucx": "1.2"}
    return {
        "benchmark": "bandwidth",
        "quick": quick,
        "created": "2026-01-02T03:04:05",
        "environment": env,
        "targets": [target("kvrdma / best raw", 0.97, ">= 0.95 ratio")],
        "tables": [table("Rows", ROWS, "layout: layout")],
        "summary": ["one line"],
    }


def test_render_marks_quick_runs_and_prints_every_target_and_table() -> None:
    text = render({"bandwidth": _doc(quick=True)})
    assert "abc1234" in text and "not numbers to quote" in text
    assert "| kvrdma / best raw | 0.97 ratio | >= 0.95 | pass | bandwidth |" in text
    assert "| split_kv |" in text and "one line" in text
    assert "not numbers to quote" not in render({"bandwidth": _doc(quick=False)})


def test_write_readme_replaces_only_the_marked_block(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold numbers\n{END}\noutro\n")
    write_readme(readme, "new numbers\n")
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{END}\noutro\n")
    assert "new numbers" in text and "old numbers" not in text


def test_write_readme_without_markers_is_an_error(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        write_readme(readme, "x")
    assert readme.read_text() == "no markers\n"


def test_sweep_is_threads_by_split_by_merging_without_progress_thread() -> None:
    grid = {(s.num_threads, s.split_batch_size, s.merge) for s in SWEEP}
    assert len(grid) == len(SWEEP) == 10
    assert {t for t, _, _ in grid} == {0, 2, 4}
    assert {m for _, _, m in grid} == {"on", "off"}
    assert {(t, s) for t, s, _ in grid if t} == {(t, s) for t in (2, 4) for s in (1, None)}
