"""Closed-form cost model of AllReduce, DiLoCo and DiLoCoX over a slow inter-cluster link (pure Python).

Compute: an inner step of one cluster takes T_step = (global batch tokens / C) / (GPUs per cluster x
tokens/s per GPU), with tokens/s per GPU = MFU x peak FLOP/s / (6 N) unless given directly.

Bytes: the tensors every rank of a cluster owns are built from a Megatron GPT layout (setup.py). Each rank's DiLoCoX payload is the codec's closed form (``PseudoGradientCodec.payload_sizes``): low-rank P
and Q of same-shape matrix groups plus the small tensors whole, each ``payload_bytes`` long; a 104-byte
header, phase 1 and phase 2 travel as all-gathers ((C-1)*S bytes sent) or, at 32 bits, ring all-reduces
(floor(2(C-1)S/C)). All ranks of a cluster share the one link, so T_comm = (sum over ranks) / bandwidth
+ latency per ring hop.

    AllReduce : every step T_step + dense gradient all-reduce (fp32 or bf16)
    DiLoCo    : every H steps a dense fp32 pseudo-gradient all-reduce, not overlapped
    DiLoCoX   : every H steps the compressed exchange; one-step-delay exposes max(0, T_exchange - H T_step)
    ceiling   : no communication at all
and both pay the round boundary's own host work every round; T_exchange = T_comm + its thread's hash (boundary.py).

No torch and no megatron import here: ``payload_bytes`` re-implements ``compression.quantize.payload_bytes``
(tests check that both agree, and that the per-rank sums equal the codec's ``payload_sizes``); the sparse
exchange's bytes are ``compression/sparse_form.py``'s, which the codec uses too.
"""
from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Optional

from megatron_dilocox.compression import sparse_form  # (no torch: the package imports its codecs on first use)
from megatron_dilocox.sim.boundary import exchange_and_boundary
from megatron_dilocox.sim.setup import Setup, active_params, model_params, numel, rank_views

HEADER_BYTES = 104  # codec.HEADER_BYTES: 13 float64 values
SCALE_BYTES = 4  # one fp32 scale per quantization block
TAG_BYTES = 32  # compression/auth.py: an HMAC-SHA256 tag per message
SUMMABLE_BITS = (4, 8, 16, 32)  # compression/scatter.py
HMAC_BYTES_PER_S = 1.7e9  # HMAC-SHA256 on one core: 1734 MB/s measured here (scripts/bench/tag_cost.py)


