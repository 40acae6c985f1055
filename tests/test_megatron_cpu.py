"""Real Megatron (megatron-core 0.19 ``pretrain()``) on CPU through ``megatron_dilocox.pretrain_gpt``.

Each test launches ``torchrun --standalone`` (as ``python -m torch.distributed.run``) with a tiny
GPT on Megatron's mock data and checks numbers parsed from Megatron's iteration log lines. GPUs
are hidden from the jobs, so the CPU backend is always the one under test. ~2.5 min on 2 cores.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dilocox.glue.cpu_backend import CPU_FLAGS

pytestmark = pytest.mark.megatron

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

# 4 layers, hidden 64, 4 heads, seq 128, vocab 256; 4 micro-batches of 2 per iteration.
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--position-embedding-type", "rope",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "10", "--lr", "1e-3", "--lr-decay-style", "constant",
    "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--num-workers", "0", "--seed", "1234",
]

_ITERATION = re.compile(
    r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|"
)


def run_megatron(nproc, *flags, entry=("-m", "megatron_dilocox.pretrain_gpt"), timeout=TIMEOUT_S):
    """Run ``pretrain_gpt`` under torchrun on CPU; return the combined output (asserts rc 0)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), *entry,
           *CPU_FLAGS, *TINY_GPT, *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
    return out


def iterations(out):
    """{iteration: (logged lm loss string, grad norm string)} from Megatron's log lines."""
    found = {int(m[1]): (m[2], m[3]) for m in _ITERATION.finditer(out)}
    assert found, "no iteration lines in the output"
    return found


def losses(out):
    """Per-iteration lm loss, undoing one quirk of Megatron's log (``--log-interval 1`` only).

    ``training_log`` does not reset its accumulators after the first iteration a process runs,
    so the next logged value is the mean of those two iterations.
    """
    logged = {it: float(loss) for it, (loss, _) in iterations(out).items()}
    first = min(logged)
    if first + 1 in logged:
        logged[first + 1] = 2 * logged[first + 1] - logged[first]
    return logged


def assert_learns(out, margin):
    """lm loss at the last iteration is at least `margin` below the first (ln 256 = 5.55)."""
    loss = losses(out)
    first, last = loss[min(loss)], loss[max(loss)]
    assert max(loss) == 10, sorted(loss)
    assert last < first - margin, (first, last)
    return loss


# slow: CI trains TP1 PP2 with DiLoCoX on (tests/test_megatron_dilocox.py::test_two_clusters_tp1_pp2: loss falls,
# validation logged) and plain (test_without_dilocox_flags_the_entry_is_plain_megatron)
@pytest.mark.slow
def test_tp1_pp2_learns_and_evaluates():
    out = run_megatron(2, "--pipeline-model-parallel-size", "2",
                       "--eval-interval", "5", "--eval-iters", "1")
    assert out.count("CPU backend active") == 2  # one line per process
    assert_learns(out, margin=0.5)
    assert re.search(r"validation loss at iteration 10 \| lm loss value: [0-9.E+-]+", out)


def test_tp2_reproduces_tp1_and_entry_hooks_reach_the_optimizer_build(tmp_path):
    """TP2 reproduces TP1's losses; the TP1 run goes through an entry of its own, main(extra_args_provider,
    install_hooks): its flag parses and its hook wraps the optimizer (one launch checked both ways)."""
    script = tmp_path / "hooked_entry.py"
    script.write_text(HOOKED_ENTRY)
    same_init = ["--use-cpu-initialization", "--attention-dropout", "0", "--hidden-dropout", "0"]
    out = run_megatron(1, *same_init, "--test-flag", "7", entry=(str(script),))
    assert out.count("HOOK test_flag=7 wrapped") == 1
    tp1 = assert_learns(out, margin=0.5)
    tp2 = losses(run_megatron(2, *same_init, "--tensor-model-parallel-size", "2"))
    assert sorted(tp1) == sorted(tp2) == list(range(1, 11))
    for it in tp1:
        assert tp2[it] == pytest.approx(tp1[it], abs=1e-4), it


# slow: CI runs DP2 with the distributed optimizer and both overlaps with DiLoCoX on
# (tests/test_megatron_dilocox.py::test_evaluation_measures_the_global_model)
@pytest.mark.slow
def test_dp2_distributed_optimizer_with_overlap():
    out = run_megatron(2, "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather")
    assert re.search(r"use_distributed_optimizer \.+ True", out)
    assert_learns(out, margin=0.5)


# slow: CI runs the interleaved schedule with DiLoCoX on
# (tests/test_megatron_dilocox.py::test_interleaved_pipeline_schedule_with_fragments)
@pytest.mark.slow
def test_interleaved_pipeline_schedule():
    out = run_megatron(2, "--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "1")
    assert re.search(r"virtual_pipeline_model_parallel_size \.+ 2\b", out)
    assert_learns(out, margin=0.5)


def test_distributed_optimizer_checkpoint_resume_is_exact(tmp_path):
    """DP2 + distributed optimizer, torch_dist, dropout on: 10 iterations straight equal 5 + 5.

    Catches the three load bugs fixed in ``glue/checkpoint_fixes`` (the last one only shows from
    the second iteration after resume) and the dropout RNG shift the CPU backend prevents.
    """
    ckpt = str(tmp_path / "ckpt")
    common = ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
    straight = run_megatron(2, *common)
    first_half = run_megatron(2, *common, "--save", ckpt, "--save-interval", "5",
                              "--exit-interval", "5")
    resumed = run_megatron(2, *common, "--load", ckpt)

    assert sorted(iterations(first_half)) == [1, 2, 3, 4, 5]
    assert "successfully loaded checkpoint" in resumed
    assert sorted(iterations(resumed)) == [6, 7, 8, 9, 10]
    full, again = iterations(straight), iterations(resumed)
    for it in (6, 8, 9, 10):  # identical log text
        assert again[it] == full[it], (it, full[it], again[it])
    # Iteration 7 is logged as the mean of 6 and 7 after a restart (see `losses`).
    assert again[7][1] == full[7][1]
    assert losses(resumed)[7] == pytest.approx(losses(straight)[7], abs=2e-6)


HOOKED_ENTRY = """
from megatron_dilocox import pretrain_gpt


def add_args(parser):
    parser.add_argument_group("test").add_argument("--test-flag", type=int, default=0)
    return parser


def install_hooks(args):
    import megatron.training.training as training

    build = training.get_megatron_optimizer

    def get_megatron_optimizer(*a, **k):
        optimizer = build(*a, **k)
        print(f"HOOK test_flag={args.test_flag} wrapped {type(optimizer).__name__}", flush=True)
        return optimizer

    training.get_megatron_optimizer = get_megatron_optimizer


if __name__ == "__main__":  # required: checkpoint saving spawns a process that imports this file
    pretrain_gpt.main(extra_args_provider=add_args, install_hooks=install_hooks)
"""

