"""Compress + decompress throughput of the real DiLoCoX codec on 100B-scale per-GPU shard shapes.

What one GPU of a 107B-class GPT holds (TP 8, one pipeline stage) is compressed by the real
``PseudoGradientCodec.exchange`` with ``SoloCollective`` (C=1: the compression arithmetic -- P = MQ,
quantize/dequantize, orthonormalize, Q' = M^T P^, reconstruction, error feedback, energy statistics -- is
the same for any C; only the wire is missing). Each shape group is timed as its own codec holding that
shape's matrices from every simulated layer, batched exactly as the stage's codec batches them.

Baselines measured in the same invocation:
  floor      memory-bandwidth floor: the codec must read M at least twice (P = MQ, Q' = M^T P^), so
             floor = 2 * bytes(M) / B, with B the bandwidth of a large tensor copy (read + write bytes / s).
             "passes" = codec time * B / bytes(M): how many M-sized memory transfers the codec time is worth.
  matmul     the two M-sized products alone (bmm(M, Q) and bmm(P^T, M): Q'^T, the faster layout of M^T P) at
             the same rank: the arithmetic floor. "x bound" = codec / max(memory floor, arithmetic floor).
  powersgd   PyTorch's own hook, torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook,
             run as is (warm start, error feedback, same-shape batching) in a single-process gloo group.
             GradBucket has no Python constructor, so the hook gets a stand-in bucket object with the five
             methods it calls (buffer, index, gradients, is_last, parameters). PowerSGD sends fp32 factors
             (no quantization), so "codec / powersgd" prices int4/int8 quantization + the codec's extras.

    .venv/bin/python scripts/bench/compression_micro.py --quick          # ~40 s on 2 cores
    .venv/bin/python scripts/bench/compression_micro.py                  # ~2 min on 2 cores
    .venv/bin/python scripts/bench/compression_micro.py --preset readme-107b --scale 0.25 --out x.json

``--scale`` is the fraction of a stage's layers simulated (at least 1); per-matrix and per-GB figures do
not depend on it, full-stage seconds are extrapolated linearly from it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))  # provenance.py

from megatron_dilocox.compression.codec import PseudoGradientCodec  # noqa: E402
from megatron_dilocox.compression.collective import SoloCollective  # noqa: E402
from megatron_dilocox.config import DiLoCoXConfig  # noqa: E402
from provenance import provenance  # noqa: E402

# Megatron weight layout is [out, in]; ColumnParallel (QKV, FC1) splits rows by TP, RowParallel (proj, FC2)
# splits columns by TP. Embedding / output layer live on the first / last stage only: a middle stage here.
PRESETS = {
    # h 8192, FFN 28672 (GELU, no GLU), 64 heads MHA, 144 layers: 144 * 738M = 106.3B (+ 1.0B embeddings)
    "dense-107b": dict(hidden=8192, ffn=28672, heads=64, groups=64, swiglu=False, layers=144, tp=8, pp=16),
    # docs/slurm.md's illustrative layout: h 8192, FFN 49152 SwiGLU, GQA 64/8, 80 layers: 80 * 1.36B = 108.6B
    "readme-107b": dict(hidden=8192, ffn=49152, heads=64, groups=8, swiglu=True, layers=80, tp=8, pp=10),
}


def shard_shapes(p: dict) -> list[tuple[str, tuple[int, ...]]]:
    """One layer's tensors on one GPU (TP shard, fp32 main params): (name, shape)."""
    h, tp = p["hidden"], p["tp"]
    head_dim = h // p["heads"]
    qkv_rows = (p["heads"] + 2 * p["groups"]) * head_dim // tp
    fc1_rows = (2 if p["swiglu"] else 1) * p["ffn"] // tp
    return [("qkv", (qkv_rows, h)), ("proj", (h, h // tp)), ("fc1", (fc1_rows, h)),
            ("fc2", (h, p["ffn"] // tp)), ("norm", (h,)), ("norm2", (h,))]


def total_params(p: dict) -> float:
    h = p["hidden"]
    kv = 2 * p["groups"] * (h // p["heads"])
    per_layer = h * (h + kv) + h * h + (3 if p["swiglu"] else 2) * h * p["ffn"] + 2 * h
    return p["layers"] * per_layer


def timed(fn, reps: int, warmup: int = 0, setup=None) -> list[float]:
    out = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def copy_bandwidth(src: torch.Tensor, dst: torch.Tensor, reps: int = 1) -> float:
    """Bytes moved per second (read + write) by a large contiguous copy; best of ``reps``."""
    best = min(timed(lambda: dst.copy_(src), reps))
    return 2 * src.numel() * src.element_size() / best


def med(xs):
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------------------------------ PowerSGD
class _Bucket:
    """What powerSGD_hook calls on a GradBucket (which torch does not let Python construct)."""

    def __init__(self, buf: torch.Tensor, shapes):
        self._buf, self._shapes = buf, [torch.Size(s) for s in shapes]

    def buffer(self):
        return self._buf

    def index(self):
        return 0

    def is_last(self):
        return True

    def parameters(self):
        return []

    def gradients(self):
        out, off = [], 0
        for s in self._shapes:
            out.append(self._buf[off:off + s.numel()].view(s))
            off += s.numel()
        return out


def init_gloo():
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def powersgd_call(mats: list[torch.Tensor], rank: int):
    """(setup, call): one run of torch's powerSGD_hook on ``mats`` as one bucket (setup refills the buffer)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    state = PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                          min_compression_rate=1, use_error_feedback=True, warm_start=True,
                          batch_tensors_with_same_shape=True, compression_stats_logging_frequency=10**9)
    state.iter = state.start_powerSGD_iter  # skip the vanilla-allreduce warm-up iterations
    flat = torch.cat([m.reshape(-1) for m in mats])
    buf = torch.empty_like(flat)
    bucket = _Bucket(buf, [m.shape for m in mats])
    return (lambda: buf.copy_(flat)), (lambda: powerSGD_hook(state, bucket).wait())


# ------------------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="dense-107b")
    ap.add_argument("--scale", type=float, default=None,
                    help="fraction of a pipeline stage's layers to simulate (default: 1 layer)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--block", type=int, default=128, help="--dilocox-quant-block-size")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3, --quick 1)")
    ap.add_argument("--quick", action="store_true", help="1 timed repetition, no warm-up call")
    ap.add_argument("--no-powersgd", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the codec's top ops for the first config")
    ap.add_argument("--out", default=None, help="JSON results (default runs/bench/compression_micro-<time>.json)")
    a = ap.parse_args(argv)
    prov = provenance()
    reps = a.reps or (1 if a.quick else 3)
    warmup = 0 if a.quick else 1
    p = PRESETS[a.preset]
    per_stage = p["layers"] // p["pp"]
    layers = max(1, round(per_stage * a.scale)) if a.scale else 1
    extrap = per_stage / layers
    shapes = shard_shapes(p)
    load0 = os.getloadavg()
    torch.manual_seed(0)

    print(f"# preset {a.preset}: {total_params(p) / 1e9:.1f}B params, hidden {p['hidden']}, ffn {p['ffn']}, "
          f"TP{p['tp']} PP{p['pp']} -> {per_stage} layers/stage; simulating {layers} layer(s) "
          f"(full-stage figures x{extrap:.2f})")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus, "
          f"load avg {load0[0]:.2f}; reps {reps} (+{warmup} warm-up), median reported")

    # one tiny exchange first: library loading (LAPACK, thread pools) is not part of any figure
    PseudoGradientCodec([(256, 256)], DiLoCoXConfig(lowrank_rank=4).validate()).exchange(
        [torch.randn(256, 256)], SoloCollective(), 1)

    # the copy-bandwidth probe: a 1 GiB fp32 copy, measured once here and again beside every timed codec call
    src = torch.ones(1 << 28)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    bw0 = copy_bandwidth(src, dst, 3)
    print(f"# copy bandwidth (1 GiB fp32 tensor copy, read+write): {bw0 / 1e9:.2f} GB/s")
    if not a.no_powersgd:
        init_gloo()

    # group the layer tensors by shape, as the stage codec does
    groups: dict = {}
    for name, s in shapes:
        key = "norms" if len(s) == 1 else name
        groups.setdefault(key, {"shape": s, "names": [], "count": 0})
        groups[key]["names"].append(name)
        groups[key]["count"] += layers
    for g in groups.values():
        g["tensors"] = [torch.randn(g["shape"]) * 1e-3 for _ in range(g["count"])]
        g["bytes"] = 4 * sum(t.numel() for t in g["tensors"])
    stage_bytes_sim = sum(g["bytes"] for g in groups.values())
    print("# per layer per GPU: " + ", ".join(f"{n} {list(s)}" for n, s in shapes)
          + f"; {stage_bytes_sim / layers / 1e6:.0f} MB fp32/layer, {stage_bytes_sim * extrap / 1e9:.2f} GB/stage")

    # Interleaved: per repetition, the copy probe, the matmuls, PowerSGD and the codec at every bit width run
    # back to back on the same matrices, and ratios are taken per repetition (then the median), so load that
    # drifts during the run (a shared host) hits the codec and its baselines alike.
    rows = []
    per_rep: dict = {}  # (group, rank) -> {"bw": [...], "matmul": [...], "psgd": [...], bits: [...]}
    for rank in a.ranks:
        for key, g in groups.items():
            cfgs = {bits: DiLoCoXConfig(lowrank_rank=rank, quant_bits=bits, quant_block_size=a.block,
                                        adaptive_rank=False).validate() for bits in a.bits}
            codecs = {bits: PseudoGradientCodec([t.shape for t in g["tensors"]], c) for bits, c in cfgs.items()}
            rnd = iter(range(1, 10**6))
            calls = {bits: (lambda c=c: c.exchange(g["tensors"], SoloCollective(), next(rnd)))
                     for bits, c in codecs.items()}
            matrix = key != "norms"
            if matrix:
                mats = torch.stack(g["tensors"])
                q = torch.randn(g["count"], g["shape"][1], rank)
                pt = torch.randn(g["count"], rank, g["shape"][0])
                mm_call = lambda: (torch.bmm(mats, q), torch.bmm(pt, mats))  # noqa: E731
                ps_setup, ps_call = powersgd_call(g["tensors"], rank) if not a.no_powersgd else (None, None)
            if a.profile and not rows:
                from torch.profiler import profile
                calls[a.bits[0]]()
                with profile() as prof:
                    calls[a.bits[0]]()
                print(f"# codec profile: {key} x{g['count']}, rank {rank}, {a.bits[0]} bits")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            rec = {"bw": [], "matmul": [], "psgd": [], **{b: [] for b in a.bits}, "sys": {b: [] for b in a.bits}}
            for i in range(warmup + reps):
                keep = i >= warmup
                bw = copy_bandwidth(src, dst)
                if matrix:
                    t_mm = timed(mm_call, 1)[0]
                    t_ps = timed(ps_call, 1, setup=ps_setup)[0] if ps_call else None
                for bits in a.bits:
                    cpu0 = os.times()
                    t = timed(calls[bits], 1)[0]
                    cpu1 = os.times()
                    user, sys_ = cpu1.user - cpu0.user, cpu1.system - cpu0.system
                    if keep:
                        rec[bits].append(t)
                        rec["sys"][bits].append(sys_ / max(user + sys_, 1e-9))
                if keep:
                    rec["bw"].append(bw)
                    if matrix:
                        rec["matmul"].append(t_mm)
                        if t_ps is not None:
                            rec["psgd"].append(t_ps)
            per_rep[(key, rank)] = rec
            for bits in a.bits:
                p1, p2 = codecs[bits].payload_sizes()
                ts = rec[bits]
                floors = [2 * g["bytes"] / b for b in rec["bw"]]
                row = {"group": key, "shape": list(g["shape"]), "count": g["count"], "rank": rank, "bits": bits,
                       "bytes_M": g["bytes"], "codec_s": med(ts), "codec_s_reps": ts, "payload_bytes": p1 + p2,
                       "copy_Bps": med(rec["bw"]), "floor_s": med(floors),
                       "x_floor": med([t / f for t, f in zip(ts, floors)]),
                       "passes": med([t * b / g["bytes"] for t, b in zip(ts, rec["bw"])]),
                       "cpu_sys_frac": med(rec["sys"][bits])}
                if matrix:
                    row.update(matmul_s=med(rec["matmul"]), x_matmul=med([t / m for t, m in zip(ts, rec["matmul"])]),
                               x_bound=med([t / max(f, m) for t, f, m in zip(ts, floors, rec["matmul"])]),
                               powersgd_s=med(rec["psgd"]),
                               x_powersgd=med([t / x for t, x in zip(ts, rec["psgd"])]) if rec["psgd"] else None)
                rows.append(row)
            del codecs, calls
            if matrix:
                del mats, mm_call, ps_setup, ps_call

    # ----------------------------------------------------------------------------------- report
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    print(f"\nPer matrix ({layers} layer(s) batched per shape group; times per matrix, ms; GB/s = fp32 M / time; "
          f"x = median over reps of the paired ratio)")
    hdr = (f"{'group':6s} {'shape':>12s} {'MB':>6s} {'r':>3s} {'b':>2s} | {'codec':>8s} {'GB/s':>5s} | "
           f"{'floor':>6s} {'x floor':>7s} {'passes':>6s} | {'matmul':>7s} {'x mm':>5s} | {'psgd':>7s} {'x psgd':>6s} | "
           f"{'fp32/wire':>9s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        n = r["count"]
        mm, ps = r.get("matmul_s"), r.get("powersgd_s")
        print(f"{r['group']:6s} {'x'.join(map(str, r['shape'])):>12s} {r['bytes_M'] / n / 1e6:6.1f} {r['rank']:3d} "
              f"{r['bits']:2d} | {1e3 * r['codec_s'] / n:8.1f} {r['bytes_M'] / r['codec_s'] / 1e9:5.2f} | "
              f"{1e3 * r['floor_s'] / n:6.1f} {r['x_floor']:7.1f} {r['passes']:6.1f} | "
              f"{fmt(mm and 1e3 * mm / n, '7.1f')} {fmt(r.get('x_matmul'), '5.1f')} | "
              f"{fmt(ps and 1e3 * ps / n, '7.1f')} {fmt(r.get('x_powersgd'), '6.2f')} | "
              f"{r['bytes_M'] / r['payload_bytes']:9.0f}")

    summary = []
    for rank in a.ranks:
        for bits in a.bits:
            sel = [r for r in rows if r["rank"] == rank and r["bits"] == bits]
            nbytes = sum(r["bytes_M"] for r in sel)
            recs = {k: per_rep[(k, rank)] for k in groups}
            mats_k = [k for k in groups if k != "norms"]
            t_rep = [sum(recs[k][bits][i] for k in groups) for i in range(reps)]
            tm_rep = [sum(recs[k][bits][i] for k in mats_k) for i in range(reps)]
            floor_rep = [sum(2 * groups[k]["bytes"] / recs[k]["bw"][i] for k in groups) for i in range(reps)]
            mm_rep = [sum(recs[k]["matmul"][i] for k in mats_k) for i in range(reps)]
            # per group the larger of its memory floor and its matmuls (norms: memory floor only)
            bound_rep = [sum(max(2 * groups[k]["bytes"] / recs[k]["bw"][i], recs[k]["matmul"][i] if k in mats_k else 0)
                             for k in groups) for i in range(reps)]
            ps_rep = ([sum(recs[k]["psgd"][i] for k in mats_k) for i in range(reps)]
                      if all(recs[k]["psgd"] for k in mats_k) else None)
            t = med(t_rep)
            summary.append({
                "rank": rank, "bits": bits, "sim_layers": layers, "bytes_M_sim": nbytes, "codec_s_sim": t,
                "codec_s_per_GB": t / (nbytes / 1e9), "codec_GBps": nbytes / t / 1e9,
                "stage_bytes": nbytes * extrap, "stage_codec_s": t * extrap, "floor_s_stage": med(floor_rep) * extrap,
                "x_floor": med([a_ / b_ for a_, b_ in zip(t_rep, floor_rep)]),
                "passes": med([a_ / b_ * 2 for a_, b_ in zip(t_rep, floor_rep)]),
                "x_matmul": med([a_ / b_ for a_, b_ in zip(tm_rep, mm_rep)]),
                "x_bound": med([a_ / b_ for a_, b_ in zip(t_rep, bound_rep)]),
                "powersgd_s_stage": ps_rep and med(ps_rep) * extrap,
                "x_powersgd": ps_rep and med([a_ / b_ for a_, b_ in zip(tm_rep, ps_rep)]),
                "compression_ratio": nbytes / sum(r["payload_bytes"] for r in sel),
                "cpu_sys_frac": statistics.mean(r["cpu_sys_frac"] for r in sel if r["group"] != "norms")})
    print(f"\nWhole pipeline stage ({per_stage} layers, {summary[0]['stage_bytes'] / 1e9:.2f} GB fp32 per GPU; "
          f"extrapolated from {layers} layer(s))")
    hdr = (f"{'r':>3s} {'b':>2s} | {'codec s':>7s} {'s/GB':>5s} {'GB/s':>5s} | {'floor s':>7s} {'x floor':>7s} "
           f"{'passes':>6s} | {'x matmul':>8s} {'x bound':>7s} | {'psgd s':>6s} {'x psgd':>6s} | {'fp32/wire':>9s} {'sys%':>4s}")
    print(hdr)
    print("-" * len(hdr))
    for s in summary:
        print(f"{s['rank']:3d} {s['bits']:2d} | {s['stage_codec_s']:7.2f} {s['codec_s_per_GB']:5.2f} "
              f"{s['codec_GBps']:5.2f} | {s['floor_s_stage']:7.3f} {s['x_floor']:7.1f} {s['passes']:6.1f} | "
              f"{fmt(s['x_matmul'], '8.2f')} {s['x_bound']:7.2f} | {fmt(s['powersgd_s_stage'], '6.2f')} {fmt(s['x_powersgd'], '6.2f')} | "
              f"{s['compression_ratio']:9.0f} {100 * s['cpu_sys_frac']:4.0f}")
    print("x floor = codec / (2 reads of M at copy bandwidth); passes = codec time in M-sized copies; "
          "x matmul = codec / (bmm(M,Q) + bmm(P^T,M)); x bound = codec / max(floor, matmul) per group; x psgd = codec / torch powerSGD_hook (fp32, matrices only); "
          "sys% = kernel share of the codec's CPU time (page faults of fresh M-sized temporaries)")

    load1 = os.getloadavg()
    out = a.out or os.path.join(REPO, "runs", "bench",
                                f"compression_micro-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    result = {"script": "compression_micro", **prov, "args": vars(a), "preset": a.preset, "model": p,
              "total_params": total_params(p), "layers_per_stage": per_stage, "sim_layers": layers,
              "copy_bandwidth_Bps": bw0, "reps": reps, "warmup": warmup,
              "env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                      "machine": platform.processor() or platform.machine(), "loadavg_start": load0,
                      "loadavg_end": load1},
              "powersgd": "torch powerSGD_hook run as is with a stand-in bucket (GradBucket has no Python "
                          "constructor); single-process gloo group; fp32 factors",
              "rows": rows, "summary": summary}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"# wrote {out}; load avg {load0[0]:.2f} -> {load1[0]:.2f}"
          + (" (other work on this host: ratios are more robust than absolute times)" if max(load0[0], load1[0]) > 0.5 * os.cpu_count() else ""))


if __name__ == "__main__":
    main()
