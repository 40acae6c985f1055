"""--dilocox-per-site-h: where the run ends, and how far along it is, in tokens every site counts alike.

With per-site H a fast site runs more steps per round than a slow one, so "--train-iters" can no longer end the
run on every site at once. Instead each site plans its own tokens (the Megatron glue: its --train-iters x global
batch x sequence length), the sites add their plans at start (one all-gather) and every applied round adds the
tokens in its header to a total that is therefore the same on every site. The run ends at the first boundary
where the tokens applied plus the round in flight (counted as large as the last one) come within half a round of
the planned total: decided from shared numbers only, so every site ends at the same round. ``progress`` is the
fraction of the total trained so far, which the glue feeds Megatron's LR schedule so that a fast site's schedule
does not run ahead of the run (docs/algorithm.md#sites-of-different-speeds). Pure PyTorch.
"""
from __future__ import annotations

from typing import Optional

import torch


def agree(sync):
    """(start) every site's planned tokens, summed: the run's total; the tokens of one step of every site (a
    lockstep iteration), and the longest planned run in iterations: what the outer lr's warm-up is measured in
    and against on every site (``outer_lr``)."""
    mine = torch.tensor([float(sync.token_budget), float(sync.tokens_per_step), float(sync.train_iters or 0)],
                        dtype=torch.float64)
    plans = [t.view(torch.float64).tolist() for t in sync.group.all_gather(mine.view(torch.uint8), (0, 0, "budget"))]
    sync.budget_total = sum(p[0] for p in plans)
    sync.tokens_per_global_step = sum(p[1] for p in plans)
    sync.run_iters_global = int(max(p[2] for p in plans)) or None


def outer_lr(sync, launched_at: int, launched_tokens: float) -> float:
    """The outer lr of a round launched at this site's iteration ``launched_at``. Per-site H: sites launch a round
    at different iterations of their own, and the outer step must be the same everywhere, so the warm-up follows
    the run's tokens instead: the lockstep-equivalent iteration, launched_tokens / the tokens of one step of every
    site, against the longest plan."""
    if sync.budget_total > 0 and sync.tokens_per_global_step > 0:
        return sync.cfg.outer_lr_at(launched_tokens / sync.tokens_per_global_step, sync.run_iters_global)
    return sync.cfg.outer_lr_at(launched_at, sync.train_iters)


def at_boundary(sync):
    """After a round is launched (or, synchronous, applied): whether this is the run's last round."""
    if sync.budget_total <= 0:
        return
    in_flight = sync.last_round_global if (sync._in_flight is not None or sync._done is not None) else 0.0
    sync.projected = sync.global_tokens + in_flight
    if sync.last_round_global > 0 and sync.projected >= sync.budget_total - 0.5 * sync.last_round_global:
        sync.run_complete = True


def progress(sync) -> Optional[float]:
    """The run's fraction trained so far, in [0, 1]: the projection at the last boundary plus this round's steps
    so far at the last round's size (before the first round lands: this site's own share of its plan)."""
    if sync.budget_total <= 0:
        return None
    if sync.last_round_global <= 0:
        return min(1.0, sync.iteration * sync.tokens_per_step / max(sync.token_budget, 1e-30))
    within = min(1.0, sync.steps_in_round / max(sync.h, 1)) * sync.last_round_global
    return min(1.0, (sync.projected + within) / sync.budget_total)


def boundary_progress(sync) -> Optional[float]:
    """The run's fraction at the last boundary (applied + in flight): the same number on every site after the
    same round, so decisions taken on it (the glue's evaluation points) agree everywhere."""
    if sync.budget_total <= 0:
        return None
    return min(1.0, sync.projected / sync.budget_total)
