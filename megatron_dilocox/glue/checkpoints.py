"""Crash-safe checkpoints and one resume iteration for every cluster (Megatron glue).

Why. Megatron saves ``iter_XXXXXXX/`` and then rewrites the tracker ``latest_checkpointed_iteration.txt`` with a
plain ``open('w')``. A SIGKILL during a save leaves a half-written ``iter_`` directory (a later save at that
iteration writes into the leftovers) or an empty tracker (``load_checkpoint`` then ``sys.exit()``s). And every
cluster checkpoints on its own: a kill during one cluster's save leaves the clusters with different latest
checkpoints, while DiLoCoX must restart every cluster from the same iteration (same round, anchor, outer momentum,
error feedback, warm start).

What.
- After every persistent save, once every rank of the cluster has returned from it (a barrier on the cluster's
  world), cluster rank 0 adds the iteration to ``dilocox_checkpoints.json`` in the save directory, written
  atomically (tmp + fsync + ``os.replace``). Only registered iterations are complete. ``--async-save`` is refused
  (the registry needs the save finished when ``save_checkpoint`` returns), and so are non-persistent checkpoints
  (Megatron would load them by itself, bypassing the agreement below).
- ``--ckpt-format torch`` with DP > 1 is refused: Megatron's legacy format saves the optimizer state dict (and so
  the DiLoCoX state riding in it) from DP rank 0 only, and every DP rank loads that file; each DP rank's DiLoCoX
  state differs (its own shards, or its round-robin share of the replica). ``torch_dist`` keeps one per rank.
- At start-up, before Megatron loads (``agree_on_resume_iteration``, from ``DiLoCoXOptimizer.__init__``), cluster
  rank 0 reads its complete iterations (those whose directory still exists); the cluster's ranks take rank 0's
  list (all-reduce), the clusters exchange theirs (all-gather over the inter-cluster group) and take the newest
  iteration complete on every cluster. Rank 0 rewrites the tracker to it atomically (repairing a truncated one),
  renames every newer ``iter_`` directory aside (``iter_0000012.dilocox-superseded-0``; nothing is deleted) and
  drops it from the registry; a barrier; then Megatron loads exactly that iteration. No common iteration: every
  cluster starts from scratch (the tracker is renamed aside too), with a warning naming what is ignored. A
  checkpoint directory without a registry (written without this module) counts by its tracker.

Rounds at a kill. The round that was in flight when the checkpoint was written is *completed from the
checkpoint*: saving finishes its exchange and stores the result (``pending``), applied at the next boundary after
the resume. Every round launched after the checkpoint (the one in flight at the kill included) is *replayed
deterministically*: every cluster restarts from the same iteration with the same model, optimizer, DiLoCoX state,
data position and RNG, so the continuation equals an uninterrupted run bitwise (losses, grad norms, per-round
hashes and bytes). That needs fixed H (``--dilocox-no-adaptive-h``): adaptive H follows
measured transfer and step times, which differ from run to run.
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
import sys

import torch

log = logging.getLogger("megatron_dilocox")

REGISTRY = "dilocox_checkpoints.json"
TRACKER = "latest_checkpointed_iteration.txt"  # megatron.training.checkpointing.get_checkpoint_tracker_filename
SUPERSEDED = ".dilocox-superseded-"
MAX_CANDIDATES = 64  # newest complete iterations each cluster offers
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


# ------------------------------------------------------------------------------------------ files
def _atomic_write(path: str, text: str):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power cut
    finally:
        os.close(fd)


def iter_dirs(ckpt_dir: str) -> dict[int, str]:
    """{iteration: directory name} of the ``iter_`` directories in ``ckpt_dir`` (superseded ones excluded)."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return {}
    return {int(m.group(1)): name for name in os.listdir(ckpt_dir) if (m := _ITER_DIR.match(name))}


def _tracker_text(ckpt_dir: str):
    try:
        with open(os.path.join(ckpt_dir, TRACKER)) as f:
            return f.read().strip()
    except OSError:
        return None


