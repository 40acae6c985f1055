"""The cost model (megatron_dilocox/sim): byte formulas against the package, time formulas, planner, CLI."""
import importlib
import json
import math
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_dilocox.sim import Setup, model_params, payload_bytes, plan, predict, rank_payload
from megatron_dilocox.sim.cost_model import exchange_bytes, round_bytes, step_seconds
from megatron_dilocox.sim.setup import numel, rank_views

pytestmark = pytest.mark.unit

SHAPES = [(256, 128), (256, 128), (64, 512), (100,), (30, 40), (128, 96), (7,), (96, 64)]
SMALL = Setup(hidden=256, layers=4, ffn=688, vocab=1000, heads=4, kv_heads=2, clusters=2, tp=2, pp=2, dp=3,
              rank=8, min_dim=32, global_batch_tokens=8192)


def _paper_setup() -> Setup:
    from megatron_dilocox.sim.__main__ import _setup, parse
    return _setup(parse(["--paper"]))


# ------------------------------------------------------------------------------ bytes vs the package
def test_payload_bytes_equal_the_package_and_real_payloads():
    torch = pytest.importorskip("torch")
    quantize = importlib.import_module("megatron_dilocox.compression.quantize")  # function of that name
    for numel in (1, 7, 127, 128, 129, 1000, 4097):
        for bits in (4, 8, 16, 32):
            for block in (32, 100, 128):
                assert payload_bytes(numel, bits, block) == quantize.payload_bytes(numel, bits, block)
        for bits in (4, 8):
            assert quantize.quantize(torch.randn(numel), bits, 64).numel() == payload_bytes(numel, bits, 64)


class FakeCollective:
    """C clusters that all send the same bytes: the package's real byte counter, no processes."""

    def __new__(cls, size):
        from megatron_dilocox.compression.collective import Collective

        class _Fake(Collective):
            def _all_gather(self, buf):
                return [buf.clone() for _ in range(self.size)]

            def _all_reduce_sum(self, buf, timeout=None):
                return buf * self.size


        c = _Fake()
        c.size, c.rank = size, 0
        return c


@pytest.mark.parametrize("bits,block,rank,C", [(4, 128, 8, 2), (8, 32, 4, 3), (16, 64, 2, 2), (32, 128, 8, 4)])
def test_rank_payload_equals_codec_payload_sizes_and_counted_bytes(bits, block, rank, C):
    torch = pytest.importorskip("torch")
    from megatron_dilocox.compression.codec import PseudoGradientCodec
    from megatron_dilocox.compression.collective import dense_allreduce_bytes
    from megatron_dilocox.config import DiLoCoXConfig
    cfg = DiLoCoXConfig(lowrank_rank=rank, quant_bits=bits, quant_block_size=block, lowrank_min_dim=32,
                        adaptive_rank=False)
    codec = PseudoGradientCodec([torch.Size(s) for s in SHAPES], cfg)
    p = rank_payload(SHAPES, rank, bits, block, min_dim=32)
    assert (p["p1"], p["p2"]) == codec.payload_sizes()
    assert p["q_numel"] == sum(q.numel() for q in codec.q)
    res = codec.exchange([torch.randn(s) for s in SHAPES], FakeCollective(C), round_idx=1)
    assert res.status == "applied"
    assert res.bytes_sent == exchange_bytes(p["p1"], p["p2"], bits, C, gathered=True)  # local basis (default)
    # (the fake sends untagged all-gathers; the reduce-scatter's and the tags' bytes: the closed forms below, and
    # counted over real gloo in tests/test_many_sites.py)
    shared = PseudoGradientCodec([torch.Size(s) for s in SHAPES],
                                 replace(cfg, lowrank_basis="shared", exchange_scheme="all-gather"))
    res = shared.exchange([torch.randn(s) for s in SHAPES], FakeCollective(C), round_idx=1)
    assert res.bytes_sent == exchange_bytes(p["p1"], p["p2"], bits, C)
    assert res.bytes_dense_fp32 == dense_allreduce_bytes(p["numel"], C)
    for scheme in ("all-gather", "reduce-scatter"):  # the cost model's closed form is the codec's, tags included
        both = PseudoGradientCodec([torch.Size(s) for s in SHAPES], replace(cfg, lowrank_basis="shared",
                                                                             exchange_scheme=scheme))
        assert both.round_bytes(rank, C, member=0) == exchange_bytes(
            p["p1"], p["p2"], bits, C, tagged=True, scheme=both.scheme_at(C, True), pieces=p, block=block)


