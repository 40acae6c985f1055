"""Sites of different speeds on real Megatron: one site at half a core (a cgroup CPU quota), one unthrottled.

The main job's GPT (``gpt_flags``; TP1 PP1, one process per site, global batch 8 x 128 tokens per site), both sites
planning --iters iterations (equal total tokens in every DiLoCoX run), the product's defaults with --dilocox-h 10.
In one invocation per corpus:

  alone_fast   one site alone, unthrottled, plain Megatron (its tokens/s on an otherwise idle host)
  alone_slow   one site alone at the quota, plain Megatron
  isolated     both sites at once, each plain Megatron on its own (no DiLoCoX, nobody waits): each at its own
               speed on the shared host, the throughput per-site H is measured against
  unthrottled  both sites unthrottled, lockstep rounds (--dilocox-no-per-site-h): the baseline for the loss
  lockstep     site 1 at the quota, lockstep rounds (every site H steps: the fast one waits)
  per_site     site 1 at the quota, the default: per-site H

Speeds come from Megatron's own "elapsed time per iteration" (the DiLoCoX hook, and any wait at a boundary, is
inside it), after the first logged interval: a site's tokens/s is 8 x 128 / its mean iteration time, a run's the
sum over its sites. The fast site's wait is the sum of its rows' exposed_comm_seconds over its training time.
The validation loss is the global model's, evaluated once, at the end, on the same 40 x 8 validation samples in
every run (no periodic evaluation, so that the lockstep runs too read the same samples). Targets (issue 35): per_site's fast site waits at most 5% of its
time; per_site's tokens/s >= 0.9 x the sum of each site training alone (isolated: both at once, as the host is
shared; the idle-host figures are printed beside); per_site's final loss within 1% of unthrottled's.

    .venv/bin/python scripts/bench/sites_benchmark.py [--iters 1000] [--corpora kjv,pydoc] [--quota 0.5]
        [--alone-iters 100] [--quick] [--out benchmarks/results/sites_speed]

--skew: sites whose data differ (the kjv+pydoc corpus: site 0 trains on the KJV, site 1 on the Python docs), the
global model evaluated at the end on each corpus's validation split (Megatron's validation set: the KJV's; its
test set: the docs'), three runs: ``equal`` (both unthrottled), ``round`` (site 1 at the quota, each site weighted
by its round's tokens: the rule before the run's clock, --dilocox-token-weight-unit round), ``step`` (site 1 at
the quota, the default: weighted by tokens per step). Writes to --out (default benchmarks/results/sites_skew).

Writes results.json (every run: iterations per site, H per round, tokens/s, wait share, validation loss, wall)
and prints a table with the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))

from megatron_dilocox.harness import throttle  # noqa: E402
from megatron_dilocox.harness.launch import run  # noqa: E402
from megatron_dilocox.harness.main_job import gpt_flags  # noqa: E402
from megatron_dilocox.metrics import read_rows  # noqa: E402
from provenance import provenance  # noqa: E402

TOKENS_PER_STEP = 8 * 128
LOCKSTEP = "--dilocox-no-per-site-h"  # today's rounds, every site H steps (per-site H is the default)
EVAL = ["--log-interval", "10", "--eval-interval", "1000000", "--eval-iters", "40"]  # one evaluation, at the end


def site_speed(log) -> float:
    """Tokens/s of one site: its mean Megatron iteration time after the first logged interval."""
    ms = [v for it, v in sorted(log.iter_ms.items())][1:] or list(log.iter_ms.values())
    return TOKENS_PER_STEP / (statistics.mean(ms) / 1000.0)


def final_validation(log):
    return log.valid_losses[-1] if log.valid_losses else None


def run_alone(data, iters, prefix, out):
    codes, logs = run(1, 1, gpt_flags(data, iters, 1, 1) + EVAL, None,
                      prefix_by_cluster={0: prefix} if prefix else None, echo=False, timeout=3600)
    if codes != [0]:
        raise SystemExit(f"alone run failed: {logs[0].lines[-30:]}")
    return {"tokens_per_s": site_speed(logs[0]), "iterations": logs[0].last_iteration}


def run_isolated(data, iters, prefix):
    codes, logs = run(2, 1, gpt_flags(data, iters, 1, 1) + EVAL, None, prefix_by_cluster={1: prefix}, echo=False,
                      timeout=3600)
    if codes != [0, 0]:
        raise SystemExit(f"isolated runs failed: {[log.lines[-30:] for log in logs]}")
    speeds = [site_speed(log) for log in logs]
    return {"tokens_per_s_sites": speeds, "tokens_per_s": sum(speeds)}


def run_pair(name, data, iters, dilocox, prefix, out, megatron=()):
    metrics = os.path.join(out, name)
    os.makedirs(metrics, exist_ok=True)
    t0 = time.time()
    codes, logs = run(2, 1, gpt_flags(data, iters, 1, 1) + EVAL + list(megatron),
                      ["--dilocox-h", "10", "--dilocox-metrics-file", f"{metrics}/metrics_c{{cluster}}.jsonl"] + dilocox,
                      prefix_by_cluster={1: prefix} if prefix else None, echo=False, timeout=7200)
    wall = time.time() - t0
    if codes != [0, 0]:
        raise SystemExit(f"{name} failed: {[log.lines[-30:] for log in logs]}")
    rows = [read_rows(f"{metrics}/metrics_c{c}.jsonl") for c in range(2)]
    speeds = [site_speed(log) for log in logs]
    fast_time = logs[0].last_iteration * TOKENS_PER_STEP / speeds[0]
    return {
        "wall_seconds": wall, "iterations": [log.last_iteration for log in logs],
        "tokens_per_s_sites": speeds, "tokens_per_s": sum(speeds),
        "fast_wait_share": sum(r["exposed_comm_seconds"] for r in rows[0]) / fast_time,
        "H": [[r["H"] for r in rs] for rs in rows], "rounds": len(rows[0]),
        "tokens": sum(r["tokens"] for rs in rows for r in rs),
        "hashes_agree": [r["global_model_hash"] for r in rows[0]] == [r["global_model_hash"] for r in rows[1]],
        "validation_loss": [final_validation(log) for log in logs],
        "test_loss": [log.test_losses[-1] if log.test_losses else None for log in logs],
        "weight_c0": [r["weight"] for r in rows[0]],
    }


def skew(a):
    """Sites whose data differ, one at the quota: per-corpus validation of the global model, old vote and new."""
    from megatron_dilocox.data.prepare import prepare
    data = os.path.join(REPO, "data", "kjv+pydoc")
    prepare(data, num_clusters=2, corpus="kjv+pydoc")
    per_corpus = ["--valid-data-path", f"{data}/valid_kjv_text_document",
                  "--test-data-path", f"{data}/valid_pydoc_text_document"]
    results = {"provenance": provenance(), "iters": a.iters, "quota_cores": a.quota, "runs": {}}
    r = results["runs"]
    with throttle.cpu_quota(f"dilocox_bench_{os.getpid()}", a.quota) as slow:
        r["equal"] = run_pair("equal", data, a.iters, [], None, a.out, per_corpus)
        r["round"] = run_pair("round", data, a.iters, ["--dilocox-token-weight-unit", "round"], slow, a.out,
                              per_corpus)
        r["step"] = run_pair("step", data, a.iters, [], slow, a.out, per_corpus)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n# kjv+pydoc: site 0 the KJV, site 1 the Python docs; {a.iters} iterations planned per site; "
          f"round/step: site 1 at {a.quota} cores")
    print(f"{'run':<8}{'iterations':>14}{'mean H c0, c1':>16}{'weight c0':>11}{'KJV valid':>11}{'docs valid':>12}"
          f"{'mean':>9}{'agree':>7}")
    for name, x in r.items():
        hs = [statistics.mean(h) for h in x["H"]]
        kjv, doc = x["validation_loss"][0], x["test_loss"][0]
        print(f"{name:<8}{str(x['iterations']):>14}{hs[0]:>8.1f},{hs[1]:>6.1f}{statistics.mean(x['weight_c0']):>11.3f}"
              f"{kjv:>11.4f}{doc:>12.4f}{(kjv + doc) / 2:>9.4f}{str(x['hashes_agree']):>7}", flush=True)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--alone-iters", type=int, default=100)
    ap.add_argument("--corpora", default="kjv,pydoc")
    ap.add_argument("--quota", type=float, default=0.5, help="the slow site's CPU quota, in cores")
    ap.add_argument("--quick", action="store_true", help="60 iterations, KJV only, 40 alone (a smoke run)")
    ap.add_argument("--skew", action="store_true", help="sites whose data differ: the vote, old rule and new")
    ap.add_argument("--out", default=None, help="default benchmarks/results/sites_speed (--skew: sites_skew)")
    a = ap.parse_args(argv)
    a.out = a.out or os.path.join(REPO, "benchmarks", "results", "sites_skew" if a.skew else "sites_speed")
    if a.quick:
        a.iters, a.alone_iters, a.corpora = 60, 40, "kjv"
    reason = throttle.unavailable()
    if reason:
        raise SystemExit(f"sites_benchmark: needs a cgroup CPU quota: {reason}")
    os.makedirs(a.out, exist_ok=True)
    if a.skew:
        return skew(a)
    from megatron_dilocox.data.prepare import prepare
    results = {"provenance": provenance(), "iters": a.iters, "quota_cores": a.quota, "corpora": {}}
    for corpus in a.corpora.split(","):
        data = os.path.join(REPO, "data", corpus)
        prepare(data, num_clusters=2, **({} if corpus == "kjv" else {"corpus": corpus}))
        out = os.path.join(a.out, corpus)
        r = results["corpora"][corpus] = {}
        with throttle.cpu_quota(f"dilocox_bench_{os.getpid()}", a.quota) as slow:
            r["alone_fast"] = run_alone(data, a.alone_iters, None, out)
            r["alone_slow"] = run_alone(data, a.alone_iters, slow, out)
            r["isolated"] = run_isolated(data, 2 * a.alone_iters, slow)
            r["unthrottled"] = run_pair("unthrottled", data, a.iters, [LOCKSTEP], None, out)
            r["lockstep"] = run_pair("lockstep", data, a.iters, [LOCKSTEP], slow, out)
            r["per_site"] = run_pair("per_site", data, a.iters, [], slow, out)  # the default: per-site H
        alone = r["isolated"]["tokens_per_s"]
        idle = r["alone_fast"]["tokens_per_s"] + r["alone_slow"]["tokens_per_s"]
        base = r["unthrottled"]["validation_loss"][0]
        for name in ("unthrottled", "lockstep", "per_site"):
            x = r[name]
            x["vs_alone_sum"] = x["tokens_per_s"] / alone
            x["vs_idle_alone_sum"] = x["tokens_per_s"] / idle
            x["loss_vs_unthrottled"] = x["validation_loss"][0] / base - 1.0
        p = r["per_site"]
        r["targets"] = {"fast_waits_at_most_5pct": p["fast_wait_share"] <= 0.05,
                        "tokens_per_s_at_least_0.9_alone_sum": p["vs_alone_sum"] >= 0.9,
                        "loss_within_1pct": abs(p["loss_vs_unthrottled"]) <= 0.01}
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        iso = r["isolated"]["tokens_per_s_sites"]
        print(f"\n# {corpus}: {a.iters} iterations planned per site, site 1 at {a.quota} cores; each alone, both at "
              f"once: {iso[0]:.0f} + {iso[1]:.0f} = {alone:.0f} tokens/s (on an idle host: "
              f"{r['alone_fast']['tokens_per_s']:.0f} + {r['alone_slow']['tokens_per_s']:.0f} = {idle:.0f})")
        print(f"{'run':<12}{'iterations':>14}{'tokens/s':>10}{'vs alone':>10}{'fast waits':>12}{'wall s':>9}"
              f"{'valid loss':>12}{'vs unthr.':>11}")
        for name in ("unthrottled", "lockstep", "per_site"):
            x = r[name]
            print(f"{name:<12}{str(x['iterations']):>14}{x['tokens_per_s']:>10.0f}{x['vs_alone_sum']:>10.3f}"
                  f"{100 * x['fast_wait_share']:>11.1f}%{x['wall_seconds']:>9.0f}{x['validation_loss'][0]:>12.5f}"
                  f"{100 * x['loss_vs_unthrottled']:>+10.2f}%")
        print(f"targets: {r['targets']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