def read_tracker(ckpt_dir: str):
    """The tracker's iteration, or None when it is missing, empty, truncated or 'release'."""
    text = _tracker_text(ckpt_dir)
    return int(text) if text and text.isdigit() else None


def _registered(ckpt_dir: str):
    try:
        with open(os.path.join(ckpt_dir, REGISTRY)) as f:
            return sorted({int(i) for i in json.load(f)["complete"]})
    except FileNotFoundError:
        return None


def complete_iterations(ckpt_dir) -> list[int]:
    """Iterations of ``ckpt_dir`` whose save completed on every rank and whose directory still exists."""
    present = iter_dirs(ckpt_dir)
    done = _registered(ckpt_dir) if present else []
    if done is None:  # not written through this module: trust a valid tracker
        done = [t] if (t := read_tracker(ckpt_dir)) is not None else []
    return [i for i in done if i in present]


def record_complete(ckpt_dir: str, iteration: int):
    """Add ``iteration`` to the registry (atomically), keeping only iterations whose directory exists."""
    present = iter_dirs(ckpt_dir)
    done = {i for i in (_registered(ckpt_dir) or []) if i in present} | {int(iteration)}
    _atomic_write(os.path.join(ckpt_dir, REGISTRY), json.dumps({"complete": sorted(done)}) + "\n")


def _aside(ckpt_dir: str, name: str) -> str:
    n = 0
    while os.path.exists(os.path.join(ckpt_dir, f"{name}{SUPERSEDED}{n}")):
        n += 1
    os.rename(os.path.join(ckpt_dir, name), os.path.join(ckpt_dir, f"{name}{SUPERSEDED}{n}"))
    return f"{name}{SUPERSEDED}{n}"


def prepare_resume(load_dir, save_dir, iteration: int) -> list[str]:
    """Make Megatron load exactly ``iteration`` (0: nothing) from ``load_dir`` and let it save into ``save_dir``.

    Tracker of ``load_dir`` rewritten atomically (renamed aside for 0); ``iter_`` directories newer than
    ``iteration`` in ``save_dir`` renamed aside and dropped from its registry. Returns what was moved aside."""
    moved = []
    if load_dir and os.path.isdir(load_dir):
        if iteration > 0:
            if read_tracker(load_dir) != iteration:
                _atomic_write(os.path.join(load_dir, TRACKER), str(iteration))
        elif _tracker_text(load_dir) not in (None, "release"):  # a release checkpoint is not ours to hide
            moved.append(os.path.join(load_dir, _aside(load_dir, TRACKER)))
    if save_dir and os.path.isdir(save_dir):
        for it, name in sorted(iter_dirs(save_dir).items()):
            if it > iteration:
                moved.append(os.path.join(save_dir, _aside(save_dir, name)))
        if _registered(save_dir) is not None:
            keep = [i for i in _registered(save_dir) if i <= iteration]
            _atomic_write(os.path.join(save_dir, REGISTRY), json.dumps({"complete": keep}) + "\n")
    return moved


# ------------------------------------------------------------------------------------------ agreement
def _candidates(args) -> list[int]:
    """This cluster's complete iterations that Megatron may load (newest MAX_CANDIDATES)."""
    load = getattr(args, "load", None)
    if not load:
        return []
    done = complete_iterations(load)
    if getattr(args, "ckpt_step", None):
        done = [i for i in done if i == args.ckpt_step]
    return done[-MAX_CANDIDATES:]


