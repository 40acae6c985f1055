"""CLI: ``python -m megatron_dilocox.sim [--paper] [--plan] [--json] [--sites SPEC] [--<input> VALUE ...]``.

Every field of ``setup.Setup`` is a flag (``--hidden``, ``--tp``, ``--link-gbps``, ``--rank``, ...).
Text output ends with the line ``speedup_vs_allreduce: <number>``; ``--json`` prints one JSON object.
``--sites 64:3200,128:1500`` (GPUs:tokens/s per GPU[:tokens per step] per site) prints instead each site's H and
weight and the run's tokens/s against lockstep rounds (``sites.py``), ending with ``vs_lockstep: <number>``.
``--exchange-layout canonical [--lanes L] [--site-layouts 8x4x4,8x8x2]`` adds each site's canonical figures beside
the local layout's (``canonical.py``); a plan whose host memory does not fit is refused: exit 1, the reason on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dataclasses import replace

from megatron_dilocox.compression.sparse_form import MAX_CHUNK
from megatron_dilocox.sim import canonical, codec_choice
from megatron_dilocox.sim import sites as site_plan
from megatron_dilocox.sim.cost_model import plan, predict
from megatron_dilocox.sim.setup import Setup, expert_tensors, layer_tensors, model_params, numel

HELP = {
    "hidden": "hidden size h", "layers": "transformer layers L", "ffn": "FFN hidden size",
    "vocab": "vocabulary size (padded to 128*TP)", "heads": "attention heads", "kv_heads": "KV heads (GQA)",
    "swiglu": "SwiGLU MLP (fc1 has 2*ffn rows)", "tied_embeddings": "output layer shares the embedding",
    "bias": "linear and norm biases", "experts": "MoE: routed experts per layer (0: dense MLP)",
    "moe_ffn": "MoE: expert FFN hidden size (default --ffn)", "topk": "MoE: experts per token (active params)",
    "ep": "MoE: expert parallel size (divides --dp and --experts)", "clusters": "number of clusters C", "tp": "tensor parallel per cluster",
    "pp": "pipeline parallel per cluster", "dp": "data parallel per cluster",
    "distributed_optimizer": "Megatron distributed optimizer (flat DP shards) vs DP replicas dealt round-robin",
    "peak_tflops": "peak dense bf16 TFLOP/s per GPU", "mfu": "model FLOPs utilisation (6 N FLOPs per token)",
    "tokens_per_gpu_s": "measured tokens/s per GPU (overrides --mfu)",
    "global_batch_tokens": "tokens per inner step, all clusters together",
    "link_gbps": "inter-cluster bandwidth per cluster, Gbit/s", "latency_ms": "one-way latency per ring hop, ms",
    "h": "inner steps per round", "rank": "low-rank rank", "bits": "quantization bits: 1, 4, 8, 16, 32",
    "block": "values per quantization block", "min_dim": "matrices with min(rows, cols) below this go whole",
    "lowrank": "low-rank compression", "sparse_k": "sparse exchange: top k of every --sparse-chunk values (0: off)",
    "sparse_chunk": "sparse exchange: values per chunk", "lowrank_basis": "local or shared (--dilocox-lowrank-basis)",
    "overlap": "eager, one-step-delay or none",
    "outer_momentum": "outer momentum (0: no momentum buffer)", "outer_state_device": "cpu or param",
    "allreduce_bits": "gradient bits of the AllReduce baseline: 32 (fp32) or 16 (bf16)",
    "scheme": "summable payloads between clusters: reduce-scatter + all-gather (about 2(C-1)/C of a payload "
              "per cluster), all-gather ((C-1)x), or auto (reduce-scatter from 3 clusters on)",
    "payload_auth": "an HMAC-SHA256 tag (32 bytes) on every message between clusters",
    "gpus_per_node": "GPUs (ranks) per node: they share the node's memory bandwidth at the round boundary",
    "host_copy_gb_s": "one core's host copy rate, GB/s read + written (scripts/bench/boundary_cost.py)",
    "host_elementwise_gb_s": "one core's fp32 elementwise rate (the outer step), GB/s read + written",
    "host_first_touch_gb_s": "one core's rate of paging in fresh host tensors, GB/s of the tensor",
    "sha256_gb_s": "one core's sha256 rate, GB/s (the per-round hashes of the outer state)",
    "node_memory_gb_s": "a node's host memory bandwidth, GB/s read + written (typical, not measured)",
    "pcie_gb_s": "GPU-host DMA rate per GPU, GB/s (typical H100 PCIe Gen5 x16, not measured)",
    "exchange_layout": "local (every site the same layout) or canonical (any layouts; the model in lanes)",
    "lanes": "canonical layout: lanes of whole tensors, each kept by one rank of a site (--dilocox-lanes)",
    "intra_site_gb_s": "canonical layout: GB/s of one pair of ranks inside a site (one 200 Gb/s NIC each)",
    "host_memory_gb": "canonical layout: host memory per rank, GB (a plan that needs more is refused)",
}

# The paper's setup (Qi et al. 2025, arXiv 2506.21263) as far as we could confirm it, the rest assumed.
PAPER = dict(hidden=8192, layers=80, ffn=47104, vocab=152064, heads=64, kv_heads=8, swiglu=True,
             tied_embeddings=False, bias=False, clusters=2, tp=1, pp=8, dp=10, distributed_optimizer=True,
             peak_tflops=312.0, mfu=0.4, global_batch_tokens=2 * 80 * 2048, link_gbps=1.0, latency_ms=10.0,
             h=100, rank=32, bits=4, block=128, allreduce_bits=32, gpus_per_node=8, pcie_gb_s=25.0)
PAPER_NOTES = [
    ("confirmed (abstract)", "107B-parameter model pre-trained over a 1 Gbps network; 357x speedup vs vanilla"
                             " AllReduce"),
    ("confirmed (Fig. 1 caption)", "example layout: 2 clusters x 16 workers, PP=8, DP=2 per cluster"),
    ("secondary source (0G blog)", "modified Qwen1.5-107B on 160 GPUs over 20 nodes; A800 GPUs (press)"),
    ("assumed", "C=2 clusters of 80 GPUs (10 nodes x 8), TP1 PP8 DP10 with the distributed optimizer"),
    ("assumed", "shape: h 8192, 80 layers, FFN 47104 SwiGLU, 64 heads / 8 KV heads, vocab 152064, untied"
                " (Qwen1.5-110B-like, FFN cut to land at 107.2B)"),
    ("assumed", "A800 peak 312 TFLOP/s bf16 dense (vendor spec), MFU 0.40"),
    ("assumed", "80 sequences x 2048 tokens per cluster per step (DP 10 x 8 micro-batches of 1)"),
    ("assumed", "AllReduce baseline: fp32 gradient ring all-reduce over the 1 Gbps link every step, not overlapped"),
    ("assumed", "H=100, rank 32, int4 blocks of 128 (this package's README example, not the paper's values);"
                " 10 ms latency per hop"),
    ("assumed", "round boundary: A800 on PCIe Gen4 x16 (~25 GB/s), 400 GB/s of host memory per 8-GPU node (typical"
                " figures); one core's copy, elementwise, page-in and sha256 rates as measured on this repository's"
                " CI host (sim/boundary.py)"),
]


def _type(annotation: str):
    return {"int": int, "float": float, "str": str}[annotation.replace("Optional[", "").rstrip("]")]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_dilocox.sim", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--paper", action="store_true", help="the paper's setup (flags given too override it)")
    ap.add_argument("--plan", action="store_true", help="also pick H, rank and bits that hide the transfer")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--choose-codec", action="store_true", help="price int4 whole, sparse and low rank at --h and "
                    "pick one by measured loss (codec_choice.py)")
    ap.add_argument("--target", type=float, default=0.9, help="--choose-codec: the fraction of the ceiling's "
                    "tokens/s a codec must reach")
    ap.add_argument("--params", type=float, help="model size; sets --layers (multiple of --pp) to match")
    ap.add_argument("--h-min", type=int, help="planner: smallest H allowed (default --h)")
    ap.add_argument("--h-max", type=int, help="planner and --choose-codec: largest H allowed (--choose-codec: "
                    "default --h)")
    ap.add_argument("--margin", type=float, default=0.1, help="planner: transfer this much shorter than a round")
    ap.add_argument("--sites", help="sites that differ: GPUS:TOKENS_PER_GPU_S[:TOKENS_PER_STEP] per site, comma-"
                                    "separated (tokens per step default: --global-batch-tokens); prints each site's "
                                    "H (--h for the slowest) and weight, and tokens/s against lockstep rounds")
    ap.add_argument("--site-layouts", help="canonical layout: each site's TPxPPxDP, comma-separated (sets --clusters; "
                                           "--tp/--pp/--dp become the first site's), e.g. 8x4x4,8x8x2")
    for f in dataclasses.fields(Setup):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=HELP[f.name])
        elif f.name == "overlap":
            ap.add_argument(flag, choices=["eager", "one-step-delay", "none"], default=f.default, help=HELP[f.name])
        elif f.name == "lowrank_basis":
            ap.add_argument(flag, choices=["local", "shared"], default=f.default, help=HELP[f.name])
        elif f.name == "scheme":
            ap.add_argument(flag, choices=["auto", "all-gather", "reduce-scatter"], default=f.default,
                            help=HELP[f.name])
        elif f.name == "exchange_layout":
            ap.add_argument(flag, choices=["local", "canonical"], default=f.default, help=HELP[f.name])
        elif f.name == "outer_state_device":
            ap.add_argument(flag, choices=["cpu", "param"], default=f.default, help=HELP[f.name])
        else:
            ap.add_argument(flag, type=_type(f.type), default=f.default, help=HELP[f.name])
    return ap


def parse(argv) -> argparse.Namespace:
    ap = build_parser()
    if "--paper" in argv:
        ap.set_defaults(**PAPER)
    args = ap.parse_args(argv)
    if args.sparse_k < 0 or args.sparse_k and not args.sparse_k <= args.sparse_chunk <= MAX_CHUNK:
        ap.error(f"--sparse-k {args.sparse_k}, --sparse-chunk {args.sparse_chunk}: need 0 (off) or k <= chunk <= "
                 f"{MAX_CHUNK}")
    if not 0 < args.target <= 1:
        ap.error(f"--target: a fraction of the ceiling in (0, 1], got {args.target}")
    if args.ep > 1 and not args.experts:
        ap.error("--ep: expert parallelism needs --experts")
    if args.experts and (args.experts % args.ep or args.dp % args.ep):
        ap.error(f"--ep: must divide --experts ({args.experts}) and --dp ({args.dp}), got {args.ep}")
    if args.site_layouts:
        try:
            args.layouts = canonical.parse_layouts(args.site_layouts)
        except ValueError as exc:
            ap.error(str(exc))
        if args.exchange_layout == "local" and len(set(args.layouts)) > 1:
            ap.error("--site-layouts: sites of different layouts need --exchange-layout canonical")
        args.clusters, (args.tp, args.pp, args.dp) = len(args.layouts), args.layouts[0]
    else:
        args.layouts = None
    if args.params:  # layers from the size: embeddings + L layers ~= params
        s = _setup(args)
        per_layer = sum(numel(t) for t in layer_tensors(s, 1)) + s.ep * sum(numel(t) for t in expert_tensors(s, 1))
        rest = model_params(replace(s, layers=0))
        args.layers = max(args.pp, round((args.params - rest) / per_layer / args.pp) * args.pp)
    return args


def _setup(args) -> Setup:
    return Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def report(args, out: dict) -> str:
    s, m = _setup(args), out["methods"]
    moe = f" (MoE: {s.experts} experts, top-{s.topk}, EP{s.ep}; {out['active_params'] / 1e9:.2f}B active)" if s.experts else ""
    lines = [f"DiLoCoX cost model: {out['params'] / 1e9:.2f}B params{moe}, {s.clusters} clusters x {s.gpus_per_cluster} GPUs"
             f" (TP{s.tp} PP{s.pp} DP{s.dp}, {'distributed optimizer' if s.distributed_optimizer else 'DP replicas'}),"
             f" {s.link_gbps:g} Gbps, H={s.h}, " + (f"sparse top {s.sparse_k} of {s.sparse_chunk}," if s.sparse_k else
                                                    f"rank {s.rank if s.lowrank else 'off'}, {s.bits}-bit/{s.block},") +
             f" {s.overlap}",
             f"inner step: {out['step_seconds']:.2f} s for {s.global_batch_tokens:,} tokens (all clusters);"
             f" H steps = {out['round_compute_seconds']:.0f} s",
             f"{'method':<10}{'tokens/s':>12}{'s/step':>12}{'comm s':>12}{'exposed s':>12}{'sent/cluster':>16}"]
    for k, per in (("allreduce", 1), ("diloco", s.h), ("dilocox", s.h), ("ceiling", 1)):
        v = m[k]
        sec = v.get("seconds_per_step", v.get("seconds_per_round", 0)) / per
        comm, exp = v.get("comm_seconds", 0.0), v.get("exposed_seconds", v.get("comm_seconds", 0.0))
        unit = "step" if k == "allreduce" else "round"
        sent = f"{_gb(v['bytes_per_cluster'])}/{unit}" if "bytes_per_cluster" in v else "-"
        lines.append(f"{k:<10}{v['tokens_per_s']:>12,.1f}{sec:>12.2f}{comm:>12.1f}{exp:>12.1f}{sent:>16}")
    if s.clusters > 1:
        sc = out["schemes"]
        lines.append(f"exchange schemes (in use: {out['scheme']}{', tagged' if s.payload_auth else ''}): " + "; ".join(
            f"{k} {_gb(v['bytes_per_cluster'])}/round, exposed {v['exposed_seconds']:.0f} s, "
            f"{v['compression_vs_dense_fp32']:.1f}x below dense fp32, {v['tokens_per_s']:,.0f} tokens/s"
            for k, v in sc.items()))
    b, parts = out["boundary"], ", ".join(f"{k} {v:.2f}" for k, v in out["boundary"]["parts"].items())
    lines.append(f"round boundary (busiest rank, outer state on {s.outer_state_device}, host work): {b['seconds']:.2f}"
                 f" s/round exposed ({parts}; {_gb(b['pcie_bytes'])} over PCIe), + {b['exchange_thread_seconds']:.2f} s"
                 f" in the exchange thread (state hash); DiLoCo: {m['diloco']['boundary_seconds']:.2f} s")
    lines.append(f"DiLoCoX compression vs dense fp32: {m['dilocox']['compression_vs_dense_fp32']:,.0f}x;"
                 f" DiLoCo speedup vs AllReduce: {out['diloco_speedup_vs_allreduce']:.1f}x")
    if out["views_rank_too_large"]:
        lines.append(f"WARNING: {out['views_rank_too_large']} matrix views are smaller than the rank"
                     " (the package refuses that configuration)")
    mem = out["memory"]
    lines.append(f"memory per GPU (busiest rank, {mem['rank_numel'] / 1e9:.3f}B values owned): outer state on"
                 f" {mem['outer_state_on']}: anchor {_gb(mem['anchor'])}, momentum {_gb(mem['momentum'])},"
                 f" round start {_gb(mem['round_start'])}; on GPU: error feedback {_gb(mem['error_feedback'])},"
                 f" Q {_gb(mem['q'])} (+{_gb(mem['transient_gpu_bytes'])} transient per round);"
                 f" totals GPU {_gb(mem['gpu_bytes'])}, CPU {_gb(mem['cpu_bytes'])}")
    if "canonical" in out:
        lines += canonical_report(out["canonical"])
    if "plan" in out:
        p = out["plan"]
        if p["feasible"]:
            x = p["prediction"]["methods"]["dilocox"]
            lines.append(f"plan: H={p['h']}, rank {p['rank'] or 'off (dense)'}, {p['bits']} bits: transfer"
                         f" {x['comm_seconds']:.1f} s vs {p['prediction']['round_compute_seconds']:.1f} s of training"
                         f" (exposed {x['exposed_seconds']:.1f} s), {x['tokens_per_s']:,.1f} tokens/s")
        else:
            lines.append(f"plan: infeasible: {p['reason']}")
    if "codec_choice" in out:
        lines += codec_choice.report(out["codec_choice"])
    if args.paper:
        lines.append("paper setup (Qi et al. 2025, arXiv 2506.21263); what is and is not from the paper:")
        lines += [f"  [{tag}] {text}" for tag, text in PAPER_NOTES]
        ar, x = m["allreduce"], m["dilocox"]
        lines.append(f"arithmetic: AllReduce step = T_step + 2(C-1)/C * 4N bytes / 125 MB/s = {out['step_seconds']:.2f}"
                     f" + {ar['comm_seconds']:.0f} s; DiLoCoX step = T_step + (exposed + boundary)/H = {out['step_seconds']:.2f}"
                     f" + {(x['exposed_seconds'] + x['boundary_seconds']) / s.h:.2f} s; speedup = {ar['seconds_per_step']:.0f} /"
                     f" {x['seconds_per_round'] / s.h:.2f} = {out['speedup_vs_allreduce']:.1f}"
                     " (~ 1 + T_AR/T_step, independent of N; scales with MFU x GPUs / (batch x bandwidth))")
        for label, kw in (("bf16 AllReduce", {"allreduce_bits": 16}), ("MFU 0.3", {"mfu": 0.3}),
                          ("MFU 0.5", {"mfu": 0.5}), ("2x batch", {"global_batch_tokens": 2 * s.global_batch_tokens})):
            lines.append(f"  sensitivity, {label}: speedup {predict(replace(s, **kw))['speedup_vs_allreduce']:.1f}")
    lines.append(f"speedup_vs_allreduce: {out['speedup_vs_allreduce']:.1f}")
    return "\n".join(lines)


def canonical_report(c: dict) -> list[str]:
    """Each site's canonical figures (the busiest rank) beside the local layout's, then the verdict."""
    gb = canonical.gb
    lines = [f"canonical exchange layout, {c['lanes']} lane(s) of {c['units']} global tensors ({c['numel'] / 1e9:.2f}B "
             f"values); a pair of ranks at {c['intra_site_gb_s']:g} GB/s; host memory {c['host_memory_gb']:g} GB per rank"
             + ("" if c["equal_layouts"] else " (layouts differ: the local layout is shown as if every site had "
                "that site's layout)")]
    for i, f in enumerate(c["sites"]):
        tp, pp, dp, m, loc = *f["layout"], f["moves"], f["local"]
        lines.append(f"  site {i} TP{tp} PP{pp} DP{dp} ({f['ranks']} ranks), busiest rank {f['busiest_rank']}: "
                     f"{f['rank_values'] / 1e9:.3f}B values in {f['lanes_per_rank']} lane(s); host {gb(f['host_bytes'])}"
                     f" ({f['host_bytes_per_value']:.1f} B/value), peak {gb(f['host_peak_bytes'])}; device "
                     f"+{gb(f['device_bytes'])} (one reused buffer of at most 2^24 values)")
        lines.append(f"         gather+scatter {m['seconds']:.1f} s x {f['moves_per_round']}/round (fabric "
                     f"{gb(m['fabric_bytes'])} in {m['fabric_seconds']:.1f} s; GPU-host {gb(m['pcie_bytes'])} and host "
                     f"copies {m['host_seconds']:.1f} s) + round logic {f['round_logic_seconds']:.1f} s; "
                     f"{gb(f['bytes_per_round'])}/round between sites")
        lines.append(f"         local layout: {loc['rank_values'] / 1e9:.3f}B values per rank, host {gb(loc['host_bytes'])}"
                     f", GPU {gb(loc['device_bytes'])}; boundary {loc['boundary_seconds']:.1f} s/round; "
                     f"{gb(loc['bytes_per_round'])}/round between sites")
    lines.append(f"canonical plan refused: {c['refusal']}" if c["refusal"] else
                 f"canonical plan fits: at most {gb(max(f['host_peak_bytes'] for f in c['sites']))} of host memory per rank")
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    s = _setup(args)
    out = predict(s)
    if args.sites:
        try:
            sites = site_plan.parse_sites(args.sites, s.global_batch_tokens)
        except ValueError as exc:
            build_parser().error(str(exc))
        comm = predict(replace(s, clusters=len(sites)))["methods"]["dilocox"]["comm_seconds"]  # the model, the link
        p = site_plan.plan_sites(sites, s.h, comm, args.margin)
        print(json.dumps(p, indent=1) if args.json else
              site_plan.report(p, s.h, comm) + f"\nvs_lockstep: {p['vs_lockstep']:.2f}")
        return 0
    if args.plan or args.paper:
        out["plan"] = plan(s, h_min=args.h_min or s.h, h_max=args.h_max, margin=args.margin)
    if args.choose_codec:
        out["codec_choice"] = codec_choice.choose(s, args.target, args.h_max)
    if s.exchange_layout == "canonical":
        try:
            out["canonical"] = canonical.price(s, args.layouts)
        except ValueError as exc:
            build_parser().error(str(exc))
    if args.json:
        if args.paper:
            out["paper_notes"] = [{"source": t, "text": x} for t, x in PAPER_NOTES]
        print(json.dumps(out, indent=1))
    else:
        print(report(args, out))
    if out.get("canonical", {}).get("refusal"):
        print(f"error: canonical plan refused: {out['canonical']['refusal']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
