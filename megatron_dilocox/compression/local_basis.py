"""Low-rank compression in each cluster's *own* basis (``--dilocox-lowrank-basis local``, the default).

PowerSGD's shared basis (one power iteration from a Q every cluster shares, ``shared``) exists so that factors
can be summed by all-reduce. The codec all-gathers its quantized payloads anyway (no low-precision sums), so
that linearity buys nothing here, and it costs quality: one iteration from last round's averaged Q captures
much less of M = δ + e than M's own top-r subspace, and under error feedback the uncaptured energy piles up.

Here every cluster estimates its own top-r subspace with ``--dilocox-lowrank-local-iters`` block power
iterations (compute, no bytes), warm-started from its own last right factor, fits the right factor to the
*quantized* left factor (least squares, so P's quantization error is mostly absorbed), and sends both in one
all-gather. The average is Δ = (1/C) Σ_c P_c Q_c^T (rank up to C·r; with unequal token weights each term
scaled by C·w_c/Σw), summed in cluster order and, inside each term, rank by rank with one rounded multiply and one
rounded add per value (``rebuild_exactly``: no BLAS, whose blocking, FMA and kernel choice differ between CPUs,
GPUs, libraries and settings), so every cluster computes bitwise the same Δ whatever its arithmetic. Bytes per round are the shared basis's at the same rank (same factor shapes),
in one phase instead of two: one WAN round trip fewer. Error feedback stays local and exact:
e_c = M_c − P_c Q_c^T with the factors as they were sent.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_dilocox.compression import adaptive, lowrank
from megatron_dilocox.compression.norms import finite as _finite, sumsq as _sumsq
from megatron_dilocox.compression.quantize import dequantize, quantize


class LocalBasisExchange:
    """The local-basis round of ``PseudoGradientCodec`` (a mixin: it uses the codec's slabs and gather)."""

    def _exchange_local(self, M: list, m_sq: list, coll, result) -> tuple[Optional[str], list, list]:
        """(refusal or None, Δ slabs, ||e||² per slab); on success e is left in M (in place). Called only when
        there are low-rank groups (``one_phase``)."""
        G, C = len(self.groups), coll.size
        bits, block = self.cfg.quant_bits, self.cfg.quant_block_size
        p_sent, qt = [], []
        for m, q in zip(M[:G], self.q):
            p = lowrank.subspace_iteration(m, q, self.cfg.lowrank_local_iters)
            # the wire layout is column by column ([B, r, rows]): one column's entries share a block scale
            wire = p.transpose(1, 2)
            p = dequantize(quantize(wire, bits, block), wire.numel(), bits, block).view(wire.shape).transpose(1, 2)
            p_sent.append(p)
            qt.append(lowrank.fit_right_factor(m, p))  # [B, r, cols]
        cum = sum(lowrank.cumulative_energy(q.transpose(1, 2)) for q in qt)
        raw = [torch.cat([cum, torch.tensor([sum(m_sq[:G])])]).float()]
        pieces = [p.transpose(1, 2) for p in p_sent] + qt + M[G:]
        out, own, stat_sum = [None] * len(M), None, None
        for c, decoded in self._gathered(pieces, raw, coll):
            factors = [(decoded[k].view(pieces[k].shape), decoded[G + k].view(qt[k].shape)) for k in range(G)]
            for k, (pw, qw) in enumerate(factors):
                qw = self._weighted(qw, c)  # (the sent factors, kept in ``own``, stay unweighted)
                first = out[k] is None
                if first:
                    out[k] = self._slab(self._out, k, M[k].shape)
                rebuild_exactly(out[k], pw, qw, first)
            if len(M) > G:
                whole = self._weighted(decoded[2 * G].view(M[G].shape), c)
                out[G] = whole.clone() if out[G] is None else out[G].add_(whole)
            stat_sum = decoded[-1].clone() if stat_sum is None else stat_sum + decoded[-1]
            if c == coll.rank:
                own = (factors, decoded[2 * G] if len(M) > G else None)
        for o in out:
            o.div_(C)
        if not all(map(_finite, out)):
            return "refused: non-finite values in the averaged payload", out, []
        e_sq = []
        factors, whole = own
        for m, (pw, qw) in zip(M[:G], factors):
            m.baddbmm_(pw.transpose(1, 2), qw, alpha=-1)  # e = M − P Q^T as sent
            e_sq.append(_sumsq(m))
        if whole is not None:
            e_sq.append(_sumsq(M[G].sub_(whole.view(M[G].shape))))
        self.q = [q.transpose(1, 2).contiguous() for q in qt]  # warm start: this cluster's own right factors
        if self.cfg.adaptive_rank:
            result.next_rank = adaptive.choose_rank(
                stat_sum[:-1].tolist(), float(stat_sum[-1]), self.rank, self.cfg.energy_threshold,
                self.cfg.resolved_rank_min, self.rank_cap)
        return None, out, e_sq


def rebuild_exactly(out: torch.Tensor, pw: torch.Tensor, qw: torch.Tensor, first: bool, block: int = 1 << 14):
    """``out`` (+)= Σ_j pw[:, j]ᵀ ⊗ qw[:, j] ([B, rows, cols] from [B, r, rows] and [B, r, cols]), one rank at a
    time in order, each an elementwise product then an elementwise add: IEEE rounds each of them to the same bits on
    every device, so the sites' Δ agree bitwise where a batched matmul's would not (MKL's reproducibility mode
    alone changes bmm's bits on one CPU: scripts/bench/mixed_arithmetic.py). It costs 2r passes over Δ instead of
    one product; a block of rows at a time (about ``block`` values) keeps those passes in cache."""
    rows_per_block = max(1, block // max(1, out.shape[-1]))
    tmp = torch.empty_like(out[:, :rows_per_block])
    for a in range(0, out.shape[1], rows_per_block):
        o = out[:, a:a + rows_per_block]
        t = tmp[:, :o.shape[1]]
        for j in range(pw.shape[1]):
            term = o if first and j == 0 else t
            torch.mul(pw[:, j, a:a + rows_per_block, None], qw[:, j, None, :], out=term)
            if term is not o:
                o.add_(term)
