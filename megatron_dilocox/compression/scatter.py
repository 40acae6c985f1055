"""Reduce-scatter then all-gather of quantized chunks: bytes per cluster that do not grow with the clusters.

All-gathering every cluster's quantized payload costs each cluster (C − 1)·S per round, S one cluster's payload.
Here every payload piece is cut into C chunks on quantization-block boundaries (chunk j: blocks
⌊j·B/C⌋ … ⌊(j+1)·B/C⌋ of the piece's B blocks, so every chunk quantizes in the same blocks as the whole piece)
and cluster j *owns* chunk j:

    reduce-scatter   each cluster sends chunk j of its quantized pieces to cluster j            (C−1)/C · S
    owner j          dequantizes the C chunks, averages them in fp32 in member order (with the round's token
                     weights), quantizes that average once
    all-gather       each owner sends its quantized average to every other cluster             (C−1)/C · S
    everyone         dequantizes the same bytes: every cluster applies bitwise the same Δ, on any hardware

So about 2(C − 1)/C · S per cluster (plus a tag per message, compression/auth.py), against (C − 1)·S: equal at
C = 2, 1.5 S against 3 S at C = 4, under 2 S at any C. fp32 (``--dilocox-quant-bits 32``) takes the same path
without quantization and is exact; it replaces a ring all-reduce with the same bytes, whose messages mix the
senders' bytes and so could not carry a sender's tag.

The price is a second quantization, of the average. The owner keeps its error as error feedback: its chunk of
the average lost r = avg − dequant(quant(avg)), so it adds C·r/s to its own e on that chunk (s its weight scale,
1 with equal weights), and its next round's contribution, worth s/C of the average, returns r
(docs/algorithm.md#reduce-scatter-exchange). Pure PyTorch.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.quantize import dequantize, payload_bytes, quantize

SUMMABLE_BITS = (4, 8, 16, 32)  # 1-bit signs are averaged by all-gather (an average of signs is not a sign)


def chunk_bounds(numel: int, parts: int, bits: int, block: int) -> list[int]:
    """Where each of ``parts`` chunks of a ``numel``-value piece starts (and the last ends), on whole blocks."""
    unit = block if bits in (1, 4, 8) else 1
    blocks = -(-numel // unit)
    return [min(numel, (blocks * j // parts) * unit) for j in range(parts + 1)]


def sent_bytes(numels: list[int], clusters: int, member: int, bits: int, block: int, tagged: bool) -> int:
    """Closed form: what member ``member`` sends in one reduce-scatter + all-gather of pieces of ``numels``."""
    if clusters <= 1:
        return 0
    bounds = [chunk_bounds(n, clusters, bits, block) for n in numels]
    size = [sum(payload_bytes(b[j + 1] - b[j], bits, block) for b in bounds) for j in range(clusters)]
    tags = 2 * (clusters - 1) * TAG_BYTES if tagged else 0
    return sum(size[j] for j in range(clusters) if j != member) + (clusters - 1) * size[member] + tags


def reduce_scatter_all_gather(flats: list[torch.Tensor], coll, bits: int, block: int,
                              scales: Optional[list[float]], context: tuple):
    """Average flat fp32 ``flats`` over the group (weighted by ``scales``, C·w_c/Σw, or plainly).

    Returns (means, sent, carry): every cluster's identical averages, this cluster's own pieces as the others
    decode them (for its error feedback e = M − sent), and the owner's requantization error to add to its e
    (zeros outside its chunks; None for fp32, which is exact)."""
    C, me = coll.size, coll.rank
    bounds = [chunk_bounds(f.numel(), C, bits, block) for f in flats]
    segments = [[f[b[j]:b[j + 1]] for j in range(C)] for f, b in zip(flats, bounds)]
    encoded = [[quantize(s, bits, block) for s in segs] for segs in segments]
    mine_in = sum(e[me].numel() for e in encoded)
    got = coll.all_to_all([torch.cat([e[j] for e in encoded]) for j in range(C)], [mine_in] * C,
                          context=(*context, "reduce-scatter"))
    sent = [torch.cat([dequantize(e[j], s[j].numel(), bits, block) for j in range(C)])
            for e, s in zip(encoded, segments)]
    owned = []  # this cluster's chunk of every piece: the weighted mean of the members' decoded chunks
    offsets = [0] * C
    for e, s in zip(encoded, segments):
        n, total = s[me].numel(), None
        for g in range(C):
            part = got[g][offsets[g]:offsets[g] + e[me].numel()]
            offsets[g] += e[me].numel()
            value = dequantize(part, n, bits, block)
            value = value if scales is None else value * scales[g]
            total = value if total is None else total + value
        owned.append(total / C)
    owned_q = [quantize(o, bits, block) for o in owned]
    mine = torch.cat(owned_q)
    sizes_in = [sum(payload_bytes(b[g + 1] - b[g], bits, block) for b in bounds) for g in range(C)]
    back = coll.all_to_all([mine] * C, sizes_in, context=(*context, "all-gather"))
    means, carry = [], []
    offsets = [0] * C
    for i, (f, b) in enumerate(zip(flats, bounds)):
        parts = []
        for g in range(C):
            k = payload_bytes(b[g + 1] - b[g], bits, block)
            parts.append(dequantize(back[g][offsets[g]:offsets[g] + k], b[g + 1] - b[g], bits, block))
            offsets[g] += k
        means.append(torch.cat(parts))
        if bits != 32:
            r = torch.zeros_like(f)
            r[b[me]:b[me + 1]] = (owned[i] - parts[me]) * (C / (1.0 if scales is None else scales[me]))
            carry.append(r)
    return means, sent, (carry if bits != 32 else None)
