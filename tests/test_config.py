"""Every invalid DiLoCoX setting raises DiLoCoXConfigError with the documented message."""
import pytest

from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError

pytestmark = pytest.mark.unit

MULTI = dict(num_clusters=2, rendezvous="127.0.0.1:29400", secret="s")

INVALID = [
    (dict(num_clusters=0), "--dilocox-num-clusters: must be >= 1, got 0"),
    (dict(num_clusters=2, cluster_id=2, rendezvous="h:1", secret="s"),
     "--dilocox-cluster-id: must be < --dilocox-num-clusters (2), got 2"),
    (dict(cluster_id=-1), "--dilocox-cluster-id: must be >= 0, got -1"),
    (dict(num_clusters=2, secret="s"), "--dilocox-rendezvous: is required with more than one cluster"),
    (dict(num_clusters=2, rendezvous="hostonly", secret="s"), "--dilocox-rendezvous: must be HOST:PORT"),
    (dict(num_clusters=2, rendezvous="h:70000", secret="s"), "--dilocox-rendezvous: must be HOST:PORT"),
    (dict(num_clusters=2, rendezvous="a:1,b:2", secret="s"),
     "--dilocox-rendezvous: lists 2 addresses, but a standby address needs --dilocox-coordinator standalone"),
    (dict(num_clusters=2, rendezvous="a:1,b", secret="s", coordinator="standalone"),
     "--dilocox-rendezvous: must be HOST:PORT"),
    (dict(coordinator="lighthouse"), "--dilocox-coordinator: must be one of embedded, standalone, got 'lighthouse'"),
    (dict(num_clusters=2, rendezvous="h:1"), "--dilocox-secret: is required with more than one cluster: set $DILOCOX_SECRET"),
    (dict(timeout_seconds=0), "--dilocox-timeout-seconds: must be a positive number of seconds, got 0"),
    (dict(h=0), "--dilocox-h: must be >= 1, got 0"),
    (dict(h=2.5), "--dilocox-h: must be an integer, got 2.5"),
    (dict(h=10, h_min=20), "--dilocox-h: must lie within [--dilocox-h-min, --dilocox-h-max] = [20, 200], got 10"),
    (dict(h=10, h_max=5), "--dilocox-h: must lie within [--dilocox-h-min, --dilocox-h-max] = [10, 5], got 10"),
    (dict(adaptive_h_margin=-0.1), "--dilocox-adaptive-h-margin: must be in [0, 10], got -0.1"),
    (dict(overlap_steps=-1), "--dilocox-overlap-steps: must be >= 0, got -1"),
    (dict(overlap_steps=2.5), "--dilocox-overlap-steps: must be an integer, got 2.5"),
    (dict(overlap="streaming"), "--dilocox-overlap: must be one of none, one-step-delay, eager, got 'streaming'"),
    (dict(delay_local_weight=1.5), "--dilocox-delay-local-weight: must be in [0, 1], got 1.5"),
    (dict(min_compression=0.5), "--dilocox-min-compression: must be a number >= 1"),
    (dict(error_decay=1.5), "--dilocox-error-decay: must be in [0, 1], got 1.5"),
    (dict(outer_lr_warmup_iters=-2), "--dilocox-outer-lr-warmup-iters: must be a whole number of iterations >= 0, got -2"),
    (dict(outer_lr=0), "--dilocox-outer-lr: must be a positive finite number, got 0"),
    (dict(outer_lr=float("nan")), "--dilocox-outer-lr: must be a positive finite number, got nan"),
    (dict(outer_momentum=1.0), "--dilocox-outer-momentum: must be in [0, 1), got 1.0"),
    (dict(outer_state_device="gpu"), "--dilocox-outer-state-device: must be one of cpu, param, got 'gpu'"),
    (dict(lowrank_rank=0, lowrank_rank_min=1), "--dilocox-lowrank-rank: must be >= 1, got 0"),
    (dict(lowrank_rank=8, lowrank_rank_max=4), "--dilocox-lowrank-rank: must lie within"),
    (dict(lowrank_rank=2, lowrank_rank_min=4), "--dilocox-lowrank-rank: must lie within"),
    (dict(lowrank_min_dim=1), "--dilocox-lowrank-min-dim: must be >= 2, got 1"),
    (dict(energy_threshold=0.0), "--dilocox-energy-threshold: must be in (0, 1], got 0.0"),
    (dict(energy_threshold=1.5), "--dilocox-energy-threshold: must be in (0, 1], got 1.5"),
    (dict(quant_bits=2), "--dilocox-quant-bits: must be one of 1, 4, 8, 16, 32 (32 = off), got 2"),
    (dict(quant_block_size=1), "--dilocox-quant-block-size: must be >= 2, got 1"),
    (dict(quant_bits=4, quant_block_size=33), "--dilocox-quant-block-size: must be even with 4-bit quantization, got 33"),
    (dict(seed=-3), "--dilocox-seed: must be >= 0, got -3"),
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(INVALID)])
def test_invalid_setting_raises_documented_message(kwargs, message, monkeypatch):
    monkeypatch.delenv("DILOCOX_SECRET", raising=False)
    with pytest.raises(DiLoCoXConfigError) as err:
        DiLoCoXConfig(**kwargs).validate()
    assert str(err.value).startswith(message), str(err.value)


