"""The two collectives a round needs, with exact byte accounting.

The codec talks to this small interface instead of torch.distributed so that it runs unchanged on a
real inter-cluster gloo group (``topology.InterClusterGroup``) or alone (``SoloCollective``, C=1).

Bytes are counted per call with the ring-algorithm formulas (what each rank puts on the wire):
all-gather of S bytes over C ranks sends and receives (C-1)*S; all-reduce of S bytes sends and
receives floor(2*(C-1)*S/C). ``dense_allreduce_bytes`` is the latter for fp32, the baseline that
plain data parallelism would pay for the same tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def allgather_bytes(payload_bytes: int, size: int) -> int:
    return (size - 1) * payload_bytes


def allreduce_bytes(payload_bytes: int, size: int) -> int:
    return 2 * (size - 1) * payload_bytes // size


def dense_allreduce_bytes(numel: int, size: int) -> int:
    return allreduce_bytes(4 * numel, size)


@dataclass
class ByteCounter:
    sent: int = 0
    received: int = 0
    seconds: float = 0.0  # wall time inside the collectives (the wire, and any wait for a peer)

    def add(self, n: int):
        self.sent += n
        self.received += n


class Collective:
    """Interface: ``rank``/``size`` in the inter-cluster group, and the two collectives."""

    rank: int = 0
    size: int = 1

    def __init__(self):
        self.counter = ByteCounter()

    def all_gather(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``buf`` (all the same size), in member order."""
        self.counter.add(allgather_bytes(buf.numel() * buf.element_size(), self.size))
        t0 = time.perf_counter()
        try:
            return self._all_gather(buf)
        finally:
            self.counter.seconds += time.perf_counter() - t0

    def all_reduce_sum(self, buf: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over members; bitwise identical on every member."""
        self.counter.add(allreduce_bytes(buf.numel() * buf.element_size(), self.size))
        t0 = time.perf_counter()
        try:
            return self._all_reduce_sum(buf)
        finally:
            self.counter.seconds += time.perf_counter() - t0

    def broadcast(self, buf: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``buf`` of member ``src`` everywhere (the anchor at start; a repair, outer/sync.py). Counted as the
        source sending one copy to each other member."""
        n = buf.numel() * buf.element_size()
        if self.rank == src:
            self.counter.sent += (self.size - 1) * n
        else:
            self.counter.received += n
        t0 = time.perf_counter()
        try:
            return self._broadcast(buf, src)
        finally:
            self.counter.seconds += time.perf_counter() - t0

    # membership (a fixed group: every round commits; InterClusterGroup overrides these)
    elastic = False
    joining = False

    def settle(self, round_idx: int, outcome: str, attempt_end: float) -> dict:
        """The outcome every member agrees on for this round's exchange (see net/membership.py)."""
        if outcome != "ok":
            raise RuntimeError(f"DiLoCoX round {round_idx}: exchange failed ({outcome}) in a fixed group")
        return {"action": "commit", "admitted": [], "lost": [], "reason": ""}

    def cluster_of(self, rank: int) -> int:
        return rank

    def close(self):
        pass

    def _all_gather(self, buf):
        raise NotImplementedError

    def _all_reduce_sum(self, buf):
        raise NotImplementedError

    def _broadcast(self, buf, src):
        raise NotImplementedError


class SoloCollective(Collective):
    """A group of one (C=1): collectives are identities and cost no bytes."""

    def _all_gather(self, buf):
        return [buf]

    def _all_reduce_sum(self, buf):
        return buf

    def _broadcast(self, buf, src):
        return buf
