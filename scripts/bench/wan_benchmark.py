"""Side-by-side on a shaped link: AllReduce vs DiLoCo vs DiLoCo+compression vs DiLoCoX vs no communication.

One invocation, the same small GPT (the main job's: 4 layers, hidden 128, TP1 PP2 per cluster), the same
corpus (the KJV; --corpus pydoc: the Python docs), the same tokens per method, 2 clusters each in its own
network namespace behind a tbf-shaped link (scripts/wan/wan.py). Methods:

  ceiling      each cluster trains alone (no inter-cluster traffic): the throughput ceiling
  allreduce    ONE Megatron world spanning both namespaces (PP2 inside a cluster, DP2 across the link,
               --use-tp-pp-dp-mapping): gradients all-reduced over the shaped link every step
  diloco       --dilocox-overlap none, no compression (OpenDiLoCo / prime behaviour)
  diloco_comp  --dilocox-overlap none, low-rank + int4 (compression without overlap)
  dilocox      one-step delay + adaptive rank and H (the product's default)
  NAME         --variant NAME=FLAGS: the dilocox method plus FLAGS (e.g. lockstep='--dilocox-no-per-site-h')

Link rate: by default it is set so that a dense fp32 all-reduce of this model takes --paper-ratio times
one inner step (the ratio the cost model gives for 107B over 1 Gbps, `python -m megatron_dilocox.sim
--paper`: 3430 s of AllReduce per 10.55 s step, 325x), computed from the ceiling run's measured step time
and the model's parameter count. At such a ratio AllReduce needs minutes per step, so its *throughput* is
measured over --allreduce-steps steps on the shaped link, and its *loss at equal tokens* comes from the
same synchronous run on an unshaped link (the arithmetic of synchronous data parallelism does not depend
on the link). Everything else runs the full --iters on the shaped link.

    .venv/bin/python scripts/bench/wan_benchmark.py [--quick] [--iters 100] [--rate 2mbit] [--out runs/bench]

Prints a table (tokens/s, ratios to AllReduce and to the ceiling, validation loss and gap to AllReduce,
bytes per round and in total vs dense fp32, exposed communication), writes JSON and PNG plots. Tokens/s
are steady state: Megatron's logged iteration times without the first interval (warm-up) and the last
(DiLoCo's final flush, the last round's whole exchange, paid once per run), and only while both clusters
were training (they start seconds apart; on a shared host one cluster alone runs faster, which flatters the
uncoupled ceiling); "xceil e2e" keeps all intervals. --quick
checks the invariants (DiLoCoX sends >= 37x fewer bytes than AllReduce and beats its tokens/s).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))  # provenance.py
sys.path.insert(0, os.path.join(REPO, "scripts", "wan"))

from megatron_dilocox.data.prepare import prepare  # noqa: E402
from megatron_dilocox.harness.launch import run  # noqa: E402
from megatron_dilocox.harness.spawn import free_port  # noqa: E402
from megatron_dilocox.harness.main_job import gpt_flags  # noqa: E402
from megatron_dilocox.metrics import read_rows  # noqa: E402
from wan import WanTestbed  # noqa: E402
from provenance import provenance  # noqa: E402

SEQ = 128
# every method evaluates the same 10 x 16 validation samples (a cluster's own global batch is 8: without this
# its evaluation read the first 80 samples and AllReduce's the first 160, different sets)
SAME_EVAL = ["--eval-global-batch-size", "16"]
GLOO_IF = {"GLOO_SOCKET_IFNAME": "wan0"}  # the cluster's uplink inside its namespace


def steady_ms(log, skip=1, tail=0, window=None):
    """Mean of Megatron's per-iteration time over the logged intervals, leaving out the first ``skip`` and
    the last ``tail`` (the last interval holds DiLoCo's final flush: the last round's whole exchange, once
    per training run however long) and, with ``window`` = (t0, t1), intervals not wholly inside it."""
    its = sorted(log.iter_ms)
    keep = its[skip:len(its) - tail]
    if window is not None:
        walls = log.iter_wall
        keep = [i for i, prev in zip(its[1:], its) if i in keep and walls[prev] >= window[0] and walls[i] <= window[1]]
    vals = [log.iter_ms[i] for i in keep] or [log.iter_ms[i] for i in its]
    return sum(vals) / len(vals)


def together(logs):
    """(t0, t1) of wall time in which every cluster was training. The clusters of one run start seconds
    apart (process start-up); on a shared host a cluster alone runs faster, which would flatter the
    uncoupled ceiling run, so only intervals inside this window count, for every method alike."""
    return (max(min(log.iter_wall.values()) for log in logs), min(max(log.iter_wall.values()) for log in logs))


def tokens_per_s(logs, tokens_per_iter, tail=1, window=True):
    """Steady tokens/s of all clusters (per cluster: tokens per iteration / its mean iteration time)."""
    win = together(logs) if window else None
    return sum(tokens_per_iter / (steady_ms(log, tail=tail, window=win) / 1000) for log in logs)


def curve(log):
    return sorted(log.losses.items())


def cluster_run(wan, name, flags, dilocox, out, clusters=2, timeout=3600, nproc=2):
    """Run every cluster (``nproc`` processes) in its own namespace; return (logs, metrics rows, wall seconds)."""
    mdir = os.path.join(out, name)
    os.makedirs(mdir, exist_ok=True)
    dl = None if dilocox is None else dilocox + ["--dilocox-metrics-file", os.path.join(mdir, "metrics_c{cluster}.jsonl")]
    t0 = time.time()
    codes, logs = run(clusters, nproc, flags, dilocox_args=dl, timeout=timeout, echo=False,
                      prefix_by_cluster={c: wan.prefix(c) for c in range(clusters)},
                      env_by_cluster={c: GLOO_IF for c in range(clusters)}, rendezvous_host=wan.addr(0))
    if any(codes):
        tail = "\n".join("\n".join([ln for ln in log.lines if "Error" in ln or "error" in ln][:10] + log.lines[-8:])
                         for log in logs)
        raise SystemExit(f"{name} failed ({codes}):\n{tail}")
    rows = [] if dilocox is None else [r for c in range(clusters) for r in read_rows(os.path.join(mdir, f"metrics_c{c}.jsonl"))]
    return logs, rows, time.time() - t0


def allreduce_run(wan, flags, iters, timeout=3600, shaped=True):
    """One Megatron world over both namespaces: node k = cluster k's namespace (2 ranks each)."""
    import subprocess
    import threading

    from megatron_dilocox.harness.launch import ClusterLog, _pump
    port = free_port()
    procs, logs, threads = [], [], []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", **GLOO_IF)
    for k in range(2):
        cmd = (wan.prefix(k) if shaped else []) + [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
            "--nproc-per-node", "2", "--master-addr", wan.addr(0) if shaped else "127.0.0.1",
            "--master-port", str(port), "-m", "megatron_dilocox.pretrain_gpt", *flags]
        p = subprocess.Popen(cmd, env=env if shaped else {k2: v for k2, v in env.items() if k2 != "GLOO_SOCKET_IFNAME"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        log = ClusterLog()
        t = threading.Thread(target=_pump, args=(p.stdout, "", log, False, None), daemon=True)
        t.start()
        procs.append(p)
        logs.append(log)
        threads.append(t)
    codes = [p.wait(timeout=timeout) for p in procs]
    for t in threads:
        t.join(timeout=5)
    if any(codes):
        raise SystemExit("allreduce failed:\n" + "\n".join("\n".join(log.lines[-25:]) for log in logs))
    return next(log for log in logs if log.losses)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: few iterations, milder link ratio, no AllReduce loss baseline")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--h", type=int, default=None)
    ap.add_argument("--rate", default=None, help="link rate (e.g. 2mbit); default: from --paper-ratio")
    ap.add_argument("--paper-ratio", type=float, default=None,
                    help="dense fp32 all-reduce time / inner step time to emulate (default 325; --quick 20)")
    ap.add_argument("--rank", type=int, default=6,
                    help="low-rank rank of the compressed methods (default 6: the smallest whose validation loss "
                         "stays within 1%% of uncompressed DiLoCo on this model, "
                         "see docs/benchmarks.md#the-main-jobs-rank)")
    ap.add_argument("--allreduce-steps", type=int, default=None, help="AllReduce steps timed on the shaped link")
    ap.add_argument("--skip", default="", help="comma-separated methods not to run, of diloco,diloco_comp (uncompressed "
                                               "DiLoCo needs ~110 s per round at ratio 325: long runs skip it)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="one more DiLoCoX method, the dilocox method's flags plus FLAGS, run in the same invocation "
                         "(so that its ratios are against the same baselines), e.g. "
                         "lockstep='--dilocox-no-per-site-h'; repeatable")
    ap.add_argument("--dilocox-extra", default="", help="more flags for the dilocox method, e.g. "
                                                         "'--dilocox-fragments 4 --dilocox-overlap one-step-delay'")
    ap.add_argument("--corpus", default="kjv", choices=("kjv", "pydoc"),
                    help="the KJV or the Python 3.11 documentation (megatron_dilocox.data.prepare)")
    ap.add_argument("--data", default=None, help="where the corpus is built (default: data/<corpus>)")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench", "wan"))
    a = ap.parse_args()
    skip = {m for m in a.skip.split(",") if m}
    if skip - {"diloco", "diloco_comp"}:
        ap.error(f"--skip: only diloco and diloco_comp may be skipped, got {sorted(skip)}")
    variants = {}
    for v in a.variant:
        name, sep, extra = v.partition("=")
        if not sep or not name.isidentifier() or name in variants or name in (
                "ceiling", "probe", "allreduce", "diloco", "diloco_comp", "dilocox"):
            ap.error(f"--variant: NAME=FLAGS with a new method name, got {v!r}")
        variants[name] = extra.split()
    prov = provenance()  # the code that runs, taken before it runs
    iters = a.iters or (20 if a.quick else 100)
    h = a.h or (5 if a.quick else 10)
    ratio = a.paper_ratio or (20.0 if a.quick else 325.0)
    ar_steps = a.allreduce_steps or (3 if a.quick else 6)
    os.makedirs(a.out, exist_ok=True)
    a.data = a.data or os.path.join(REPO, "data", a.corpus)
    prepare(a.data, num_clusters=2, corpus=a.corpus)
    per_cluster = gpt_flags(a.data, iters, 1, 2) + ["--log-interval", "5"] + SAME_EVAL
    results, curves = {}, {}
    tokens_per_iter = 8 * SEQ  # per cluster (global batch 8)

    with WanTestbed(2, a.rate or "1000mbit") as wan:
        # 1) ceiling: both clusters at once, no inter-cluster traffic at all
        logs, _, wall = cluster_run(wan, "ceiling", per_cluster, None, a.out)
        step_s = max(steady_ms(log, window=together(logs)) for log in logs) / 1000.0  # both clusters busy
        results["ceiling"] = dict(tokens_per_s=tokens_per_s(logs, tokens_per_iter),
                                  tokens_per_s_with_ends=tokens_per_s(logs, tokens_per_iter, tail=0, window=False),
                                  valid_loss=sum(log.valid_losses[-1] for log in logs) / 2, bytes_total=0,
                                  exposed_comm_seconds=0.0, wall_seconds=wall)
        curves["ceiling"] = curve(logs[0])

        # 2) DiLoCoX full on the link chosen from the measured step time
        diloco_base = ["--dilocox-h", str(h), "--dilocox-lowrank-min-dim", "64", "--dilocox-no-adaptive-h"]
        probe_logs, probe_rows, _ = cluster_run(wan, "probe", gpt_flags(a.data, h, 1, 2) + ["--log-interval", "5", "--lr-warmup-iters", "0"],
                                               diloco_base + ["--dilocox-no-lowrank", "--dilocox-quant-bits", "32",
                                                              "--dilocox-overlap", "none"], a.out)
        dense_per_allreduce = sum(r["bytes_dense_fp32"] for r in probe_rows if r["round"] == 1)  # both clusters
        per_link_bytes = dense_per_allreduce / 2  # each cluster's uplink carries its own share
        rate_bits = per_link_bytes * 8 / (ratio * step_s)
        rate = a.rate or f"{max(rate_bits / 1e3, 8):.0f}kbit"
        wan.set_rate(rate)
        print(f"# step {step_s * 1000:.0f} ms; dense fp32 all-reduce {dense_per_allreduce / 1e6:.2f} MB "
              f"({per_link_bytes / 1e6:.2f} MB per uplink); link {rate} => AllReduce/step ratio ~{ratio:.0f}", flush=True)

        methods = {
            "diloco": diloco_base + ["--dilocox-overlap", "none", "--dilocox-no-lowrank", "--dilocox-quant-bits", "32"],
            "diloco_comp": diloco_base + ["--dilocox-overlap", "none", "--dilocox-lowrank-rank", str(a.rank),
                                          "--dilocox-quant-bits", "4"],
            "dilocox": ["--dilocox-h", str(h), "--dilocox-lowrank-min-dim", "64", "--dilocox-lowrank-rank", str(a.rank),
                        "--dilocox-quant-bits", "4", *a.dilocox_extra.split()],
        }
        methods.update({name: methods["dilocox"] + extra for name, extra in variants.items()})
        for name, dl in methods.items():
            if name in skip:
                continue
            logs, rows, wall = cluster_run(wan, name, per_cluster, dl, a.out)
            rounds = max(r["round"] for r in rows)  # (with --dilocox-fragments: rounds of each fragment)
            results[name] = dict(
                tokens_per_s=tokens_per_s(logs, tokens_per_iter),
                tokens_per_s_with_ends=tokens_per_s(logs, tokens_per_iter, tail=0, window=False),
                valid_loss=logs[0].valid_losses[-1], bytes_total=sum(r["bytes_sent"] for r in rows),
                bytes_per_round=sum(r["bytes_sent"] for r in rows) / rounds,
                dense_per_round=sum(r["bytes_dense_fp32"] for r in rows) / rounds,
                exposed_comm_seconds=sum(r["exposed_comm_seconds"] for r in rows) / 2,
                comm_seconds=sum(r["comm_seconds"] for r in rows) / 2, rounds=rounds, wall_seconds=wall,
                final_H=max(r["next_H"] for r in rows), final_rank=max(r["next_lowrank_rank"] for r in rows),
                fragments=1 + max(r.get("fragment", 0) for r in rows),  # > 1: the rounds went as fragments
                iterations=[log.last_iteration for log in logs])
            curves[name] = curve(logs[0])
            # kept before the AllReduce baseline runs: its timing over the shaped link can fail (gloo timeouts)
            print(f"# {name}: validation {results[name]['valid_loss']:.4f}, exposed "
                  f"{results[name]['exposed_comm_seconds']:.1f} s of {wall:.0f} s", flush=True)
            with open(os.path.join(a.out, "results.partial.json"), "w") as f:
                json.dump(dict(results=results, curves=curves, **prov), f, indent=1)

        # 3) AllReduce: throughput on the shaped link over a few steps; loss from the same run unshaped
        ar_flags = gpt_flags(a.data, ar_steps, 1, 2) + ["--log-interval", "1", "--use-tp-pp-dp-mapping",
                                                        "--lr-warmup-iters", "0",
                                                        "--global-batch-size", "16",
                                                        "--train-data-path", f"{a.data}/train_all_text_document"]
        t0 = time.time()
        shaped = allreduce_run(wan, ar_flags, ar_steps)
        ar_ms = steady_ms(shaped, skip=1)
        full_flags = gpt_flags(a.data, iters, 1, 2) + SAME_EVAL + ["--log-interval", "5", "--use-tp-pp-dp-mapping",
                                                       "--global-batch-size", "16",
                                                       "--train-data-path", f"{a.data}/train_all_text_document"]
        # (--quick, a CI smoke run: no loss baseline, the speed and bytes invariants only)
        unshaped = None if a.quick else allreduce_run(wan, full_flags, iters, shaped=False)
        results["allreduce"] = dict(tokens_per_s=2 * tokens_per_iter / (ar_ms / 1000),
                                    tokens_per_s_with_ends=2 * tokens_per_iter / (ar_ms / 1000),
                                    valid_loss=unshaped.valid_losses[-1] if unshaped else float("nan"),
                                    bytes_total=dense_per_allreduce * iters, bytes_per_round=dense_per_allreduce,
                                    dense_per_round=dense_per_allreduce,
                                    exposed_comm_seconds=max(0.0, ar_ms / 1000 - step_s) * iters,
                                    wall_seconds=time.time() - t0, timed_steps=ar_steps)
        if unshaped:
            curves["allreduce"] = curve(unshaped)

    ar = results["allreduce"]
    print(f"\n{'method':12s} {'tok/s':>9s} {'xAR':>7s} {'xceil':>6s} {'val loss':>9s} {'gap':>7s} "
          f"{'B/round':>10s} {'B total':>11s} {'x fewer':>8s} {'exposed s':>9s} {'xceil e2e':>9s}")
    order = ["allreduce", "diloco", "diloco_comp", "dilocox"] + [n for n in results if n not in ("allreduce", "ceiling")]
    for name in (n for n in dict.fromkeys(order + ["ceiling"]) if n in results):
        r = results[name]
        r["ratio_vs_allreduce"] = r["tokens_per_s"] / ar["tokens_per_s"]
        r["ratio_vs_ceiling"] = r["tokens_per_s"] / results["ceiling"]["tokens_per_s"]
        r["ratio_vs_ceiling_with_ends"] = r["tokens_per_s_with_ends"] / results["ceiling"]["tokens_per_s_with_ends"]
        r["loss_gap_vs_allreduce"] = (r["valid_loss"] - ar["valid_loss"]) / ar["valid_loss"]
        r["bytes_fewer_than_allreduce"] = ar["bytes_total"] / r["bytes_total"] if r["bytes_total"] else float("inf")
        print(f"{name:12s} {r['tokens_per_s']:9.0f} {r['ratio_vs_allreduce']:7.2f} {r['ratio_vs_ceiling']:6.2f} "
              f"{r['valid_loss']:9.4f} {100 * r['loss_gap_vs_allreduce']:6.2f}% {r.get('bytes_per_round', 0):10.0f} "
              f"{r['bytes_total']:11.0f} {r['bytes_fewer_than_allreduce']:8.1f} {r['exposed_comm_seconds']:9.2f} "
              f"{r['ratio_vs_ceiling_with_ends']:9.2f}")
    predicted = predict_testbed(step_s, rate_bits if not a.rate else None, a.rate, h, a.rank)
    print("\ncost model for this testbed (python -m megatron_dilocox.sim) vs measured, speed-up over AllReduce:")
    for name in (n for n in ("diloco", "dilocox") if n in results):
        key = "speedup_vs_allreduce" if name == "dilocox" else "diloco_speedup_vs_allreduce"
        print(f"  {name:8s} predicted {predicted[key]:7.2f}x   measured {results[name]['ratio_vs_allreduce']:7.2f}x")
    meta = dict(corpus=a.corpus, iters=iters, h=h, rank=a.rank, rate=rate, paper_ratio=ratio, step_seconds=step_s, predicted=predicted,
                dense_fp32_per_allreduce=dense_per_allreduce, tokens_per_method=2 * tokens_per_iter * iters)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, results=results, curves=curves, **prov), f, indent=1)
    plot(a.out, results, curves, tokens_per_iter)
    if a.quick:
        d = results["dilocox"]
        # the link budget sends at most the int4 whole payload (7.5x below fp32) per H = 5 steps: >= 37x below
        # AllReduce's fp32 gradients every step (rounds 1-2 are sized from the link probe at start)
        assert d["bytes_fewer_than_allreduce"] >= 37, d["bytes_fewer_than_allreduce"]
        assert d["tokens_per_s"] > ar["tokens_per_s"], (d["tokens_per_s"], ar["tokens_per_s"])
        print("quick invariants: ok")


