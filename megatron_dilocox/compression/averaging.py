"""How a round's payloads are averaged over the clusters: the token weights, and the two ways summable payloads
travel (``scheme``): an all-gather of every cluster's quantized payload (fp32 unauthenticated: a ring all-reduce),
or reduce-scatter + all-gather of quantized chunks (compression/scatter.py). Either way every cluster ends with
bitwise the same average. A mixin of ``PseudoGradientCodec`` (it uses the codec's config and scales). Pure
PyTorch.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_dilocox.compression.collective import Collective
from megatron_dilocox.compression.quantize import bytes_as, dequantize, payload_bytes, quantize
from megatron_dilocox.compression.scatter import SUMMABLE_BITS, reduce_scatter_all_gather


class PayloadError(RuntimeError):
    """A peer's payload does not match this cluster's round; nothing was applied."""


class ClusterAverage:
    """The averaging half of ``PseudoGradientCodec`` (codec.py)."""

    def _weight_scales(self, weights: list) -> Optional[list]:
        """C·w_c/Σw per member, or None for the plain mean (equal weights, or --dilocox-no-token-weights)."""
        if not self.cfg.token_weights or len(set(weights)) <= 1:
            return None
        total = math.fsum(weights)
        return [len(weights) * w / total for w in weights]

    def _weighted(self, t: torch.Tensor, member: int) -> torch.Tensor:
        """Member ``member``'s term of the weighted sum (itself when the weights are equal)."""
        return t if self._scales is None else t * self._scales[member]

    def _reduce(self, pieces, raw, coll: Collective, phase: str):
        """Average ``pieces`` (compressed; weighted) and sum ``raw`` (fp32 as is) over clusters.

        Returns (means, what this cluster transmitted as decoded, raw sums, the requantization error this
        cluster keeps as error feedback per piece, or None)."""
        n, C = len(pieces), coll.size
        if self.scheme(coll) == "reduce-scatter":
            flat = [p.reshape(-1).float() for p in pieces]
            means, sent, carry = reduce_scatter_all_gather(flat, coll, self.cfg.quant_bits, self.cfg.quant_block_size,
                                                           self._scales, self._context(phase))
            raw_sums = None
            if raw:  # (small statistics: gathered and summed in member order, exact)
                for part in coll.all_gather(torch.cat([r.float() for r in raw]), self._context(phase + "-stats")):
                    raw_sums = part.clone() if raw_sums is None else raw_sums + part
                raw_sums = list(torch.split(raw_sums, [r.numel() for r in raw]))
            shape = [p.shape for p in pieces]
            return ([m.view(s) for m, s in zip(means, shape)], [t.view(s) for t, s in zip(sent, shape)], raw_sums or [],
                    None if carry is None else [c.view(s) for c, s in zip(carry, shape)])
        if self.cfg.quant_bits == 32:
            flat = [p.reshape(-1).float() for p in pieces]
            weighted = [self._weighted(f, coll.rank) for f in flat]
            total = coll.all_reduce_sum(torch.cat(weighted + [r.float() for r in raw]))
            parts = list(torch.split(total, [f.numel() for f in flat] + [r.numel() for r in raw]))
            sent = flat
        else:
            parts, sent = None, None
            for c, decoded in self._gathered(pieces, raw, coll, phase):
                terms = [self._weighted(d, c) for d in decoded[:n]] + decoded[n:]  # (raw sums are statistics)
                parts = terms if parts is None else [a + b for a, b in zip(parts, terms)]
                if c == coll.rank:
                    sent = decoded[:n]
        means = [(s / C).view(p.shape) for s, p in zip(parts[:n], pieces)]
        sent = [s.view(p.shape) for s, p in zip(sent, pieces)]
        return means, sent, parts[n:], None

    def scheme(self, coll: Collective) -> str:
        return self.scheme_at(coll.size, coll.authenticated)

    def scheme_at(self, clusters: int, authenticated: bool) -> str:
        """How this round's summable payloads travel: "reduce-scatter" (compression/scatter.py) or "all-gather"
        (fp32 unauthenticated: a ring all-reduce). auto: reduce-scatter from three clusters on (fewer bytes; at
        two the bytes are equal and the all-gather needs no second quantization), and for fp32 whenever the
        messages are authenticated (an all-reduce cannot carry the senders' tags)."""
        bits, choice = self.cfg.quant_bits, self.cfg.exchange_scheme
        if clusters <= 1 or bits not in SUMMABLE_BITS:  # (a sparse round is all-gathered: compression/sparse.py)
            return "all-gather"
        if choice == "auto":
            return "reduce-scatter" if clusters >= 3 or (bits == 32 and authenticated) else "all-gather"
        if choice == "all-gather" and bits == 32 and authenticated:
            return "reduce-scatter"  # (the fp32 all-reduce cannot be authenticated; the same bytes, exact)
        return choice

    def _context(self, kind: str) -> tuple:
        return (self._round, self.fragment, kind)

    def _gathered(self, pieces, raw, coll: Collective, phase: str = "payload"):
        """All-gather ``pieces`` (quantized at --dilocox-quant-bits) and ``raw`` (fp32); yield (cluster index,
        its decoded flat pieces + raw) in cluster order, so that any sum over them is the same everywhere."""
        bits, block = self.cfg.quant_bits, self.cfg.quant_block_size
        flat = [p.reshape(-1).float() for p in pieces]
        sizes = [f.numel() for f in flat]
        payload = torch.cat([quantize(f, bits, block) for f in flat] + [r.float().view(torch.uint8) for r in raw])
        nbytes = [payload_bytes(n, bits, block) for n in sizes] + [4 * r.numel() for r in raw]
        for c, buf in enumerate(coll.all_gather(payload, self._context(phase))):
            if buf.numel() != sum(nbytes):
                raise PayloadError(f"refused payload: cluster {coll.cluster_of(c)} sent {buf.numel()} bytes, expected {sum(nbytes)}")
            chunks = torch.split(buf, nbytes)
            decoded = [dequantize(ch, n, bits, block) for ch, n in zip(chunks[:len(flat)], sizes)]
            yield c, decoded + [bytes_as(ch, torch.float32) for ch in chunks[len(flat):]]