def test_distributed_optimizer_views_are_row_aligned_like_param_views():
    torch = pytest.importorskip("torch")
    from megatron_dilocox.glue.param_views import row_aligned_views
    from megatron_dilocox.sim.setup import _row_views
    for shape, (start, end) in [((10, 7), (0, 70)), ((10, 7), (3, 40)), ((10, 7), (8, 13)), ((50,), (5, 20))]:
        flat = torch.zeros(end - start)
        assert [tuple(v.shape) for v in row_aligned_views(flat, torch.Size(shape), start, end)] == \
            _row_views(shape, start, end)
    # every element of the model is owned by exactly one (PP, DP) rank per TP rank
    owned = sum(sum(math.prod(v) for v in views) for _, views in rank_views(replace(SMALL, tp=1)))
    assert owned == model_params(SMALL)


def test_model_params_closed_form():
    s = replace(SMALL, kv_heads=None, swiglu=False)  # GPT: qkv 3h x h, proj h x h, fc1 ffn x h, fc2 h x ffn
    h, f, L, vp = 256, 688, 4, 1024  # vocab padded to a multiple of 128
    assert model_params(s) == L * (3 * h * h + h * h + f * h + h * f + 2 * h) + 2 * vp * h + h


# ------------------------------------------------------------------------------ time formulas
def test_allreduce_time_is_ring_formula_every_step():
    s = replace(SMALL, tp=1, pp=1, dp=1, clusters=4, link_gbps=1.0, latency_ms=0.0)
    out = predict(s)
    n = model_params(s)
    ar = out["methods"]["allreduce"]
    assert ar["comm_seconds"] == pytest.approx(2 * 3 / 4 * 4 * n / 125e6)  # 2(C-1)/C x fp32 bytes / 1 Gbps
    assert ar["seconds_per_step"] == pytest.approx(out["step_seconds"] + ar["comm_seconds"])
    assert predict(replace(s, allreduce_bits=16))["methods"]["allreduce"]["comm_seconds"] == \
        pytest.approx(ar["comm_seconds"] / 2)
    lat = predict(replace(s, latency_ms=10.0))["methods"]["allreduce"]["comm_seconds"]
    assert lat == pytest.approx(ar["comm_seconds"] + 2 * 3 * 0.010)
    # step time: 6 N FLOPs per token at MFU x peak
    assert out["step_seconds"] == pytest.approx((8192 / 4) / (1 * 0.4 * 312e12 / (6 * n)))


def test_slow_link_ordering_dilocox_diloco_allreduce():
    s = replace(SMALL, link_gbps=0.01, h=50, tokens_per_gpu_s=2000.0)
    out = predict(s)
    m = out["methods"]
    assert m["dilocox"]["exposed_seconds"] == 0.0  # only the boundary's own work is left exposed
    assert m["dilocox"]["seconds_per_round"] == pytest.approx(out["round_compute_seconds"] + out["boundary"]["seconds"])
    assert m["ceiling"]["tokens_per_s"] > m["dilocox"]["tokens_per_s"] > m["diloco"]["tokens_per_s"] > \
        m["allreduce"]["tokens_per_s"]
    # synchronous (overlap none) DiLoCoX still beats dense DiLoCo, and one-step-delay hides what it can
    none_out = predict(replace(s, overlap="none"))
    none = none_out["methods"]["dilocox"]
    assert m["diloco"]["tokens_per_s"] < none["tokens_per_s"] <= m["dilocox"]["tokens_per_s"]
    assert none["exposed_seconds"] == pytest.approx(none["comm_seconds"] + none_out["boundary"]["exchange_thread_seconds"])


