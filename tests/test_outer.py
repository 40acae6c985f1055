"""Outer optimizer and the round logic in one process (C=1): reductions to plain training, resume."""
import pytest
import torch

from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.outer.nesterov import OuterNesterov
from megatron_dilocox.outer.sync import DiLoCoXSync, DivergedError
from tests.workers import batch, loss_fn, make_inner, make_model


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


def train(steps, dilocox=None, inner="adam", save_at=None, load=None):
    """Train the test network on cluster 0's data; optionally with DiLoCoX (C=1)."""
    model = make_model(0)
    opt = make_inner(model, inner, 0.01)
    sync = None
    if dilocox is not None:
        sync = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(**dilocox)).start()
    first = 0
    if load is not None:
        model.load_state_dict(load["model"])
        opt.load_state_dict(load["opt"])
        sync.load_state_dict(load["sync"])
        first = load["step"]
    losses, saved = [], None
    for step in range(first, steps):
        loss = loss_fn(model, *batch(0, 0, step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sync is not None:
            sync.after_inner_step()
        losses.append(float(loss.detach()))
        if save_at == step + 1:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "opt": __import__("copy").deepcopy(opt.state_dict()), "sync": sync.state_dict(), "step": step + 1}
    if sync is not None:
        sync.close()
    return losses, [p.detach().clone() for p in model.parameters()], saved, sync


@pytest.mark.parametrize("overlap", ["none", "one-step-delay", "eager"])
def test_single_cluster_reproduces_plain_training(overlap):
    plain_losses, plain_params, _, _ = train(24)
    cfg = dict(h=4, overlap=overlap, lowrank=False, quant_bits=32, outer_lr=1.0, outer_momentum=0.0,
               adaptive_h=False)
    losses, params, _, sync = train(24, cfg)
    assert sync.round == 6
    # Not bitwise: θ is rebuilt as φ − (φ − θ) at each boundary, which rounds in fp32 (|θ| <= ~1 here,
    # so one rounding is <= 6e-8); six rounds of it stay far below 1e-6.
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(params, plain_params)) < 1e-6


@pytest.mark.parametrize("overlap", ["none", "one-step-delay", "eager"])
def test_resume_from_state_dict_mid_round_is_bitwise_identical(overlap):
    """Save while a delayed round is in flight (step 10, H=4), resume in a fresh sync: same bits."""
    cfg = dict(h=4, overlap=overlap, lowrank_rank=2, lowrank_min_dim=8, quant_bits=4, quant_block_size=32,
               adaptive_h=False, adaptive_rank=True, lowrank_rank_max=4)
    full_losses, full_params, saved, _ = train(20, cfg, save_at=10)
    resumed_losses, resumed_params, _, _ = train(20, cfg, load=saved)
    assert resumed_losses == full_losses[10:]
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, full_params))


def test_state_dict_refuses_other_settings():
    model = make_model(0)
    sync = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4)).start()
    other = DiLoCoXSync([p.data for p in model.parameters()], DiLoCoXConfig(h=4, quant_bits=8)).start()
    with pytest.raises(ValueError, match=r"different settings: \['quant_bits'\]"):
        other.load_state_dict(sync.state_dict())


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
