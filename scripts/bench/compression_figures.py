"""Compression figures for one 4096 x 4096 pseudo-gradient: error vs the SVD optimum, bytes vs dense fp32.

The matrix has a known spectrum (M = U diag(s) V^T with random orthonormal U, V of 1024 columns), so the
best rank-r error is exact (Eckart-Young) without an SVD. For each rank and bit width it runs the real
codec (SoloCollective: the compression arithmetic is identical for any C) cold, then warm-started on
the same matrix, and prints the relative error and its ratio to the optimum, plus the bytes one cluster
sends per round for C=2 against a dense fp32 ring all-reduce of the same matrix.

    .venv/bin/python scripts/bench/compression_figures.py [--n 4096] [--spectrum power|sqrt]
"""
import argparse
import math
import time

import torch

from megatron_dilocox.compression.codec import HEADER_BYTES, PseudoGradientCodec
from megatron_dilocox.compression.collective import SoloCollective, allgather_bytes, dense_allreduce_bytes
from megatron_dilocox.config import DiLoCoXConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=1024, help="number of non-zero singular values")
    ap.add_argument("--spectrum", choices=["power", "sqrt"], default="power", help="s_i = 1/i or 1/sqrt(i)")
    ap.add_argument("--warm-rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    n, k = args.n, args.k
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(n, k, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g))
    i = torch.arange(1, k + 1, dtype=torch.float32)
    s = 1.0 / i if args.spectrum == "power" else 1.0 / i.sqrt()
    M = (u * s) @ v.T
    norm = float(M.norm())
    print(f"# {n}x{n}, spectrum s_i = {'1/i' if args.spectrum == 'power' else '1/sqrt(i)'} (i <= {k}), C=2")
    print("rank bits | opt_err  cold_err (x opt)  warm_err (x opt) | bytes/round  dense_fp32  ratio | sec/round")
    for rank in (4, 16, 64):
        opt = math.sqrt(float((s[rank:] ** 2).sum() / (s ** 2).sum()))
        for bits in (4, 8):
            cfg = DiLoCoXConfig(lowrank_rank=rank, quant_bits=bits, quant_block_size=128, adaptive_rank=False).validate()
            codec = PseudoGradientCodec([M.shape], cfg)
            errs, secs = [], []
            for t in range(1, 2 + args.warm_rounds):
                codec.error = [torch.zeros_like(M)]
                t0 = time.perf_counter()
                delta = codec.exchange([M], SoloCollective(), t).deltas[0]
                secs.append(time.perf_counter() - t0)
                errs.append(float((delta - M).norm()) / norm)
            p1, p2 = codec.payload_sizes()
            sent = allgather_bytes(HEADER_BYTES + p1 + p2, 2)
            dense = dense_allreduce_bytes(M.numel(), 2)
            print(f"{rank:4d} {bits:4d} | {opt:.4f}   {errs[0]:.4f} ({errs[0] / opt:.3f})   "
                  f"{errs[-1]:.4f} ({errs[-1] / opt:.3f}) | {sent:11d} {dense:11d} {dense / sent:6.0f}x | "
                  f"{sum(secs) / len(secs):.2f}")


if __name__ == "__main__":
    main()
