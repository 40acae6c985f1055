"""Outer optimizer and the round logic in one process (C=1): reductions to plain training, resume."""
import dataclasses
import math
import time

import pytest
import torch

from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.outer.nesterov import OuterNesterov
from megatron_dilocox.outer.cluster import IntraCluster
from megatron_dilocox.outer.link import agree_on_cluster
from megatron_dilocox.outer.sync import DiLoCoXSync, DivergedError
from tests.workers import inner_step, make_inner, make_model, train_one_cluster

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_equals_torch_sgd_with_delta_as_gradient(nesterov):
    g = torch.Generator().manual_seed(0)
    phi = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    ref = [torch.nn.Parameter(p.clone()) for p in phi]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=nesterov, foreach=False)
    outer = OuterNesterov(phi, lr=0.7, momentum=0.9, nesterov=nesterov)
    for _ in range(6):
        delta = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
        for p, d in zip(ref, delta):
            p.grad = d.clone()
        sgd.step()
        outer.step(delta)
        for p, a in zip(ref, phi):
            assert torch.equal(p.detach(), a)


@pytest.mark.parametrize("overlap,tau", [("none", None), ("one-step-delay", None), ("eager", None),
                                         ("one-step-delay", 2), ("eager", 1)])
def test_single_cluster_reproduces_plain_training(overlap, tau):
    """C = 1, outer lr 1, no momentum: every round (landing at H or τ < H steps in) gives back θ."""
    plain_losses, plain_params, _, _ = train_one_cluster(24)
    cfg = dict(h=4, overlap=overlap, lowrank=False, quant_bits=32, outer_lr=1.0, outer_momentum=0.0,
               outer_lr_warmup_iters=0,
               adaptive_h=False, overlap_steps=tau)
    losses, params, _, sync = train_one_cluster(24, cfg)
    assert sync.round == 6
    # Not bitwise: θ is rebuilt as φ − (φ − θ) at each boundary, which rounds in fp32 (|θ| <= ~1 here,
    # so one rounding is <= 6e-8); six rounds of it stay far below 1e-6.
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(params, plain_params)) < 1e-6


@pytest.mark.parametrize("overlap,tau,save_at", [("none", None, 10), ("one-step-delay", None, 10),
                                                 ("eager", None, 10), ("eager", 3, 9), ("eager", 3, 11)])
def test_resume_from_state_dict_mid_round_is_bitwise_identical(overlap, tau, save_at):
    """Save while a delayed round is in flight (step 10, H=4; with τ = 3: step 9, before it lands at 11, and
    step 11, after), resume in a fresh sync: same bits."""
    cfg = dict(h=4, overlap=overlap, lowrank_rank=2, lowrank_min_dim=8, quant_bits=4, quant_block_size=32,
               adaptive_h=False, adaptive_rank=True, lowrank_rank_max=4, overlap_steps=tau)
    full_losses, full_params, saved, _ = train_one_cluster(20, cfg, save_at=save_at)
    resumed_losses, resumed_params, _, _ = train_one_cluster(20, cfg, load=saved)
    assert resumed_losses == full_losses[save_at:]
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, full_params))


def test_state_dict_refuses_other_settings():
    model = make_model(0)
    sync = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4)).start()
    other = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4, quant_bits=8)).start()
    with pytest.raises(ValueError, match=r"different settings: \['quant_bits'\]"):
        other.load_state_dict(sync.state_dict())
    # a checkpoint from before the outer-lr default changed (0.7, no warm-up): the message gives the flags to pass
    old = DiLoCoXSync([p.data for p in model.parameters()],
                      DiLoCoXConfig(h=4, outer_lr=0.7, outer_lr_warmup_iters=0, lowrank=False)).start().state_dict()
    with pytest.raises(ValueError) as err:
        sync.load_state_dict(old)
    assert str(err.value) == (
        "DiLoCoX checkpoint was written with different settings: ['lowrank', 'outer_lr', 'outer_lr_warmup_iters']; "
        "to resume it, run with the saved ones: --dilocox-no-lowrank --dilocox-outer-lr 0.7 "
        "--dilocox-outer-lr-warmup-iters 0 (in Python: lowrank=False, outer_lr=0.7, outer_lr_warmup_iters=0; now "
        "lowrank=True, outer_lr=None, outer_lr_warmup_iters=None)")