def test_exposed_communication_is_what_h_steps_do_not_hide():
    s = replace(SMALL, link_gbps=0.001, h=1, tokens_per_gpu_s=2000.0)
    out = predict(s)
    x, b = out["methods"]["dilocox"], out["boundary"]
    exchange = x["comm_seconds"] + b["exchange_thread_seconds"]  # the transfer and the exchange thread's hash
    assert x["exposed_seconds"] == pytest.approx(exchange - out["step_seconds"])
    assert x["seconds_per_round"] == pytest.approx(exchange + b["seconds"]) and x["boundary_seconds"] == b["seconds"]


def test_memory_of_outer_state():
    s = replace(SMALL, outer_state_device="cpu")
    mem = predict(s)["memory"]
    n = max(sum(math.prod(v) for v in views) for _, views in rank_views(s))
    assert mem["rank_numel"] == n and mem["anchor"] == mem["momentum"] == mem["round_start"] == 4 * n
    # eager (the default) adds its private proxy: c, δ_{t−1} and c's momentum buffer (LocalCorrection)
    # beside the params: e, the spare M slab, the last Δ of the low-rank groups (not of the whole tensors), δ in flight
    whole = round_bytes(s)["max_rank_whole_numel"]
    assert mem["eager_correction"] == 12 * n and mem["cpu_bytes"] == 24 * n
    assert mem["gpu_bytes"] == 16 * n - 4 * whole + mem["q"]
    assert predict(replace(s, overlap="one-step-delay"))["memory"]["cpu_bytes"] == 12 * n
    on_gpu = predict(replace(s, outer_state_device="param", overlap="none", outer_momentum=0.0))["memory"]
    assert on_gpu["cpu_bytes"] == 0 and on_gpu["gpu_bytes"] == 16 * n - 4 * whole + on_gpu["q"]  # anchor + codec slabs


# ------------------------------------------------------------------------------ the round boundary's own work
RATES = dict(host_copy_gb_s=10.0, host_elementwise_gb_s=20.0, host_first_touch_gb_s=5.0, sha256_gb_s=2.0,
             node_memory_gb_s=1000.0, gpus_per_node=8, pcie_gb_s=25.0)


def test_boundary_seconds_are_the_closed_form():
    """Outer state on the CPU, eager, landing apart: every part from the stated rates, in seconds per GB of one
    fp32 copy of the rank's state (B = 4n bytes). A GPU-host copy: max(B/PCIe, 2B/copy, 3B/node share) = 0.2."""
    from megatron_dilocox.sim.boundary import boundary_seconds
    s = replace(SMALL, outer_state_device="cpu", overlap="eager", outer_momentum=0.3, **RATES)
    rb = round_bytes(s)
    gb = 4 * rb["max_rank_numel"] / 1e9
    b = boundary_seconds(s, rb, lands_apart=True)
    move, fresh, sha, copy, elem = 0.2, 1 / 5, 1 / 2, 1 / 10, 1 / 20
    expected = {"pseudo_gradient": move,  # round_start to the GPU
                "outer_step": move + fresh + 11 * elem + fresh,  # Δ to the host (fresh), Nesterov (u fresh)
                "global_model_hash": 2 * copy + fresh + sha,  # tobytes, sha256
                "local_start": move + fresh + 18 * elem + 4 * fresh + 2 * move,  # δ to the host, c's step, φ + c back
                "round_start": move + fresh,  # θ to the host
                "landing": 2 * move + 2 * copy}  # φ and round_start to the GPU; round_start <- φ
    assert b["parts"] == pytest.approx({k: v * gb for k, v in expected.items()})
    assert b["seconds"] == pytest.approx(5.75 * gb)
    assert b["exchange_thread_seconds"] == pytest.approx(2 * 0.9 * gb)  # φ and the momentum hashed
    assert b["pcie_bytes"] == pytest.approx(8 * gb * 1e9)  # 1 + 1 + 3 + 1 + 2 copies of the state
    # a node whose memory the ranks share at 1 GB/s each binds every host rate, and a copy moves 3 B through it
    tight = boundary_seconds(replace(s, node_memory_gb_s=8.0), rb, lands_apart=True)
    assert tight["seconds"] == pytest.approx((3 + 16 + 4 + 32 + 4 + 8) * gb)
    # the round landing at the boundary (τ = H) skips the landing's recombination; one-step-delay: θ = φ − δ
    assert boundary_seconds(s, rb, lands_apart=False)["parts"]["landing"] == 0.0
    assert boundary_seconds(replace(s, overlap="one-step-delay"), rb)["parts"]["local_start"] == pytest.approx(move * gb)
    # overlap none: δ, the outer step, the hash, θ <- φ
    none = boundary_seconds(replace(s, overlap="none"), rb)
    assert none["seconds"] == pytest.approx((move + 1.15 + 0.9 + move) * gb)


