"""The pure description of an on-receive block permute (SPEC §5), for the planner.

After a READ, a local attention block holds its bytes in *landing order*
`[R sub-blocks][F fragments][C source chunks][chunk in the remote layout]`. A `BlockPermute`
says how to reorder it into the local layout (HND or NHD); `postprocess` executes it with torch,
so that planning never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# dimension labels: R sub-blocks, F fragments, C chunks, H heads/chunk, L layers inside a
# head (vLLM's BHLNC order; 1 otherwise), B tokens, X head bytes
_SRC = {"HND": "RFCHLBX", "NHD": "RFCLBHX"}
_DST = {"HND": "FCHLRBX", "NHD": "FLRBCHX"}


@dataclass(frozen=True)
class BlockPermute:
    """How to reorder one attention region's received blocks into the local layout."""

    region: int
    ratio: int  # R: remote blocks per local block
    fragments: int  # F
    chunks: int  # C: source chunks per fragment
    chunk_heads: int  # H: heads per chunk
    remote_block_size: int  # B: tokens per remote block
    head_bytes: int  # X: head_dim * element size
    remote_layout: str
    local_layout: str
    layers: int = 1  # L: layers inside each head's bytes (BHLNC)

    def _sizes(self) -> dict[str, int]:
        return {
            "R": self.ratio,
            "F": self.fragments,
            "C": self.chunks,
            "H": self.chunk_heads,
            "L": self.layers,
            "B": self.remote_block_size,
            "X": self.head_bytes,
        }

    @property
    def src_shape(self) -> tuple[int, ...]:
        sizes = self._sizes()
        return tuple(sizes[c] for c in _SRC[self.remote_layout])

    @property
    def perm(self) -> tuple[int, ...]:
        src = _SRC[self.remote_layout]
        return tuple(src.index(c) for c in _DST[self.local_layout])

    @property
    def is_identity(self) -> bool:
        """True when the bytes already sit in the local layout (only size-1 dims move)."""
        sizes = self._sizes()
        src = [c for c in _SRC[self.remote_layout] if sizes[c] > 1]
        dst = [c for c in _DST[self.local_layout] if sizes[c] > 1]
        return src == dst

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.src_shape))
