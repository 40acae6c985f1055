"""The tiny real-Megatron runs the tests launch, in one place so that every test trains the same GPT: its flags,
the CPU environment and launcher (``megatron_dilocox.harness.launch``, output kept in the logs), the metrics rows
it writes, and the report an assertion prints when a run fails."""
import os
import time

from megatron_dilocox.glue.cpu_backend import CPU_FLAGS
from megatron_dilocox.harness import launch
from megatron_dilocox.metrics import read_rows

# No GPU even where the host has one (the CPU backend is what the tests pin); wandb, where a test enables it, offline.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "offline"}


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


def mock_gpt_flags(iters=2, global_batch=1, eval_iters=0):
    """A 2-layer, hidden-64 GPT on Megatron's mock data (no corpus, no tokenizer file): for runs whose point is the
    argument path or what the run writes, not what it learns."""
    return CPU_FLAGS + [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", str(global_batch),
        "--train-iters", str(iters), "--lr", "1e-3", "--seed", "1234", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "512", "--num-workers", "0", "--log-interval", "1",
        "--eval-interval", str(iters), "--eval-iters", str(eval_iters)]


def tiny_dilocox_flags(metrics_dir, *extra, h=4):
    """DiLoCoX at H, rank 4, int4, fixed H, rounds landing at the boundary and no link budget (adaptive H, τ and
    the link budget follow wall times: these tests compare runs bitwise and pin the low-rank path's bytes; the
    main job and the SLURM test run the defaults), metrics per cluster in ``metrics_dir``."""
    return ["--dilocox-h", str(h), "--dilocox-lowrank-rank", "4", "--dilocox-lowrank-min-dim", "32",
            "--dilocox-quant-bits", "4", "--dilocox-quant-block-size", "64", "--dilocox-no-adaptive-h",
            "--dilocox-no-link-budget", "--dilocox-overlap-steps", "1000000",
            "--dilocox-metrics-file", f"{metrics_dir}/metrics_c{{cluster}}.jsonl", *extra]


def metrics_rows(metrics_dir, cluster):
    """Cluster ``cluster``'s round rows so far in the metrics file ``tiny_dilocox_flags`` names ([] before its
    first round)."""
    path = f"{metrics_dir}/metrics_c{cluster}.jsonl"
    return read_rows(path) if os.path.exists(path) else []


def run_on_cpu(clusters, nproc, megatron, dilocox=None, env=None, **kw):
    """``harness.launch.run`` on CPU (``CPU_ENV`` plus ``env``), nothing echoed: (exit codes, logs)."""
    return launch.run(clusters, nproc, megatron, dilocox_args=dilocox, env={**CPU_ENV, **(env or {})}, echo=False,
                      **kw)


def start_on_cpu(clusters, nproc, megatron, dilocox=None, env=None, **kw):
    """``harness.launch.start`` on CPU (``CPU_ENV`` plus ``env``), nothing echoed: the running ``Clusters``."""
    return launch.start(clusters, nproc, megatron, dilocox_args=dilocox, env={**CPU_ENV, **(env or {})}, echo=False,
                        **kw)


def run_many_on_cpu(jobs, timeout=600):
    """Independent runs at once: ``jobs`` is a list of ``(clusters, nproc, megatron, dilocox)`` (or a dict of them,
    by name); returns their ``(exit codes, logs)`` in the same shape. Worth it for one-process runs (a 4-iteration
    one is mostly start-up: four take 17 s side by side, 30 s one after the other); two-process runs keep the 2
    cores busy already and gain nothing."""
    named = jobs if isinstance(jobs, dict) else dict(enumerate(jobs))
    handles = {}
    try:
        for key, (clusters, nproc, megatron, dilocox) in named.items():
            handles[key] = start_on_cpu(clusters, nproc, megatron, dilocox)
        deadline = time.monotonic() + timeout
        results = {key: (h.wait(max(1.0, deadline - time.monotonic())), h.logs) for key, h in handles.items()}
    finally:
        for h in handles.values():
            h.stop()
    return results if isinstance(jobs, dict) else [results[k] for k in range(len(jobs))]


def failure_report(logs, coordinators=(), tail: int = 30) -> str:
    """Each cluster's first Python traceback (the root cause; torchrun's summary buries it) and its tail, then the
    end of each standalone coordinator's log (``tests/coord_util.py``)."""
    parts = []
    for c, log in enumerate(logs):
        first = next((i for i, line in enumerate(log.lines) if "Traceback (most recent call last)" in line), None)
        cause = log.lines[first:first + 40] if first is not None else []
        parts.append(f"--- cluster {c}: first traceback ---\n" + "\n".join(cause)
                     + f"\n--- cluster {c}: last {tail} lines ---\n" + "\n".join(log.lines[-tail:]))
    parts += [f"--- coordinator {i}: end of its log ---\n" + coord.text()[-2000:]
              for i, coord in enumerate(coordinators)]
    return "\n".join(parts)
