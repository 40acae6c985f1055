"""The configurations 100B-class runs use, through real Megatron with DiLoCoX (2 clusters, KJV, CPU): an MoE GPT
with expert parallelism (EP2 x DP2, alltoall dispatcher over gloo, bf16) with the distributed optimizer
(``moe``) and without it (``moe_replicas``: every DP rank a full replica, views dealt round-robin over the DP
and expert-DP groups), and a dense GPT with GQA + SwiGLU + RMSNorm + untied embeddings + bf16 + distributed
optimizer (``dense_107b``).

Each configuration has one uninterrupted reference run, whose numbers are asserted: loss
falls, the global-model hash is equal on both clusters after every round, the elements each rank syncs partition
the model's dense, expert and router parameters exactly (counts from the model's shape), and every round's
``bytes_sent`` equals the sum of the ranks' closed-form ``round_bytes`` (logged by the seam). For MoE, Megatron's
own argument dump shows the alltoall dispatcher, EP2 and gloo, and every iteration logs the aux (load-balancing)
loss. Expert implementation: ``--transformer-impl local`` (CPU) builds ``SequentialMLP`` whatever
``--moe-grouped-gemm`` says (``LocalSpecProvider.grouped_mlp_modules``), and on CPU ``--moe-grouped-gemm`` stops
in Megatron's argument validation (``tests/test_bad_input.py``); TE's ``TEGroupedMLP`` is GPU only
(``scripts/gpu/validate.sh``).

Resume, bitwise against the reference (printed losses and grad norms, per-round hash and bytes), as
``tests/test_resume.py`` does for the small dense GPT. MoE: a rank of cluster 1 is SIGKILLed between round
boundaries in a run checkpointing every H, both clusters restart with the same flags. Dense: the reference run
itself checkpoints every H; both clusters restart from its iteration-H checkpoint (round 1 in flight) after
its iteration-2H checkpoint is removed, as if lost (the SIGKILL form of it is marked slow: two more launches).
"""
import json
import os
import re
import shutil
import signal
from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatron_dilocox.metrics import read_rows
from megatron_dilocox.sim.cost_model import round_bytes
from tests.megatron_flags import (failure_report, metrics_rows, run_on_cpu, start_on_cpu, tiny_dilocox_flags,
                                  tiny_gpt_flags)
from tests.moe_shapes import EXPERTS, LAYERS, TINY_MOE, dense_107b_count, moe_param_counts

pytestmark = pytest.mark.megatron

ITERS, H = 8, 4
TIMEOUT = 500

MOE = ["--num-experts", str(EXPERTS), "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
       "--use-distributed-optimizer", "--bf16"]
DENSE_107B = ["--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--use-distributed-optimizer",
              "--bf16"]


MOE_REPLICAS = [f for f in MOE if f != "--use-distributed-optimizer"]  # EP2 x DP2, every DP rank a full replica
CONFIGS = {"moe": (4, MOE), "moe_replicas": (4, MOE_REPLICAS), "dense_107b": (2, DENSE_107B)}
CHECKPOINTING_REFERENCE = {"dense_107b", "moe"}  # their references save every H: the restart tests start from them
MOE_ARGS_DUMP = {"moe_token_dispatcher_type": "alltoall", "expert_model_parallel_size": "2",
                 "distributed_backend": "gloo", "num_experts": str(EXPERTS), "moe_router_topk": "2"}


def launch(corpus, out, name, checkpoints=False):
    """Both clusters of configuration ``name``; with ``checkpoints``, saving every H to out/ckpt_c{k} and loading."""
    nproc, extra = CONFIGS[name]
    ckpt = f"{out}/ckpt_c{{cluster}}"
    saving = ["--save", ckpt, "--load", ckpt, "--save-interval", str(H), "--ckpt-format", "torch_dist"]
    megatron = tiny_gpt_flags(str(corpus), ITERS, *extra, *(saving if checkpoints else []), layers=LAYERS, seq=64)
    return start_on_cpu(2, nproc, megatron, tiny_dilocox_flags(out, "--dilocox-no-adaptive-rank", h=H))


