"""The main job: a small real GPT pretraining across 2 simulated clusters on this host, with DiLoCoX.

1. builds the offline KJV corpus (tokenizer + per-cluster Megatron .bin/.idx; idempotent) in ``data/kjv``;
2. launches C clusters (default 2), each its own torchrun world running real Megatron (TP1 PP2 by
   default) via ``megatron_dilocox.pretrain_gpt`` on its own shard, meeting at an authenticated rendezvous;
3. prints Megatron's iteration lines and one line per outer round, and ends with a summary:
   validation loss, tokens/s, total bytes sent vs a dense fp32 all-reduce, rank, H, exposed comm;
4. draws ``<out>/loss.png``: each cluster's training loss and the global model's validation loss against
   tokens (``harness/plot.py``; the plotted series in ``<out>/loss.json``), its path in the summary ("plot").

On a machine without a GPU everything runs on CPU (the CPU backend says so in the log).

    python -m megatron_dilocox.main_job [--clusters 2] [--iters 200] [-- extra Megatron or --dilocox-* flags]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # megatron_dilocox/harness/ -> repo


def iterations_run(curve: dict, log) -> int:
    """A cluster's iterations: where Megatron's final evaluation says it ended (per-site H ends a fast site past
    --train-iters, a slow one before it; the training loss is printed only every --log-interval)."""
    valid = curve["validation"]
    return valid["iteration"][-1] if valid["final"] and valid["final"][-1] else log.last_iteration


def gpt_flags(corpus: str, iters: int, tp: int, pp: int, eval_interval: int | None = None) -> list[str]:
    """The small GPT's Megatron flags. Evaluation once at the end by default; the main job asks for a few
    more (``eval_interval``) so that its picture has a validation curve."""
    from megatron_dilocox.glue.cpu_backend import CPU_FLAGS
    import torch
    flags = [] if torch.cuda.is_available() else list(CPU_FLAGS)
    return flags + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--position-embedding-type", "rope",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(iters),
        "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
        "--weight-decay", "0.01", "--clip-grad", "1.0",
        "--log-interval", "10", "--eval-interval", str(eval_interval or iters), "--eval-iters", "10",
        "--num-workers", "0",
        "--seed", "1234", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{corpus}/tokenizer.model",
        "--train-data-path", f"{corpus}/train_c{{cluster}}_text_document",
        "--valid-data-path", f"{corpus}/valid_text_document"]


def split_dilocox_flags(extra: list[str]) -> tuple[list[str], list[str]]:
    """(--dilocox-* flags with their values, everything else): a value follows its flag."""
    mine, theirs, target = [], [], None
    for x in extra:
        if x.startswith("--"):
            target = mine if x.startswith("--dilocox") else theirs
        (target if target is not None else theirs).append(x)
    return mine, theirs


def last_value(flags: list[str], name: str, default: str) -> str:
    """The value Megatron's argparse ends up with: the last ``name VALUE`` on the command line."""
    found = [flags[i + 1] for i, x in enumerate(flags[:-1]) if x == name]
    return found[-1] if found else default


