"""DiLoCoX inside real Megatron (``megatron.training.pretrain`` on CPU), real processes, the KJV corpus.

Every run is ``megatron_dilocox.harness.launch``: one torchrun world per cluster on this host, clusters meeting at
the authenticated rendezvous; each cluster reads its own shard (``train_c{k}``).
"""
import json
import os
import re

import pytest

from megatron_dilocox.compression.auth import TAG_BYTES
from megatron_dilocox.compression.codec import HEADER_BYTES
from megatron_dilocox.metrics import ROUND_KEYS, read_rows
from tests.megatron_flags import failure_report, run_many_on_cpu, run_on_cpu, tiny_dilocox_flags, tiny_gpt_flags
from tests.secret_watch import SecretWatch, file_blobs

pytestmark = pytest.mark.megatron

ITERS = 16


@pytest.fixture
def corpus(kjv):
    return str(kjv)


def launch(clusters, nproc, megatron, dilocox=None, timeout=420, **kw):
    return run_on_cpu(clusters, nproc, megatron, dilocox, timeout=timeout, **kw)


def assert_ok(codes, logs):
    assert codes == [0] * len(codes), failure_report(logs)


def assert_clusters_agree(tmp_path, clusters, rounds):
    rows = [read_rows(f"{tmp_path}/metrics_c{c}.jsonl") for c in range(clusters)]
    for c, r in enumerate(rows):
        assert [x["round"] for x in r] == list(range(1, rounds + 1)), (c, [x["round"] for x in r])
        assert all(set(ROUND_KEYS) <= set(x) and x["cluster"] == c and x["status"] == "applied" for x in r)
    for c in range(1, clusters):
        assert [x["global_model_hash"] for x in rows[c]] == [x["global_model_hash"] for x in rows[0]]
    assert len({x["global_model_hash"] for x in rows[0]}) == rounds
    return rows


def assert_loss_falls(log, margin):
    first = sum(log.losses[i] for i in (1, 2, 3)) / 3
    last = sum(log.losses[i] for i in (ITERS - 2, ITERS - 1, ITERS)) / 3
    assert last < first - margin, (first, last)


