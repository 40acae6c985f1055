"""Many sites on a shaped link: the reduce-scatter exchange against the all-gather, in one invocation.

C sites (default 4), one process each (the main job's GPT, TP1 PP1, global batch 8 per site), each in its own
network namespace behind a tbf-shaped access link (scripts/wan/wan.py: a flow between two sites passes the
sender's uplink and the receiver's downlink, so C-1 senders share one downlink, as at real sites). Every
method trains the same iterations with a fixed H, int4 blocks, matrices whole (no low rank: the payload the
planner falls back to at four sites and more), one-step delay:

  ceiling         each site trains alone (no inter-site traffic): the throughput ceiling
  all-gather      --dilocox-exchange-scheme all-gather: every site sends its payload S to the C-1 others
  reduce-scatter  --dilocox-exchange-scheme reduce-scatter: each site owns 1/C of the chunks, receives the
                  others' pieces of them, sends back their average: about 2(C-1)/C x S per site

The link rate is set from the ceiling's measured step time so that the all-gather's transfer takes
``--ratio`` times the H steps it may hide behind (default 2: the all-gather is exposed, the reduce-scatter
about fits). Prints, per method: tokens/s (steady state, while every site trains), the ratio to the ceiling,
bytes sent per site per round (the codec's count), communication and exposed seconds per round (the
metrics' own timers: exposed = what the boundary waited for), and the cost model's prediction of the same
(``python -m megatron_dilocox.sim`` at this testbed's measured step, rate and C, whole rounds). On a link
this slow the slow-link switch (--dilocox-slow-link-fragments, on by default) turns on fragments after two
rounds, for both schemes alike; ``--dilocox-extra '--dilocox-slow-link-fragments 1'`` keeps whole rounds, as
the model prices them. Writes results.json.

    .venv/bin/python scripts/bench/many_sites_wan.py [--sites 4] [--iters 60] [--h 5] [--ratio 2]
        [--rate 4mbit] [--dilocox-extra FLAGS] [--out runs/bench/many_sites]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))
sys.path.insert(0, os.path.join(REPO, "scripts", "wan"))

from megatron_dilocox.data.prepare import prepare  # noqa: E402
from megatron_dilocox.harness.main_job import gpt_flags  # noqa: E402
from provenance import provenance  # noqa: E402
from wan import WanTestbed, parse_rate  # noqa: E402
from wan_benchmark import SAME_EVAL, SEQ, cluster_run, steady_ms, together, tokens_per_s  # noqa: E402

SCHEMES = ("all-gather", "reduce-scatter")
BLOCK = 128  # --dilocox-quant-block-size (the product's default)


def predict(sites, step_s, rate_bits, h):
    """The cost model at this testbed: per scheme, bytes per site per round, comm and exposed seconds."""
    from megatron_dilocox.sim.cost_model import Setup, predict as model
    s = Setup(hidden=128, layers=4, ffn=512, vocab=4096, heads=4, swiglu=False, tied_embeddings=True, bias=True,
              clusters=sites, tp=1, pp=1, dp=1, distributed_optimizer=False,
              tokens_per_gpu_s=8 * SEQ / step_s, global_batch_tokens=sites * 8 * SEQ,
              link_gbps=rate_bits / 1e9, h=h, lowrank=False, bits=4, block=BLOCK)
    return {k: {"bytes_per_site": v["bytes_per_cluster"], "comm_seconds": v["comm_seconds"],
                "exposed_seconds": v["exposed_seconds"]} for k, v in model(s)["schemes"].items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--h", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=2.0,
                    help="the all-gather's transfer time over H steps, which sets the link rate (default 2)")
    ap.add_argument("--rate", default=None, help="link rate instead (e.g. 4mbit)")
    ap.add_argument("--methods", default="ceiling,all-gather,reduce-scatter",
                    help="comma-separated, of ceiling, all-gather, reduce-scatter (without the ceiling, give --rate)")
    ap.add_argument("--corpus", default="kjv", choices=("kjv", "pydoc"))
    ap.add_argument("--data", default=None, help="corpus folder (default runs/bench/many_sites_data/<corpus>: "
                                                 "sharded --sites ways)")
    ap.add_argument("--dilocox-extra", default="", help="more --dilocox flags for both schemes, e.g. "
                                                       "'--dilocox-slow-link-fragments 1' (whole rounds, as the model)")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "bench", "many_sites"))
    a = ap.parse_args(argv)
    if a.sites < 3:
        ap.error("--sites must be at least 3 (at two sites both schemes send the same bytes)")
    methods = [m for m in a.methods.split(",") if m]
    if set(methods) - {"ceiling", *SCHEMES} or not methods:
        ap.error(f"--methods takes ceiling, all-gather and reduce-scatter, got {a.methods!r}")
    if "ceiling" not in methods and not a.rate:
        ap.error("without the ceiling run (which measures the step time the link rate is set from), give --rate")
    prov = provenance()
    os.makedirs(a.out, exist_ok=True)
    a.data = a.data or os.path.join(REPO, "runs", "bench", "many_sites_data", a.corpus)
    prepare(a.data, num_clusters=a.sites, corpus=a.corpus)
    flags = gpt_flags(a.data, a.iters, 1, 1) + ["--log-interval", "5"] + SAME_EVAL
    tokens_per_iter = 8 * SEQ  # per site
    base = ["--dilocox-h", str(a.h), "--dilocox-no-adaptive-h", "--dilocox-no-lowrank", "--dilocox-quant-bits", "4",
            "--dilocox-quant-block-size", str(BLOCK), *a.dilocox_extra.split()]
    results, step_s = {}, None
    with WanTestbed(a.sites, a.rate or "1000mbit") as wan:
        if "ceiling" in methods:
            logs, _, wall = cluster_run(wan, "ceiling", flags, None, a.out, clusters=a.sites, nproc=1)
            step_s = max(steady_ms(log, window=together(logs)) for log in logs) / 1000.0
            results["ceiling"] = dict(tokens_per_s=tokens_per_s(logs, tokens_per_iter), wall_seconds=round(wall, 1))
        if a.rate:
            rate_bits = parse_rate(a.rate)
        else:  # the all-gather's per-site bytes from the cost model (the codec's closed form), over ratio x H steps
            ag = predict(a.sites, step_s, 1e9, a.h)["all-gather"]["bytes_per_site"]
            rate_bits = ag * 8 / (a.ratio * a.h * step_s)
        rate = a.rate or f"{rate_bits / 1e3:.0f}kbit"
        wan.set_rate(rate)
        print(f"# {a.sites} sites, H {a.h}: link {rate} per site" +
              (f", step {step_s * 1000:.0f} ms (sites alone)" if step_s else ""), flush=True)
        for scheme in (m for m in SCHEMES if m in methods):
            logs, rows, wall = cluster_run(wan, scheme, flags, base + ["--dilocox-exchange-scheme", scheme], a.out,
                                           clusters=a.sites, nproc=1)
            rounds = max(r["round"] for r in rows)
            per_site = lambda key: sum(r[key] for r in rows) / a.sites / rounds  # noqa: E731
            hashes = {}  # one row per round, or per fragment of a round once the slow-link switch made fragments
            for r in rows:
                hashes.setdefault((r["round"], r.get("fragment", 0)), set()).add(r["global_model_hash"])
            results[scheme] = dict(
                tokens_per_s=tokens_per_s(logs, tokens_per_iter), rounds=rounds, wall_seconds=round(wall, 1),
                bytes_per_site_per_round=per_site("bytes_sent"),
                comm_seconds_per_round=per_site("comm_seconds"),
                exposed_seconds_per_round=per_site("exposed_comm_seconds"),
                valid_loss=logs[0].valid_losses[-1], step_seconds=8 * SEQ * a.sites / tokens_per_s(logs, tokens_per_iter),
                hashes_agree_every_round=all(len(h) == 1 for h in hashes.values()),
                fragments_per_round=max(r.get("fragment", 0) for r in rows) + 1)
            print(f"# {scheme}: {json.dumps(results[scheme])}", flush=True)
    # the cost model at the sites' measured step (alone, or, without the ceiling run, coupled: an upper figure)
    step_s = step_s or min(r["step_seconds"] for r in results.values())
    predicted = predict(a.sites, step_s, rate_bits, a.h)
    ceil = results["ceiling"]["tokens_per_s"] if "ceiling" in results else None
    print(f"\n{'method':15s} {'tok/s':>8s} {'xceil':>6s} {'B/site/round':>13s} {'comm s':>7s} {'exposed s':>9s}"
          f" {'model: B':>10s} {'comm s':>7s} {'exposed s':>9s} {'val loss':>9s}")
    for name in (m for m in ("ceiling", *SCHEMES) if m in results):
        r, p = results[name], predicted.get(name)
        r["ratio_vs_ceiling"] = r["tokens_per_s"] / ceil if ceil else float("nan")
        if p is None:
            print(f"{name:15s} {r['tokens_per_s']:8.0f} {r['ratio_vs_ceiling']:6.2f}")
            continue
        r["predicted"] = p
        print(f"{name:15s} {r['tokens_per_s']:8.0f} {r['ratio_vs_ceiling']:6.2f} {r['bytes_per_site_per_round']:13.0f} "
              f"{r['comm_seconds_per_round']:7.2f} {r['exposed_seconds_per_round']:9.2f} {p['bytes_per_site']:10.0f} "
              f"{p['comm_seconds']:7.2f} {p['exposed_seconds']:9.2f} {r['valid_loss']:9.4f}")
    rs, ag = results.get("reduce-scatter"), results.get("all-gather")
    if rs and ag:
        print(f"\nreduce-scatter / all-gather: tokens/s {rs['tokens_per_s'] / ag['tokens_per_s']:.2f}x, bytes per site "
              f"{rs['bytes_per_site_per_round'] / ag['bytes_per_site_per_round']:.2f}x, exposed per round "
              f"{rs['exposed_seconds_per_round']:.2f} s vs {ag['exposed_seconds_per_round']:.2f} s")
    meta = dict(methods=methods, sites=a.sites, iters=a.iters, h=a.h, rate=rate, rate_bits=rate_bits, ratio=a.ratio, step_seconds=step_s,
                corpus=a.corpus, block=BLOCK)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, results=results, **prov), f, indent=1)
    print(f"results: {os.path.join(a.out, 'results.json')}")


if __name__ == "__main__":
    main()
