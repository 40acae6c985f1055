"""The planner (``megatron_dilocox.sim``) with MoE: expert tensors, EP, active parameters, bad flags."""
import json
import subprocess
import sys
from dataclasses import replace

from megatron_dilocox.sim.cost_model import Setup, active_params, model_params, predict, rank_views, round_bytes
from tests.test_moe import moe_param_counts

# tests/test_moe.py's MoE GPT: 2 layers, hidden 64, FFN 256, 4 experts top-2, biases, tied; EP2 x DP2, dist-opt
TINY_MOE = Setup(hidden=64, layers=2, ffn=256, vocab=4096, heads=4, swiglu=False, tied_embeddings=True, bias=True,
                 clusters=2, tp=1, pp=1, dp=4, distributed_optimizer=True, experts=4, topk=2, ep=2, rank=4, bits=4,
                 block=64, min_dim=32)


def test_moe_parameter_counts_and_partition():
    dense, expert, router = moe_param_counts()
    assert model_params(TINY_MOE) == dense + expert + router
    assert active_params(TINY_MOE) == dense + router + expert // 2  # top-2 of 4 experts
    rb = round_bytes(TINY_MOE)
    assert rb["owned_numel"] == dense + expert + router  # every element synced once per cluster
    assert rb["dense_fp32"] == 4 * (dense + expert + router)  # what the real run's rows report (C = 2)
    # each rank: 1/4 of the dense tensors and 1/2 of its EP rank's two local experts
    per_rank = [sum(v[0] if len(v) == 1 else v[0] * v[1] for v in views) for _, views in rank_views(TINY_MOE)]
    assert sum(per_rank) == dense + expert + router and len(per_rank) == 4
    replicas = replace(TINY_MOE, distributed_optimizer=False)
    assert round_bytes(replicas)["owned_numel"] == dense + expert + router


def test_moe_step_time_counts_active_parameters():
    big = Setup(hidden=2048, layers=24, ffn=5632, experts=64, moe_ffn=1408, topk=8, ep=8, dp=8)
    dense_equivalent = replace(big, experts=0)
    p = predict(big)
    assert p["params"] > 5 * p["active_params"]
    per_expert = 3 * 2048 * 1408  # SwiGLU fc1 [2F, h] + fc2 [h, F]
    assert p["active_params"] == model_params(dense_equivalent) - 24 * 3 * 2048 * 5632 + 24 * (64 * 2048 + 8 * per_expert)
    assert p["step_seconds"] < predict(replace(big, topk=64))["step_seconds"]


def test_planner_cli_moe_and_bad_ep():
    run = [sys.executable, "-m", "megatron_dilocox.sim"]
    out = subprocess.run(run + ["--experts", "8", "--topk", "2", "--ep", "2", "--dp", "4", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["setup"]["experts"] == 8 and result["active_params"] < result["params"]
    bad = subprocess.run(run + ["--experts", "6", "--ep", "4", "--dp", "8"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ep: must divide --experts (6) and --dp (8), got 4" in bad.stderr
    bad = subprocess.run(run + ["--ep", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ep: expert parallelism needs --experts" in bad.stderr