def payload_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of one quantized payload of ``numel`` values (same closed form as compression.quantize)."""
    if bits == 32:
        return 4 * numel
    if bits == 16:
        return 2 * numel
    return math.ceil(numel * bits / 8) + SCALE_BYTES * math.ceil(numel / block)


def allgather_bytes(size: int, clusters: int) -> int:
    return (clusters - 1) * size


def allreduce_bytes(size: int, clusters: int) -> int:
    return 2 * (clusters - 1) * size // clusters


def chunk_bounds(numel: int, parts: int, bits: int, block: int) -> list[int]:
    """compression/scatter.py's chunks: ``parts`` runs of whole quantization blocks."""
    unit = block if bits in (1, 4, 8) else 1
    blocks = -(-numel // unit)
    return [min(numel, (blocks * j // parts) * unit) for j in range(parts + 1)]


def scatter_bytes(numels: list[int], bits: int, block: int, clusters: int, member: int = 0,
                  tagged: bool = False) -> int:
    """Bytes member ``member`` sends in one reduce-scatter + all-gather of pieces of ``numels`` values:
    about 2 (C-1)/C of one payload (compression/scatter.py's closed form)."""
    if clusters <= 1:
        return 0
    bounds = [chunk_bounds(n, clusters, bits, block) for n in numels]
    size = [sum(payload_bytes(b[j + 1] - b[j], bits, block) for b in bounds) for j in range(clusters)]
    return (sum(size[j] for j in range(clusters) if j != member) + (clusters - 1) * size[member]
            + (2 * (clusters - 1) * TAG_BYTES if tagged else 0))


def scheme_at(bits: int, clusters: int, choice: str = "auto", tagged: bool = False, sparse: bool = False) -> str:
    """codec.scheme_at: reduce-scatter from 3 clusters on (auto), and for fp32 whenever messages are tagged; the
    sparse exchange always all-gathers."""
    if clusters <= 1 or bits not in SUMMABLE_BITS or sparse:
        return "all-gather"
    if choice == "auto":
        return "reduce-scatter" if clusters >= 3 or (bits == 32 and tagged) else "all-gather"
    return "reduce-scatter" if choice == "all-gather" and bits == 32 and tagged else choice


# --------------------------------------------------------------------------------------- bytes
def rank_payload(shapes: list[tuple], rank: int, bits: int, block: int, min_dim: int = 64,
                 lowrank: bool = True, sparse: tuple = (0, 0)) -> dict:
    """The codec's closed form for one rank: phase-1 and phase-2 payload bytes and its state sizes. ``sparse``:
    (k, chunk) of the sparse exchange (k 0: off), which replaces low rank and quantization."""
    if sparse[0]:
        n = [numel(sh) for sh in shapes]
        return {"p1": sparse_form.payload_bytes(n, *sparse), "p2": 0, "n1": [sum(n)], "n2": [], "numel": sum(n),
                "whole_numel": sum(n), "groups": 0, "q_numel": 0, "rank_too_large": 0}
    groups: dict = {}
    whole, too_small = 0, 0
    for sh in shapes:
        if len(sh) >= 2 and sh[0] > 0 and lowrank and min(sh[0], numel(sh) // sh[0]) >= min_dim:
            key = (sh[0], numel(sh) // sh[0])
            groups[key] = groups.get(key, 0) + 1
            too_small += rank > min(key)  # the codec refuses such a rank (DiLoCoXConfigError)
        else:
            whole += numel(sh)
    if not rank:  # the link budget's rank 0: every matrix whole, phase 1 alone (the codec's slabs)
        n1 = [b * r * c for (r, c), b in groups.items()] + ([whole] if whole else [])
        return {"p1": sum(payload_bytes(n, bits, block) for n in n1), "p2": 0, "n1": n1, "n2": [],
                "numel": sum(numel(sh) for sh in shapes), "whole_numel": whole, "groups": 0, "q_numel": 0,
                "rank_too_large": 0}
    p1 = sum(payload_bytes(b * r * rank, bits, block) for (r, _), b in groups.items())
    p1 += payload_bytes(whole, bits, block) if whole else 0
    p2 = sum(payload_bytes(b * c * rank, bits, block) for (_, c), b in groups.items())
    p2 += 4 * (rank + 1) if groups else 0
    return {"p1": p1, "p2": p2, "n1": [b * r * rank for (r, _), b in groups.items()] + ([whole] if whole else []),
            "n2": [b * c * rank for (_, c), b in groups.items()],
            "numel": sum(numel(sh) for sh in shapes), "whole_numel": whole, "groups": len(groups),
            "q_numel": sum(b * c * rank for (_, c), b in groups.items()), "rank_too_large": too_small}


def exchange_bytes(p1: int, p2: int, bits: int, clusters: int, gathered: bool = False, tagged: bool = False,
                   scheme: str = "all-gather", pieces: Optional[dict] = None, block: int = 128) -> int:
    """Bytes one rank sends in one round: header all-gather, then phase 1 and phase 2 (one all-gather of both
    for the local low-rank basis: ``gathered``); by ``scheme`` otherwise: all-gather (fp32 untagged: all-reduce)
    or reduce-scatter + all-gather of the pieces ``pieces`` (rank_payload's n1 / n2; the phase-2 statistics by
    all-gather). ``tagged``: a tag on every message."""
    tag = TAG_BYTES if tagged else 0
    header = allgather_bytes(HEADER_BYTES + tag, clusters)
    if clusters <= 1:
        return 0
    if gathered:
        return header + allgather_bytes(p1 + p2 + tag, clusters)
    if scheme == "reduce-scatter":
        total = header + scatter_bytes(pieces["n1"], bits, block, clusters, tagged=tagged)
        if pieces["n2"]:
            stats = p2 - sum(payload_bytes(n, bits, block) for n in pieces["n2"])
            total += scatter_bytes(pieces["n2"], bits, block, clusters, tagged=tagged) + \
                allgather_bytes(stats + tag, clusters)
        return total
    coll = allreduce_bytes if bits == 32 else (lambda n, c: allgather_bytes(n + tag, c))
    return header + coll(p1, clusters) + (coll(p2, clusters) if p2 else 0)


def round_bytes(s: Setup, views: Optional[list] = None) -> dict:
    """Per-cluster bytes of one round (DiLoCoX and dense fp32) and the largest rank's state."""
    total = dense = owned = max_numel = max_whole = max_q = too_small = 0
    phases = 2
    for mult, views in views if views is not None else rank_views(s):
        p = rank_payload(views, s.rank, s.bits, s.block, s.min_dim, s.lowrank, (s.sparse_k, s.sparse_chunk))
        local = bool(p["groups"]) and s.lowrank_basis == "local" or bool(s.sparse_k)  # (one all-gather)
        total += mult * exchange_bytes(p["p1"], p["p2"], s.bits, s.clusters, gathered=local, tagged=s.payload_auth,
                                       scheme=scheme_at(s.bits, s.clusters, s.scheme, s.payload_auth, bool(s.sparse_k)),
                                       pieces=p, block=s.block)
        dense += mult * allreduce_bytes(4 * p["numel"], s.clusters)
        owned += mult * p["numel"]
        if p["numel"] > max_numel:
            max_numel, max_whole = p["numel"], p["whole_numel"]
        max_q = max(max_q, p["q_numel"])
        too_small += mult * p["rank_too_large"]
        phases = max(phases, 3 if p["groups"] and s.lowrank_basis != "local" else 2)
    return {"dilocox": total, "dense_fp32": dense, "owned_numel": owned, "max_rank_numel": max_numel,
            "max_rank_whole_numel": max_whole,
            "max_rank_q_numel": max_q, "views_rank_too_large": too_small, "phases": phases}


# --------------------------------------------------------------------------------------- time
def step_seconds(s: Setup, n_params: Optional[int] = None) -> float:
    n = n_params or active_params(s)
    per_gpu = s.tokens_per_gpu_s or s.mfu * s.peak_tflops * 1e12 / (6 * n)
    return (s.global_batch_tokens / s.clusters) / (s.gpus_per_cluster * per_gpu)


def link_seconds(nbytes: float, s: Setup, hops: int) -> float:
    if s.clusters == 1:
        return 0.0
    return nbytes / (s.link_gbps * 1e9 / 8) + hops * s.latency_ms / 1e3


def allreduce_step_seconds(grad_bytes: float, s: Setup) -> float:
    """Ring all-reduce of ``grad_bytes`` (per cluster, before the 2(C-1)/C factor) over the link."""
    return link_seconds(2 * (s.clusters - 1) / s.clusters * grad_bytes, s, 2 * (s.clusters - 1))


def dilocox_comm_seconds(s: Setup, rb: dict) -> float:
    """Transfer time of one round: all ranks' bytes over the shared link, plus one latency per ring hop, plus
    (authenticated) sealing what each rank sends and verifying what it receives at HMAC_BYTES_PER_S."""
    local = s.lowrank and s.lowrank_basis == "local" or bool(s.sparse_k)
    scatter = not local and scheme_at(s.bits, s.clusters, s.scheme, s.payload_auth) == "reduce-scatter"
    gathered = s.bits != 32 or local
    hops = (s.clusters - 1) * (1 + 2 * (rb["phases"] - 1) if scatter or not gathered else rb["phases"])
    # every rank seals and verifies its own share, on its own core, in its exchange thread
    tags = 2 * rb["dilocox"] / (HMAC_BYTES_PER_S * s.gpus_per_cluster) if s.payload_auth and s.clusters > 1 else 0.0
    return link_seconds(rb["dilocox"], s, hops) + tags


def memory(s: Setup, rb: dict) -> dict:
    """Bytes of DiLoCoX state on the busiest GPU's rank (outer state on CPU or beside the params)."""
    n = rb["max_rank_numel"]
    outer = {"anchor": 4 * n, "momentum": 4 * n if s.outer_momentum else 0,
             "round_start": 4 * n if s.overlap != "none" else 0,
             # eager's private proxy: c, δ_{t−1} and c's momentum buffer (outer/nesterov.py LocalCorrection)
             "eager_correction": 4 * n * (2 + bool(s.outer_momentum)) if s.overlap == "eager" else 0}
    # beside the params: the codec's slabs (e and a spare for the next M; the last Δ of the low-rank groups)
    # and, while a round is in flight (overlapped modes), its δ_t (kept as error feedback if the round drops)
    gpu = {"error_feedback": 4 * n, "codec_slabs": 8 * n - 4 * rb.get("max_rank_whole_numel", 0), "in_flight_delta": 4 * n if s.overlap != "none" else 0,
           "q": 4 * rb["max_rank_q_numel"]}
    where = "cpu" if s.outer_state_device == "cpu" else "gpu"
    gpu_total = sum(gpu.values()) + (sum(outer.values()) if where == "gpu" else 0)
    cpu_total = sum(outer.values()) if where == "cpu" else 0
    return {"rank_numel": n, "outer_state_on": where, **outer, **gpu, "gpu_bytes": gpu_total,
            "cpu_bytes": cpu_total, "transient_gpu_bytes": 8 * n}  # δ and M = δ + e during a round


def predict(s: Setup) -> dict:
    n = model_params(s)
    rb = round_bytes(s)
    t_step = step_seconds(s, active_params(s))
    b_step = s.global_batch_tokens
    ceiling = b_step / t_step
    # AllReduce: dense gradients of every owned tensor, every step
    grad_bytes = rb["owned_numel"] * s.allreduce_bits / 8
    t_ar = allreduce_step_seconds(grad_bytes, s)
    # DiLoCo: dense fp32 pseudo-gradient every H steps, blocking (this package's boundary at overlap none)
    t_diloco = link_seconds(rb["dense_fp32"], s, 2 * (s.clusters - 1))
    e_diloco, b_diloco = exchange_and_boundary(replace(s, overlap="none"), rb, t_diloco, t_step)
    # DiLoCoX: compressed exchange every H steps, then the boundary's own work
    t_x = dilocox_comm_seconds(s, rb)
    exposed, bnd = exchange_and_boundary(s, rb, t_x, t_step)
    hidden = s.h * t_step
    schemes = {}  # both ways of moving the summable payloads, side by side
    for name in ("all-gather", "reduce-scatter"):
        alt = replace(s, scheme=name)
        alt_rb = round_bytes(alt)
        t = dilocox_comm_seconds(alt, alt_rb)
        e, b = exchange_and_boundary(alt, alt_rb, t, t_step)
        schemes[name] = {"bytes_per_cluster": alt_rb["dilocox"], "comm_seconds": t, "exposed_seconds": e,
                         "boundary_seconds": b["seconds"], "tokens_per_s": s.h * b_step / (hidden + e + b["seconds"]),
                         "compression_vs_dense_fp32": alt_rb["dense_fp32"] / max(alt_rb["dilocox"], 1)}
    methods = {
        "allreduce": {"seconds_per_step": t_step + t_ar, "comm_seconds": t_ar,
                      "bytes_per_cluster": 2 * (s.clusters - 1) * grad_bytes / s.clusters},
        "diloco": {"seconds_per_round": hidden + e_diloco + b_diloco["seconds"], "comm_seconds": t_diloco,
                   "exposed_seconds": e_diloco, "boundary_seconds": b_diloco["seconds"],
                   "bytes_per_cluster": rb["dense_fp32"]},
        "dilocox": {"seconds_per_round": hidden + exposed + bnd["seconds"], "comm_seconds": t_x,
                    "exposed_seconds": exposed, "boundary_seconds": bnd["seconds"], "bytes_per_cluster": rb["dilocox"],
                    "compression_vs_dense_fp32": rb["dense_fp32"] / max(rb["dilocox"], 1)},
        "ceiling": {"seconds_per_step": t_step},
    }
    methods["allreduce"]["tokens_per_s"] = b_step / methods["allreduce"]["seconds_per_step"]
    for k in ("diloco", "dilocox"):
        methods[k]["tokens_per_s"] = s.h * b_step / methods[k]["seconds_per_round"]
    methods["ceiling"]["tokens_per_s"] = ceiling
    ar = methods["allreduce"]["tokens_per_s"]
    return {"setup": asdict(s), "params": n, "active_params": active_params(s), "gpus": s.clusters * s.gpus_per_cluster, "step_seconds": t_step,
            "round_compute_seconds": hidden, "methods": methods, "memory": memory(s, rb), "schemes": schemes,
            "boundary": bnd,
            "scheme": scheme_at(s.bits, s.clusters, s.scheme, s.payload_auth, bool(s.sparse_k)),
            "views_rank_too_large": rb["views_rank_too_large"],
            "speedup_vs_allreduce": methods["dilocox"]["tokens_per_s"] / ar,
            "diloco_speedup_vs_allreduce": methods["diloco"]["tokens_per_s"] / ar}


# --------------------------------------------------------------------------------------- planner
def plan(s: Setup, h_min: int, h_max: Optional[int] = None, margin: float = 0.1,
         ranks: Optional[list] = None, bits_options: tuple = (32, 16, 8, 4)) -> dict:
    """Smallest H >= h_min that hides the transfer (adaptive-H rule), then the highest rank and bits.

    Candidates: every rank in ``ranks`` (default powers of two up to 1024; ``None`` = no low-rank, dense)
    with every quantization. H = max(h_min, ceil(T_comm / T_step * (1 + margin))), as in the package's
    adaptive H. Among the candidates with the smallest H, prefer dense over low-rank, then the higher
    rank, then the more bits (more information for the same hidden transfer). Low rank and quantization only: the
    sparse exchange is weighed against them by ``codec_choice.choose`` (--choose-codec)."""
    ranks = ranks if ranks is not None else [None] + [2 ** k for k in range(10, -1, -1)]
    t_step, views = step_seconds(s), rank_views(s)
    best, tried = None, []
    for r in ranks:
        for bits in bits_options:
            c = replace(s, rank=r or 1, lowrank=r is not None, bits=bits, sparse_k=0)
            rb = round_bytes(c, views)
            if rb["views_rank_too_large"]:
                continue
            t = dilocox_comm_seconds(c, rb)
            h = max(h_min, math.ceil(t / t_step * (1 + margin)))
            if h_max is not None and h > h_max:
                continue
            key = (h, -(r or math.inf), -bits)
            tried.append({"rank": r, "bits": bits, "h": h, "comm_seconds": t})
            if best is None or key < best[0]:
                best = (key, r, bits, h)
    if best is None:
        return {"feasible": False, "reason": f"no rank/bits hides the transfer with H <= {h_max}"}
    _, r, bits, h = best
    chosen = replace(s, h=h, rank=r or 1, lowrank=r is not None, bits=bits, sparse_k=0)
    return {"feasible": True, "h": h, "rank": r, "bits": bits, "prediction": predict(chosen),
            "candidates": sorted(tried, key=lambda x: (x["h"], -(x["rank"] or math.inf), -x["bits"]))}