def test_boundary_outer_state_on_the_gpu_copies_only_for_the_hashes():
    """outer_state_device param: δ, the outer step and θ stay on the GPU (not counted); what is left is the
    hashes, which read φ (and the momentum) on the host: one GPU-host copy each, no other PCIe traffic."""
    from megatron_dilocox.sim.boundary import boundary_seconds
    s = replace(SMALL, outer_state_device="param", **RATES)
    rb = round_bytes(s)
    gb = 4 * rb["max_rank_numel"] / 1e9
    b = boundary_seconds(s, rb, lands_apart=True)
    assert {k: v for k, v in b["parts"].items() if k != "global_model_hash"} == dict.fromkeys(
        ["pseudo_gradient", "outer_step", "local_start", "round_start", "landing"], 0.0)
    assert b["parts"]["global_model_hash"] == pytest.approx((0.2 + 1 / 5 + 0.9) * gb)
    assert b["pcie_bytes"] == pytest.approx(gb * 1e9)
    assert b["exchange_thread_seconds"] == pytest.approx(2 * 1.3 * gb)
    assert b["seconds"] < boundary_seconds(replace(s, outer_state_device="cpu"), rb)["seconds"]


def test_predict_adds_the_boundary_to_every_round():
    from megatron_dilocox.sim.boundary import boundary_seconds
    for link, apart in ((0.01, True), (0.0001, False)):  # the exchange hides (lands τ < H) or outlasts the round
        s = replace(SMALL, link_gbps=link, h=20, tokens_per_gpu_s=2000.0, **RATES)
        out, rb = predict(s), round_bytes(s)
        m, hidden = out["methods"], out["round_compute_seconds"]
        b = boundary_seconds(s, rb, lands_apart=apart)
        assert out["boundary"] == b and m["dilocox"]["boundary_seconds"] == b["seconds"] > 0
        exchange = m["dilocox"]["comm_seconds"] + b["exchange_thread_seconds"]
        assert m["dilocox"]["exposed_seconds"] == pytest.approx(max(0.0, exchange - hidden))
        assert m["dilocox"]["seconds_per_round"] == pytest.approx(hidden + m["dilocox"]["exposed_seconds"] + b["seconds"])
        sc = out["schemes"][out["scheme"]]
        assert sc["boundary_seconds"] == b["seconds"] and sc["tokens_per_s"] == pytest.approx(m["dilocox"]["tokens_per_s"])
        # DiLoCo: this package's boundary at overlap none, the exchange (and its hash) not hidden
        d = boundary_seconds(replace(s, overlap="none"), rb)
        assert m["diloco"]["boundary_seconds"] == d["seconds"]
        assert m["diloco"]["seconds_per_round"] == pytest.approx(
            hidden + m["diloco"]["comm_seconds"] + d["exchange_thread_seconds"] + d["seconds"])