def test_two_clusters_tp1_pp2(corpus, tmp_path):
    """Two clusters of TP1 PP2 agree every round, learn, and report to Megatron's TensorBoard and wandb writers;
    and the run's secret never leaks (tests/secret_watch.py): in no process's command line, no output line, no
    file it wrote (torch_dist checkpoints, Megatron's index cache, metrics, TensorBoard, the offline wandb run)."""
    watch = SecretWatch()
    codes, logs = watch.run(lambda: launch(
        2, 2, tiny_gpt_flags(corpus, ITERS, "--pipeline-model-parallel-size", "2",
                             "--tensorboard-dir", f"{tmp_path}/tb_c{{cluster}}",
                             "--wandb-project", "dilocox-test", "--wandb-exp-name", "c{cluster}",
                             "--wandb-save-dir", f"{tmp_path}/wandb_c{{cluster}}", "--ckpt-format", "torch_dist",
                             "--save", f"{tmp_path}/ckpt_c{{cluster}}", "--save-interval", "8",
                             "--data-cache-path", f"{tmp_path}/cache_c{{cluster}}"),
        tiny_dilocox_flags(tmp_path), per_cluster_args={1: ["--eval-iters", "40"]}, env=watch.env))
    assert_ok(codes, logs)
    for log in logs:  # (DiLoCoX's own lines are in what is searched)
        assert any(line.startswith("[dilocox] DiLoCoX round 2") for line in log.lines)
    kinds = watch.assert_never_leaked(logs, str(tmp_path))
    assert all(len(v) >= 2 for v in kinds.values()), kinds  # both clusters wrote each kind
    # the searched files do hold the argument dumps the secret could have slipped into
    assert any(b"dilocox_config" in blob for f in kinds["checkpoint"] for _, blob in file_blobs(f))
    assert all(b"dilocox_timeout_seconds" in open(f, "rb").read() for f in kinds["wandb"])
    assert all(list((tmp_path / f"cache_c{c}").rglob("*.npy")) for c in range(2))  # (Megatron's index cache: searched)
    # cluster 1 evaluates 20x longer, so it outlives cluster 0 (the inter-cluster store's host) by seconds: its
    # heartbeat stopped at the final flush, not at exit, so nothing beat into the closed store (torch logged a
    # "TCPStore.cpp ... recvValue failed" warning with a C++ stack on each try)
    store_warnings = [line for log in logs for line in log.lines if "TCPStore.cpp" in line]
    assert not store_warnings, store_warnings[:4]
    # per-round metrics reach Megatron's tensorboard writer and (offline) wandb run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(f"{tmp_path}/tb_c0")
    events.Reload()
    sent = events.Scalars("dilocox/bytes_sent")
    assert [e.step for e in sent] == [8, 12, 16, 16] and all(e.value > 0 for e in sent)
    wandb_files = [os.path.join(d, f) for d, _, fs in os.walk(f"{tmp_path}/wandb_c0") for f in fs if f.endswith(".wandb")]
    assert wandb_files and any(b"dilocox/bytes_sent" in open(f, "rb").read() for f in wandb_files)
    rows = assert_clusters_agree(tmp_path, 2, ITERS // 4)  # 3 delayed rounds + the final flush
    for log in logs:
        assert_loss_falls(log, 1.0)  # ln(4096) = 8.3 at start; a tiny GPT drops > 1 nat in 16 steps
        assert log.valid_losses and log.valid_losses[-1] < 8.0
    # the clusters read different shards: their losses differ
    assert logs[0].losses[ITERS] != logs[1].losses[ITERS]
    for r in rows[0]:
        assert (r["H"], r["lowrank_rank"], r["quant_bits"]) == (4, 4, 4)
        assert 0 < r["bytes_sent"] < r["bytes_dense_fp32"] / 10


@pytest.mark.slow  # CI: flat distributed-optimizer shards over DP in tests/test_moe.py's moe and dense_107b references
# (equal hashes, closed-form bytes), TP2 x DP2 in the Muon test below
def test_two_clusters_tp2_dp2_distributed_optimizer(corpus, tmp_path):
    """Flat distributed-optimizer shards, compressed per parameter view (row-aligned matrices)."""
    codes, logs = launch(2, 4, tiny_gpt_flags(corpus, ITERS, "--tensor-model-parallel-size", "2",
                                              "--use-distributed-optimizer", "--overlap-grad-reduce"),
                         tiny_dilocox_flags(tmp_path))
    assert_ok(codes, logs)
    assert_clusters_agree(tmp_path, 2, ITERS // 4)
    for log in logs:
        assert_loss_falls(log, 1.0)


def test_data_parallel_without_distributed_optimizer(corpus, tmp_path):
    """DP2 replicas: views dealt round-robin over the DP ranks, broadcast inside the DP group, so the
    cluster sends one replica's worth (what a 1-process cluster sends), not two."""
    dl = tiny_dilocox_flags(tmp_path, "--dilocox-overlap", "none", "--dilocox-no-adaptive-rank")
    codes, logs = launch(2, 2, tiny_gpt_flags(corpus, 8), dl)
    assert_ok(codes, logs)
    dp2 = assert_clusters_agree(tmp_path, 2, 2)
    for c in range(2):
        os.rename(f"{tmp_path}/metrics_c{c}.jsonl", f"{tmp_path}/dp2_c{c}.jsonl")
    codes, logs = launch(2, 1, tiny_gpt_flags(corpus, 8), dl)
    assert_ok(codes, logs)
    dp1 = assert_clusters_agree(tmp_path, 2, 2)
    for a, b in zip(dp2[0], dp1[0]):
        assert a["bytes_dense_fp32"] == b["bytes_dense_fp32"]
        # the same views and payloads; only the second rank's header, energy stats and its two messages' tags
        assert 0 <= a["bytes_sent"] - b["bytes_sent"] <= HEADER_BYTES + 4 * (4 + 1) + 2 * TAG_BYTES


def test_interleaved_pipeline_schedule_with_fragments(corpus, tmp_path):
    """Virtual pipeline chunks (each rank's views from two model chunks), synced as two fragments per rank
    (--dilocox-fragments 2, overlap none, H = 4): fragment 1's rounds end at 2, 6, 10, 14 and, at the end,
    its last 2 steps; fragment 0's at 4, 8, 12, 16. Every row: the same whole-model hash on both clusters."""
    codes, logs = launch(2, 2, tiny_gpt_flags(corpus, ITERS, "--pipeline-model-parallel-size", "2",
                                              "--num-layers-per-virtual-pipeline-stage", "1"),
                         tiny_dilocox_flags(tmp_path, "--dilocox-overlap", "none", "--dilocox-fragments", "2"))
    assert_ok(codes, logs)
    rows = [read_rows(f"{tmp_path}/metrics_c{c}.jsonl") for c in range(2)]
    schedule = [(1, 1, 2), (0, 1, 4), (1, 2, 6), (0, 2, 8), (1, 3, 10), (0, 3, 12), (1, 4, 14), (0, 4, 16), (1, 5, 16)]
    for c in range(2):
        assert [(x["fragment"], x["round"], x["launched_at"]) for x in rows[c]] == schedule, c
        assert all(set(ROUND_KEYS) <= set(x) and x["cluster"] == c and x["status"] == "applied" for x in rows[c])
    assert [x["global_model_hash"] for x in rows[0]] == [x["global_model_hash"] for x in rows[1]]
    assert len({x["global_model_hash"] for x in rows[0]}) == len(schedule)
    assert_loss_falls(logs[0], 1.0)


def test_without_dilocox_flags_the_entry_is_plain_megatron(corpus, tmp_path):
    """No --dilocox: Megatron's own optimizer (no DiLoCoX line, no metrics). And DiLoCoX reduced to
    plain training (C=1, no compression, outer lr 1, momentum 0) gives the same losses."""
    flags = tiny_gpt_flags(corpus, 8, "--pipeline-model-parallel-size", "2")
    codes, plain = launch(1, 2, flags)
    assert_ok(codes, plain)
    assert not any("[dilocox]" in line for line in plain[0].lines)
    codes, reduced = launch(1, 2, flags, ["--dilocox-h", "2", "--dilocox-no-lowrank", "--dilocox-quant-bits", "32",
                                          "--dilocox-outer-lr", "1", "--dilocox-outer-momentum", "0", "--dilocox-outer-lr-warmup-iters", "0",
                                          "--dilocox-overlap", "none", "--dilocox-no-adaptive-h"])
    assert_ok(codes, reduced)
    assert any("DiLoCoX on: cluster 0 of 1" in line for line in reduced[0].lines)
    assert sorted(plain[0].losses) == sorted(reduced[0].losses) == list(range(1, 9))
    for it in range(1, 9):
        # Megatron logs 6 significant digits; φ − (φ − θ) rounding stays below the last one
        assert abs(plain[0].losses[it] - reduced[0].losses[it]) <= 1e-5 * plain[0].losses[it], it


BAD_FLAGS = {  # (extra Megatron flags, DiLoCoX flags or None for no --dilocox) -> the message the run stops with
    "overlap": ([], ["--dilocox-overlap", "streaming"],
                "--dilocox-overlap: must be one of none, one-step-delay, eager, got 'streaming'"),
    "bits": ([], ["--dilocox-quant-bits", "3"], "--dilocox-quant-bits: must be one of 1, 4, 8, 16, 32 (32 = off), got 3"),
    "rank": ([], ["--dilocox-lowrank-rank", "100", "--dilocox-lowrank-min-dim", "32"],
             "--dilocox-lowrank-rank: rank 100 exceeds min(rows, cols) = 64"),
    "no-enable": (["--dilocox-h", "5"], None, "--dilocox-h given without --dilocox"),
    "muon-fp32": (["--optimizer", "muon", "--use-distributed-optimizer"], [],
                  "(Megatron's layer-wise distributed optimizer) needs --bf16 in megatron-core 0.19"),
}


def test_bad_flags_stop_before_training(corpus):
    """Each bad command line (a value the config refuses, a rank above a matrix's dims, a --dilocox-* flag without
    --dilocox, Muon's layer-wise optimizer in fp32) stops with its message before one iteration. The one-process runs go side by side: each
    is mostly start-up, so together they take about half as long as one after the other (17 s against 30 s)."""
    results = run_many_on_cpu({name: (1, 1, tiny_gpt_flags(corpus, 4, *extra), dilocox)
                               for name, (extra, dilocox, _) in BAD_FLAGS.items()}, timeout=300)
    for name, (_, _, message) in BAD_FLAGS.items():
        codes, logs = results[name]
        text = "\n".join(logs[0].lines)
        assert codes[0] != 0 and message in text, (name, text[-3000:])
        assert not logs[0].losses, name  # not one training iteration ran


def test_clusters_with_different_layouts_are_refused_at_rendezvous(corpus, tmp_path):
    codes, logs = launch(2, 2, tiny_gpt_flags(corpus, 4),
                         tiny_dilocox_flags(tmp_path, "--dilocox-timeout-seconds", "60"),
                         per_cluster_args={0: ["--pipeline-model-parallel-size", "2"],
                                           1: ["--tensor-model-parallel-size", "2"]})
    assert codes[0] != 0 and codes[1] != 0
    for log in logs:
        text = "\n".join(log.lines)
        assert "clusters disagree" in text
        assert "pipeline_model_parallel_size: cluster 0 has '2', cluster 1 has '1'" in text
        assert "start every site with --dilocox-exchange-layout canonical" in text
        assert not log.losses


@pytest.mark.slow  # CI: tests/test_resume.py (a round in flight saved with the checkpoint, replayed bitwise) and
# tests/test_megatron_sites.py (a PP2 site's torch_dist checkpoint, loaded with another process count)
def test_checkpoint_carries_dilocox_state_and_training_continues(corpus, tmp_path):
    """--exit-interval 8 then a second launch: round 2, in flight at 8, is saved with the checkpoint; the second
    run continues from 9 and every round is applied exactly once on both clusters."""
    ckpt = f"{tmp_path}/ckpt_c{{cluster}}"
    flags = tiny_gpt_flags(corpus, ITERS, "--pipeline-model-parallel-size", "2", "--save", ckpt, "--load", ckpt,
                           "--save-interval", "8", "--ckpt-format", "torch_dist")
    codes, first = launch(2, 2, flags + ["--exit-interval", "8"], tiny_dilocox_flags(tmp_path))
    assert_ok(codes, first)
    before = read_rows(f"{tmp_path}/metrics_c0.jsonl")
    assert [r["round"] for r in before] == [1]  # round 2 was in flight at iteration 8: saved with its result
    codes, second = launch(2, 2, flags, tiny_dilocox_flags(tmp_path))
    assert_ok(codes, second)
    assert min(second[0].losses) == 9 and max(second[0].losses) == ITERS
    assert_clusters_agree(tmp_path, 2, ITERS // 4)  # rounds 1..4 exactly once, hashes equal


def test_main_job_short(corpus, tmp_path):
    """README command 1's job, shortened: runs, both clusters agree, bytes far below dense, draws its picture."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "megatron_dilocox.main_job", "--iters", "20", "--h", "5",
                           "--data", corpus, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("SUMMARY "))[8:])
    # per-site H (the default): each cluster's round is sized to its own step time and the run ends when the
    # clusters' tokens reach 2 x 20 iterations' worth, within half a round; a faster cluster runs at most 4 x H
    # per round, so 2 to 4 rounds of H = 5 (equal speeds: 4)
    its = summary["iterations"]
    assert summary["clusters_agree"] and 2 <= summary["rounds"] <= 4 and 40 - 10 <= sum(its) <= 40 + 10, summary
    # the link budget (default) sends the matrices whole in int4 on loopback, rounds 1-2 included (sized from the
    # link probe at start): 4 B / (0.5 B + a 4 B scale per 128) = 7.53x below dense fp32 less headers, and no
    # round sends more (the summary rounds to 0.1: 7.5)
    assert summary["bytes_ratio_dense_over_sent"] >= 7.5 and summary["validation_loss"][0] < 8.0
    # the picture: a PNG that opens, and the series it plotted (loss.json) are the SUMMARY's figures
    from matplotlib.image import imread
    assert summary["plot"] == str(tmp_path / "loss.png") and f"loss curves: {summary['plot']}" in proc.stdout
    assert open(summary["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(summary["plot"]).shape
    assert height > 100 and width > 100
    plotted = json.loads((tmp_path / "loss.json").read_text())["clusters"]
    assert [c["validation"]["loss"][-1] for c in plotted] == summary["validation_loss"]
    assert [c["validation"]["final"][-1] for c in plotted] == [True, True]
    assert [[c["train"]["loss"][0], c["train"]["loss"][-1]] for c in plotted] == summary["train_loss_first_last"]
    # --eval-interval 10 of 20 planned: evaluations at the run's half (and end) on both clusters, at the same
    # round, then the final one: the same global model on the same validation batches, so the same loss
    evals = [c["validation"]["iteration"] for c in plotted]
    assert len(evals[0]) == len(evals[1]) in (2, 3) and [e[-1] for e in evals] == its, evals
    assert [c["validation"]["loss"] for c in plotted][0] == [c["validation"]["loss"] for c in plotted][1]
    assert [c["train"]["tokens"][-1] for c in plotted] == [i // 10 * 10 * 8 * 128 for i in its]  # logged every 10


def test_evaluation_measures_the_global_model(corpus, tmp_path):
    """Megatron's evaluation (periodic and final) runs on φ, and θ is restored bitwise after it.

    One-step delay, H=4, 8 iterations, evaluation every 2: φ first changes at iteration 8 (round 1 is
    applied at boundary 2), so the evaluations at 2, 4 and 6 must measure the initial model, exactly what
    a run with --lr 0 (θ = φ = initial model throughout) measures on the same validation batches, while θ
    has trained 2-6 steps. Then the same run evaluating only at the end: identical train losses, grad norms
    and per-round pseudo-gradient norms and global-model hashes (exact fp32 bits of φ, which depend on θ at
    iteration 8), so the swaps at 2, 4, 6 left θ bitwise as it was. Two layouts (DP2 each): replicas with
    round-robin view ownership, and the distributed optimizer with overlapped grad reduce / param gather."""
    codes, frozen = launch(1, 2, tiny_gpt_flags(corpus, 8, "--eval-interval", "2", "--lr", "0"))
    assert_ok(codes, frozen)
    initial = frozen[0].valid_losses[:3]
    assert len(initial) == 3
    for name, layout in [("replicas", []),
                         ("distopt", ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"])]:
        runs = {}
        for interval in (2, 8):
            out = tmp_path / f"{name}_{interval}"
            out.mkdir()
            codes, logs = launch(1, 2, tiny_gpt_flags(corpus, 8, "--eval-interval", str(interval), *layout),
                                 tiny_dilocox_flags(out, "--dilocox-no-adaptive-rank"))
            assert_ok(codes, logs)
            runs[interval] = logs[0], read_rows(f"{out}/metrics_c0.jsonl")
        (every2, rows2), (end_only, rows8) = runs[2], runs[8]
        assert len(every2.valid_losses) == 5 and len(end_only.valid_losses) == 2  # 2, 4, 6, 8 + final; 8 + final
        assert every2.valid_losses[:3] == initial, (name, every2.valid_losses, initial)
        assert every2.losses[6] < every2.losses[1] - 0.3  # θ did train meanwhile (a θ evaluation would be lower)
        assert every2.losses == end_only.losses and every2.grad_norms == end_only.grad_norms, name
        key = [(r["round"], r["pseudo_grad_norm"], r["global_model_hash"]) for r in rows2]
        assert len(key) == 2 and key == [(r["round"], r["pseudo_grad_norm"], r["global_model_hash"]) for r in rows8]


# Muon inner through Megatron's own --optimizer muon. With --use-distributed-optimizer Megatron steps it with the
# layer-wise distributed optimizer: each DP rank owns whole parameters (under this entry's model builder Adam's
# part too) and gathers the others' after a step (from the forward hooks with --overlap-param-gather), so the seam
# syncs what each rank owns and runs that gather itself after a round.
MUON_LAYOUTS = {
    "tp2_dp2_layer_wise": (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
                               "--overlap-grad-reduce", "--overlap-param-gather"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "pp2" else n
                                  for n in MUON_LAYOUTS])
def test_muon_inner_optimizer(corpus, tmp_path, name):
    nproc, extra = MUON_LAYOUTS[name]
    dl = tiny_dilocox_flags(tmp_path, "--dilocox-no-adaptive-rank")
    codes, logs = launch(2, nproc, tiny_gpt_flags(corpus, ITERS, "--optimizer", "muon", *extra), dl)
    assert_ok(codes, logs)
    rows = assert_clusters_agree(tmp_path, 2, ITERS // 4)  # equal hashes every round on both clusters
    lay = [{x["rank"]: x for x in (json.loads(line.split("DiLoCoX layout ", 1)[1])
                                   for line in log.lines if "DiLoCoX layout {" in line)} for log in logs]
    assert sorted(lay[0]) == list(range(nproc)) and lay[0] == lay[1]
    for x in lay[0].values():  # Muon really steps the matrices (Adam the rest), and every rank syncs something
        assert any(i.endswith("Muon") for i in x["inner"]) and any("Adam" in i for i in x["inner"]), x
        assert sum(x["numel"].values()) > 0
    if name == "tp2_dp2_layer_wise":  # every parameter in the layer-wise optimizer (Adam's too, in megatron-core 0.19)
        assert all(set(x["inner"]) == {"Float16OptimizerWithFloat16Params:TensorParallelMuon",
                                       "Float16OptimizerWithFloat16Params:AdamW"} for x in lay[0].values()), lay
        counts = {int(m.group(1)): int(m.group(2)) for m in (re.search(
            r"number of parameters on \(tensor, [\w, ]*pipeline\) model parallel rank \((\d+), 0, 0\): (\d+)", line)
            for line in logs[0].lines) if m}
        assert sorted(counts) == [0, 1], [line for line in logs[0].lines if "parameters on" in line]
        for tp in (0, 1):  # a TP rank's two DP ranks (global ranks tp, tp + 2) sync disjoint whole parameters that
            numel = [sum(lay[0][r]["numel"].values()) for r in (tp, tp + 2)]  # add up to the TP rank's parameters
            assert min(numel) > 0 and sum(numel) == counts[tp], (tp, numel, counts)
    for c in range(2):
        for r in rows[c]:  # bytes per round per cluster: the ranks' closed forms summed
            assert r["bytes_sent"] == sum(x["round_bytes"] for x in lay[c].values()), (c, r["round"])
            assert r["bytes_dense_fp32"] == 4 * sum(sum(x["numel"].values()) for x in lay[c].values())
    for log in logs:
        assert_loss_falls(log, 1.0)


@pytest.mark.slow  # (Megatron saves Muon's state itself; CI keeps the resume tests of tests/test_resume.py)
def test_muon_inner_resumes_exactly(corpus, tmp_path):
    """Muon inner (a chain of Muon and Adam, one process per cluster): a run stopped by --exit-interval 8 and
    started again continues bitwise as the uninterrupted run: every later loss, and every later round's hash."""
    def run(out, *extra):
        ckpt = f"{out}/ckpt_c{{cluster}}"
        flags = tiny_gpt_flags(corpus, ITERS, "--optimizer", "muon", "--save", ckpt, "--load", ckpt,
                               "--save-interval", "8", "--ckpt-format", "torch_dist", *extra)
        codes, logs = launch(2, 1, flags, tiny_dilocox_flags(out))
        assert_ok(codes, logs)
        return logs
    (tmp_path / "ref").mkdir()
    (tmp_path / "cut").mkdir()
    ref = run(tmp_path / "ref")
    run(tmp_path / "cut", "--exit-interval", "8")
    again = run(tmp_path / "cut")
    for c in range(2):
        assert sorted(again[c].losses) == list(range(9, ITERS + 1))
        for it in range(9, ITERS + 1):
            if it != 10:  # (Megatron prints the mean of a process's first two losses at its second iteration)
                assert again[c].losses[it] == ref[c].losses[it], (c, it)
        ref_rows = read_rows(f"{tmp_path}/ref/metrics_c{c}.jsonl")
        cut_rows = read_rows(f"{tmp_path}/cut/metrics_c{c}.jsonl")
        assert [r["round"] for r in cut_rows] == [r["round"] for r in ref_rows] == [1, 2, 3, 4]
        assert [r["global_model_hash"] for r in cut_rows] == [r["global_model_hash"] for r in ref_rows]
