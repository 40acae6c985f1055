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
at one transmitted bit per value. Bytes per site: 2 per entry + 1 per 8 entries + 4·LEVELS per chunk (the closed
form ``SparsePlan.payload_bytes``); at K = 64 of 4096 that is 0.30 bits per parameter.

Exchange. Sites choose different indices, so the payloads cannot be summed on the way: every site all-gathers every
payload (one size for all: the closed form), decodes each and adds it, weighted (C·w_c/Σw) into a zero buffer in
member order, then divides by C; every site performs the same additions on the same bytes, so Δ is bitwise the
same everywhere. Error feedback: e = M − what this site sent, as decoded (Vogels et al., 2019; SparseLoCo, arXiv
2508.15706). Pure PyTorch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_dilocox.compression.averaging import PayloadError
from megatron_dilocox.compression.norms import finite as _finite, sumsq as _sumsq
from megatron_dilocox.compression.quantize import bytes_as, pack_signs, unpack_signs

LEVELS = 4  # magnitudes per chunk
INDEX_BYTES = 2  # an entry's place in its chunk (--dilocox-sparse-chunk <= 32768: int16)
MAX_CHUNK = 1 << 15


class SparsePayloadError(RuntimeError):
    """A payload that does not decode into this site's chunks (wrong size, an index past its chunk)."""


class SparsePlan:
    """The chunks of a list of tensors laid end to end (the codec's flat slab), and where each entry slot of the
    wire lands: fixed by the shapes, K and the chunk size, so every site holds the same plan."""

    def __init__(self, numels: Sequence[int], k: int, chunk: int, device="cpu"):
        self.k, self.chunk, self.numel = int(k), int(chunk), int(sum(numels))
        self.pieces = []  # (slab offset, rows, row length, entries per row): a tensor's full chunks, then its tail
        base, slot_len, slot_level = [], [], []
        offset, chunk_id = 0, 0
        for n in numels:
            full, tail = divmod(int(n), self.chunk)
            for rows, length in ((full, self.chunk), (1 if tail else 0, tail)):
                if not rows:
                    continue
                kk = min(self.k, length)
                self.pieces.append((offset, rows, length, kk))
                starts = offset + length * torch.arange(rows, dtype=torch.int64)
                base.append(starts.repeat_interleave(kk))
                slot_len.append(torch.full((rows * kk,), length, dtype=torch.int32))
                run = torch.arange(kk, dtype=torch.int64) * LEVELS // kk  # each entry's run of places
                ids = chunk_id + torch.arange(rows, dtype=torch.int64)
                slot_level.append((ids[:, None] * LEVELS + run[None, :]).reshape(-1))
                offset += rows * length
                chunk_id += rows
        self.chunks = chunk_id
        cat = lambda xs, dtype: torch.cat(xs) if xs else torch.zeros(0, dtype=dtype)  # noqa: E731
        self.device = torch.device(device)  # (where the codec's slabs live: the tables index them there)
        self.slot_base = cat(base, torch.int64).to(self.device)
        self.slot_len = cat(slot_len, torch.int32).to(self.device)
        self.slot_level = cat(slot_level, torch.int64).to(self.device)
        self.entries = int(self.slot_base.numel())
        self._level_count = torch.bincount(self.slot_level, minlength=self.chunks * LEVELS).clamp_(min=1).float()

    @property
    def payload_bytes(self) -> int:
        """Closed form: bytes one site's payload takes."""
        return INDEX_BYTES * self.entries + -(-self.entries // 8) + 4 * LEVELS * self.chunks

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The payload (flat uint8) of ``flat``, the slab of M: every chunk's top-k indices, signs and levels."""
        idx, mags, negative = [], [], []
        for offset, rows, length, kk in self.pieces:
            block = flat[offset:offset + rows * length].view(rows, length)
            m, i = block.abs().topk(kk, dim=1, sorted=True)  # decreasing |M|: the order the levels follow
            idx.append(i.reshape(-1))
            mags.append(m.reshape(-1))
            negative.append(block.gather(1, i).reshape(-1) < 0)
        if not idx:
            return torch.zeros(0, dtype=torch.uint8, device=flat.device)
        levels = torch.zeros(self.chunks * LEVELS, dtype=torch.float32, device=flat.device).index_add_(
            0, self.slot_level, torch.cat(mags).float()).div_(self._level_count)
        return torch.cat([torch.cat(idx).to(torch.int16).view(torch.uint8), pack_signs(torch.cat(negative)),
                          levels.view(torch.uint8)])

    def decode(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slab positions, values) of a payload; raises SparsePayloadError for one that is not this plan's."""
        if payload.numel() != self.payload_bytes:
            raise SparsePayloadError(f"{payload.numel()} bytes, expected {self.payload_bytes}")
        n = self.entries
        idx = bytes_as(payload[:INDEX_BYTES * n], torch.int16).to(torch.int64)
        if n and not bool(((idx >= 0) & (idx < self.slot_len)).all()):
            raise SparsePayloadError("an index lies outside its chunk")
        signs = unpack_signs(payload[INDEX_BYTES * n:INDEX_BYTES * n + -(-n // 8)], n)
        levels = bytes_as(payload[INDEX_BYTES * n + -(-n // 8):], torch.float32)
        return self.slot_base + idx, levels[self.slot_level] * signs


class SparseExchange:
    """The sparse round of ``PseudoGradientCodec`` (a mixin: it uses the codec's slab, weights and tags). Under
    ``--dilocox-sparse-k`` every tensor is in the codec's one flat slab (compression/layout.py)."""

    sparse: Optional[SparsePlan] = None

    def _exchange_sparse(self, M: list, coll, result) -> tuple[Optional[str], list, list]:
        """(refusal or None, [Δ slab], [||e||²]); on success e is left in M (in place)."""
        slab, C = M[-1], coll.size
        total, own = torch.zeros_like(slab), None
        for c, buf in enumerate(coll.all_gather(self.sparse.encode(slab), self._context("sparse"))):
            try:
                where, values = self.sparse.decode(buf)
            except SparsePayloadError as exc:
                raise PayloadError(f"refused payload: cluster {coll.cluster_of(c)} sent a sparse payload that does "
                                   f"not decode ({exc}); nothing was applied") from None
            total.index_add_(0, where, self._weighted(values, c))  # (a slot's index is unique in a payload)
            if c == coll.rank:
                own = (where, values)
        total.div_(C)
        if not _finite(total):
            return "refused: non-finite values in the averaged sparse payload", [total], []
        slab.index_add_(0, own[0], own[1], alpha=-1)  # e = M − what this site sent
        return None, [total], [_sumsq(slab)]
