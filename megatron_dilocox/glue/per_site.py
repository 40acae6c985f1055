"""Per-site H in Megatron (docs/algorithm.md#sites-of-different-speeds): whether a run gets it, and the site's plan
before Megatron builds its scheduler and data. Every step after that, what Megatron decided by its own iterations
(the LR schedule, the loop's end, evaluations, saves, exits) follows the run's clock instead (glue/run_clock.py).

``opt`` below is the glue's DiLoCoXOptimizer (glue/seam.py)."""
from __future__ import annotations

import logging
import math
from typing import Optional

from megatron_dilocox.config import DiLoCoXConfigError
from megatron_dilocox.outer.plan import MAX_SPEED_RATIO

log = logging.getLogger("megatron_dilocox")


def run_iters(args) -> Optional[int]:
    """The run's length in iterations (per-site H: this site's plan); sample-based runs (--train-samples) get
    args.train_iters from Megatron only after the optimizer is built."""
    if getattr(args, "dilocox_planned_iters", None):
        return args.dilocox_planned_iters
    if getattr(args, "train_iters", None):
        return args.train_iters
    return args.train_samples // args.global_batch_size if getattr(args, "train_samples", None) else None


def resolve(cfg, args) -> tuple[bool, str]:
    """--dilocox-per-site-h unset (auto): per-site H wherever the run allows it, so that a slower site does not
    make the others wait by default; lockstep where it does not, saying why (the reason is one line in the log).
    Explicit on/off is kept; explicit on with what it cannot take was refused by the config already."""
    if cfg.per_site_h is not None:
        return cfg.per_site_h, ("per-site H (--dilocox-per-site-h)" if cfg.per_site_h
                                else "lockstep, every site H steps (--dilocox-no-per-site-h)")
    blockers = [why for cond, why in (
        (cfg.num_clusters < 2, "one cluster"),
        (not cfg.adaptive_h, "--dilocox-no-adaptive-h"),
        (bool(getattr(args, "rampup_batch_size", None)), "--rampup-batch-size"),
        (not (getattr(args, "train_iters", None) or getattr(args, "train_samples", None)), "no run length"),
    ) if cond]
    if blockers:
        return False, f"lockstep, every site H steps (per-site H is off with {', '.join(blockers)})"
    return True, ("per-site H: each site's round sized to its own step time, the run ended at the sites' token "
                  "total (--dilocox-no-per-site-h: lockstep)")


def plan(args):
    """Per-site H, before Megatron builds the scheduler and the datasets: --train-iters is this site's
    plan (its tokens count towards the run's total, outer/clock.py), the LR schedule keeps that length
    (--lr-decay-iters), and the data and the loop get room for up to MAX_SPEED_RATIO x as many iterations: a fast
    site runs more steps per round and the run ends when the sites' tokens reach the total."""
    if getattr(args, "rampup_batch_size", None):
        raise DiLoCoXConfigError("--dilocox-per-site-h does not support --rampup-batch-size "
                                 "(add --dilocox-no-per-site-h for lockstep rounds)")
    if getattr(args, "train_samples", None):  # Megatron's sample-based run: the same plan, counted in samples
        args.dilocox_planned_iters = args.train_samples // args.global_batch_size
        _marks(args)
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        args.train_samples = math.ceil(args.train_samples * MAX_SPEED_RATIO)
        return
    if not getattr(args, "train_iters", None):
        raise DiLoCoXConfigError("--dilocox-per-site-h: give the run's length (--train-iters or --train-samples)")
    args.dilocox_planned_iters = args.train_iters
    _marks(args)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.train_iters = math.ceil(args.train_iters * MAX_SPEED_RATIO)


def _marks(args):
    """How many times in the planned run Megatron would evaluate, save and exit (--eval-interval, --save-interval,
    --exit-interval, in planned iterations): glue/run_clock.py takes each at the same points of the run on every
    site."""
    planned = args.dilocox_planned_iters
    args.dilocox_marks = {kind: planned // every
                          for kind, every in (("eval", getattr(args, "eval_interval", None)),
                                              ("save", getattr(args, "save_interval", None)),
                                              ("exit", getattr(args, "exit_interval", None))) if every}
    args.dilocox_eval_marks = args.dilocox_marks.get("eval", 0)


def plan_tokens(opt, args):
    """--dilocox-per-site-h: this site's planned tokens for the run, before the sites add theirs up at start."""
    if opt.cfg.per_site_h:  # (canonical: every lane this rank owns)
        opt.sync.plan_tokens(run_iters(args) * opt.tokens_per_step, opt.tokens_per_step)