def agree_on_resume_iteration(cfg, args, group, intra) -> int:
    """The newest iteration complete on every cluster; Megatron is made to load it (see module docstring).

    ``group``: the inter-cluster ``Collective`` (None with one cluster); ``intra``: this cluster's
    ``IntraCluster``. Every rank of every cluster must call it (collectives). Returns the iteration (0: none).
    Installs the save wrapper too, for entries that did not (the explicit-hook entry)."""
    if "megatron.training.training" in sys.modules:
        install(args)
    rank0 = torch.distributed.get_rank() == 0
    mine = _candidates(args) if rank0 else []
    vec = [float(i) for i in mine] + [-1.0] * (MAX_CANDIDATES - len(mine))
    vec = [int(v) for v in intra.reduce(vec, "max")]  # rank 0's list on every rank of the cluster
    per_cluster = [vec]
    if group is not None:
        buf = torch.tensor(vec, dtype=torch.int64).view(torch.uint8)
        per_cluster = [t.view(torch.int64).tolist() for t in group.all_gather(buf, (0, 0, "resume"))]
    sets = [{i for i in v if i > 0} for v in per_cluster]
    common = set.intersection(*sets)
    agreed = max(common, default=0)
    # rank 0's answer for the whole cluster (with the canonical exchange only rank 0 has the inter-cluster group)
    agreed = int(intra.reduce([agreed if rank0 else -1], "max")[0])
    if rank0:
        moved = prepare_resume(getattr(args, "load", None), getattr(args, "save", None), agreed)
        ignored = {c: sorted(i for i in s if i > agreed) for c, s in enumerate(sets)}
        if agreed:
            log.info("DiLoCoX resume: every cluster loads iteration %d (complete per cluster: %s)", agreed,
                     {c: sorted(s) for c, s in enumerate(sets)})
        elif any(sets):
            log.warning("DiLoCoX resume: no iteration is complete on every cluster (complete per cluster: %s); "
                        "every cluster starts from scratch", {c: sorted(s) for c, s in enumerate(sets)})
        if any(ignored.values()) or moved:
            log.warning("DiLoCoX resume: ignoring newer checkpoints %s; moved aside: %s",
                        {c: v for c, v in ignored.items() if v}, moved or "nothing")
    if getattr(args, "ckpt_step", None):
        args.ckpt_step = agreed or None  # Megatron loads ckpt_step instead of the tracker's iteration
    torch.distributed.barrier()  # the tracker is right before any rank of the cluster reads it
    return agreed


# ------------------------------------------------------------------------------------------ saving
def _after_save(bound: dict):
    """Every rank returned from the save: cluster rank 0 registers the iteration as complete."""
    from megatron.training import get_args
    args = get_args()
    if bound.get("non_persistent_ckpt") or bound.get("release") or not args.save:
        return
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        record_complete(args.save, bound["iteration"])


def check_args(args):
    """Settings the registry cannot work with (call before any process group exists)."""
    from megatron_dilocox.config import DiLoCoXConfigError
    if getattr(args, "async_save", False):
        raise DiLoCoXConfigError("--async-save: not supported with --dilocox; a checkpoint counts as complete "
                                 "(crash-safe resume) only once the save has finished, so drop --async-save")
    if getattr(args, "non_persistent_save_interval", None):
        raise DiLoCoXConfigError("--non-persistent-save-interval: not supported with --dilocox; Megatron would "
                                 "load such a checkpoint on its own, and clusters could resume from different "
                                 "iterations")
    dp = getattr(args, "data_parallel_size", None) or 1
    if getattr(args, "ckpt_format", None) == "torch" and dp > 1 and (getattr(args, "save", None)
                                                                      or getattr(args, "load", None)):
        raise DiLoCoXConfigError(
            f"--ckpt-format torch: not supported with --dilocox and data parallelism (DP = {dp}); Megatron writes "
            "the optimizer state, where each rank's DiLoCoX state rides, from DP rank 0 only and every DP rank "
            "loads that one, so the other ranks would resume with rank 0's DiLoCoX state; use --ckpt-format "
            "torch_dist (one DiLoCoX state object per rank)")


def install(args):
    """Wrap ``megatron.training.training.save_checkpoint`` (what ``save_checkpoint_and_time`` calls). Idempotent."""
    check_args(args)
    import megatron.training.training as training
    if getattr(training.save_checkpoint, "_dilocox_registry", False):
        return
    original = training.save_checkpoint
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(*a, **kw):
        result = original(*a, **kw)
        _after_save(signature.bind(*a, **kw).arguments)
        return result

    save_checkpoint._dilocox_registry = True
    training.save_checkpoint = save_checkpoint
