"""Inner-step overhead of DiLoCoX inside real Megatron (CPU), against plain Megatron, in one invocation.

Three configurations of the same small GPT on the KJV corpus, each a real ``megatron.training.pretrain``
run started by ``megatron_dilocox.harness.launch.run`` (one cluster, ``--nproc`` processes):

  plain      no --dilocox (the entry is plain Megatron)
  none       --dilocox --dilocox-num-clusters 1 --dilocox-overlap none          (no rendezvous at C=1)
  delay      --dilocox --dilocox-num-clusters 1 --dilocox-overlap one-step-delay

Megatron's "elapsed time per iteration (ms)" is read for every iteration (--log-interval 1). Iterations
are classed by their position in the round (H fixed, --dilocox-no-adaptive-h): "boundary" = multiples of
H (the hook compresses and, for none, applies the round there), "after" = the step following a boundary
(with one-step-delay the exchange runs in a background thread during it), "mid" = the rest; "between"
= after + mid. The first --skip iterations (warm-up) and the last one (end-of-training flush) are
left out. The same iteration indices of the plain run are the baseline for each class. The configurations
run interleaved, --reps times, in a rotating order; samples are pooled over repetitions; medians and
IQRs are printed, with ratios of medians against plain. The C=1 exchange (``comm_seconds`` in the
metrics) is the codec's compute: no bytes leave the process.

    .venv/bin/python scripts/bench/step_overhead.py --quick        # ~1 min on 2 cores
    .venv/bin/python scripts/bench/step_overhead.py                # ~4 min on 2 cores
    .venv/bin/python scripts/bench/step_overhead.py --hidden 256 --nproc 2 -- --pipeline-model-parallel-size 2

Anything after ``--`` is appended to every configuration's Megatron flags.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))  # provenance.py

from megatron_dilocox.glue.cpu_backend import CPU_FLAGS  # noqa: E402
from megatron_dilocox.harness.launch import run  # noqa: E402
from megatron_dilocox.metrics import read_rows  # noqa: E402
from provenance import provenance  # noqa: E402

CONFIGS = ("plain", "none", "delay")
CLASSES = ("between", "mid", "after", "boundary")


def gpt_flags(corpus: str, iters: int, hidden: int, layers: int, heads: int, seq: int, gbs: int) -> list[str]:
    """The tests' tiny GPT (tests/megatron_flags.py) with the width, depth and batch as knobs."""
    return CPU_FLAGS + [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--position-embedding-type", "rope",
        "--micro-batch-size", "2", "--global-batch-size", str(gbs), "--train-iters", str(iters),
        "--lr", "3e-3", "--lr-decay-style", "constant", "--log-interval", "1",
        "--eval-interval", str(iters), "--eval-iters", "1", "--num-workers", "0", "--seed", "1234",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{corpus}/tokenizer.model",
        "--train-data-path", f"{corpus}/train_c0_text_document",
        "--valid-data-path", f"{corpus}/valid_text_document"]


def dilocox_flags(overlap: str, h: int, rank: int, bits: int, metrics: str) -> list[str]:
    return ["--dilocox-h", str(h), "--dilocox-no-adaptive-h", "--dilocox-overlap", overlap,
            "--dilocox-lowrank-rank", str(rank), "--dilocox-no-adaptive-rank", "--dilocox-lowrank-min-dim", "32",
            "--dilocox-quant-bits", str(bits), "--dilocox-quant-block-size", "64", "--dilocox-metrics-file", metrics]


def stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"n": len(xs), "median": med, "q1": q1, "q3": q3, "iqr": q3 - q1, "mean": statistics.fmean(xs)}


def classify(it: int, h: int) -> str:
    return "boundary" if it % h == 0 else "after" if it % h == 1 else "mid"


