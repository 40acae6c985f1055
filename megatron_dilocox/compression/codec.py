"""One round's exchange of pseudo-gradients: compress, average over clusters, decompress.

Per rank the codec owns the error-feedback buffers e and the warm-start Q of every low-rank group.
``exchange`` turns this rank's pseudo-gradient δ into the cluster-average Δ:

    M = δ + e
    header all-gather      (round, layout, rank, ok flag, timings, tokens, state hash: refuse mismatches
                            before any payload)
    phase 1: P = M Q  (low-rank groups) and the small / 1-D tensors whole, quantized, averaged in fp32
    P^ = orth(mean P)                                  (identical on every cluster)
    phase 2: Q' = M^T P^, quantized, averaged in fp32  (+ energy statistics for adaptive rank)
    Δ = P^ mean(Q')^T  and  mean(whole);   e = M - (what this cluster actually transmitted)

Under ``--dilocox-sparse-k`` every tensor is in the one flat slab, and a round at rank SPARSE is
compression/sparse.py's: one all-gather of each cluster's top-k entries, summed in member order; under the link budget the other rounds go
whole (rank 0), on the same slab and the same e (outer/plan.py chooses, docs/algorithm.md#sparse-exchange).

At rank 0 (``--dilocox-link-budget`` chose it: the link carries the matrices whole) every slab is sent whole,
quantized, in phase 1 alone; Q is kept as the warm start for when a rank returns.

Quantized payloads (4/8/16 bits) travel by all-gather and are summed locally in fp32 in cluster order, so
no low-precision sum can overflow and every cluster gets bitwise the same Δ; from three clusters on, those that
can be summed chunk-wise go by reduce-scatter + all-gather instead (averaging.py, scatter.py); fp32 payloads
use a ring all-reduce, or the reduce-scatter when messages are authenticated (auth.py: every message tagged).

Weights: the average is Σ_c w_c x_c / Σ_c w_c, w_c cluster c's tokens per inner step in the round (its header's
tokens over its steps): a pseudo-gradient already grows with the steps that made it, so weighing it by its steps
again would count a fast site's steps twice; one token, one vote (docs/algorithm.md#weights). Every cluster
computes the scales C·w_c/Σw from the same headers; when all weights are equal (sites of one batch size, whatever
their steps) no scale is applied at all, which keeps that case bitwise the plain mean. The header also carries each cluster's
hash of its outer state at the round's launch (outer/repair.py compares them and repairs a site that differs).

Error feedback is local (Vogels et al., 2019): the decompression of
this cluster's own P^ Q'^T, so the running sum of transmitted updates equals the running sum of true
updates minus the current e.

Memory traffic. A round is bound by passes over M-sized memory, so e, M and Δ live in "slabs" (one
[B, rows, cols] tensor per same-shape group, one flat tensor for the whole tensors): M = δ + e is written
straight into a slab and e is computed in place in it, norms are row-wise reductions without temporaries,
and the slabs -- three fp32 copies of the tensors (e, a spare for the next M, the last Δ), allocated at
construction -- are reused every round (a fresh M-sized tensor costs a page fault per 4 KiB on CPU).
A slab is reused only while nothing outside the codec references its memory (a snapshot, a view from
``error``, a caller still holding the last Δ); otherwise a new one is allocated.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_dilocox.compression import adaptive, lowrank
from megatron_dilocox.compression.averaging import ClusterAverage, PayloadError
from megatron_dilocox.compression.collective import Collective, dense_allreduce_bytes
from megatron_dilocox.compression.layout import split_layout, unaliased
from megatron_dilocox.compression.local_basis import LocalBasisExchange
from megatron_dilocox.compression.norms import EXACT_IN_FP32 as _EXACT_IN_FP32, finite as _finite, sumsq as _sumsq
from megatron_dilocox.compression.quantize import bytes_as
# (HEADER_BYTES: the header's size, which callers take from the codec)
from megatron_dilocox.compression.sizing import HEADER_BYTES, HEADER_FIELDS, SPARSE, RoundSizing  # noqa: F401
from megatron_dilocox.compression.sparse import SparseExchange, SparsePlan
from megatron_dilocox.config import DiLoCoXConfig

MAGIC = 0x44694C6F  # "DiLo"
_F = {name: i for i, name in enumerate(HEADER_FIELDS)}


@dataclass
class ExchangeResult:
    round: int
    deltas: Optional[list]  # averaged pseudo-gradient per tensor, None when the round was refused
    status: str  # "applied" or "refused: <why>"
    num_clusters: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_dense_fp32: int = 0
    compression_rel_error: float = 0.0
    pseudo_grad_norm: float = 0.0
    rank: int = 0
    next_rank: int = 0
    peer_comm_seconds: float = 0.0  # max over clusters of the previous round's transfer time
    peer_step_seconds: float = 0.0  # max over clusters of the mean inner-step time
    peer_seconds_per_byte: float = 0.0  # max over clusters of the link's measured seconds per payload byte
    wire_seconds: float = 0.0  # time in the payload collectives (after the header): the link's share of the round
    wire_bytes: int = 0  # bytes sent by those collectives
    comm_seconds: float = 0.0  # wall time of this exchange (set by the caller that timed it)
    peer_wait_seconds: float = 0.0  # of it, until the header all-gather returned: mostly the wait for the last cluster
    transfer_seconds: float = 0.0  # the committed attempt without that wait (what adaptive H should hide)
    local_ok: bool = True
    lost: list = field(default_factory=list)  # clusters lost in this round (status "stopped: ...")
    launched_at: int = 0  # the iteration whose boundary launched this round
    launched_tokens: float = 0.0  # the tokens of every applied round, all sites, when it was launched
    tokens: float = 0.0  # this cluster's tokens in the round (the run's clock counts them)
    steps: int = 0  # and the inner steps they took
    member_tokens: list = field(default_factory=list)  # each member's tokens in the round (header; group order)
    end_requested: bool = False  # a member asked the run to end (header; outer/clock.py)
    member_plans_left: list = field(default_factory=list)  # each member's planned tokens not yet applied (header; clock.py)
    member_index: int = 0  # this cluster's place in the group (and in the lists below) at the exchange
    member_step_seconds: list = field(default_factory=list)  # each member's inner-step time (header)
    weights: list = field(default_factory=list)  # each member's tokens per step: what the round was averaged with
    state_hashes: list = field(default_factory=list)  # each member's outer-state hash at launch (group order)
    repaired: list = field(default_factory=list)  # clusters whose outer state was replaced (outer/sync.py)
    repair: Optional[list] = None  # (this cluster, when repaired) the reference's φ and momentum, flat


class PseudoGradientCodec(RoundSizing, LocalBasisExchange, SparseExchange, ClusterAverage):
    def __init__(self, shapes: Sequence[torch.Size], config: DiLoCoXConfig, device="cpu"):
        self.cfg = config
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.device = torch.device(device)
        self.rank = SPARSE if config.sparse_k else config.lowrank_rank
        self.groups, self.whole = split_layout(self.shapes, config)
        if config.sparse_k:  # (every tensor whole, in one flat slab: split_layout leaves no low-rank group)
            self.sparse = SparsePlan(self.numels, config.sparse_k, config.sparse_chunk, self.device)
        # slabs: groups in order, then (if any) the whole tensors concatenated
        slab_shapes = [(len(g.members), g.rows, g.cols) for g in self.groups]
        slab_shapes += [(sum(self.numels[i] for i in self.whole),)] if self.whole else []
        # allocated and paged in once, here: no round (the first included) allocates M-sized memory
        self._err = [torch.zeros(s, dtype=torch.float32, device=self.device) for s in slab_shapes]
        self._spare = [torch.zeros_like(e) for e in self._err]  # slabs free for the next M (last round's e)
        self._out = [torch.zeros_like(e) for e in self._err[:len(self.groups)]]  # last round's Δ slabs
        self.q = [lowrank.init_q(len(g.members), g.cols, self.rank, config.seed, gi, self.device)
                  for gi, g in enumerate(self.groups)]
        self.layout_hash = self._layout_hash()
        self._scales: Optional[list] = None  # this round's C·w_c/Σw (None: equal weights)
        self._round, self.fragment = 0, 0  # (what this round's messages are tagged with; streaming sets fragment)
        self.rank_cap = self._rank_cap(config.num_clusters)

    # ---------------------------------------------------------------------------------- layout
    def _layout_hash(self) -> int:
        text = repr((self.shapes, self.cfg.lowrank, self.cfg.lowrank_min_dim, self.cfg.quant_bits,
                     self.cfg.quant_block_size)  # the shared basis keeps the hash it had before bases existed
                    + ((self.cfg.lowrank_basis,) if self.cfg.lowrank_basis != "shared" else ())
                    + (("sparse", self.cfg.sparse_k, self.cfg.sparse_chunk) if self.cfg.sparse_k else ()))
        return int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)  # 48 bits: exact in float64

    def set_rank(self, rank: int, round_idx: int):
        """Rank 0 sends the matrices whole and keeps Q as it is, the warm start for when the rank returns; SPARSE
        (under --dilocox-sparse-k) sends the sparse payload of the same slab, e carried across."""
        self._check_rank(rank)
        if rank != self.rank:
            if rank > 0:
                self.q = [lowrank.resize_q(q, rank, self.cfg.seed, gi, round_idx) for gi, q in enumerate(self.q)]
            self.rank = rank

    def _check_rank(self, rank: int):
        if rank == SPARSE and self.sparse is None or rank != SPARSE and rank < 0:
            raise ValueError(f"rank {rank}: a sparse round needs --dilocox-sparse-k, and no other rank is negative")

    def _views(self, slabs) -> list:
        """Per-tensor views (parameter order) of slabs laid out as ``self._err``."""
        out = [None] * len(self.shapes)
        for g, slab in zip(self.groups, slabs):
            for b, i in enumerate(g.members):
                out[i] = slab[b].view(self.shapes[i])
        if self.whole:
            for i, piece in zip(self.whole, slabs[-1].split([self.numels[i] for i in self.whole])):
                out[i] = piece.view(self.shapes[i])
        return out

    def _slab(self, pool: list, k: int, shape) -> torch.Tensor:
        """pool[k] when nothing outside the codec references its memory, else a new tensor."""
        old = pool[k] if k < len(pool) else None
        if old is not None and old.shape == shape and unaliased(old):
            return old
        return torch.empty(shape, dtype=torch.float32, device=self.device)

    # ---------------------------------------------------------------------------------- exchange
    def exchange(self, deltas: Sequence[torch.Tensor], coll: Collective, round_idx: int, *args, **kwargs
                 ) -> ExchangeResult:
        """``_exchange`` with the messages' authentication refusals deferred to its end (collective.py): a
        cluster that received a forged message still takes part in the rest of the round, then raises
        ForgedPayload; the caller applies nothing (outer/sync.py)."""
        with coll.deferred_refusals():
            return self._exchange(deltas, coll, round_idx, *args, **kwargs)

    def _exchange(self, deltas: Sequence[torch.Tensor], coll: Collective, round_idx: int,
                  comm_seconds_prev: float = 0.0, step_seconds: float = 0.0,
                  seconds_per_byte_prev: float = 0.0, link_steps: float = 0.0, tokens: float = 1.0,
                  state_hash: int = 0, steps: int = 1, end_request: bool = False, plan_left: float = 0.0) -> ExchangeResult:
        """One round: compress M = δ + e, average over the clusters, keep the new e. ``link_steps`` > 0 (round 1
        under the link budget): first set the rank to what the link carries in that many steps, from the
        header's figures (the same on every cluster, so all decide alike). ``tokens``, ``steps``: this cluster's
        tokens and inner steps in the round (its weight in the average is their ratio); ``end_request``: it asks
        the run to end and ``plan_left``: its planned tokens not yet in an applied round (outer/clock.py); ``state_hash``: its outer state's hash (< 2^48), passed
        through to ``result.state_hashes``."""
        t_enter = time.perf_counter()
        C = coll.size
        sent0, recv0 = coll.counter.sent, coll.counter.received
        M = [self._slab(self._spare, k, e.shape) for k, e in enumerate(self._err)]
        for d, s, e, m in zip(deltas, self.shapes, self.error, self._views(M)):
            d = d.detach().to(self.device)
            # M = δ + β e (β = 1: classic error feedback; 1.0 * e is exact, so that case is bitwise δ + e)
            torch.add((d if d.dtype in _EXACT_IN_FP32 else d.float()).reshape(s), e, alpha=self.cfg.error_decay, out=m)
        m_sq = [_sumsq(m) for m in M]  # ||M||² per slab: energy total, rel. error, and the finiteness check
        local_ok = all(map(math.isfinite, m_sq)) or all(bool(torch.isfinite(m).all()) for m in M)
        result = ExchangeResult(round=round_idx, deltas=None, status="applied", num_clusters=C,
                                rank=self.rank, next_rank=self.rank, local_ok=local_ok,
                                bytes_dense_fp32=dense_allreduce_bytes(sum(self.numels), C),
                                pseudo_grad_norm=math.sqrt(sum(_sumsq(d) for d in deltas)))

        def finish(status: Optional[str] = None) -> ExchangeResult:
            result.bytes_sent = coll.counter.sent - sent0
            result.bytes_received = coll.counter.received - recv0
            result.wire_seconds, result.wire_bytes = coll.counter.seconds - wire0[0], coll.counter.sent - wire0[1]
            if status is not None:
                result.status, result.deltas = status, None
                if local_ok:  # keep this round's progress for the next round instead of losing it
                    self._spare, self._err = self._err, M
            return result

        header = torch.tensor([MAGIC, round_idx, self.layout_hash, self.rank, float(local_ok),
                               comm_seconds_prev, step_seconds, seconds_per_byte_prev, tokens, state_hash,
                               float(steps), float(end_request), float(plan_left)],
                              dtype=torch.float64)
        self._round = round_idx
        # (the header's tag leaves the round out: the header carries it, and a peer at another round is refused
        # by _check_headers saying so; every payload's tag names the round)
        headers = [bytes_as(h, torch.float64) for h in coll.all_gather(header.view(torch.uint8),
                                                                          (0, self.fragment, "header"))]
        result.peer_wait_seconds = time.perf_counter() - t_enter
        wire0 = (coll.counter.seconds, coll.counter.sent)
        self._check_headers(headers, header, coll)
        result.peer_comm_seconds = max(float(h[5]) for h in headers)
        result.peer_step_seconds = max(float(h[6]) for h in headers)
        result.peer_seconds_per_byte = max(float(h[7]) for h in headers)
        result.tokens, result.steps, result.member_tokens = float(tokens), int(steps), [float(h[8]) for h in headers]
        per_step = self.cfg.token_weight_unit == "step"  # one token, one vote (docs/algorithm.md#weights)
        result.weights = [float(h[_F["tokens"]]) / (max(float(h[_F["steps"]]), 1.0) if per_step else 1.0)
                          for h in headers]
        result.end_requested = any(h[_F["end_request"]] != 0 for h in headers)
        result.member_plans_left = [float(h[_F["plan_left"]]) for h in headers]
        result.member_index, result.member_step_seconds = coll.rank, [float(h[6]) for h in headers]
        result.state_hashes = [int(h[9]) for h in headers]
        self._scales = self._weight_scales(result.weights)
        if link_steps > 0 and (self.groups or self.sparse is not None) and result.peer_seconds_per_byte > 0 \
                and result.peer_step_seconds > 0:
            self.set_rank(self.link_rank(link_steps * result.peer_step_seconds, result.peer_seconds_per_byte, C),
                          round_idx)
            result.rank = result.next_rank = self.rank
        bad = [c for c, h in enumerate(headers) if h[4] != 1.0]
        if bad:
            return finish(f"refused: non-finite pseudo-gradient from cluster(s) {bad}")

        G = len(self.groups) if self.rank > 0 else 0  # rank 0: the matrices travel whole, like the small tensors
        if self.rank == SPARSE:
            refused, out, e_sq = self._exchange_sparse(M, coll)
            return finish(refused) if refused else self._commit(M, out, e_sq, m_sq, result, finish)
        if self.one_phase:
            refused, out, e_sq = self._exchange_local(M, m_sq, coll, result)
            if refused:
                return finish(refused)
            return self._commit(M, out, e_sq, m_sq, result, finish)
        # factors travel column by column ([B, r, n]): a column's entries share a scale (its singular
        # value), so quantization blocks never mix a large column with a small one
        pieces1 = [torch.bmm(m, q).transpose(1, 2) for m, q in zip(M[:G], self.q)]
        pieces1 += M[G:]  # the whole tensors, already one flat slab (at rank 0 also the matrix slabs)
        means1, sent1, _, carry1 = self._reduce(pieces1, [], coll, "phase1")
        if not all(map(_finite, means1)):
            return finish("refused: non-finite values in the averaged phase-1 payload")

        out, e_sq = [], [None] * len(M)  # e_sq: ||e||² per slab, for the relative error
        if G:
            p_hat = [lowrank.orthonormalize(s.transpose(1, 2)) for s in means1[:G]]
            # Q'^T = P^^T M ([B, r, cols]: the wire layout; reads M row-major, faster than M^T P^)
            qt_local = [torch.bmm(p.transpose(1, 2), m) for m, p in zip(M, p_hat)]
            cum = sum(lowrank.cumulative_energy(q.transpose(1, 2)) for q in qt_local)
            stats = torch.cat([cum, torch.tensor([sum(m_sq[:G])])]).float()
            q_mean, sent2, (stat_sum,), _ = self._reduce(qt_local, [stats], coll, "phase2")  # [B, r, cols]
            if not all(map(_finite, q_mean)):
                return finish("refused: non-finite values in the averaged phase-2 payload")
            for k, (m, p, qm, qs) in enumerate(zip(M, p_hat, q_mean, sent2)):
                out.append(torch.bmm(p, qm, out=self._slab(self._out, k, m.shape)))  # Δ = P^ mean(Q')^T
                m.baddbmm_(p, qs, alpha=-1)  # e = M - P^ Q'_sent^T, in place: M is not needed after this
                e_sq[k] = _residual_sq(m_sq[k], p, qt_local[k], qs)
                if not e_sq[k] >= 1e-2 * m_sq[k]:  # closed form lost to cancellation (or NaN): measure
                    e_sq[k] = _sumsq(m)
            self.q = [q.transpose(1, 2) for q in q_mean]  # warm start: the shared averaged Q, [B, cols, r]
            if self.cfg.adaptive_rank:
                result.next_rank = adaptive.choose_rank(
                    stat_sum[:-1].tolist(), float(stat_sum[-1]), self.rank, self.cfg.energy_threshold,
                    self.cfg.resolved_rank_min, self.rank_cap)
        for k in range(G, len(M)):  # the slabs sent whole
            out.append(self._slab(self._out, k, M[k].shape).copy_(means1[k]) if k < len(self.groups) else means1[k])
            M[k].sub_(sent1[k])  # e = M - what this cluster transmitted
            if carry1 is not None:  # (reduce-scatter: the owner's requantization error of its chunks)
                M[k].add_(carry1[k])
            e_sq[k] = _sumsq(M[k])

        return self._commit(M, out, e_sq, m_sq, result, finish)

    def _commit(self, M, out, e_sq, m_sq, result, finish) -> ExchangeResult:
        """The round is applied: M now holds e, ``out`` holds Δ (slabs)."""
        self._spare, self._err, self._out = self._err, M, out[:len(self.groups)]
        result.compression_rel_error = math.sqrt(sum(e_sq)) / max(math.sqrt(sum(m_sq)), 1e-30)
        result.deltas = self._views(out)
        return finish()

    def _check_headers(self, headers, mine, coll: Collective):
        my_rank = coll.cluster_of(coll.rank)
        for g, h in enumerate(headers):
            c = coll.cluster_of(g)
            if h.numel() != len(HEADER_FIELDS):
                raise PayloadError(f"cluster {c} sent a header of {h.numel()} values, expected {len(HEADER_FIELDS)}")
            for k, name in enumerate(HEADER_FIELDS[:4]):
                if h[k] != mine[k]:
                    what = {"magic": "is not a DiLoCoX peer (bad magic)",
                            "round": f"is at round {int(h[k])}, this cluster (#{my_rank}) at {int(mine[k])}",
                            "layout": "has a different parameter layout or compression settings "
                                      "(shapes, --dilocox-quant-bits/-block-size, --dilocox-lowrank*, "
                                      "--dilocox-sparse-*)",
                            "rank": f"sends {_round_kind(h[k])}, this cluster (#{my_rank}) "
                                    f"{_round_kind(mine[k])}"}[name]
                    raise PayloadError(f"refused payload: cluster {c} {what}; nothing was applied")
            if not (math.isfinite(float(h[8])) and float(h[8]) > 0):
                raise PayloadError(f"refused payload: cluster {c} reports {float(h[8])} tokens for its round "
                                   f"(a weight must be positive); nothing was applied")

    # ---------------------------------------------------------------------------------- state
    @property
    def error(self) -> list:
        """Error feedback per tensor: views into the codec's slabs, unchanged while they are alive (exchange
        never writes into memory something outside the codec references). Assign a list to replace e."""
        return self._views(self._err)

    @error.setter
    def error(self, tensors):
        tensors = [t.detach().to(self.device, torch.float32).reshape(s) for t, s in zip(tensors, self.shapes)]
        slabs = [torch.stack([tensors[i].reshape(g.rows, g.cols) for i in g.members]) for g in self.groups]
        self._err = slabs + ([torch.cat([tensors[i].reshape(-1) for i in self.whole])] if self.whole else [])

    def snapshot(self):
        """What an exchange may change, taken before an attempt so that a round the clusters did not commit
        leaves no trace: aliases of the error slabs (no copy; while they live, exchange never writes into
        that memory and replaces the q list rather than writing into it)."""
        return [e.detach() for e in self._err], self.q, self.rank

    def restore(self, snap):
        err, self.q, self.rank = snap
        self._err = list(err)

    def state_dict(self) -> dict:
        return {"error": [e.clone() for e in self.error], "q": [q.clone() for q in self.q], "rank": self.rank}

    def load_state_dict(self, state: dict):
        if len(state["error"]) != len(self.shapes) or len(state["q"]) != len(self.q):
            raise ValueError("DiLoCoX codec state does not match this model's parameter layout")
        rank = int(state["rank"])
        if self.sparse is not None and (rank > 0 or not self.cfg.link_sizes_rounds):
            rank = SPARSE  # (a checkpoint of a sparse run from before whole rounds, which stored the low-rank rank)
        self._check_rank(rank)
        self.rank = rank
        self.error = state["error"]
        self.q = [q.to(self.device, torch.float32).clone() for q in state["q"]]


def _round_kind(rank) -> str:
    rank = int(rank)
    return "sparse" if rank == SPARSE else "whole" if rank == 0 else f"low-rank rank {rank}"


def _residual_sq(m_sq: float, p: torch.Tensor, qt_local: torch.Tensor, qt_sent: torch.Tensor) -> float:
    """||M - P^ S^T||² from the small factors, without reading M again (S^T = qt_sent, P^^T M = qt_local):
    ||M||² - 2 <P^^T M, S^T> + <P^^T P^, S^T S>, in float64. Accurate while ||e||² is not << ||M||²."""
    p, q, s = p.double(), qt_local.double(), qt_sent.double()
    return m_sq - 2 * float((q * s).sum()) + float(((p.mT @ p) * (s @ s.mT)).sum())