def test_state_dict_from_before_a_knob_existed_loads_when_the_knob_is_at_its_default():
    model = make_model(0)
    sync = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4)).start()
    old = sync.state_dict()
    del old["config"]["outer_lr_warmup_iters"]  # a checkpoint written before --dilocox-outer-lr-warmup-iters
    DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4)).start().load_state_dict(old)
    warm = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4, outer_lr_warmup_iters=5)).start()
    with pytest.raises(ValueError, match=r"different settings: \['outer_lr_warmup_iters'\]"):
        warm.load_state_dict(old)


def test_state_dict_from_when_the_outer_momentum_was_0_3_at_any_number_of_sites():
    """Before 2026-12-07 the default outer momentum was 0.3 whatever the number of sites, and a checkpoint saved it
    as None: it resumes where the default still means 0.3 (two sites), and at four sites stops naming the momentum
    it ran with; a checkpoint that saved the resolved momentum resumes at four sites with the default."""
    model = make_model(0)
    params = [p.data for p in model.parameters()]
    old = DiLoCoXSync(params, DiLoCoXConfig(h=4)).start().state_dict()
    assert old["outer_momentum"] == 0.3 and old["config"]["outer_momentum"] is None
    del old["outer_momentum"]  # (written before the resolved momentum was saved)
    DiLoCoXSync(params, DiLoCoXConfig(h=4)).start().load_state_dict(old)

    def at_four(**kw):  # (a one-process sync that resolves its defaults as a site of four would)
        sync = DiLoCoXSync(params, DiLoCoXConfig(h=4, **kw)).start()
        sync.cfg = dataclasses.replace(sync.cfg, num_clusters=4, rendezvous="h:1", secret="s")
        return sync
    old4 = dict(old, config=dict(old["config"], num_clusters=4))
    with pytest.raises(ValueError, match=r"different settings: \['outer_momentum'\]; to resume it, run with the "
                                         r"saved ones: --dilocox-outer-momentum 0.3 "):
        at_four().load_state_dict(old4)
    at_four(outer_momentum=0.3).load_state_dict(old4)
    at_four().load_state_dict(dict(old4, outer_momentum=0.5))


def test_state_dict_from_when_the_outer_lr_default_was_a_number_loads_where_it_resolves_the_same():
    """Before 2026-12-05 a checkpoint saved outer_lr = 1.0 when the flag was left out; now the default is None
    (1.0 whole, 1.3 for fragments that overlap): such a checkpoint resumes where the default still means 1.0, not elsewhere."""
    model = make_model(0)
    old = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4)).start().state_dict()
    old["config"]["outer_lr"] = 1.0
    DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4)).start().load_state_dict(old)
    other = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4, outer_lr=1.3)).start()
    with pytest.raises(ValueError, match=r"different settings: \['outer_lr'\]; .* --dilocox-outer-lr 1.0"):
        other.load_state_dict(old)


def test_diverged_inner_training_raises_and_leaves_the_global_model():
    model = make_model(0)
    sync = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=2, overlap="none")).start()
    anchor = [a.clone() for a in sync.anchor]
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    sync.after_inner_step()
    with pytest.raises(DivergedError, match="round 1: this cluster's pseudo-gradient has NaN/Inf"):
        sync.after_inner_step()
    assert all(torch.equal(a, b) for a, b in zip(anchor, sync.anchor))


