"""The planner (``megatron_dilocox.sim``) with MoE: expert tensors, EP, active parameters, bad flags."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_dilocox.sim.cost_model import predict, round_bytes
from megatron_dilocox.sim.setup import Setup, active_params, model_params, rank_views
from tests.moe_shapes import TINY_MOE, moe_param_counts

pytestmark = pytest.mark.unit


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


def _held_bytes(obj, seen, depth=0) -> int:
    """Bytes of every tensor storage reachable from ``obj``'s package objects (each storage once)."""
    import torch
    if depth > 6:
        return 0
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen or not st.nbytes():
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(_held_bytes(x, seen, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return sum(_held_bytes(x, seen, depth + 1) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("megatron_dilocox"):
        return sum(_held_bytes(x, seen, depth + 1) for x in vars(obj).values())
    return 0


def test_planner_memory_equals_what_the_codec_and_outer_state_hold():
    """The busiest rank of the tiny MoE (planner's views): run DiLoCoXSync for 3 rounds on CPU, count every
    tensor storage it holds besides the params: the planner's per-GPU + host figure, exactly (eager: 5,624,008 B;
    before the codec slabs and the in-flight δ were modelled the planner said 3,952,568)."""
    import torch

    from megatron_dilocox.config import DiLoCoXConfig
    from megatron_dilocox.outer.sync import DiLoCoXSync
    for overlap in ("eager", "one-step-delay", "none"):
        s = replace(TINY_MOE, overlap=overlap)
        _, shapes = max(rank_views(s), key=lambda mv: sum(torch.Size(v).numel() for v in mv[1]))
        params = [torch.randn(shape) for shape in shapes]
        cfg = DiLoCoXConfig(num_clusters=1, cluster_id=0, h=2, lowrank_rank=4, lowrank_min_dim=32, quant_bits=4,
                            quant_block_size=64, adaptive_h=False, adaptive_rank=False, overlap=overlap)
        sync = DiLoCoXSync(params, cfg)
        with torch.no_grad():
            sync.start()
            for _ in range(6):
                for p in params:
                    p.add_(torch.randn_like(p), alpha=1e-3)
                sync.after_inner_step()
        held = _held_bytes(sync, {p.untyped_storage().data_ptr() for p in params})
        mem = predict(s)["memory"]
        assert held == mem["gpu_bytes"] + mem["cpu_bytes"], (overlap, held, mem)
