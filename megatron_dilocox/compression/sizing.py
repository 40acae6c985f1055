"""What a round sends (a mixin of the codec, codec.py): the closed-form bytes of each rank's payload and of its
round at a given rank, and the rank the measured link carries (the link budget, outer/plan.py).

The header's fields are here because the header is part of every round's bytes: 13 float64 values, all-gathered
(with a tag when --dilocox-payload-auth). A round at rank SPARSE is the sparse exchange's (compression/sparse.py),
at rank 0 every matrix goes whole in phase 1, at rank r > 0 the low-rank factors (one phase with the local basis,
two with the shared one).
"""
from __future__ import annotations

from typing import Optional

from megatron_dilocox.compression import adaptive
from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.collective import allgather_bytes, allreduce_bytes, dense_allreduce_bytes
from megatron_dilocox.compression.quantize import payload_bytes
from megatron_dilocox.compression.scatter import sent_bytes

HEADER_FIELDS = ("magic", "round", "layout", "rank", "ok", "comm_seconds", "step_seconds",
                 "seconds_per_byte", "tokens", "state_hash", "steps", "end_request", "plan_left")
HEADER_BYTES = 8 * len(HEADER_FIELDS)
SPARSE = -1  # the "rank" of a sparse round (--dilocox-sparse-k): the header's rank field, the plan's, the checkpoint's


class RoundSizing:
    """Needs the codec's cfg, groups, whole, numels, rank, sparse and scheme_at (averaging.py)."""

    def payload_sizes(self, rank: Optional[int] = None) -> tuple[int, int]:
        """Bytes this rank contributes to phase 1 and phase 2 at ``rank`` (closed form; rank 0: every matrix
        sent whole, in phase 1; SPARSE: the sparse payload)."""
        r = self.rank if rank is None else rank
        if r == SPARSE:
            return self.sparse.payload_bytes, 0
        bits, block = self.cfg.quant_bits, self.cfg.quant_block_size
        whole = sum(self.numels[i] for i in self.whole)
        if r == 0:
            return sum(payload_bytes(len(g.members) * g.rows * g.cols, bits, block) for g in self.groups) + (
                payload_bytes(whole, bits, block) if whole else 0), 0
        p1 = sum(payload_bytes(len(g.members) * g.rows * r, bits, block) for g in self.groups)
        p1 += payload_bytes(whole, bits, block) if whole else 0
        p2 = sum(payload_bytes(len(g.members) * g.cols * r, bits, block) for g in self.groups)
        p2 += 4 * (r + 1) if self.groups else 0  # fp32 energy statistics
        return p1, p2

    @property
    def one_phase(self) -> bool:
        """The local basis with matrices to factor: one all-gather of P, Q' and the whole tensors, in every
        precision (the shared basis, or nothing low-rank, sends two phases and all-reduces fp32)."""
        return self._one_phase_at(self.rank)

    def _one_phase_at(self, rank: int) -> bool:
        return rank == SPARSE or (bool(self.groups) and self.cfg.lowrank_basis == "local" and rank != 0)

    def round_bytes(self, rank: int, clusters: int, member: Optional[int] = None) -> int:
        """Bytes this rank sends in one round at ``rank`` (closed form: the header, then the payload messages by
        the scheme ``scheme_at`` picks, a tag on each when --dilocox-payload-auth; rank 0: phase 1 alone).
        ``member``: this cluster's place in the group (reduce-scatter chunks differ by a block; default its id)."""
        if clusters <= 1:
            return 0
        tag = TAG_BYTES if self.cfg.payload_auth else 0
        member = min(self.cfg.cluster_id if member is None else member, clusters - 1)
        header = allgather_bytes(HEADER_BYTES + tag, clusters)
        p1, p2 = self.payload_sizes(rank)
        if self._one_phase_at(rank):
            return header + allgather_bytes(p1 + p2 + tag, clusters)
        scheme = self.scheme_at(clusters, bool(tag))
        n1, n2 = self._piece_numels(rank)
        bits, block = self.cfg.quant_bits, self.cfg.quant_block_size
        if scheme == "reduce-scatter":
            total = header + sent_bytes(n1, clusters, member, bits, block, bool(tag))
            if n2:  # phase 2: Q' by reduce-scatter, the energy statistics (fp32) by all-gather
                total += sent_bytes(n2, clusters, member, bits, block, bool(tag)) + allgather_bytes(p2 - sum(
                    payload_bytes(n, bits, block) for n in n2) + tag, clusters)
            return total
        phase = allreduce_bytes if bits == 32 else (lambda n, c: allgather_bytes(n + tag, c))
        return header + phase(p1, clusters) + (phase(p2, clusters) if p2 else 0)

    def _piece_numels(self, rank: int) -> tuple[list, list]:
        """The values of each piece phase 1 and phase 2 send (the two-phase path), as ``exchange`` cuts them."""
        whole = [sum(self.numels[i] for i in self.whole)] if self.whole else []
        if rank == 0:
            return [len(g.members) * g.rows * g.cols for g in self.groups] + whole, []
        return ([len(g.members) * g.rows * rank for g in self.groups] + whole,
                [len(g.members) * g.cols * rank for g in self.groups])

    def _rank_cap(self, clusters: int, budget: bool = True) -> int:
        """Adaptive rank's ceiling: --dilocox-lowrank-rank-max, each matrix's min(rows, cols) when that flag is
        left to its default, and (``budget``) the largest rank whose round stays within dense fp32 /
        --dilocox-min-compression (never below the initial rank: an explicit rank is the user's choice)."""
        cap = self.cfg.resolved_rank_max
        if self.cfg.lowrank_rank_max is None and self.groups:
            cap = min(cap, min(min(g.rows, g.cols) for g in self.groups))
        if clusters > 1 and self.groups and budget:
            budget = dense_allreduce_bytes(sum(self.numels), clusters) / self.cfg.min_compression
            while cap > self.rank and self.round_bytes(cap, clusters) > budget:
                cap -= 1
        return max(cap, self.rank)

    def link_rank(self, seconds: float, seconds_per_byte: float, clusters: int) -> int:
        """--dilocox-link-budget: the rank (0: whole) whose round the measured link carries in ``seconds``; under
        --dilocox-sparse-k whole when the link carries it or when the sparse round would send no fewer bytes (it
        is all-gathered: from (C−1)·payload against about 2(C−1)/C for a reduce-scatter), else SPARSE. Sized as
        member 0 of the group (a reduce-scatter's chunks differ by a block between members), so every cluster
        decides alike from the same header figures."""
        if self.sparse is not None:
            whole = self.round_bytes(0, clusters, member=0)
            fits = whole * seconds_per_byte <= seconds or self.round_bytes(SPARSE, clusters, member=0) >= whole
            return 0 if fits else SPARSE
        return adaptive.choose_rank_for_link(lambda r: self.round_bytes(r, clusters, member=0), seconds,
                                             seconds_per_byte, self.rank, self.cfg.resolved_rank_min,
                                             self._rank_cap(clusters, budget=False))