def paired_excess(iter_ms: dict, h: int, skip: int, iters: int) -> dict:
    """Within one run: boundary / after step minus the median of the same round's mid steps (ms).

    Robust to load that drifts between runs (a shared host): each step is compared with its neighbours."""
    out = {"boundary": [], "after": []}

    def mids(lo, hi):  # mid steps lo..hi inclusive, past warm-up, before the last iteration
        return [iter_ms[i] for i in range(lo, hi + 1) if skip < i < iters and i in iter_ms and classify(i, h) == "mid"]

    for b in range(h, iters, h):
        before = mids(b - h + 2, b - 1)
        if b > skip and before:
            out["boundary"].append(iter_ms[b] - statistics.median(before))
        after = mids(b + 2, b + h - 1)
        if b + 1 > skip and b + 1 < iters and after:
            out["after"].append(iter_ms[b + 1] - statistics.median(after))
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repetition of 20 iterations (~1 min on 2 cores)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 3, --quick 1)")
    ap.add_argument("--iters", type=int, default=None, help="--train-iters, a multiple of H (default 40, --quick 20)")
    ap.add_argument("--h", type=int, default=5, help="--dilocox-h (fixed)")
    ap.add_argument("--skip", type=int, default=2, help="warm-up iterations left out")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=4, help="--dilocox-lowrank-rank (fixed)")
    ap.add_argument("--bits", type=int, default=4, help="--dilocox-quant-bits")
    ap.add_argument("--nproc", type=int, default=1, help="processes of the one cluster")
    ap.add_argument("--data", default=os.path.join(REPO, "data", "kjv"), help="corpus dir (built if missing)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per Megatron run")
    ap.add_argument("--out", default=None, help="JSON results (default runs/bench/step_overhead-<time>.json)")
    a = ap.parse_args(own)
    prov = provenance()
    reps = a.reps or (1 if a.quick else 3)
    iters = a.iters or (20 if a.quick else 40)
    if iters % a.h:
        ap.error(f"--iters ({iters}) must be a multiple of --h ({a.h})")

    from megatron_dilocox.data.prepare import prepare
    prepare(a.data, num_clusters=2)  # idempotent: reuses what is there
    load0 = os.getloadavg()
    t_start = time.time()
    base = gpt_flags(a.data, iters, a.hidden, a.layers, a.heads, a.seq, a.global_batch) + extra
    env = {"CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline"}
    print(f"# GPT hidden {a.hidden} x {a.layers} layers, seq {a.seq}, global batch {a.global_batch}, nproc {a.nproc}; "
          f"{iters} iters, H={a.h}, rank {a.rank}, {a.bits} bits; {reps} interleaved rep(s); load avg {load0[0]:.2f}",
          flush=True)

    samples = {c: {k: [] for k in CLASSES + ("final",)} for c in CONFIGS}
    raw, rounds, params = [], {c: [] for c in CONFIGS}, None
    paired = {c: {"boundary": [], "after": []} for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="dilocox-step-") as tmp:
        for rep in range(reps):
            order = CONFIGS[rep % 3:] + CONFIGS[:rep % 3]
            for cfg in order:
                metrics = os.path.join(tmp, f"m_{cfg}_{rep}.jsonl")
                dl = None if cfg == "plain" else dilocox_flags(
                    "none" if cfg == "none" else "one-step-delay", a.h, a.rank, a.bits, metrics)
                t0 = time.time()
                codes, logs = run(1, a.nproc, base, dilocox_args=dl, env=env, timeout=a.timeout, echo=False)
                log = logs[0]
                if codes != [0] or len(log.iter_ms) < iters:
                    sys.exit(f"{cfg} run failed (exit {codes}, {len(log.iter_ms)} iterations):\n"
                             + "\n".join(log.lines[-40:]))
                if params is None:
                    params = next((int(ln.rsplit(":", 1)[1]) for ln in log.lines
                                   if "number of parameters on" in ln), None)
                for it, ms in sorted(log.iter_ms.items()):
                    if it <= a.skip:
                        continue
                    cls = "final" if it == iters else classify(it, a.h)
                    samples[cfg][cls].append(ms)
                    if cls in ("mid", "after"):
                        samples[cfg]["between"].append(ms)
                iter_ms = {int(k): v for k, v in log.iter_ms.items()}
                for k, v in paired_excess(iter_ms, a.h, a.skip, iters).items():
                    paired[cfg][k] += v
                if dl is not None:
                    rounds[cfg] += [{"rep": rep, **{k: r[k] for k in ("round", "iteration", "comm_seconds",
                                                                     "exposed_comm_seconds", "bytes_sent")}}
                                    for r in read_rows(metrics)]
                raw.append({"rep": rep, "config": cfg, "iter_ms": log.iter_ms, "wall_s": time.time() - t0,
                            "loadavg_end": os.getloadavg()[0]})
                print(f"# rep {rep} {cfg:5s}: {time.time() - t0:5.1f}s wall, median step "
                      f"{statistics.median(list(log.iter_ms.values())[a.skip:]):.1f} ms", flush=True)

    table = {c: {k: stats(v) for k, v in samples[c].items()} for c in CONFIGS}
    print(f"\nStep time (ms), median [IQR], pooled over {reps} rep(s); x = ratio of medians vs plain"
          + (f"; model {params / 1e6:.2f}M params/rank" if params else ""))
    hdr = f"{'config':6s} | " + " | ".join(f"{k:>22s}" for k in ("between", "after (1st post-boundary)",
                                                                   "boundary (it % H == 0)", "mean, all steps"))
    print(hdr)
    print("-" * len(hdr))
    summary = {}
    for c in CONFIGS:
        cells, summary[c] = [], {}
        for k in ("between", "after", "boundary"):
            s, p = table[c][k], table["plain"][k]
            ratio = s["median"] / p["median"] if s["n"] and p["n"] else None
            summary[c][k] = dict(s, x_plain=ratio)
            cells.append(f"{s['median']:6.1f} [{s['iqr']:5.1f}] x{ratio:5.2f}" if s["n"] else "-")
        allc = [v for k in ("mid", "after", "boundary") for v in samples[c][k]]
        allp = [v for k in ("mid", "after", "boundary") for v in samples["plain"][k]]
        mean_ratio = statistics.fmean(allc) / statistics.fmean(allp)
        summary[c]["mean_all"] = {"mean": statistics.fmean(allc), "x_plain": mean_ratio}
        cells.append(f"{statistics.fmean(allc):6.1f}         x{mean_ratio:5.2f}")
        print(f"{c:6s} | " + " | ".join(f"{x:>22s}" for x in cells))
    print("\nWithin-run paired excess (ms): step minus the median of the same round's mid steps, median [IQR];"
          " net = minus plain's (the control); x = 1 + net / plain's median mid step")
    print(f"{'config':6s} | {'boundary':>16s} {'net':>7s} {'x':>5s} | {'after':>16s} {'net':>7s} {'x':>5s}")
    plain_mid = table["plain"]["mid"]["median"]
    for c in CONFIGS:
        cells = []
        for k in ("boundary", "after"):
            s, p = stats(paired[c][k]), stats(paired["plain"][k])
            net = s["median"] - p["median"] if s["n"] and p["n"] else None
            x = 1 + net / plain_mid if net is not None else None
            summary[c][f"paired_{k}"] = dict(s, net_vs_plain=net, x_plain=x)
            cells.append(f"{s['median']:6.1f} [{s['iqr']:6.1f}] {net:+7.1f} {x:5.2f}" if s["n"] else "-")
        print(f"{c:6s} | " + " | ".join(cells))
    for c in ("none", "delay"):
        rs = [r for r in rounds[c] if r["iteration"] < iters]  # the last iteration's rounds are the flush
        if rs:
            comm = statistics.median(r["comm_seconds"] for r in rs)
            exp = statistics.median(r["exposed_comm_seconds"] for r in rs)
            extra_ms = summary[c]["boundary"]["median"] - summary["plain"]["boundary"]["median"]
            summary[c]["exchange"] = {"rounds": len(rs), "comm_s_median": comm, "exposed_s_median": exp,
                                      "boundary_extra_ms": extra_ms}
            print(f"# {c}: {len(rs)} rounds, exchange (C=1 codec compute) median {1e3 * comm:.1f} ms, "
                  f"exposed {1e3 * exp:.1f} ms; boundary step {extra_ms:+.1f} ms vs plain (pooled medians), "
                  f"{summary[c]['paired_boundary']['net_vs_plain']:+.1f} ms (paired)")
    fin = {c: table[c]["final"].get("median") for c in CONFIGS}
    print("# final iteration (end-of-training flush), median ms: "
          + ", ".join(f"{c} {v:.1f}" for c, v in fin.items() if v is not None))

    load1 = os.getloadavg()
    out = a.out or os.path.join(REPO, "runs", "bench", f"step_overhead-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"script": "step_overhead", **prov, "args": vars(a), "extra_megatron_flags": extra, "iters": iters,
                   "reps": reps, "params_per_rank": params, "megatron_flags": base,
                   "env": {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": load1,
                           "wall_s": time.time() - t_start},
                   "stats": table, "summary": summary, "paired_excess_ms": paired, "rounds": rounds, "raw": raw}, f, indent=1)
    print(f"# wrote {out}; {time.time() - t_start:.0f}s; load avg {load0[0]:.2f} -> {load1[0]:.2f}"
          + (" (other work on this host: compare ratios, not absolute times)"
             if max(load0[0], load1[0]) > 0.5 * os.cpu_count() else ""))


if __name__ == "__main__":
    main()
