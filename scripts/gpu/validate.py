"""One-command validation of DiLoCoX on real Megatron: what a GPU run takes that the CPU tests cannot prove.

Configurations (``--configs``, default all), every one with payload authentication on (the launcher's secret):

    dense        2 clusters x 1 process, a dense GPT with the 107B shape's features (GQA, SwiGLU, RMSNorm, untied)
    moe          2 clusters x 1 process, an MoE GPT (TE grouped GEMM on GPU)
    three-sites  3 clusters x 1 process, dense: the pairwise reduce-scatter (gloo send/recv between sites) with a
                 tag on every message, each site's device tensors staged through host memory
    canonical    2 clusters of different layouts (1 process; PP2 in 2 processes), ``--dilocox-exchange-layout
                 canonical`` in two lanes (one per rank of the PP2 site, both in the other site's process),
                 per-site rounds (the default): the lanes' point-to-point moves on the device's own groups

GPU form (default): every process on GPU 0, Transformer Engine, bf16; about 10 minutes on one GPU. ``--cpu``: the
same runs on CPU with the local implementation, a smaller model and fewer iterations (CI runs three-sites and
canonical: ``tests/test_validate.py``). Both print, per configuration: losses, the global-model hash of every round on every
cluster, bytes sent against the codec's closed form and dense fp32, exposed communication, and peak GPU memory
next to Megatron's own estimate and the planner's DiLoCoX-state figure. The last line is ``VALIDATE {json}``; the
exit status is 1 on any disagreement (hashes, bytes, rounds, loss not falling).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))  # provenance.py

from megatron_dilocox.glue.cpu_backend import CPU_FLAGS  # noqa: E402  (imports no megatron)
from megatron_dilocox.harness.launch import run  # noqa: E402
from megatron_dilocox.metrics import read_rows  # noqa: E402
from megatron_dilocox.sim import cost_model  # noqa: E402
from provenance import provenance  # noqa: E402

SIZES = {  # (hidden, layers, heads, seq, iters, H, micro batch, global batch)
    "gpu": dict(hidden=512, layers=8, heads=8, seq=512, iters=60, h=10, mbs=4, gbs=32),
    "cpu": dict(hidden=64, layers=2, heads=4, seq=64, iters=8, h=4, mbs=2, gbs=8),
}
RANK, BITS, BLOCK, MIN_DIM, VOCAB, EXPERTS = 4, 4, 64, 32, 4096, 4
CONFIGS = {  # model, clusters, processes per cluster where not 1, flags per cluster, DiLoCoX flags, per-site rounds
    "dense": dict(model="dense", clusters=2),
    "moe": dict(model="moe", clusters=2),
    "three-sites": dict(model="dense", clusters=3,  # (the corpus has two sites' shards: the third trains on both)
                        per_cluster={2: ["--train-data-path", "{data}/train_all_text_document"]}),
    "canonical": dict(model="dense", clusters=2, nproc={1: 2}, per_cluster={1: ["--pipeline-model-parallel-size", "2"]},
                      dilocox=["--dilocox-exchange-layout", "canonical", "--dilocox-lanes", "2"], per_site=True),
}
MEMORY_RE = re.compile(r"memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+)")
THEORY_RE = re.compile(r"Theoretical memory footprints: weight and optimizer=([\d.]+) MB")


def megatron_flags(data: str, size: dict, gpu: bool, config: str) -> list[str]:
    s = size
    flags = ["--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]), "--num-attention-heads",
             str(s["heads"]), "--seq-length", str(s["seq"]), "--max-position-embeddings", str(s["seq"]),
             "--position-embedding-type", "rope", "--micro-batch-size", str(s["mbs"]),
             "--global-batch-size", str(s["gbs"]), "--train-iters", str(s["iters"]), "--lr", "3e-3",
             "--lr-decay-style", "constant", "--log-interval", "1", "--eval-interval", str(s["iters"]),
             "--eval-iters", "2", "--num-workers", "0", "--seed", "1234", "--bf16", "--use-distributed-optimizer",
             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{data}/tokenizer.model",
             "--train-data-path", f"{data}/train_c{{cluster}}_text_document",
             "--valid-data-path", f"{data}/valid_text_document", "--disable-bias-linear"]
    flags += ["--transformer-impl", "transformer_engine"] if gpu else CPU_FLAGS
    if config == "dense":  # the 107B shape's features
        flags += ["--group-query-attention", "--num-query-groups", str(s["heads"] // 2), "--swiglu",
                  "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights"]
    else:
        flags += ["--num-experts", str(EXPERTS), "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
                  "--moe-token-dispatcher-type", "alltoall"] + (["--moe-grouped-gemm"] if gpu else [])
    return flags


def dilocox_flags(out: str, size: dict, spec: dict) -> list[str]:
    """Fixed H and rank, so that the rounds are known: per-site rounds (the default) give every site the same H
    when the sites run at the same speed; ``per_site`` configurations have sites that do not."""
    return ["--dilocox-h", str(size["h"]), "--dilocox-lowrank-rank", str(RANK), "--dilocox-lowrank-min-dim",
            str(MIN_DIM), "--dilocox-quant-bits", str(BITS), "--dilocox-quant-block-size", str(BLOCK),
            "--dilocox-no-adaptive-h", "--dilocox-no-adaptive-rank",
            "--dilocox-metrics-file", f"{out}/metrics_c{{cluster}}.jsonl"] + spec.get("dilocox", [])


def planner(size: dict, spec: dict) -> dict:
    """The planner's prediction for the run's shape (1 GPU per cluster): DiLoCoX state per GPU, bytes."""
    moe = spec["model"] == "moe"
    s = cost_model.Setup(hidden=size["hidden"], layers=size["layers"],
                         ffn=4 * size["hidden"] if moe else 64 * int(8 * size["hidden"] / 3 / 64), vocab=VOCAB,
                         heads=size["heads"], kv_heads=None if moe else size["heads"] // 2, swiglu=not moe,
                         tied_embeddings=moe, bias=False, experts=EXPERTS if moe else 0, topk=2, clusters=spec["clusters"], tp=1,
                         pp=1, dp=1, h=size["h"], rank=RANK, bits=BITS, block=BLOCK, min_dim=MIN_DIM)
    return cost_model.predict(s)


def summarize(config: str, codes: list, logs: list, out: str, gpu: bool) -> dict:
    """Everything the run showed, and the list of disagreements (empty = pass)."""
    rows = [read_rows(f"{out}/metrics_c{c}.jsonl") if os.path.exists(f"{out}/metrics_c{c}.jsonl") else []
            for c in range(len(codes))]
    layouts = [{x["rank"]: x for x in (json.loads(ln.split("DiLoCoX layout ", 1)[1]) for ln in log.lines
                                       if "DiLoCoX layout {" in ln)} for log in logs]
    peak = [max((float(m.group(2)) for ln in log.lines if (m := MEMORY_RE.search(ln))), default=None)
            if gpu else None for log in logs]  # on CPU Megatron's counters are all zero
    theory = [next((float(m.group(1)) for ln in log.lines if (m := THEORY_RE.search(ln))), None) for log in logs]
    losses = [log.losses for log in logs]
    return {"config": config, "exit_codes": codes, "rows": rows, "layouts": layouts, "losses": losses,
            "valid_losses": [log.valid_losses for log in logs], "peak_mb": peak, "megatron_weight_optimizer_mb": theory}


def problems(result: dict, iters: int, h: int, per_site: bool = False) -> list[str]:
    """The disagreements validate exits 1 on. ``per_site``: each site's H and iterations follow the token plan, so
    the rounds are 1..R for the same R everywhere (not iters / h) and each site's loss falls over what it trained;
    the sites' layouts differ by design."""
    bad = []
    codes = result["exit_codes"]
    if codes != [0] * len(codes):
        return [f"exit codes {codes}"]
    rows, layouts, losses = result["rows"], result["layouts"], result["losses"]
    rounds = len(rows[0]) if per_site else iters // h
    for c in range(len(codes)):
        if [r["round"] for r in rows[c]] != list(range(1, rounds + 1)) or not rounds:
            bad.append(f"cluster {c} rounds {[r['round'] for r in rows[c]]}, expected 1..{rounds}")
        if any(r["status"] != "applied" for r in rows[c]):
            bad.append(f"cluster {c}: a round was not applied")
        last = max(losses[c], default=0) if per_site else iters
        if (not per_site and sorted(losses[c]) != list(range(1, iters + 1))) or not losses[c].get(last, 1e9) < \
                losses[c].get(1, 0):
            bad.append(f"cluster {c}: loss did not fall ({losses[c].get(1)} -> {losses[c].get(last)})")
        closed = sum(x["round_bytes"] for x in layouts[c].values())
        for r in rows[c]:
            if r["bytes_sent"] != closed:
                bad.append(f"cluster {c} round {r['round']}: sent {r['bytes_sent']} B, closed form {closed} B")
    if any([r["global_model_hash"] for r in rs] != [r["global_model_hash"] for r in rows[0]] for rs in rows):
        bad.append("global-model hashes differ between the clusters")
    if not per_site and any(lay != layouts[0] for lay in layouts):
        bad.append("the clusters' per-rank layouts differ")
    return bad


