"""The run's one clock: where the run is, in numbers every site holds identically (docs/algorithm.md#the-runs-clock).

Megatron counts its own iterations. With per-site H a fast site runs more iterations per round than a slow one, so
"iteration 60" is a different point of the run on each site, and every decision that the sites must take together
(where the run ends, when to evaluate, save or exit, where the LR schedule and the outer lr's warm-up stand) is
taken here instead, from numbers every site received in the same round headers:

    start:            planned_total ← Σ_c (site c's planned tokens)          (one all-gather, ``agree``)
    round applied:    tokens_applied += Σ_c tokens_c                         (the header's token counts)
                      when the members changed (--dilocox-on-peer-failure continue):
                      planned_total ← tokens applied before the round + Σ_c plan left_c over the round's
                                        members (the headers': a lost site takes the rest of its plan out, what
                                        it trained stays; a rejoining one brings its plan back)
                      end_requested |= any site asked to end                  (the header's flag, ``--exit-duration``)
    every boundary:   round ← rounds launched;  projected ← applied + the round in flight (as large as the last)
                      complete ← projected within half a round of planned_total
                      ending ← end_requested                                 (every site: the same boundary)
    a decision "every 1/n of the run" (evaluate, save, exit): at the first boundary where
                      ⌊projected / planned_total · n⌋ passes the last mark taken (``marks``)

Nothing here reads a site's own iteration, so after the same round every site has taken the same decisions.
Without a token plan (lockstep rounds) ``planned_total`` is 0: every site runs H steps per round, Megatron's
iteration is the same point of the run on every site, and the glue leaves those decisions to Megatron. Pure
PyTorch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# (the checkpoint's old names for these fields, before the clock was one object)
_OLD_NAMES = {"budget_total": "planned_total", "global_tokens": "tokens_applied", "last_round_global": "last_round",
              "run_complete": "complete"}


@dataclass
class RunClock:
    planned_total: float = 0.0  # the training sites' planned tokens, summed (0: no token plan, lockstep rounds)
    tokens_per_global_step: float = 0.0  # one inner step of every site: a lockstep-equivalent iteration
    run_iters_global: Optional[int] = None  # the longest site's plan in iterations (the outer lr's warm-up)
    round: int = 0  # rounds launched everywhere, at the last boundary
    tokens_applied: float = 0.0  # tokens of every applied round, every site's together
    last_round: float = 0.0  # of the last applied round
    projected: float = 0.0  # at the last boundary: applied + the round in flight (as large as the last one)
    complete: bool = False  # the run ends at this boundary (its last round is the one just launched)
    end_requested: bool = False  # an applied round carried a site's request to end (--exit-duration-in-mins)
    ending: bool = False  # the run stops at this boundary on every site (saving), by that request
    sites: int = 0  # how many sites' plans the total holds (a change of members re-counts it)

    # ------------------------------------------------------------------------------------ the shared numbers
    def agree(self, group, token_budget: float, tokens_per_step: float, train_iters: Optional[int]):
        """(start) every site's plan, summed: the run's total; one step of every site; the longest plan."""
        mine = torch.tensor([float(token_budget), float(tokens_per_step), float(train_iters or 0)],
                            dtype=torch.float64)
        plans = [t.view(torch.float64).tolist() for t in group.all_gather(mine.view(torch.uint8), (0, 0, "budget"))]
        self.planned_total, self.sites = sum(p[0] for p in plans), len(plans)
        self.tokens_per_global_step = sum(p[1] for p in plans)
        self.run_iters_global = int(max(p[2] for p in plans)) or None

    def applied(self, member_tokens: list, end_requested: bool, member_plans_left: Sequence[float] = (),
                launched_tokens: float = 0.0):
        """A round was applied: the tokens every site trained in it (its header), whether a site asked to end, and
        what the sites that took part still planned when it was launched (``launched_tokens``: the tokens applied
        then): when the members changed, the run's total from now on is what was trained plus what the sites
        training it still plan (while they stay, the total stays: a checkpoint from before sites counted their own
        tokens resumes with its total)."""
        if self.sites < 0:  # (resumed from a checkpoint that did not count them: the members it resumed with)
            self.sites = len(member_plans_left)
        if self.planned_total > 0 and member_plans_left and len(member_plans_left) != self.sites:
            self.planned_total, self.sites = launched_tokens + sum(member_plans_left), len(member_plans_left)
        self.last_round = sum(member_tokens)
        self.tokens_applied += self.last_round
        self.end_requested = self.end_requested or end_requested

    def at_boundary(self, rounds_launched: int, in_flight: bool):
        """After a round is launched (or, synchronous, applied): the run's position, and whether it ends here."""
        self.round = rounds_launched
        self.ending = self.end_requested
        if self.planned_total <= 0:
            return
        self.projected = self.tokens_applied + (self.last_round if in_flight else 0.0)
        if self.last_round > 0 and self.projected >= self.planned_total - 0.5 * self.last_round:
            self.complete = True

    # ------------------------------------------------------------------------------------ readings
    def boundary_progress(self) -> Optional[float]:
        """The run's fraction at the last boundary (applied + in flight); None without a token plan."""
        if self.planned_total <= 0:
            return None
        return min(1.0, self.projected / self.planned_total)

    def marks(self, n: int) -> int:
        """How many of the marks k/n of the run the last boundary has passed (0 without a token plan)."""
        at = self.boundary_progress()
        return int(at * n + 1e-9) if (at is not None and n > 0) else 0

    def progress(self, steps_in_round: int, h: int, iteration: int, tokens_per_step: float,
                 token_budget: float) -> Optional[float]:
        """The run's fraction now, for this site's LR schedule: the last boundary's projection plus this round's
        steps so far at the last round's size (before the first round lands: this site's share of its own plan)."""
        if self.planned_total <= 0:
            return None
        if self.last_round <= 0:
            return min(1.0, iteration * tokens_per_step / max(token_budget, 1e-30))
        within = min(1.0, steps_in_round / max(h, 1)) * self.last_round
        return min(1.0, (self.projected + within) / self.planned_total)

    def outer_lr(self, cfg, launched_at: int, launched_tokens: float, train_iters: Optional[int]) -> float:
        """The outer lr of a round launched at this site's iteration ``launched_at``: with a token plan the warm-up
        follows the run's tokens (lockstep-equivalent iterations against the longest plan), so every site takes the
        same outer step although the sites launch the round at different iterations of their own."""
        if self.planned_total > 0 and self.tokens_per_global_step > 0:
            return cfg.outer_lr_at(launched_tokens / self.tokens_per_global_step, self.run_iters_global)
        return cfg.outer_lr_at(launched_at, train_iters)

    # ------------------------------------------------------------------------------------ moving it
    FIELDS = ("planned_total", "tokens_per_global_step", "run_iters_global", "round", "tokens_applied", "last_round",
              "projected", "complete", "end_requested", "ending", "sites")

    def as_floats(self) -> list[float]:
        """Every field as a float64 (exact for these values): one broadcast moves the clock inside a site."""
        return [float(getattr(self, k) or 0) for k in self.FIELDS]

    @classmethod
    def from_floats(cls, values: list[float]) -> "RunClock":
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        out = {}
        for k, v in zip(cls.FIELDS, values):
            out[k] = bool(v) if kinds[k] == "bool" else int(v) if "int" in kinds[k] else float(v)
        out["run_iters_global"] = out["run_iters_global"] or None
        return cls(**out)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict):
        """From a checkpoint (one written before the clock was one object names some fields otherwise). A request
        to end belonged to the job that saved it (its --exit-duration-in-mins): the resumed job goes on."""
        for k, v in state.items():
            setattr(self, _OLD_NAMES.get(k, k), v)
        self.end_requested = self.ending = False
        if "sites" not in state:
            self.sites = -1
