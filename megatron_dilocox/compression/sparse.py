"""The sparse exchange (``--dilocox-sparse-k K``): per chunk, the K largest entries of M = δ + e, one bit each.

Chunks. Every tensor the codec is given is cut, row-major, into chunks of ``--dilocox-sparse-chunk`` values (the
last one of a tensor shorter); a chunk never spans two tensors, so a tensor's entries compete only with its own.
In the local layout every rank compresses its own TP/PP shard (every site holds the same shards, so the same
chunks); in the canonical layout the tensors are lane pieces in global coordinates, the same on every site
whatever its layout (docs/algorithm.md#sparse-exchange).

Values. A chunk sends its k = min(K, its length) entries in the order of decreasing |M|, so the decoder knows each
entry's place in that order: the places are split into ``LEVELS`` equal runs and each run sends one magnitude, the
mean |M| over the run (the least-squares level for that split); each entry sends its 16-bit index and its sign.
That is a non-uniform quantizer fitted to each chunk (MuLoCo, arXiv 2505.23725: at 2 bits a linear one degrades),
for a sign bit per value beside its index. Bytes per site: 2 per entry + 1 per 8 entries + 4·LEVELS per chunk
(the closed form ``sparse_form.payload_bytes``, which the cost model prices); at K = 64 of 4096, 0.30 bits per
parameter.

Exchange. Sites choose different indices, so the payloads cannot be summed on the way: every site all-gathers every
payload (one size for all: the closed form), decodes each and adds it, weighted (C·w_c/Σw) into a zero buffer in
member order, then divides by C; every site performs the same additions on the same bytes, so Δ is bitwise the
same everywhere. Error feedback: e = M − what this site sent, as decoded (Vogels et al., 2019; SparseLoCo, arXiv
2508.15706). Pure PyTorch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_dilocox.compression import sparse_form
from megatron_dilocox.compression.averaging import PayloadError
from megatron_dilocox.compression.norms import finite as _finite, sumsq as _sumsq
from megatron_dilocox.compression.quantize import bytes_as, pack_signs, unpack_signs
from megatron_dilocox.compression.sparse_form import INDEX_BYTES, LEVELS


class SparsePayloadError(RuntimeError):
    """A payload that does not decode into this site's chunks (size, an index past its chunk or twice in it, a
    magnitude that is negative or not finite)."""


class SparsePlan:
    """The chunks of a list of tensors laid end to end (the codec's flat slab): fixed by the shapes, K and the chunk
    size, so every site holds the same plan. Each piece (a tensor's full chunks, or its last, shorter one) is
    encoded and decoded as one [rows, length] block: no per-entry tables."""

    def __init__(self, numels: Sequence[int], k: int, chunk: int, device="cpu"):
        self.k, self.chunk, self.numel = int(k), int(chunk), int(sum(numels))
        self.pieces = sparse_form.pieces(numels, self.k, self.chunk)
        self.entries = sum(rows * kk for _, rows, _, kk in self.pieces)
        self.chunks = sum(rows for _, rows, _, _ in self.pieces)
        self.payload_bytes = sparse_form.bytes_of(self.pieces)
        self.device = torch.device(device)
        # each place's run (which of its chunk's LEVELS magnitudes it takes), per entries-per-row value
        self._run = {kk: torch.arange(kk, device=self.device) * LEVELS // kk for kk in {p[3] for p in self.pieces}}

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The payload (flat uint8) of ``flat``, the slab of M: every chunk's top-k indices, signs and levels."""
        idx, negative, levels = [], [], []
        for offset, rows, length, kk in self.pieces:
            block = flat[offset:offset + rows * length].view(rows, length)
            m, i = block.abs().topk(kk, dim=1, sorted=True)  # decreasing |M|: the order the runs follow
            idx.append(i.reshape(-1))
            negative.append(block.gather(1, i).reshape(-1) < 0)
            b = sparse_form.run_bounds(kk)
            levels.append(torch.stack([m[:, b[r]:b[r + 1]].mean(dim=1) if b[r + 1] > b[r] else m.new_zeros(rows)
                                       for r in range(LEVELS)], dim=1).reshape(-1))
        if not idx:
            return torch.zeros(0, dtype=torch.uint8, device=flat.device)
        return torch.cat([torch.cat(idx).to(torch.int16).view(torch.uint8), pack_signs(torch.cat(negative)),
                          torch.cat(levels).float().view(torch.uint8)])

    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slab positions, values) of a payload; raises SparsePayloadError for one that is not this plan's."""
        if payload.numel() != self.payload_bytes:
            raise SparsePayloadError(f"{payload.numel()} bytes, expected {self.payload_bytes}")
        n, sign_bytes = self.entries, -(-self.entries // 8)
        idx = bytes_as(payload[:INDEX_BYTES * n], torch.int16).to(torch.int64)
        signs = unpack_signs(payload[INDEX_BYTES * n:INDEX_BYTES * n + sign_bytes], n)
        levels = bytes_as(payload[INDEX_BYTES * n + sign_bytes:], torch.float32)
        if levels.numel() and not bool((torch.isfinite(levels) & (levels >= 0)).all()):
            raise SparsePayloadError("a magnitude that is negative or not finite")
        where, values, e, c = [], [], 0, 0
        for offset, rows, length, kk in self.pieces:
            i = idx[e:e + rows * kk].view(rows, kk)
            if not bool(((i >= 0) & (i < length)).all()):
                raise SparsePayloadError("an index lies outside its chunk")
            if kk > 1 and not bool((i.sort(dim=1).values.diff(dim=1) > 0).all()):
                raise SparsePayloadError("an index appears twice in its chunk")
            starts = offset + length * torch.arange(rows, device=i.device)
            where.append((starts[:, None] + i).reshape(-1))
            level = levels[c * LEVELS:(c + rows) * LEVELS].view(rows, LEVELS)[:, self._run[kk]]
            values.append(level.reshape(-1) * signs[e:e + rows * kk])
            e, c = e + rows * kk, c + rows
        if not where:
            return idx, signs
        return torch.cat(where), torch.cat(values)


class SparseExchange:
    """The sparse round of ``PseudoGradientCodec`` (a mixin: it uses the codec's slab, weights and tags). Under
    ``--dilocox-sparse-k`` every tensor is in the codec's one flat slab (compression/layout.py)."""

    sparse: Optional[SparsePlan] = None

    def _exchange_sparse(self, M: list, coll) -> tuple[Optional[str], list, list]:
        """(refusal or None, [Δ slab], [||e||²]); on success e is left in M (in place)."""
        slab, C = M[-1], coll.size
        total, own = torch.zeros_like(slab), None
        for c, buf in enumerate(coll.all_gather(self.sparse.encode(slab), self._context("sparse"))):
            # (every index is unique in its chunk, so each sum below adds one term per position: the same bits on
            # every site and device)
            try:
                where, values = self.sparse.decode(buf)
            except SparsePayloadError as exc:
                raise PayloadError(f"refused payload: cluster {coll.cluster_of(c)} sent a sparse payload that does "
                                   f"not decode ({exc}); nothing was applied") from None
            total.index_add_(0, where, self._weighted(values, c))
            if c == coll.rank:
                own = (where, values)
        total.div_(C)
        if not _finite(total):
            return "refused: non-finite values in the averaged sparse payload", [total], []
        slab.index_add_(0, own[0], own[1], alpha=-1)  # e = M − what this site sent
        return None, [total], [_sumsq(slab)]