def predict_testbed(step_s, rate_bits, rate_text, h, rank):
    """The cost model's prediction for this exact testbed (small GPT, TP1 PP2, 2 clusters, this link)."""
    from megatron_dilocox.sim.cost_model import Setup, predict
    if rate_bits is None:
        from wan import parse_rate
        rate_bits = parse_rate(rate_text)
    s = Setup(hidden=128, layers=4, ffn=512, vocab=4096, heads=4, swiglu=False, tied_embeddings=True, bias=True,
              clusters=2, tp=1, pp=2, dp=1, distributed_optimizer=False,
              tokens_per_gpu_s=8 * SEQ / (step_s * 2), global_batch_tokens=2 * 8 * SEQ,
              link_gbps=rate_bits / 1e9, h=h, rank=rank, bits=4, block=128, min_dim=64)
    p = predict(s)
    return {"speedup_vs_allreduce": p["speedup_vs_allreduce"],
            "diloco_speedup_vs_allreduce": p["diloco_speedup_vs_allreduce"], "params": p["params"]}


def plot(out, results, curves, tokens_per_iter):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name, pts in curves.items():
        scale = 2  # tokens per iteration across both clusters (AllReduce: one batch of twice the size)
        ax[0].plot([i * tokens_per_iter * scale for i, _ in pts], [v for _, v in pts], label=name)
        tps = results[name]["tokens_per_s"]
        ax[1].plot([i * tokens_per_iter * scale / tps for i, _ in pts], [v for _, v in pts], label=name)
    ax[0].set(xlabel="tokens", ylabel="train loss", title="loss vs tokens")
    ax[1].set(xlabel="seconds (at measured tokens/s)", ylabel="train loss", title="loss vs wall time")
    names = [n for n in results if results[n]["bytes_total"]]
    ax[2].bar(names, [results[n]["bytes_total"] for n in names])
    ax[2].set(yscale="log", ylabel="bytes sent (total)", title="bytes per method")
    for x in ax[:2]:
        x.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "wan_benchmark.png"), dpi=110)
    print(f"plots: {os.path.join(out, 'wan_benchmark.png')}")


if __name__ == "__main__":
    main()
