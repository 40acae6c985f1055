"""PowerSGD-style low-rank pieces: shared warm-start Q, fp32 orthonormalisation, energy per rank.

For M (n x m) and a warm-start Q (m x r), one power iteration gives P = M Q, P^ = orth(P),
Q' = M^T P^, and M ~ P^ Q'^T. Because P^ has orthonormal columns, the energy this approximation
captures is ||Q'||_F^2 and its spectrum is the singular values of Q' (m x r, cheap): that is what
adaptive rank reads. Same-shape matrices are stacked in a batch dimension.
"""
from __future__ import annotations

import torch


def shared_generator(seed: int, *salt: int) -> torch.Generator:
    """A CPU generator every cluster seeds identically (same seed, same salt -> same numbers)."""
    g = torch.Generator(device="cpu")
    mixed = seed
    for s in salt:
        mixed = (mixed * 1_000_003 + s) % (2**62)
    g.manual_seed(mixed)
    return g


def init_q(batch: int, cols: int, rank: int, seed: int, group: int, device) -> torch.Tensor:
    """Warm-start Q [batch, cols, rank], identical on every cluster."""
    g = shared_generator(seed, group)
    return torch.randn(batch, cols, rank, generator=g, dtype=torch.float32).to(device)


def resize_q(q: torch.Tensor, rank: int, seed: int, group: int, round_idx: int) -> torch.Tensor:
    """Keep the leading columns on shrink; append shared random columns on growth."""
    have = q.shape[-1]
    if rank <= have:
        return q[..., :rank].contiguous()
    g = shared_generator(seed, group, round_idx, rank)
    extra = torch.randn(*q.shape[:-1], rank - have, generator=g, dtype=torch.float32).to(q.device)
    return torch.cat([q, extra], dim=-1)


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning p (batched), computed in fp32 (QR, reduced)."""
    q, _ = torch.linalg.qr(p.float(), mode="reduced")
    return q


def cumulative_energy(q_local: torch.Tensor) -> torch.Tensor:
    """[rank] cumulative energy of the top-k components of P^ Q^T (k = 1..rank), summed over the batch."""
    s = torch.linalg.svdvals(q_local.float())  # [batch, rank], descending
    return (s * s).sum(dim=0).cumsum(dim=0)


def subspace_iteration(m: torch.Tensor, q: torch.Tensor, iters: int) -> torch.Tensor:
    """Orthonormal P^ [batch, rows, r] spanning M's top-r left singular subspace, estimated by ``iters`` block
    power iterations from Q [batch, cols, r] (a warm start: last round's right factors). Local compute only."""
    for i in range(iters):
        p = orthonormalize(torch.bmm(m, q))
        if i + 1 < iters:
            q = torch.bmm(m.transpose(1, 2), p)
    return p


def fit_right_factor(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Q'^T [batch, r, cols] minimising ||M - P Q'^T|| for a given (e.g. quantized, so not exactly orthonormal)
    P: the least-squares solution (P^T P)^{-1} P^T M."""
    gram = torch.bmm(p.transpose(1, 2), p)
    return torch.linalg.solve(gram, torch.bmm(p.transpose(1, 2), m))