def test_defaults_and_resolved_bounds():
    cfg = DiLoCoXConfig().validate()
    assert (cfg.resolved_h_min, cfg.h, cfg.resolved_h_max) == (50, 50, 1000)
    assert (cfg.resolved_rank_min, cfg.lowrank_rank, cfg.resolved_rank_max) == (1, 16, 64)
    assert cfg.overlap == "eager" and cfg.quant_bits == 4
    # outer momentum: by the configured number of sites (0.3 up to 2, 0.5 from 4, linear between), in every overlap
    # mode (docs/convergence.md#many-sites), unless given
    assert cfg.resolved_outer_momentum == 0.3
    assert DiLoCoXConfig(overlap="one-step-delay").resolved_outer_momentum == 0.3
    assert DiLoCoXConfig(overlap="none").resolved_outer_momentum == 0.3
    sites = {c: DiLoCoXConfig(num_clusters=c, rendezvous="h:1", secret="s").resolved_outer_momentum
             for c in (2, 3, 4, 8, 16)}
    assert sites == {2: 0.3, 3: pytest.approx(0.4), 4: 0.5, 8: 0.5, 16: 0.5}, sites
    assert DiLoCoXConfig(num_clusters=8, rendezvous="h:1", secret="s", outer_momentum=0.3).resolved_outer_momentum == 0.3
    # eager's weight of the fresh-minus-stale local term: halfway between the paper's 1/C and 1
    assert DiLoCoXConfig(num_clusters=2, rendezvous="h:1", secret="s").resolved_local_weight == 0.75
    assert DiLoCoXConfig(overlap="one-step-delay").resolved_local_weight == 1.0
    assert DiLoCoXConfig(outer_momentum=0.0).resolved_outer_momentum == 0.0
    # outer lr: 1.0 whole, 1.3 for fragments that overlap (docs/convergence.md), unless given
    assert (cfg.outer_lr, cfg.resolved_outer_lr) == (None, 1.0)
    assert DiLoCoXConfig(h=8, fragments=8, overlap="one-step-delay").resolved_outer_lr == 1.3
    assert DiLoCoXConfig(h=8, fragments=8, overlap="one-step-delay", outer_lr=1.0).resolved_outer_lr == 1.0
    assert DiLoCoXConfig(h=8, fragments=8, overlap="none").resolved_outer_lr == 1.0  # synchronous: none lands late


def test_secret_comes_from_environment_and_never_leaves_public_views(monkeypatch):
    monkeypatch.setenv("DILOCOX_SECRET", "hunter2")
    cfg = DiLoCoXConfig(num_clusters=2, rendezvous="127.0.0.1:1").validate()
    assert cfg.secret == "hunter2"
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg.public_dict())
    assert "secret" not in cfg.agreement_dict() and "cluster_id" not in cfg.agreement_dict()