def report(result: dict, plan: dict):
    print(f"== {result['config']}")
    for c in range(len(result["rows"])):
        ls = result["losses"][c]
        peak = "n/a on CPU" if result["peak_mb"][c] is None else f"{result['peak_mb'][c]} MB"
        print(f"  cluster {c}: loss {ls.get(1)} -> {ls.get(max(ls, default=0))}, validation "
              f"{result['valid_losses'][c][-1:]}, peak GPU memory {peak} "
              f"(Megatron's weight+optimizer estimate {result['megatron_weight_optimizer_mb'][c]} MB)")
        for r in result["rows"][c]:
            print(f"    round {r['round']} @ {r['iteration']}: hash {r['global_model_hash']} sent {r['bytes_sent']} B "
                  f"(dense fp32 {r['bytes_dense_fp32']} B) exposed {r['exposed_comm_seconds']:.3f}s")
    mem = plan["memory"]
    print(f"  planner DiLoCoX state per GPU: {mem['gpu_bytes'] / 2**20:.2f} MB on GPU, "
          f"{mem['cpu_bytes'] / 2**20:.2f} MB host ({mem['outer_state_on']} outer state); planner bytes/round "
          f"{plan['methods']['dilocox']['bytes_per_cluster']} B per cluster")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU (CI); default: GPU 0 with Transformer Engine")
    ap.add_argument("--data", help="prepared corpus directory (default: built from KJV in a temporary directory)")
    ap.add_argument("--out", help="where runs write metrics (default: a temporary directory)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    args = ap.parse_args(argv)
    prov = provenance()
    gpu = not args.cpu
    if gpu:
        import torch
        if not torch.cuda.is_available():
            print("validate: no GPU visible; run with --cpu for the CPU form", file=sys.stderr)
            return 2
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            print("validate: the GPU form needs Transformer Engine (the docker/ image has it)", file=sys.stderr)
            return 2
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        ap.error(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    size = SIZES["gpu" if gpu else "cpu"]
    out = args.out or tempfile.mkdtemp(prefix="dilocox_validate_")
    data = args.data or os.path.join(out, "data")
    if not args.data:
        from megatron_dilocox.data.prepare import prepare
        prepare(data, num_clusters=2, vocab_size=VOCAB)
    env = {"CUDA_VISIBLE_DEVICES": "0" if gpu else "", "WANDB_MODE": "offline"}
    results, failed = [], []
    for config in args.configs.split(","):
        spec = CONFIGS[config]
        run_dir = os.path.join(out, config)
        os.makedirs(run_dir, exist_ok=True)
        for c in range(spec["clusters"]):  # (metrics files append: a rerun into the same --out starts clean)
            if os.path.exists(f"{run_dir}/metrics_c{c}.jsonl"):
                os.remove(f"{run_dir}/metrics_c{c}.jsonl")
        t0 = time.time()
        codes, logs = run(spec["clusters"], 1, megatron_flags(data, size, gpu, spec["model"]),
                          dilocox_args=dilocox_flags(run_dir, size, spec), nproc_by_cluster=spec.get("nproc"),
                          per_cluster_args={c: [a.replace("{data}", data) for a in flags]
                                            for c, flags in spec.get("per_cluster", {}).items()}, env=env, echo=False, timeout=900)
        result = summarize(config, codes, logs, run_dir, gpu)
        result["wall_seconds"] = round(time.time() - t0, 1)
        bad = problems(result, size["iters"], size["h"], spec.get("per_site", False))
        if any(codes):
            print("\n".join("\n".join(log.lines[-30:]) for log in logs))
        report(result, planner(size, spec))
        print(f"  {'OK' if not bad else 'DISAGREE: ' + '; '.join(bad)} ({result['wall_seconds']} s)")
        failed += [f"{config}: {b}" for b in bad]
        results.append({k: result[k] for k in ("config", "exit_codes", "peak_mb", "wall_seconds")} |
                       {"hashes": [[r["global_model_hash"] for r in rows] for rows in result["rows"]],
                        "bytes_sent": [[r["bytes_sent"] for r in rows] for rows in result["rows"]],
                        "closed_form_bytes": [sum(x["round_bytes"] for x in lay.values()) for lay in result["layouts"]],
                        "first_last_loss": [[ls.get(1), ls.get(max(ls, default=0))] for ls in result["losses"]],
                        "problems": bad})
    print("VALIDATE " + json.dumps({"device": "gpu" if gpu else "cpu", "ok": not failed, **prov, "results": results}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
