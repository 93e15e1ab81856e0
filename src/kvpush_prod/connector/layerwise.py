"""Layer-wise push on P (``push.layerwise``): which layers the running forward has computed;
the engine thread's side only (whether a step is pushed layer by layer: ``config.core``).

vLLM calls ``save_kv_layer`` after each attention layer's forward (its KV written into the
cache: on the CPU backend synchronously, before the call). The engine thread records the
layer and, when the run of computed layers from the first one grows, hands the pump a
``LayersReady`` per prompt; it never waits for the pump nor posts anything itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpush_prod.connector.metadata import SendSpec
from kvpush_prod.core import messages

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvpush_prod.connector")


def layer_parts(
    kv_caches: dict[str, torch.Tensor], layout: messages.Layout, device: str
) -> dict[str, int]:
    """Layer name -> its place, when each layer's KV is its own equal share of the layout's
    regions in ``kv_caches``' order (then part ``i`` of a layer-wise WRITE is layer ``i``'s
    regions); {} when layer-wise push cannot be done on this cache (with the reason logged)."""
    n, regions = len(kv_caches), layout.regions
    why = ""
    if device != "cpu":
        # A GPU layer's KV is final only once its stream's kernels ran: posting it from
        # save_kv_layer would need an event per layer (not done yet).
        why = f"the KV cache is on {device}; layer-wise push is done on CPU KV caches only"
    elif n < 2 or len(regions) % n:
        why = f"{n} KV cache tensors over {len(regions)} regions (not one share per layer)"
    else:
        per = len(regions) // n
        for i, t in enumerate(kv_caches.values()):
            start, size = t.data_ptr(), t.numel() * t.element_size()
            if not all(start <= r.base < start + size for r in regions[i * per : (i + 1) * per]):
                why = "layers share KV storage (regions are not one share per layer)"
                break
    if why:
        logger.warning(
            "kvpush: push.layerwise is set but this engine pushes after the forward: %s", why
        )
        return {}
    return {name: i for i, name in enumerate(kv_caches)}


@dataclass
class LayerStep:
    """One forward's layer-wise push: the prompts it completes and the layers done."""

    sends: list[SendSpec]
    on: bool
    done: set[int] = field(default_factory=set)
    ready: int = 0  # layers 0..ready-1 are computed

    def saved(self, index: int) -> int:
        """Layer ``index`` is computed; the new count of layers computed from the first
        (0: no change)."""
        self.done.add(index)
        ready = self.ready
        while ready in self.done:
            ready += 1
        if ready == self.ready:
            return 0
        self.ready = ready
        return ready
