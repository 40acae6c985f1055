"""The --dilocox-* flags: generated from the config, mapped onto it, chainable as extra_args_provider."""
import argparse

import pytest

from megatron_dilocox.arguments import add_dilocox_args, chain_providers, config_from_args, flag_table
from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError

pytestmark = pytest.mark.unit


def parse(*argv, chain=None):
    return add_dilocox_args(argparse.ArgumentParser(), chain=chain).parse_args(list(argv))


def test_flags_map_onto_the_config_and_defaults_stay():
    cfg = config_from_args(parse("--dilocox", "--dilocox-h", "7", "--dilocox-no-lowrank", "--dilocox-overlap", "none",
                                 "--dilocox-outer-lr", "0.5", "--dilocox-quant-bits", "8"))
    assert (cfg.h, cfg.lowrank, cfg.overlap, cfg.outer_lr, cfg.quant_bits) == (7, False, "none", 0.5, 8)
    assert cfg.lowrank_rank == DiLoCoXConfig().lowrank_rank and cfg.adaptive_rank is True


def test_absent_means_plain_megatron_and_stray_flags_are_an_error():
    assert config_from_args(parse()) is None
    with pytest.raises(DiLoCoXConfigError, match=r"--dilocox-h, --dilocox-quant-bits given without --dilocox"):
        config_from_args(parse("--dilocox-h", "5", "--dilocox-quant-bits", "8"))


def test_invalid_value_names_the_flag():
    with pytest.raises(DiLoCoXConfigError, match=r"^--dilocox-quant-bits: must be one of 1, 4, 8, 16, 32"):
        config_from_args(parse("--dilocox", "--dilocox-quant-bits", "5"))


def test_secret_is_not_a_flag():
    with pytest.raises(SystemExit):
        parse("--dilocox", "--dilocox-secret", "x")


def test_chains_with_other_extra_args_providers():
    def other(parser):
        parser.add_argument("--my-flag", type=int, default=0)
        return parser
    args = parse("--my-flag", "3", "--dilocox", chain=other)
    assert args.my_flag == 3 and args.dilocox
    combined = chain_providers(other, add_dilocox_args)(argparse.ArgumentParser())
    assert combined.parse_args(["--my-flag", "4", "--dilocox-h", "2"]).dilocox_h == 2


def test_flag_table_lists_every_flag():
    table = flag_table()
    for flag in ("--dilocox-num-clusters", "--dilocox-lowrank-rank-max", "--dilocox-no-adaptive-h", "$DILOCOX_SECRET"):
        assert flag in table
    assert "--dilocox-secret" not in table


def test_main_job_passes_dilocox_flags_with_their_values():
    from megatron_dilocox.harness.main_job import split_dilocox_flags
    mine, theirs = split_dilocox_flags(["--dilocox-outer-lr", "0.7", "--lr", "1e-3", "--dilocox-no-adaptive-h",
                                        "--seed", "3", "--dilocox-outer-momentum", "0.3"])
    assert mine == ["--dilocox-outer-lr", "0.7", "--dilocox-no-adaptive-h", "--dilocox-outer-momentum", "0.3"]
    assert theirs == ["--lr", "1e-3", "--seed", "3"]


def test_per_site_h_auto_resolves_from_the_run_and_says_why():
    """--dilocox-per-site-h unset: on where the run allows it, else lockstep naming every reason; explicit kept;
    the sample-based plan pins the LR schedule's length and makes room for 4x the samples."""
    from types import SimpleNamespace

    from megatron_dilocox.glue import per_site
    run = dict(rampup_batch_size=None, train_iters=100, train_samples=None)
    base = DiLoCoXConfig(num_clusters=2)
    assert base.per_site_h is None and per_site.resolve(base, SimpleNamespace(**run))[0] is True
    off, why = per_site.resolve(DiLoCoXConfig(num_clusters=2, adaptive_h=False, on_peer_failure="continue"),
                                SimpleNamespace(**{**run, "rampup_batch_size": [8, 8, 100]}))
    assert not off and why == ("lockstep, every site H steps (per-site H is off with --dilocox-no-adaptive-h, "
                               "--rampup-batch-size)")
    # it composes with fragments and with continue (docs/algorithm.md#sites-of-different-speeds)
    for other in (dict(fragments=4, overlap="one-step-delay"), dict(on_peer_failure="continue")):
        cfg = DiLoCoXConfig(num_clusters=2, rendezvous="h:1", secret="s", **other).validate()
        assert per_site.resolve(cfg, SimpleNamespace(**run))[0] is True
    assert per_site.resolve(DiLoCoXConfig(num_clusters=2, per_site_h=False), SimpleNamespace(**run))[0] is False
    assert per_site.resolve(DiLoCoXConfig(num_clusters=1), SimpleNamespace(**run))[0] is False
    args = SimpleNamespace(rampup_batch_size=None, train_iters=None, train_samples=1000, global_batch_size=8,
                           lr_decay_samples=None, eval_interval=25)
    per_site.plan(args)
    assert (args.dilocox_planned_iters, args.lr_decay_samples, args.train_samples, args.dilocox_eval_marks) == \
        (125, 1000, 4000, 5)
    assert per_site.run_iters(args) == 125
    with pytest.raises(DiLoCoXConfigError, match="--dilocox-no-per-site-h"):
        per_site.plan(SimpleNamespace(**{**run, "rampup_batch_size": [8, 8, 100]}))
