"""The round boundary's own work: what every rank does on its host between two inner steps, once per round
(pure Python; docs/algorithm.md#the-boundarys-own-work).

Where it runs. ``DiLoCoXSync.after_inner_step`` (outer/sync.py) is called by the training thread after the inner
optimizer step (glue/seam.py: ``DiLoCoXOptimizer.step``), and ``boundary()`` and ``land()`` run in that thread:
the next step starts when they return, so their work is exposed, every round. Only ``_exchange`` (the codec, the
collectives, the outer-state hash of the header) runs in the exchange thread, beside training; its host work is
added to the exchange's duration, which H steps hide or not (overlap none: the exchange runs in the training
thread too, all of it exposed).

What is counted, per round, n = the values the busiest rank owns (fp32 main params; ``round_bytes``'s
``max_rank_numel``), outer state on the CPU (``outer_state_device`` "cpu", the default) with the params on the GPU:

    boundary()   δ = round_start.to(gpu) − θ                                   H2D n
                 eager: c.step(δ): δ.to(cpu); (δ − δ_prev)·w; Outer_c; prev = δ.clone()
                                                                               D2H n (fresh), 18 passes, 4 fresh n
                        θ = φ.to(gpu) + c.to(gpu)                               H2D 2n
                 one-step-delay: θ = φ.to(gpu) − w δ                            H2D n
                 round_start = θ.to(cpu, copy=True)                             D2H n (fresh)
    land()       Δ.to(cpu); Nesterov: b.mul_(μ).add_(Δ); u = Δ.add(b, μ); φ.add_(u, −lr)
                                                                               D2H n, 11 passes, 2 fresh n
                 the metrics row's global-model hash: sha256(φ.numpy().tobytes())   copy n (fresh), sha256 n
                 (τ < H, the default adaptive τ when the exchange takes under H/2 steps: θ = φ.to(gpu) +
                 θ − round_start.to(gpu); round_start.copy_(φ))                 H2D 2n, copy n
    overlap none: δ (H2D n), the outer step and hash as in land(), θ ← φ (H2D n)
    exchange thread: the header's state hash, sha256 of φ and the momentum (tobytes: copy 2n fresh, sha256 2n)

A pass is 4 bytes read or written per value (``b.mul_(μ).add_(Δ)``: 5 passes); a copy of B bytes moves 2B; a
fresh host tensor (the CPU allocator mmaps large blocks anew) costs first-touch page faults on top. A GPU-host
copy of B bytes into or out of pageable memory (``.to("cpu")``) is staged by the CUDA driver through pinned
buffers: the DMA (B / ``pcie_gb_s``) and the driver's memcpy (2B at the host copy rate) pipeline, the slower
wins. With ``outer_state_device`` "param" the outer state lives on the GPU: no GPU-host copy but the hashes' (the
hash reads φ, and the momentum, on the host: ``.cpu()``), and the GPU-side arithmetic is not counted (tens of
passes over n at HBM rates: under 0.1 s at 1.4B values). Not counted either: the outer-lr warm-up's rescale of
c (one pass, while the lr changes), the codec's arithmetic (on the GPU, in the exchange thread), the payloads'
own GPU-host copies (what a rank sends and receives: under a second at the paper's scale with the default scheme),
and the extra param all-gather of the distributed optimizer after a boundary (glue/seam.py; intra-cluster, GPU).

Rates: one core each (torchrun starts every rank with OMP_NUM_THREADS=1), capped by the rank's share of the
node's memory bandwidth (``node_memory_gb_s`` / ``gpus_per_node``: every rank of a node reaches the boundary at
the same step), all in bytes read + written per second (STREAM's convention).
"""
from __future__ import annotations

import math

# One core of this repository's CI host (2 vCPU AMD EPYC, KVM): scripts/bench/boundary_cost.py, 64M fp32 values, best
# of 5 in CPU time, the median of 3 runs, while a benchmark loaded both cores (load average 16-30). Idle, one run:
# 40.4, 52.9, 2.8, 2.11; the loaded figures stay, as a node's ranks share its memory at the boundary
# (docs/algorithm.md#the-boundarys-own-work). (Page faults cost more in a VM: HOST_FIRST_TOUCH_GB_S may be low
# for a bare-metal server.)
HOST_COPY_GB_S = 30.2  # dst.copy_(src): bytes read + written per second (runs: 30.2, 30.8, 22.2)
HOST_ELEMENTWISE_GB_S = 41.8  # b.mul_(m).add_(d), torch.add(d, b, alpha, out=u), a.add_(u, alpha) (41.8, 41.8, 35.7)
HOST_FIRST_TOUCH_GB_S = 2.0  # a fresh tensor: its bytes / (fresh-output add - the same add with out=) (2.1, 1.8, 2.0)
SHA256_GB_S = 1.76  # hashlib.sha256 over a tensor's bytes, SHA-NI (1.78, 1.76, 1.70; tag_cost.py's HMAC: 1.73)
# Not measured here (no GPU, one small VM): typical figures.
NODE_MEMORY_GB_S = 400.0  # a two-socket DDR5 server node (16 channels, 614 GB/s peak; STREAM ~2/3 of it)
PCIE_GB_S = 50.0  # H100 on PCIe Gen5 x16: 64 GB/s per direction raw, ~50 GB/s effective DMA (pinned)
# The canonical layout (sim/canonical.py), typical figures too. Its moves inside a site go one pair of ranks at a
# time, and in a site of several nodes most pairs meet across nodes: one NIC each, a 200 Gb/s HDR InfiniBand rail
# per GPU (A100/A800 clusters'; NDR's 400 Gb/s would double it).
INTRA_SITE_GB_S = 25.0
# A rank's host memory: 1 TB per 8-GPU node (DGX A100's), 3/4 of a rank's share, the rest left to the OS, Megatron's
# own host use (data loader workers, checkpoint staging) and pinned buffers.
HOST_MEMORY_GB = 96.0