def test_round_lands_tau_steps_into_the_next_round_with_the_local_progress_kept():
    """H = 4, τ = 2: round t (launched at 4t) lands at 4t + 2, and θ = φ_new + (θ − θ_s) exactly."""
    model = make_model(0)
    opt = make_inner(model, "adam", 0.01)
    cfg = DiLoCoXConfig(h=4, overlap="one-step-delay", lowrank=False, quant_bits=32, outer_lr=0.7,
                        adaptive_h=False, overlap_steps=2)
    params = [p.data for p in model.parameters()]
    sync = DiLoCoXSync(params, cfg).start()
    for step in range(14):
        inner_step(model, opt, step)
        if step + 1 in (6, 10):  # the landing steps: predict θ from the state just before
            before = [p.clone() for p in params]
            start = [s.clone() for s in sync.round_start]
            sync._in_flight.result()  # (finished now, so the prediction below sees the same φ)
        changed = sync.after_inner_step()
        assert changed == (step + 1 in (4, 6, 8, 10, 12, 14))
        if step + 1 in (6, 10):
            assert all(torch.equal(p, a + (b - s)) for p, a, b, s in zip(params, sync.anchor, before, start))
            assert all(torch.equal(s, a) for s, a in zip(sync.round_start, sync.anchor))
    assert [r["iteration"] for r in sync.rows] == [6, 10, 14]  # round 3 landed at 14 = 12 + 2
    assert [r["round"] for r in sync.rows] == [1, 2, 3]
    sync.close()


def test_adaptive_tau_follows_the_measured_transfer(monkeypatch):
    """--dilocox-overlap-steps 0: rounds 1 and 2 land one step in (a payload carries the transfer
    time of the round before it, so round 2's is the first with one), later ones at
    clamp(ceil(2 T_comm / T_step), 1, H) from the figures in the payload. The figures are wall times (an
    in-process transfer is microseconds on an idle host, can be a step on a loaded one), so the expected
    landing steps are computed from the figures each round really carried."""
    seen = []
    adapt = DiLoCoXSync._adapt

    def recording_adapt(self, result):
        seen.append((result.peer_comm_seconds, result.peer_step_seconds))
        adapt(self, result)
    monkeypatch.setattr(DiLoCoXSync, "_adapt", recording_adapt)
    _, _, _, sync = train_one_cluster(16, dict(h=4, overlap="eager", lowrank=False, quant_bits=32, overlap_steps=0))
    assert seen[0][0] == 0.0 and seen[1][0] > 0  # round 1 carries no transfer time, round 2 the first
    tau_after_round_2 = min(4, max(1, math.ceil(2 * seen[1][0] / seen[1][1])))
    assert [r["iteration"] for r in sync.rows][:2] == [5, 9]
    assert sync.rows[2]["iteration"] == 12 + tau_after_round_2
    assert sync.h == 4


def test_adaptive_tau_lands_at_the_boundary_when_the_round_could_land_only_at_its_end(monkeypatch):
    """H = 1 under --dilocox-overlap-steps 0: τ can only be H = 1 (the whole round on the stand-in), so a
    round whose transfer took at most SYNC_LANDING_STEPS of a step lands at its own boundary (τ = 0) and
    training goes on from φ exactly; a slower one keeps τ = 1. Expected from the figures each round carried."""
    from megatron_dilocox.outer.plan import SYNC_LANDING_STEPS
    seen, after = [], []
    adapt, boundary, hook = DiLoCoXSync._adapt, DiLoCoXSync.boundary, DiLoCoXSync.after_inner_step

    def recording_adapt(self, result):
        seen.append((result.peer_comm_seconds, result.peer_step_seconds))
        adapt(self, result)

    def recording_boundary(self):
        boundary(self)
        after.append(all(torch.equal(p, a) for p, a in zip(self.params, self.anchor)))

    def slow_step(self):  # a 50 ms inner step: the test network's own is about as short as an in-process transfer
        time.sleep(0.05)
        return hook(self)
    monkeypatch.setattr(DiLoCoXSync, "_adapt", recording_adapt)
    monkeypatch.setattr(DiLoCoXSync, "boundary", recording_boundary)
    monkeypatch.setattr(DiLoCoXSync, "after_inner_step", slow_step)
    _, _, _, sync = train_one_cluster(12, dict(h=1, overlap="eager", lowrank=False, quant_bits=32, overlap_steps=0))
    taus = [1] + [0 if 0 < t <= SYNC_LANDING_STEPS * s else 1 for t, s in seen]  # τ of rounds 1, 2, ...
    landed = [r["launched_at"] + taus[r["round"] - 1] for r in sync.rows]
    assert [r["iteration"] for r in sync.rows] == landed
    assert sum(t == 0 for t in taus[:len(sync.rows)]) >= 1  # an in-process transfer takes far under 25 ms
    # θ = φ after exactly the boundaries whose round landed at once (a delayed one leaves the stand-in φ + c)
    assert after == [taus[k] == 0 for k in range(12)]
    assert sync.rows[-1]["round"] == 12
    sync.close()


