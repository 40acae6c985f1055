"""Flags for the tiny real-Megatron runs the tests launch (one place, so every test trains the same GPT)."""
from megatron_dilocox.glue.cpu_backend import CPU_FLAGS


def tiny_gpt_flags(corpus, iters, *extra, layers=4, seq=128, global_batch=8):
    """A 4-layer, hidden-64 GPT on the KJV corpus; ``{cluster}`` picks each cluster's shard."""
    return CPU_FLAGS + [
        "--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--position-embedding-type", "rope",
        "--micro-batch-size", "2", "--global-batch-size", str(global_batch), "--train-iters", str(iters),
        "--lr", "3e-3", "--lr-decay-style", "constant", "--log-interval", "1",
        "--eval-interval", str(iters), "--eval-iters", "2", "--num-workers", "0", "--seed", "1234",
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{corpus}/tokenizer.model",
        "--train-data-path", f"{corpus}/train_c{{cluster}}_text_document",
        "--valid-data-path", f"{corpus}/valid_text_document", *extra]


def tiny_dilocox_flags(metrics_dir, *extra, h=4):
    """DiLoCoX at H, rank 4, int4, fixed H, rounds landing at the boundary and no link budget (adaptive H, τ and
    the link budget follow wall times: these tests compare runs bitwise and pin the low-rank path's bytes; the
    main job and the SLURM test run the defaults), metrics per cluster in ``metrics_dir``."""
    return ["--dilocox-h", str(h), "--dilocox-lowrank-rank", "4", "--dilocox-lowrank-min-dim", "32",
            "--dilocox-quant-bits", "4", "--dilocox-quant-block-size", "64", "--dilocox-no-adaptive-h",
            "--dilocox-no-link-budget", "--dilocox-overlap-steps", "1000000",
            "--dilocox-metrics-file", f"{metrics_dir}/metrics_c{{cluster}}.jsonl", *extra]


def failure_report(logs, tail: int = 30) -> str:
    """Each cluster's first Python traceback (the root cause; torchrun's summary buries it) and its tail."""
    parts = []
    for c, log in enumerate(logs):
        first = next((i for i, line in enumerate(log.lines) if "Traceback (most recent call last)" in line), None)
        cause = log.lines[first:first + 40] if first is not None else []
        parts.append(f"--- cluster {c}: first traceback ---\n" + "\n".join(cause)
                     + f"\n--- cluster {c}: last {tail} lines ---\n" + "\n".join(log.lines[-tail:]))
    return "\n".join(parts)