def megatron_args(log) -> dict:
    """{name: value} from Megatron's argument dump ("  name ....... value")."""
    found = (re.match(r"^\s+(\w+) \.{3,} (.*)$", line) for line in log.lines)
    return {m.group(1): m.group(2).strip() for m in found if m}


def layouts(log):
    """{rank: layout} from the seam's "DiLoCoX layout {json}" lines."""
    found = [json.loads(line.split("DiLoCoX layout ", 1)[1]) for line in log.lines if "DiLoCoX layout {" in line]
    return {x["rank"]: x for x in found}


@pytest.fixture(scope="module")
def reference(request, kjv, tmp_path_factory):
    """The uninterrupted run of configuration ``request.param`` (one per module, shared by the tests)."""
    out = tmp_path_factory.mktemp(request.param)
    cl = launch(kjv, out, request.param, checkpoints=request.param in CHECKPOINTING_REFERENCE)
    codes = cl.wait(TIMEOUT)
    assert codes == [0, 0], failure_report(cl.logs)
    rows = [read_rows(f"{out}/metrics_c{c}.jsonl") for c in range(2)]
    return SimpleNamespace(name=request.param, out=out, logs=cl.logs, rows=rows)


# (moe_replicas slow: CI keeps the MoE reference with the distributed optimizer, views dealt over DP replicas in
# tests/test_megatron_dilocox.py::test_data_parallel_without_distributed_optimizer, and MoE in the composition matrix)
@pytest.mark.parametrize("reference", [pytest.param(c, marks=pytest.mark.slow) if c == "moe_replicas" else c
                                       for c in sorted(CONFIGS)], indirect=True)