class _TwoRanks(IntraCluster):
    """The other rank of a two-rank cluster, as a fixed list: reduce() is what the collective returns."""

    def __init__(self, other):
        self.other = other

    def reduce(self, values, op):
        assert op == "max"
        return [float(max(a, b)) for a, b in zip(values, self.other)]


def test_cluster_agreement_orders_link_budget_ranks_by_bytes():
    """Under the link budget each rank proposes what its own transfer carries; the cluster must take the
    proposal sending the fewest bytes (whole = 0 sends the most), else a rank whose link fits only rank 20 is
    made to send rank 24, or rank 0 (whole) beats every low rank. Without the budget: the largest rank."""
    def both(mine, theirs, by_bytes):
        other = [theirs[0], -(theirs[1] or 2.0 ** 30) if by_bytes else theirs[1], theirs[2]]
        return agree_on_cluster(_TwoRanks(other), *mine, by_bytes=by_bytes)
    assert both((10, 20, 1), (12, 24, 3), by_bytes=True) == (12, 20, 3)
    assert both((10, 0, 1), (10, 24, 1), by_bytes=True) == (10, 24, 1)  # whole fits here, not there
    assert both((10, 0, 1), (10, 0, 2), by_bytes=True) == (10, 0, 2)  # whole everywhere stays whole
    assert both((10, 20, 1), (12, 24, 3), by_bytes=False) == (12, 24, 3)
    assert both((10, 0, 1), (10, 24, 1), by_bytes=False) == (10, 24, 1)


def test_outer_lr_warmup_is_torch_sgd_with_a_linear_lr_ramp_over_iterations():
    """--dilocox-outer-lr-warmup-iters 6, H = 2, C = 1, synchronous: round t (launched at iteration 2t) steps
    SGD (Nesterov, μ 0.9) on δ_t at lr 0.7 x min(1, 2t/6): 0.2333, 0.4667, 0.7, 0.7, ... (same bits as
    torch.optim.SGD)."""
    model = make_model(0)
    opt = make_inner(model, "adam", 0.01)
    cfg = DiLoCoXConfig(h=2, overlap="none", lowrank=False, quant_bits=32, outer_lr=0.7, outer_momentum=0.9,
                        outer_lr_warmup_iters=6, adaptive_h=False)
    assert [cfg.outer_lr_at(i) for i in (2, 4, 6, 8, 18)] == [0.7 * 2 / 6, 0.7 * 4 / 6, 0.7, 0.7, 0.7]
    params = [p.data for p in model.parameters()]
    sync = DiLoCoXSync(params, cfg).start()
    ref = [torch.nn.Parameter(a.clone()) for a in sync.anchor]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    for step in range(10):
        inner_step(model, opt, step)
        if (step + 1) % 2 == 0:  # a boundary: δ_t = φ − θ is the average at C = 1
            t = (step + 1) // 2
            for r, p in zip(ref, params):
                r.grad = r.detach() - p.float()
            sgd.param_groups[0]["lr"] = 0.7 * min(1.0, 2 * t / 6)
            sgd.step()
        sync.after_inner_step()
        if (step + 1) % 2 == 0:
            assert all(torch.equal(r.detach(), a) for r, a in zip(ref, sync.anchor)), f"round {t}"
    assert sync.round == 5
    sync.close()