# Work per value the rank owns: passes (4 bytes each) of elementwise ops and of copies, values of fresh host
# memory, values hashed, values moved host-to-device and device-to-host.
OUTER_STEP = {"elementwise": 11, "fresh": 1}  # OuterNesterov.step after the first: 5 + 3 + 3 passes, u fresh
OUTER_STEP_NO_MOMENTUM = {"elementwise": 3}  # φ.add_(Δ, −lr)
EAGER_CORRECTION = {"elementwise": 18, "fresh": 4}  # LocalCorrection.step: (δ − p)·w 5, the step 11, clone 2
HASH = {"copy": 2, "fresh": 1, "hashed": 1}  # report.tensors_hash of a host tensor: tobytes, then sha256


def _add(*works) -> dict:
    out: dict = {}
    for w in works:
        for k, v in w.items():
            out[k] = out.get(k, 0) + v
    return out


def host_seconds(work: dict, n: int, s) -> float:
    """Seconds one rank takes for ``work`` (counts per value, as above) over ``n`` fp32 values, at ``s``'s rates
    (a Setup, or anything with its rate fields)."""
    node = s.node_memory_gb_s * 1e9 / s.gpus_per_node  # this rank's share of the node's memory bandwidth
    copy, b = min(s.host_copy_gb_s * 1e9, node), 4 * n
    per_transfer = max(1 / (s.pcie_gb_s * 1e9), 2 / copy, 3 / node)  # DMA into staging, memcpy out of it
    return b * (work.get("elementwise", 0) / min(s.host_elementwise_gb_s * 1e9, node)
                + work.get("copy", 0) / copy + work.get("fresh", 0) / min(s.host_first_touch_gb_s * 1e9, node)
                + work.get("hashed", 0) / min(s.sha256_gb_s * 1e9, node)
                + (work.get("h2d", 0) + work.get("d2h", 0)) * per_transfer)


def boundary_work(s, lands_apart: bool = True) -> tuple[dict, dict]:
    """(training thread's parts, exchange thread's parts) of one round, each part a work dict per value owned.
    ``lands_apart``: the round lands τ < H steps in, in ``land()`` (else at the next boundary, τ = H)."""
    cpu, delayed = s.outer_state_device == "cpu", s.overlap != "none"
    momentum = s.outer_momentum > 0
    host = {"d2h": 1, "fresh": 1}  # tensor.to("cpu"): a fresh host tensor
    main = {"pseudo_gradient": {"h2d": 1} if cpu else {},
            "outer_step": _add(host, OUTER_STEP if momentum else OUTER_STEP_NO_MOMENTUM) if cpu else {},
            "global_model_hash": HASH if cpu else _add(host, HASH)}
    if not delayed:
        main["set_params"] = {"h2d": 1} if cpu else {}
    else:
        eager = _add(host, EAGER_CORRECTION, {"h2d": 2})
        main["local_start"] = (eager if s.overlap == "eager" else {"h2d": 1}) if cpu else {}
        main["round_start"] = dict(host) if cpu else {}
        main["landing"] = {"h2d": 2, "copy": 2} if cpu and lands_apart else {}
    state = 2 if momentum else 1  # φ and the momentum buffer
    thread = {"state_hash": {k: state * v for k, v in (HASH if cpu else _add(host, HASH)).items()}}
    return main, thread


def boundary_seconds(s, rb: dict, lands_apart: bool = True) -> dict:
    """Seconds of one round's boundary work on the busiest rank, by part: ``seconds`` (training thread:
    exposed every round) and ``exchange_thread_seconds`` (part of the exchange: hidden when H steps hide it);
    ``pcie_bytes``: what crosses PCIe in the training thread."""
    n = rb["max_rank_numel"]
    main, thread = boundary_work(s, lands_apart)
    parts = {k: host_seconds(w, n, s) for k, w in main.items()}
    in_thread = {k: host_seconds(w, n, s) for k, w in thread.items()}
    moved = sum(w.get("h2d", 0) + w.get("d2h", 0) for w in main.values())
    return {"parts": parts, "seconds": sum(parts.values()), "exchange_thread": in_thread,
            "exchange_thread_seconds": sum(in_thread.values()), "pcie_bytes": 4 * n * moved,
            "rank_numel": n, "lands_apart": lands_apart}


def exchange_and_boundary(s, rb: dict, t_comm: float, t_step: float) -> tuple[float, dict]:
    """(exposed seconds of the exchange, ``boundary_seconds``) of one round. The exchange (the transfer and its
    thread's host work) hides behind H steps unless overlap is none; the boundary's own work never hides. The
    round lands apart (``land()``) when adaptive τ = ceil(2 T_exchange / T_step) < H, or at once (τ = 0; plan.py)."""
    t_ex = t_comm + boundary_seconds(s, rb)["exchange_thread_seconds"]
    apart = s.overlap != "none" and (math.ceil(2 * t_ex / t_step) < s.h or t_ex <= 0.5 * t_step)
    return (max(0.0, t_ex - s.h * t_step) if s.overlap != "none" else t_ex), boundary_seconds(s, rb, apart)