def test_clusters_agree_loss_falls_bytes_match_closed_form(reference):
    logs, rows = reference.logs, reference.rows
    nproc = CONFIGS[reference.name][0]
    for c in range(2):
        assert [r["round"] for r in rows[c]] == [1, 2] and all(r["status"] == "applied" for r in rows[c])
        losses = logs[c].losses
        assert sorted(losses) == list(range(1, ITERS + 1))
        assert (losses[7] + losses[8]) / 2 < (losses[1] + losses[2]) / 2 - 0.5, losses
        assert logs[c].valid_losses and logs[c].valid_losses[-1] < 8.0
    hashes = [[r["global_model_hash"] for r in rows[c]] for c in range(2)]
    assert hashes[0] == hashes[1] and len(set(hashes[0])) == 2
    lay = [layouts(log) for log in logs]
    assert sorted(lay[0]) == list(range(nproc)) and lay[0] == lay[1]  # local rank k syncs the same shards everywhere
    for c in range(2):
        for r in rows[c]:
            assert r["bytes_sent"] == sum(x["round_bytes"] for x in lay[c].values()), (c, r["round"])
            assert r["bytes_sent"] < r["bytes_dense_fp32"] / 50
    for x in lay[0].values():  # each rank's low-rank groups and whole tensors cover exactly what it syncs
        assert sum(rows_ * cols * n for rows_, cols, n in x["lowrank_groups"]) + x["whole_numel"] == sum(
            x["numel"].values())
    total = {k: sum(x["numel"][k] for x in lay[0].values()) for k in ("dense", "expert", "router")}
    if reference.name.startswith("moe"):
        dense, expert, router = moe_param_counts()
        # distributed optimizer: dense shards over DP4, expert shards over expert-DP2 of each EP rank;
        # replicas: dense and router tensors dealt over DP4, each EP rank's expert tensors over its expert-DP2
        assert total == {"dense": dense, "expert": expert, "router": router}, total
        assert all(x["whole_numel"] >= x["numel"]["router"] for x in lay[0].values())  # the router is sent whole
        assert rows[0][0]["bytes_dense_fp32"] == 4 * (dense + expert + router)  # ring all-reduce, C = 2
        for c in range(2):  # Megatron's own argument dump: the alltoall dispatcher over gloo, EP2; the aux loss
            shown = megatron_args(logs[c])
            assert {k: shown.get(k) for k in MOE_ARGS_DUMP} == MOE_ARGS_DUMP, shown
            assert shown["use_distributed_optimizer"] == str(reference.name == "moe")
            aux = [line for line in logs[c].lines if " iteration " in line and "load_balancing_loss: " in line]
            assert len(aux) == ITERS, aux
        if reference.name == "moe":
            assert all(x["numel"]["expert"] == expert // 4 for x in lay[0].values())
            # the planner's model of this run: the same elements and dense bytes; its DiLoCoX bytes approximate
            # the flat shards by per-parameter slices (more partial rows), so they may only be higher, by < 50%
            planned = round_bytes(TINY_MOE)
            assert rows[0][0]["bytes_sent"] <= planned["dilocox"] < 1.5 * rows[0][0]["bytes_sent"], planned
        else:
            # each expert-DP pair splits its EP rank's two local experts (4 x 33,088 elements) between them
            assert sorted(x["numel"]["expert"] for x in lay[0].values()) == [65792, 65792, 66560, 66560]
            # the planner deals whole tensors round-robin too: its bytes per round are the measured ones
            planned = round_bytes(replace(TINY_MOE, distributed_optimizer=False))
            assert planned["dilocox"] == rows[0][0]["bytes_sent"], planned
        assert planned["owned_numel"] == dense + expert + router and planned["dense_fp32"] == rows[0][0]["bytes_dense_fp32"]
    else:
        assert total == {"dense": dense_107b_count(), "expert": 0, "router": 0}, total
        assert rows[0][0]["bytes_dense_fp32"] == 4 * dense_107b_count()


def assert_continuation_is_the_reference(reference, logs, out, seen):
    """Iterations H+1..ITERS and rounds 1-2 of the restarted clusters equal the reference bitwise."""
    for c, log in enumerate(logs):
        ref = reference.logs[c]
        agreed = [line for line in log.lines if f"; this cluster loads iteration {H} " in line]
        assert len(agreed) == 1, failure_report([log])
        assert sorted(log.losses) == sorted(log.grad_norms) == list(range(H + 1, ITERS + 1))
        for it in range(H + 1, ITERS + 1):
            assert log.grad_norms[it] == ref.grad_norms[it], (c, it)
            if it == H + 2:  # Megatron prints the mean of a process's first two losses here (tests/test_resume.py)
                mean = (ref.losses[it - 1] + ref.losses[it]) / 2
                assert abs(log.losses[it] - mean) <= 1e-6 * mean, (c, it)
            else:
                assert log.losses[it] == ref.losses[it], (c, it, log.losses[it], ref.losses[it])
        new = metrics_rows(out, c)[seen[c]:]
        old = [r for r in reference.rows[c] if r["iteration"] > H]
        assert [r["round"] for r in new] == [r["round"] for r in old] == [1, 2]
        for a, b in zip(new, old):
            for key in ("global_model_hash", "bytes_sent", "bytes_received", "pseudo_grad_norm"):
                assert a[key] == b[key], (c, key, a[key], b[key])


# CI restarts both from their references' checkpoints (below: one launch each); the SIGKILL forms cost two more
# launches each and are slow (a SIGKILL mid-round and its resume run in CI in tests/test_resume.py and
# tests/test_megatron_sites.py)
@pytest.mark.slow
@pytest.mark.parametrize("reference", ["dense_107b", "moe"], indirect=True)
def test_sigkill_and_restart_resume_bitwise(reference, kjv, tmp_path):
    """Cluster 1's rank 0 dies after iteration 5 (round 1 in flight since the boundary at 4, saved with
    checkpoint 4); both clusters restart from 4 and replay iterations 5-8 and rounds 1-2 bitwise."""
    cl = launch(kjv, tmp_path, reference.name, checkpoints=True)
    try:
        assert cl.logs[1].wait_for(lambda log: 5 in log.losses, TIMEOUT), failure_report(cl.logs)
        cl.kill(1, signal.SIGKILL, rank=0)
        assert cl.logs[1].wait_for(lambda log: log.ended, 60), "torchrun did not take cluster 1 down"
        cl.logs[0].wait_for(lambda log: log.ended, 5)
    finally:
        cl.wait(1)
    assert max(cl.logs[1].losses) in (5, 6, 7), sorted(cl.logs[1].losses)
    seen = [len(metrics_rows(tmp_path, c)) for c in range(2)]  # none yet: both rounds are applied at iteration 8
    again = launch(kjv, tmp_path, reference.name, checkpoints=True)
    assert again.wait(TIMEOUT) == [0, 0], failure_report(again.logs)
    assert_continuation_is_the_reference(reference, again.logs, tmp_path, seen)


# The dense one is slow: the distributed optimizer's torch_dist resume is pinned on the dense GPT in CI by
# tests/test_megatron_cpu.py (10 iterations straight equal 5 + 5) and tests/test_resume.py; MoE's sharded experts
# only here.
# (slow, both: CI restarts an MoE run in the composition matrix, and tests/test_resume.py checks a restart bitwise)
@pytest.mark.parametrize("reference", [pytest.param("dense_107b", marks=pytest.mark.slow),
                                       pytest.param("moe", marks=pytest.mark.slow)], indirect=True)
def test_restart_from_the_references_checkpoint_resumes_bitwise(reference, kjv, tmp_path):
    """The dense GQA/SwiGLU/RMSNorm/untied bf16 dist-opt GPT, and the MoE one (EP2, experts sharded by the
    distributed optimizer): the reference saved at 4 (round 1 in flight) and 8.
    Its checkpoints copied, iteration 8's removed as if lost; both clusters restart with the reference's flags,
    agree on 4 and replay iterations 5-8 and rounds 1-2 bitwise."""
    for c in range(2):
        ckpt = f"{tmp_path}/ckpt_c{c}"
        shutil.copytree(f"{reference.out}/ckpt_c{c}", ckpt)
        assert sorted(os.listdir(ckpt)) == ["dilocox_checkpoints.json", f"iter_{H:07d}", f"iter_{ITERS:07d}",
                                            "latest_checkpointed_iteration.txt"], os.listdir(ckpt)
        shutil.rmtree(f"{ckpt}/iter_{ITERS:07d}")
    again = launch(kjv, tmp_path, reference.name, checkpoints=True)
    assert again.wait(TIMEOUT) == [0, 0], failure_report(again.logs)
    assert_continuation_is_the_reference(reference, again.logs, tmp_path, [0, 0])


def test_clusters_with_a_different_expert_layout_are_refused(kjv, tmp_path):
    """Cluster 0: 4 experts over EP2; cluster 1: 2 experts, EP1. Both stop at the rendezvous naming both settings."""
    megatron = tiny_gpt_flags(str(kjv), 4, "--moe-router-topk", "2", layers=LAYERS, seq=64)
    codes, logs = run_on_cpu(2, 2, megatron, tiny_dilocox_flags(tmp_path, "--dilocox-timeout-seconds", "60"),
                             timeout=300,
                             per_cluster_args={0: ["--num-experts", "4", "--expert-model-parallel-size", "2"],
                                               1: ["--num-experts", "2", "--expert-model-parallel-size", "1"]})
    assert codes[0] != 0 and codes[1] != 0
    for log in logs:
        text = "\n".join(log.lines)
        assert "clusters disagree" in text, text[-3000:]
        assert "num_experts: cluster 0 has '4', cluster 1 has '2'" in text
        assert "expert_model_parallel_size: cluster 0 has '2', cluster 1 has '1'" in text
        assert not log.losses
