"""Megatron's decisions on the run's clock (outer/clock.py, docs/algorithm.md#the-runs-clock).

Megatron decides by its own iteration count when to evaluate, save and exit, where its LR schedule stands and
when the loop ends. With per-site H a fast site runs more iterations per round than a slow one, so each of these
is moved onto the run's clock, which every site holds alike after the same round:

- the LR schedule at the run's progress in tokens, and the loop's end where the run's tokens reach the total;
- ``--eval-interval``, ``--save-interval``, ``--exit-interval`` (in planned iterations): at the first round
  boundary past each k / (planned iterations // interval) of the run, so every site evaluates, saves or exits
  after the same round (a checkpoint records its round: glue/checkpoints.py resumes every site at the same one);
- ``--exit-duration-in-mins`` (per-site H or lockstep, more than one site): a site whose time is up says so in its
  next round's header; every site stops at the first boundary after that round is applied, saving (Megatron's
  own check would stop each site after its own iteration, at another round than the others');
- Megatron sizes (and so shuffles) its validation set from ``--train-iters``, which the per-site plan enlarges:
  the counts are taken from the planned iterations instead, so every run of the same data and evaluation
  settings evaluates on the same validation samples, whatever its rounds, plan or speed.

``opt`` below is the glue's DiLoCoXOptimizer (glue/seam.py).
"""
from __future__ import annotations

import logging
import time

import torch

from megatron_dilocox.glue.per_site import run_iters

log = logging.getLogger("megatron_dilocox")
NEVER = 1 << 62  # an interval no iteration reaches
MARKS = (("eval", "eval_interval"), ("save", "save_interval"), ("exit", "exit_interval"))


def install(args, num_clusters: int):
    """Before training: the validation set's size from the plan; Megatron's own duration check handed over to the
    run's clock (with more than one site)."""
    import megatron.training.training as training
    if num_clusters > 1 and getattr(args, "exit_duration_in_mins", None):
        args.dilocox_exit_minutes, args.exit_duration_in_mins = args.exit_duration_in_mins, None
    if getattr(training.get_train_valid_test_num_samples, "_dilocox_plan", False):
        return
    original = training.get_train_valid_test_num_samples

    def get_train_valid_test_num_samples():
        train, valid, test = original()
        planned = getattr(args, "dilocox_planned_iters", None)
        if planned and valid is not None and not getattr(args, "skip_train", False):
            enlarged, args.train_iters = args.train_iters, planned  # (the evaluations a planned run makes)
            try:
                _, valid, test = original()
            finally:
                args.train_iters = enlarged
        return train, valid, test

    get_train_valid_test_num_samples._dilocox_plan = True
    training.get_train_valid_test_num_samples = get_train_valid_test_num_samples


def before_step(opt):
    """(every rank, before the inner step, which may be skipped) per-site H: no mark is due unless the step's
    after_step says so; --exit-duration-in-mins: whether this site's time is up, agreed over the site's ranks as
    Megatron agrees it (the maximum), so every rank's next header says the same."""
    from megatron.training import get_args
    import megatron.training.training as training
    args = get_args()
    for kind, attr in MARKS:
        if kind in getattr(args, "dilocox_marks", {}):
            setattr(args, attr, NEVER)
    minutes = getattr(args, "dilocox_exit_minutes", None)
    start = getattr(training, "_TRAIN_START_TIME", None)
    if not minutes or start is None:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    up = torch.tensor([float((time.time() - start) / 60.0 > minutes)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(up, op=torch.distributed.ReduceOp.MAX)
    if up.item():
        opt.sync.request_end()


def take_marks_passed(opt):
    """(start, and after a checkpoint is loaded) the marks the run has passed count as taken: a resumed run does
    not evaluate, save or exit again for the marks before its checkpoint."""
    from megatron.training import get_args
    marks = getattr(get_args(), "dilocox_marks", {})
    opt.marks_done = {kind: opt.sync.clock.marks(n) for kind, n in marks.items()}


def after_step(opt):
    """(every rank, after a successful inner step) what the run's clock decides at this step."""
    from megatron.training import get_args
    args = get_args()
    clock = opt.sync.clock
    if opt.cfg.per_site_h:
        _follow_the_run(opt, args)
        for kind, attr in MARKS:
            if kind not in getattr(args, "dilocox_marks", {}):
                continue  # (an interval longer than the plan: n = 0, never due, and before_step keeps it NEVER)
            due, done = clock.marks(args.dilocox_marks[kind]), opt.marks_done.get(kind, 0)
            opt.marks_done[kind] = max(done, due)
            if due > done:  # Megatron: iteration % interval == 0 (1: this iteration, whatever its count)
                setattr(args, attr, 1)
    if clock.ending and not opt.sync.stopped:
        if args.exit_interval != 1:
            log.warning("DiLoCoX: a site's --exit-duration-in-mins is up: every site saves and exits after round %d "
                        "(this site's iteration %d)", clock.round, opt.sync.iteration)
        args.exit_interval = 1  # Megatron saves and exits this iteration


def _follow_the_run(opt, args):
    """Megatron's LR schedule at the run's progress in tokens, not at this site's own iterations; and the loop
    ends where the run does (every site at the same round)."""
    progress = opt.sync.progress()
    if progress is not None and opt.scheduler is not None:  # Megatron steps it by one batch after this
        opt.scheduler.num_steps = max(0, int(progress * run_iters(args) * args.global_batch_size)
                                       - args.global_batch_size)
    if opt.sync.clock.complete and opt.sync.iteration < opt.train_iters:
        log.info("DiLoCoX: the sites' tokens reach the run's total: this site ends at iteration %d",
                 opt.sync.iteration)
        opt.train_iters = args.train_iters = opt.sync.iteration