# ------------------------------------------------------------------------------ planner
def test_planner_picks_smallest_h_that_hides_the_transfer():
    s = replace(SMALL, link_gbps=0.001, tokens_per_gpu_s=2000.0)
    p = plan(s, h_min=2, margin=0.1)
    assert p["feasible"] and p["h"] >= 2
    x, t_step = p["prediction"]["methods"]["dilocox"], step_seconds(s)
    assert x["exposed_seconds"] == 0.0 and x["comm_seconds"] * 1.1 <= p["h"] * t_step
    assert p["h"] == min(c["h"] for c in p["candidates"])
    if p["h"] > 2:  # nothing fits one step earlier
        assert all(c["comm_seconds"] * 1.1 > (p["h"] - 1) * t_step for c in p["candidates"])


def test_planner_prefers_dense_and_more_bits_when_the_link_is_free():
    p = plan(replace(SMALL, link_gbps=100.0, tokens_per_gpu_s=2000.0), h_min=10)
    assert (p["h"], p["rank"], p["bits"]) == (10, None, 32)
    assert plan(replace(SMALL, link_gbps=1e-6), h_min=1, h_max=5)["feasible"] is False


# ------------------------------------------------------------------------------ the paper and the CLI
def test_paper_speedup_is_the_reported_order_of_magnitude():
    """Reported: 357x. The prediction is ~ 1 + T_AR / T_step; MFU and batch size are not stated in
    what we could read of the paper, and plausible choices move the figure by 2-3x either way, so the
    band is one order of magnitude around it rather than the number itself."""
    out = predict(_paper_setup())
    assert 100 <= out["speedup_vs_allreduce"] <= 1000
    assert 100e9 < out["params"] < 110e9 and out["gpus"] == 160
    assert out["methods"]["dilocox"]["exposed_seconds"] == 0.0


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_dilocox.sim", *args], capture_output=True, text=True,
                          check=True).stdout


def test_cli_paper_text_ends_with_speedup_line():
    out = _cli("--paper").rstrip("\n").splitlines()
    assert re.fullmatch(r"speedup_vs_allreduce: \d+(\.\d+)?", out[-1])
    assert float(out[-1].split(": ")[1]) == pytest.approx(predict(_paper_setup())["speedup_vs_allreduce"], abs=0.05)
    assert any("[assumed]" in line for line in out) and any("confirmed" in line for line in out)
    assert any(re.match(r"round boundary \(busiest rank, outer state on cpu, host work\): [\d.]+ s/round exposed", line)
               for line in out)


def test_cli_json_and_flags():
    d = json.loads(_cli("--json", "--plan", "--clusters", "3", "--link-gbps", "0.5", "--bits", "8",
                        "--no-distributed-optimizer", "--params", "1.3e9", "--hidden", "2048", "--pp", "2"))
    assert d["setup"]["clusters"] == 3 and d["setup"]["bits"] == 8 and not d["setup"]["distributed_optimizer"]
    assert 1.1e9 < d["params"] < 1.5e9 and d["setup"]["layers"] % 2 == 0
    assert d["plan"]["feasible"] and d["speedup_vs_allreduce"] > 0


