"""Layer-wise push on a vLLM producer: the requests whose prefill ends in this step's forward
are written to the decoders that expect them layer by layer, as vLLM saves each layer.

vLLM calls `save_kv_layer` once a layer's kernels are launched, not once they are done. On
a GPU each layer therefore gets an event on the current stream and is written once the event
has completed: checked at each later layer; at the end of the forward (`wait_for_save`)
the stream is waited for before the rest is written. Host caches hold the layer's KV when
the call comes.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from kvrdma.errors import ConfigError

if TYPE_CHECKING:
    from kvrdma.vllm.params import BlockGroups
    from kvrdma.worker import Worker

logger = logging.getLogger(__name__)


class LayerwisePush:
    """One worker rank's layer-wise pushes within a forward pass."""

    def __init__(self, block_ids: Callable[[BlockGroups], list[int]]) -> None:
        self._block_ids = block_ids  # a request's scheduler block groups -> pushed ids
        self._begun: dict[str, None] = {}  # pushed layer by layer in this forward, in order
        self._whole: set[str] = set()  # pushed whole at its end (layer-wise not possible)
        self._fences: collections.deque[tuple[Any, str]] = collections.deque()
        self._device = False  # this forward's caches are on a GPU

    def save(
        self, w: Worker, push_layers: Mapping[str, BlockGroups], layer: str, kv: torch.Tensor
    ) -> None:
        """`layer`'s kernels of this forward are launched: write it once they are done."""
        for rid, groups in push_layers.items():
            if rid not in self._begun and rid not in self._whole:
                self._begin(w, rid, groups)
        if not self._begun:
            return
        if kv.is_cuda:
            self._device = True
            event = torch.cuda.Event()
            event.record()
            self._fences.append((event, layer))
            self._flush(w, wait=False)
        else:
            for rid in self._begun:
                w.push_layer(rid, layer)

    def finish(self, w: Worker, push_layers: Mapping[str, BlockGroups]) -> None:
        """The forward is launched: write what is left once it is done; requests that saw
        no layer (or cannot go layer by layer) go whole."""
        self._flush(w, wait=True)
        rest = [rid for rid in push_layers if rid not in self._begun]
        # what `end_push` and whole pushes write includes state written after the last
        # saved layer (a Mamba layer's): the whole forward must be done
        if self._device or (rest and torch.cuda.is_available() and torch.cuda.is_initialized()):
            torch.cuda.current_stream().synchronize()
        self._device = False
        for rid in self._begun:
            w.end_push(rid)
        for rid in rest:
            w.push(rid, self._block_ids(push_layers[rid]))
        self._begun.clear()
        self._whole.clear()

    def _begin(self, w: Worker, rid: str, groups: BlockGroups) -> None:
        try:
            w.push(rid, self._block_ids(groups), layerwise=True)
        except ConfigError as exc:  # e.g. host-staged caches: copied out whole
            logger.info("request %r is pushed whole: %s", rid, exc)
            self._whole.add(rid)
            return
        self._begun[rid] = None

    def _flush(self, w: Worker, *, wait: bool) -> None:
        """Write the layers whose kernels are done, in order (all of them with `wait`)."""
        while self._fences:
            event, layer = self._fences[0]
            if wait:
                event.synchronize()
            elif not event.query():
                return
            self._fences.popleft()
            for rid in self._begun:
                w.push_layer(rid, layer)
