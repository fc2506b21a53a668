"""READs between GPU-resident caches (VRAM), skipped without a CUDA device.

The same byte-exact cases as the data-path matrix, with the caches where a serving engine
keeps them: on the GPU. Both sides in VRAM (UCX's cuda transports), one side in VRAM and the
other in host memory, and host staging (`kv_buffer_device: cpu` with caches on the GPU: the
registered buffers are host copies, staged out by the producer and in by the consumer).

The whole matrix also runs on VRAM with `KVRDMA_TEST_DEVICE=cuda` (or `P=cuda,D=cpu`)
set for `tests/integration/test_data_path_matrix.py`.
"""

from __future__ import annotations

import pytest
import torch
from rank_host import HostPool
from test_data_path_matrix import run_case

pytest.importorskip("nixl")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (layout, P tp, D tp, KV heads, block-size ratio, D kv layout): every layout, TP up and
# down, a ratio, NHD on the reader
CASES = [
    ("split_kv", 1, 1, 8, 1, "HND"),
    ("split_kv", 2, 4, 8, 2, "NHD"),
    ("blocks_first", 4, 2, 8, 1, "HND"),
    ("blocks_first", 1, 2, 2, 4, "NHD"),
    ("mla", 1, 4, 1, 2, "HND"),
    ("cross_layer", 4, 1, 8, 2, "HND"),
    ("cross_layer", 1, 2, 8, 1, "NHD"),
    ("mamba", 2, 4, 8, 1, "HND"),
    ("mamba", 4, 1, 2, 1, "NHD"),
]


def _ids(case: tuple[object, ...]) -> str:
    layout, pt, dt, h, r, kvl = case
    return f"{layout}-p{pt}d{dt}-h{h}-r{r}-{kvl}"


@pytest.mark.parametrize(
    "devices",
    [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")],
    ids=["vram-to-vram", "vram-to-dram", "dram-to-vram"],
)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_read_between_devices_byte_exact(
    rank_hosts: HostPool, case: tuple[str, int, int, int, int, str], devices: tuple[str, str]
) -> None:
    run_case(rank_hosts, *case, devices=devices)


@pytest.mark.parametrize("case", CASES[::2], ids=_ids)
def test_host_staging_byte_exact(
    rank_hosts: HostPool, case: tuple[str, int, int, int, int, str]
) -> None:
    run_case(rank_hosts, *case, devices=("cuda", "cuda"), kv_buffer_device="cpu")