def test_default_outer_lr_warmup_is_a_fifth_of_the_run_at_most_200_iterations():
    """The default warm-up follows the run: a fifth of train_iters, at most 200 (200 when unknown); an explicit
    value, 0 included, wins. The sync steps at the lr of the run length it was given."""
    cfg = DiLoCoXConfig()
    assert cfg.resolved_outer_lr == 1.0 and cfg.outer_lr_warmup_iters is None
    assert [cfg.resolved_outer_lr_warmup_iters(n) for n in (None, 16, 60, 200, 999, 1000, 5000)] == \
        [200, 3, 12, 40, 199, 200, 200]
    assert [cfg.outer_lr_at(i, 60) for i in (0, 6, 12, 13)] == [1 / 12, 0.5, 1.0, 1.0]
    assert cfg.outer_lr_at(100, None) == 0.5 and cfg.outer_lr_at(100, 60) == 1.0
    assert DiLoCoXConfig(outer_lr_warmup_iters=0).outer_lr_at(1, 60) == 1.0
    assert DiLoCoXConfig(outer_lr_warmup_iters=30).resolved_outer_lr_warmup_iters(60) == 30

    def anchors_after(train_iters, warmup=None):  # 3 synchronous rounds of H = 2, μ 0, C = 1: φ_t = φ_{t−1} − lr_t δ_t
        model = make_model(0)
        opt = make_inner(model, "adam", 0.01)
        sync = DiLoCoXSync([p.data for p in model.parameters()],
                           DiLoCoXConfig(h=2, overlap="none", lowrank=False, quant_bits=32, outer_momentum=0.0,
                                         adaptive_h=False, outer_lr_warmup_iters=warmup), train_iters=train_iters).start()
        for step in range(6):
            inner_step(model, opt, step)
            sync.after_inner_step()
        sync.close()
        return [a.clone() for a in sync.anchor]

    # train_iters 20: warm-up 4, lrs 0.5, 1, 1 at iterations 2, 4, 6; the same as the explicit 4
    assert all(torch.equal(a, b) for a, b in zip(anchors_after(20), anchors_after(None, warmup=4)))
    assert not all(torch.equal(a, b) for a, b in zip(anchors_after(20), anchors_after(None)))


def test_eager_stand_in_under_a_changing_outer_lr_is_the_optimizer_run_at_the_current_lr():
    """c_t must equal the outer optimizer run from zero on w (δ_k − δ_{k−1}), k ≤ t, at today's lr (the
    telescoping that makes θ = φ + c the eager proxy). With μ = 0 that is −lr_t w δ_t, whatever the lrs were."""
    from megatron_dilocox.outer.nesterov import LocalCorrection
    cfg = DiLoCoXConfig(outer_lr=1.0, outer_momentum=0.0)
    corr = LocalCorrection([(3, 2)], cfg, "cpu")
    g = torch.Generator().manual_seed(0)
    for lr in (0.25, 0.5, 1.0, 1.0, 0.7):
        d = torch.randn(3, 2, generator=g)
        corr.step([d], 0.75, lr=lr)
        assert torch.allclose(corr.value[0], -lr * 0.75 * d, atol=1e-6), lr


def test_the_runs_total_follows_the_members_what_was_trained_stays():
    """outer/clock.py under --dilocox-on-peer-failure continue: while the members stay the total stays; when a site
    is lost the rest of its plan leaves the total (what it trained stays: tokens applied before the round plus
    what the remaining members still plan); when it rejoins, its plan comes back. A checkpoint written before the
    clock counted its sites resumes with its total."""
    from megatron_dilocox.outer.clock import RunClock
    c = RunClock(planned_total=120.0, sites=2, tokens_per_global_step=2.0)
    c.applied([4.0, 8.0], False, [56.0, 52.0], 0.0)
    assert (c.planned_total, c.sites, c.tokens_applied) == (120.0, 2, 12.0)
    c.applied([4.0], False, [52.0], 12.0)  # site 1 lost after its 8 tokens: 12 applied + site 0's 52 left
    assert (c.planned_total, c.sites) == (64.0, 1)
    c.applied([4.0, 4.0], False, [48.0, 60.0], 16.0)  # it rejoins as a new process: its whole plan ahead
    assert (c.planned_total, c.sites) == (124.0, 2)
    old = RunClock()
    old.load_state_dict({"planned_total": 120.0, "tokens_applied": 40.0})
    old.applied([4.0, 4.0], False, [60.0, 60.0], 40.0)  # (no own tokens saved: plans left look whole)
    assert (old.planned_total, old.sites) == (120.0, 2)
