"""Crash-safe checkpoints and one resume iteration for every cluster (Megatron glue).

Why. Megatron saves ``iter_XXXXXXX/`` and then rewrites the tracker ``latest_checkpointed_iteration.txt`` with a
plain ``open('w')``. A SIGKILL during a save leaves a half-written ``iter_`` directory (a later save at that
iteration writes into the leftovers) or an empty tracker (``load_checkpoint`` then ``sys.exit()``s). And every
cluster checkpoints on its own: a kill during one cluster's save leaves the clusters with different latest
checkpoints, while DiLoCoX must restart every cluster from the same iteration (same round, anchor, outer momentum,
error feedback, warm start).

What.
- After every persistent save, once every rank of the cluster has returned from it (a barrier on the cluster's
  world), cluster rank 0 adds the iteration and its place in the run (the round, the steps into the next one)
  to ``dilocox_checkpoints.json`` in the save directory, written atomically (tmp + fsync + ``os.replace``). Only
  registered iterations are complete. ``--async-save`` is refused
  (the registry needs the save finished when ``save_checkpoint`` returns), and so are non-persistent checkpoints
  (Megatron would load them by itself, bypassing the agreement below).
- ``--ckpt-format torch`` with DP > 1 is refused: Megatron's legacy format saves the optimizer state dict (and so
  the DiLoCoX state riding in it) from DP rank 0 only, and every DP rank loads that file; each DP rank's DiLoCoX
  state differs (its own shards, or its round-robin share of the replica). ``torch_dist`` keeps one per rank.
- At start-up, before Megatron loads (``agree_on_resume_iteration``, from ``DiLoCoXOptimizer.__init__``), cluster
  rank 0 reads its complete checkpoints (those whose directory still exists); the cluster's ranks take rank 0's
  list (all-reduce), the clusters exchange theirs (all-gather over the inter-cluster group) and agree on the
  newest *place in the run* complete on every cluster, then each loads its own iteration for it. The place is
  the round: with per-site H a site's iteration is its own count (a fast site's iteration 60 is a later round
  than a slow site's), and any two checkpoints taken in the same round hold the same global state (φ, momentum,
  the round in flight finished), each with its own steps into the next round. In lockstep rounds every site runs
  the same steps, so the place is the round and the iteration (the same on every site), which keeps the
  continuation bitwise. Rank 0 rewrites the tracker to its iteration atomically (repairing a truncated
  one), renames every newer ``iter_`` directory aside (``iter_0000012.dilocox-superseded-0``; nothing is
  deleted) and drops it from the registry; a barrier; then Megatron loads exactly that iteration. Nothing common:
  every cluster starts from scratch (the tracker is renamed aside too), with a warning naming what is ignored. A
  checkpoint without its round (written without this module, or before rounds were registered) counts by its
  iteration.

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
from typing import Callable, Optional

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


def _registry(ckpt_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(ckpt_dir, REGISTRY)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _registered(ckpt_dir: str):
    reg = _registry(ckpt_dir)
    return None if reg is None else sorted({int(i) for i in reg["complete"]})


def places(ckpt_dir: str) -> dict[int, tuple[int, int]]:
    """{iteration: (round, steps into the next round)} of the registered checkpoints that recorded it."""
    reg = _registry(ckpt_dir) or {}
    return {int(i): (int(p[0]), int(p[1])) for i, p in reg.get("places", {}).items()}


def _write_registry(ckpt_dir: str, done, place: dict):
    place = {str(i): list(place[i]) for i in sorted(done) if i in place}
    _atomic_write(os.path.join(ckpt_dir, REGISTRY), json.dumps({"complete": sorted(done), "places": place}) + "\n")


def complete_iterations(ckpt_dir) -> list[int]:
    """Iterations of ``ckpt_dir`` whose save completed on every rank and whose directory still exists."""
    present = iter_dirs(ckpt_dir)
    done = _registered(ckpt_dir) if present else []
    if done is None:  # not written through this module: trust a valid tracker
        done = [t] if (t := read_tracker(ckpt_dir)) is not None else []
    return [i for i in done if i in present]


def record_complete(ckpt_dir: str, iteration: int, place: Optional[tuple[int, int]] = None):
    """Add ``iteration`` (at ``place``: round, steps into the next) to the registry (atomically), keeping only
    iterations whose directory exists."""
    present = iter_dirs(ckpt_dir)
    done = {i for i in (_registered(ckpt_dir) or []) if i in present} | {int(iteration)}
    known = places(ckpt_dir)
    if place is not None:
        known[int(iteration)] = tuple(place)
    _write_registry(ckpt_dir, done, known)


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
            _write_registry(save_dir, [i for i in _registered(save_dir) if i <= iteration], places(save_dir))
    return moved


# ------------------------------------------------------------------------------------------ agreement
PAD = -(1 << 62)  # an empty slot in a cluster's list of candidates


def _candidates(args, per_site_h: bool) -> list[tuple[int, int, int]]:
    """This cluster's complete checkpoints that Megatron may load (newest MAX_CANDIDATES), as (place, iteration):
    the place is (round, 0) with per-site H, (round, iteration) in lockstep rounds (where every site's iteration is
    the same point of the run: a round dropped under the stop policy leaves the round count where an earlier
    checkpoint had it), (-1, iteration) for a checkpoint that did not record its round."""
    load = getattr(args, "load", None)
    if not load:
        return []
    done = complete_iterations(load)
    if getattr(args, "ckpt_step", None):
        done = [i for i in done if i == args.ckpt_step]
    known = places(load)
    out = []
    for i in done[-MAX_CANDIDATES:]:
        if i in known:
            out.append((known[i][0], 0 if per_site_h else i, i))
        else:
            out.append((-1, i, i))
    return out


def agree_on_resume_iteration(cfg, args, group, intra) -> int:
    """The newest place in the run complete on every cluster; Megatron is made to load this cluster's iteration
    for it (see module docstring).

    ``group``: the inter-cluster ``Collective`` (None with one cluster); ``intra``: this cluster's
    ``IntraCluster``. Every rank of every cluster must call it (collectives). Returns the iteration (0: none).
    Installs the save wrapper too, for entries that did not (the explicit-hook entry)."""
    if "megatron.training.training" in sys.modules:
        install(args)
    rank0 = torch.distributed.get_rank() == 0
    mine = _candidates(args, bool(getattr(cfg, "per_site_h", False))) if rank0 else []
    vec = [float(v) for c in mine for v in c] + [float(PAD)] * (3 * (MAX_CANDIDATES - len(mine)))
    vec = [int(v) for v in intra.reduce(vec, "max")]  # rank 0's list on every rank of the cluster
    per_cluster = [vec]
    if group is not None:
        buf = torch.tensor(vec, dtype=torch.int64).view(torch.uint8)
        per_cluster = [t.view(torch.int64).tolist() for t in group.all_gather(buf, (0, 0, "resume"))]
    # per cluster: {place: its newest iteration there}
    offers = [{} for _ in per_cluster]
    for offer, v in zip(offers, per_cluster):
        for r, offset, it in zip(v[0::3], v[1::3], v[2::3]):
            if it > 0 and r != PAD:
                offer[(r, offset)] = max(it, offer.get((r, offset), 0))
    common = set.intersection(*(set(o) for o in offers))
    place = max(common, default=None)
    me = group.rank if group is not None else 0
    agreed = offers[me][place] if place is not None else 0
    # rank 0's answer for the whole cluster (with the canonical exchange only rank 0 has the inter-cluster group)
    agreed = int(intra.reduce([agreed if rank0 else -1], "max")[0])
    if rank0:
        moved = prepare_resume(getattr(args, "load", None), getattr(args, "save", None), agreed)
        listing = {c: {_place_text(p): i for p, i in sorted(o.items())} for c, o in enumerate(offers)}
        if agreed:
            log.info("DiLoCoX resume: every cluster resumes at %s; this cluster loads iteration %d (complete per "
                     "cluster, place: iteration: %s)", _place_text(place), agreed, listing)
        elif any(offers):
            log.warning("DiLoCoX resume: no place in the run is complete on every cluster (complete per cluster, "
                        "place: iteration: %s); every cluster starts from scratch", listing)
        if moved:
            log.warning("DiLoCoX resume: newer checkpoints of this cluster moved aside: %s", moved)
    if getattr(args, "ckpt_step", None):
        args.ckpt_step = agreed or None  # Megatron loads ckpt_step instead of the tracker's iteration
    torch.distributed.barrier()  # the tracker is right before any rank of the cluster reads it
    return agreed


def _place_text(place) -> str:
    return f"iteration {place[1]}" if place[0] < 0 else f"round {place[0]}"


# ------------------------------------------------------------------------------------------ saving
_position: list[Callable] = []  # the run's place now (round, steps into the next), set by the seam (``track``)


def track(position: Callable[[], Optional[tuple[int, int]]]):
    """Register where a checkpoint saved now sits in the run (the seam: its sync's round and steps)."""
    _position[:] = [position]


def _after_save(bound: dict):
    """Every rank returned from the save: cluster rank 0 registers the iteration, at its place, as complete."""
    from megatron.training import get_args
    args = get_args()
    if bound.get("non_persistent_ckpt") or bound.get("release") or not args.save:
        return
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        record_complete(args.save, bound["iteration"], _position[0]() if _position else None)


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
    if getattr(args, "ckpt_format", None) == "torch" and getattr(args, "use_layer_wise_distributed_optimizer", False) \
            and (getattr(args, "save", None) or getattr(args, "load", None)):
        raise DiLoCoXConfigError(
            f"--ckpt-format torch: not supported with --dilocox and --optimizer {args.optimizer} "
            "--use-distributed-optimizer; Megatron saves and loads that (layer-wise) optimizer's state through its "
            "own files, past the DiLoCoX state; use --ckpt-format torch_dist")


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