def test_sim_imports_no_torch():
    code = "import sys, megatron_dilocox.sim, megatron_dilocox.sim.__main__; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sites_sized_to_their_speed():
    """Two one-GPU sites, one twice as fast: per-site H gives the fast site 2H steps and half the weight (one token,
    one vote: the same tokens per step), no
    site waits, and the run makes 1.5x lockstep's tokens/s (lockstep: the fast site waits half of every round);
    a speed ratio that does not divide leaves the fast site less than one of its steps of waiting."""
    from megatron_dilocox.sim.sites import Site, parse_sites, plan_sites
    p = plan_sites([Site(1, 100.0, 1000.0), Site(1, 50.0, 1000.0)], h=10)
    assert [s["H"] for s in p["sites"]] == [20, 10] and p["round_seconds"] == pytest.approx(200.0)
    assert [s["weight"] for s in p["sites"]] == pytest.approx([1 / 2, 1 / 2])
    assert [s["wait_share"] for s in p["sites"]] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert [s["lockstep_wait_share"] for s in p["sites"]] == pytest.approx([0.5, 0.0])
    assert (p["tokens_per_s"], p["lockstep_tokens_per_s"], p["vs_lockstep"]) == pytest.approx((150.0, 100.0, 1.5))
    sites = parse_sites("64:3200,128:1500", 131072)
    p = plan_sites(sites, h=100)
    fast, slow = p["sites"]
    assert slow["H"] == 100 and fast["H"] == 106  # floor(68.27 s / 0.64 s)
    assert 0 < fast["wait_share"] * p["round_seconds"] < fast["step_seconds"]
    assert p["vs_ideal"] > 0.99 and p["vs_lockstep"] > 1.0
    # a transfer longer than the slowest site's H steps stretches the round for every site
    p = plan_sites([Site(1, 100.0, 1000.0), Site(1, 50.0, 1000.0)], h=10, comm_seconds=400.0, margin=0.1)
    assert p["round_seconds"] == pytest.approx(440.0) and [s["H"] for s in p["sites"]] == [44, 22]
    for bad in ("64", "64:0", "0:10", "64:x", "64:3200"):
        with pytest.raises(ValueError, match="--sites"):
            parse_sites(bad, 1000)


def test_sites_cli_prints_each_sites_h_weight_and_the_ratio_to_lockstep():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "megatron_dilocox.sim", "--sites", "1:100:1000,1:50:1000", "--h", "10",
                          "--hidden", "64", "--layers", "2", "--vocab", "512", "--ffn", "256", "--heads", "4",
                          "--kv-heads", "4"], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[-1] == "vs_lockstep: 1.50"
    assert lines[2].split()[:6] == ["0", "1", "100", "10.000", "20", "0.500"]
    assert lines[3].split()[:6] == ["1", "1", "50", "20.000", "10", "0.500"]