def main(argv=None):
    from megatron_dilocox.harness.launch import split_passthrough
    own, extra = split_passthrough(argv)
    ap = argparse.ArgumentParser(description="DiLoCoX main job: small real GPT pretraining across clusters")
    ap.add_argument("--clusters", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--h", type=int, default=10)
    ap.add_argument("--data", default=os.path.join(REPO, "data", "kjv"))
    ap.add_argument("--out", default=None, help="folder for metrics (default: a new temporary folder)")
    a = ap.parse_args(own)

    from megatron_dilocox.data.prepare import prepare
    from megatron_dilocox.harness import plot
    from megatron_dilocox.harness.launch import run
    from megatron_dilocox.metrics import read_rows

    t0 = time.time()
    manifest = prepare(a.data, num_clusters=a.clusters)
    print(f"corpus: {a.data} ({manifest.get('splits', {}).get('train_all', {}).get('tokens', '?')} training tokens)",
          flush=True)
    out = a.out or tempfile.mkdtemp(prefix="dilocox_main_job_")
    os.makedirs(out, exist_ok=True)
    # rank 6 int4: 130x fewer bytes per round than dense fp32; rank 8 is 99x, rank 4 costs 2% of validation loss
    # (60-iteration sweep in docs/benchmarks.md#the-main-jobs-rank)
    dilocox = ["--dilocox-h", str(a.h), "--dilocox-lowrank-rank", "6", "--dilocox-lowrank-min-dim", "64",
               "--dilocox-quant-bits", "4", "--dilocox-metrics-file", os.path.join(out, "metrics_c{cluster}.jsonl")]
    mine, theirs = split_dilocox_flags(extra)
    dilocox += mine
    # four evaluations along the run and the final one (10 batches each: ~5% of the wall time at 200 iterations)
    megatron = gpt_flags(a.data, a.iters, a.tp, a.pp, eval_interval=max(10, a.iters // 4)) + theirs
    seq_length = int(last_value(megatron, "--seq-length", "128"))
    codes, logs = run(a.clusters, a.tp * a.pp, megatron, dilocox_args=dilocox,
                      echo_filter=r"iteration\s+\d+/|\[dilocox\]|validation loss|Error|error:|Traceback|CPU backend")
    if any(codes):
        print(f"main job failed: exit codes {codes}", file=sys.stderr)
        sys.exit(1)

    rows = [r for c in range(a.clusters) for r in read_rows(os.path.join(out, f"metrics_c{c}.jsonl"))]
    last = {c: max((r for r in rows if r["cluster"] == c), key=lambda r: r["round"]) for c in range(a.clusters)}
    tokens_per_s = 0.0
    for log in logs:
        steady = [ms for it, ms in log.iter_ms.items() if it > 10] or list(log.iter_ms.values())
        tokens_per_s += log.global_batch * seq_length / (sum(steady) / len(steady) / 1000.0)
    curves = plot.series(logs, seq_length)  # the SUMMARY's losses are the plotted ones
    summary = {
        "clusters": a.clusters, "layout": f"TP{a.tp} PP{a.pp}", "iterations": [iterations_run(c, log) for c, log in zip(curves["clusters"], logs)],
        "validation_loss": [c["validation"]["loss"][-1] if c["validation"]["loss"] else None
                            for c in curves["clusters"]],
        "train_loss_first_last": [[c["train"]["loss"][0], c["train"]["loss"][-1]] for c in curves["clusters"]],
        "tokens_per_s_all_clusters": round(tokens_per_s, 1),
        "rounds": len(rows) // a.clusters,
        "bytes_sent": sum(r["bytes_sent"] for r in rows),
        "bytes_dense_fp32": sum(r["bytes_dense_fp32"] for r in rows),
        "final_H": last[0]["next_H"], "final_rank": last[0]["next_lowrank_rank"],
        "exposed_comm_seconds": round(sum(r["exposed_comm_seconds"] for r in rows), 3),
        "comm_seconds": round(sum(r["comm_seconds"] for r in rows), 3),
        "clusters_agree": all(len({r["global_model_hash"] for r in rows if r["round"] == k}) == 1
                              for k in {r["round"] for r in rows}),  # every round, not only the last
        "wall_seconds": round(time.time() - t0, 1), "metrics": out,
    }
    summary["bytes_ratio_dense_over_sent"] = round(summary["bytes_dense_fp32"] / max(1, summary["bytes_sent"]), 1)
    sent = f"rank {summary['final_rank']}" if summary["final_rank"] else "whole tensors"  # rank 0: not low-rank
    summary["plot"] = plot.write(curves, out, (
        f"DiLoCoX main job: {a.clusters} clusters, {summary['layout']}, "
        f"{' + '.join(map(str, summary['iterations']))} iterations, "
        f"{summary['rounds']} rounds (final H {summary['final_H']}, {sent})\n"
        f"{summary['bytes_ratio_dense_over_sent']}x fewer bytes between clusters than a dense fp32 all-reduce; "
        f"final validation loss {summary['validation_loss'][0]}"))
    print(f"loss curves: {summary['plot']}", flush=True)
    print("SUMMARY " + json.dumps(summary), flush=True)
    if not summary["clusters_agree"]:
        sys.exit("clusters disagree on the final global model")


if __name__ == "__main__":
    main()
