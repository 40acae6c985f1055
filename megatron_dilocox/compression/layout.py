"""How a model's tensors map onto the codec's slabs, and when a slab's memory may be reused.

Same-shape matrices at least --dilocox-lowrank-min-dim on both sides are compressed together as one
[B, rows, cols] slab; the rest (1-D tensors, small matrices) go whole, concatenated into one flat slab; under
--dilocox-sparse-k every tensor does (compression/sparse.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError


@dataclass
class Group:
    """Same-shape matrices compressed together as a batch."""
    rows: int
    cols: int
    members: list = field(default_factory=list)


def split_layout(shapes: Sequence[torch.Size], config: DiLoCoXConfig) -> tuple[list[Group], list[int]]:
    """(low-rank groups of same-shape matrices, indices of the tensors sent whole). Raises the config error
    for a rank above a matrix's min(rows, cols): the seam calls it before the rendezvous, so a bad rank is
    reported at once rather than after waiting for the other clusters."""
    by_shape: dict = {}
    whole: list[int] = []
    for i, s in enumerate(torch.Size(s) for s in shapes):
        rows, cols = (s[0], s.numel() // s[0]) if len(s) >= 2 and s[0] > 0 else (0, 0)
        if config.lowrank and not config.sparse_k and min(rows, cols) >= config.lowrank_min_dim:
            explicit = config.lowrank_rank if config.lowrank_rank_max is None else config.lowrank_rank_max
            if explicit > min(rows, cols):
                flag = "--dilocox-lowrank-rank" if config.lowrank_rank_max is None else "--dilocox-lowrank-rank-max"
                raise DiLoCoXConfigError(
                    f"{flag}: rank {explicit} exceeds min(rows, cols) = "
                    f"{min(rows, cols)} of tensor {i} with shape {tuple(s)}; lower the rank or raise "
                    f"--dilocox-lowrank-min-dim above {min(rows, cols)}")
            by_shape.setdefault((rows, cols), Group(rows, cols)).members.append(i)
        else:
            whole.append(i)
    return list(by_shape.values()), whole


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private but stable (torch._inductor uses it)


def _storage_refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


_LONE = _storage_refs(torch.empty(1)) if _use_count else None  # what a tensor nothing else aliases counts


def unaliased(t: torch.Tensor) -> bool:
    """No other tensor (view, snapshot alias, caller's result) shares ``t``'s memory."""
    return _LONE is not None and _storage_refs(t) == _LONE