# ------------------------------------------------------------------------------ the sparse exchange and the codec choice
@pytest.mark.parametrize("k,chunk,C", [(64, 4096, 2), (8, 100, 4)])
def test_sparse_bytes_equal_the_codecs(k, chunk, C):
    torch = pytest.importorskip("torch")
    from megatron_dilocox.compression.codec import PseudoGradientCodec
    from megatron_dilocox.config import DiLoCoXConfig
    from megatron_dilocox.compression.sparse_form import payload_bytes as sparse_payload_bytes
    codec = PseudoGradientCodec([torch.Size(s) for s in SHAPES], DiLoCoXConfig(sparse_k=k, sparse_chunk=chunk).validate())
    p = rank_payload(SHAPES, 8, 4, 128, min_dim=32, sparse=(k, chunk))
    lengths = [min(chunk, numel(s) - a) for s in SHAPES for a in range(0, numel(s), chunk)]  # (docs' definition)
    entries = sum(min(k, n) for n in lengths)
    assert (p["p1"], p["p2"]) == codec.payload_sizes() == (2 * entries + -(-entries // 8) + 16 * len(lengths), 0)
    assert p["p1"] == codec.sparse.encode(torch.randn(sum(numel(s) for s in SHAPES))).numel()
    assert codec.round_bytes(codec.rank, C) == exchange_bytes(p["p1"], p["p2"], 4, C, gathered=True, tagged=True)
    s = replace(SMALL, clusters=C, sparse_k=k, sparse_chunk=chunk)
    rb = round_bytes(s)
    expected = sum(m * exchange_bytes(sparse_payload_bytes([numel(v) for v in views], k, chunk), 0, 4, C,
                                      gathered=True, tagged=True) for m, views in rank_views(s))
    assert rb["dilocox"] == expected and predict(s)["scheme"] == "all-gather"


def test_codec_choice_takes_the_least_measured_loss_that_reaches_the_target(monkeypatch):
    from megatron_dilocox.sim import codec_choice
    monkeypatch.setattr(codec_choice, "LOSS_VS_INT4", {10: {(64, 4096): 0.3, (96, 4096): 0.1}})
    free = codec_choice.choose(replace(SMALL, link_gbps=100.0, tokens_per_gpu_s=2000.0))
    assert free["chosen"] == "int4 whole"  # every codec hides: the least loss
    s = replace(_paper_setup(), clusters=8, global_batch_tokens=8 * 80 * 2048, link_gbps=0.1)
    slow = codec_choice.choose(s, 0.9, h_max=300)
    rows = {r["codec"]: r for r in slow["candidates"]}
    assert rows["int4 whole"]["of_ceiling"] < 0.9 <= rows["sparse 64/4096"]["of_ceiling"]
    assert rows["sparse 96/4096"]["of_ceiling"] >= 0.9 and slow["chosen"] == "sparse 96/4096"  # less loss than 64
    # the flags under which a run's link budget takes that codec on this link (outer/plan.py)
    assert slow["flags"] == "--dilocox-sparse-k 96 --dilocox-h 100 --dilocox-h-max 300"
    assert free["flags"] == f"--dilocox-h {SMALL.h} --dilocox-h-max {SMALL.h}"
    # int4 whole at H max whose transfer needs more than H max / 2: a run would not send it whole, so it is not chosen
    # however many tokens/s it would give (two sites at 0.2 Gbit/s: about 432 steps needed against 300)
    mid = codec_choice.choose(replace(_paper_setup(), link_gbps=0.2), 0.9, h_max=300)
    whole = next(r for r in mid["candidates"] if r["codec"] == "int4 whole")
    assert whole["h"] == 300 and not whole["runs"] and whole["of_ceiling"] >= 0.9 and mid["chosen"] != "int4 whole"
    assert all(r["h"] <= 300 for r in rows.values())
    # each codec at the smallest H whose steps hold twice its transfer (the run's link budget: outer/plan.py)
    for r in rows.values():
        need = math.ceil(r["comm_seconds"] / slow["step_seconds"] * 2)
        assert r["h"] == min(max(100, need), 300), r
    assert rows["low rank 8"]["loss_vs_int4_pct"] is None  # 8 of a width-8192 model: never measured
    assert codec_choice.choose(s, 0.9)["chosen"].startswith("low rank")  # at H = 100 no measured codec hides
    assert "not measured" in codec_choice.choose(s, 0.9)["why"]


def test_codec_choice_takes_each_codecs_loss_at_about_its_h():
    """A sparse codec priced at H takes the loss measured at the largest H not above it: at the slow link's H the
    H = 100 figures (fewer rounds: a larger gap), below every measured H the smallest's; a (k, chunk) not measured
    at that H counts as not measured."""
    from megatron_dilocox.sim import codec_choice
    table = codec_choice.LOSS_VS_INT4
    s = replace(_paper_setup(), sparse_k=64, sparse_chunk=4096)
    assert codec_choice.measured_loss("sparse 64/4096", replace(s, h=5)) == table[10][(64, 4096)]
    assert codec_choice.measured_loss("sparse 64/4096", replace(s, h=99)) == table[10][(64, 4096)]
    assert codec_choice.measured_loss("sparse 64/4096", replace(s, h=300)) == table[100][(64, 4096)]
    assert table[100][(64, 4096)] > table[10][(64, 4096)]
    assert codec_choice.measured_loss("sparse 32/4096", replace(s, h=300, sparse_k=32)) is None
    assert codec_choice.measured_loss("int4 whole", s) == 0.0 and codec_choice.measured_loss("low rank 8", s) is None
