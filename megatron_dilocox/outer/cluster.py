"""How the ranks *inside* one cluster agree (same H, same rank, one metrics row per cluster).

The core never touches Megatron's groups; the glue passes an ``IntraCluster`` built on the cluster's own
world. ``SingleRank`` is the trivial one (a cluster of one process, or the tests).
"""
from __future__ import annotations

from typing import Sequence


class IntraCluster:
    is_writer: bool = True  # the one rank per cluster that writes the metrics row

    def reduce(self, values: Sequence[float], op: str) -> list[float]:
        """Element-wise 'sum' or 'max' of ``values`` over the cluster's ranks (identical result on each)."""
        raise NotImplementedError

    def gather_str(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order."""
        raise NotImplementedError


class SingleRank(IntraCluster):
    def reduce(self, values, op):
        return [float(v) for v in values]

    def gather_str(self, text):
        return [text]


class TorchDistCluster(IntraCluster):
    """Agreement over a torch.distributed group (default: the process's own default world)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self._dist, self._group = dist, group
        self.is_writer = dist.get_rank(group) == 0

    def reduce(self, values, op):
        import torch
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        red = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX}[op]
        self._dist.all_reduce(t, op=red, group=self._group)
        return t.tolist()

    def gather_str(self, text):
        out = [None] * self._dist.get_world_size(self._group)
        self._dist.all_gather_object(out, text, group=self._group)
        return out
