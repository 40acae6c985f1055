"""The seam into Megatron: DiLoCoX wraps whatever optimizer ``get_megatron_optimizer`` builds.

``install(cfg)`` patches ``megatron.training.training.get_megatron_optimizer`` so that the optimizer the
training loop receives is a ``DiLoCoXOptimizer``: ``step()`` runs Megatron's own step (inner) and, after
each successful one, the DiLoCoX hook on the fp32 main params this rank owns (``param_views``). When the
hook changed them (a round boundary) the model params are refreshed from the main params, and under the
distributed optimizer the param all-gather runs again (with ``--overlap-param-gather`` the next forward's
gather picks the new values up by itself). Everything else is delegated to the inner optimizer.

Ownership: with the distributed optimizer each DP rank syncs its own shards; with Muon's layer-wise distributed
optimizer (``--optimizer muon --use-distributed-optimizer``) the whole parameters it steps, and the layer-wise
optimizer's gather runs after a round too. Without either every DP rank
holds the full replica, so parameter views are dealt round-robin over the DP ranks (each syncs 1/DP of
them over the slow link) and broadcast inside the DP group after each round.

Evaluation measures the global model φ. ``megatron.training.training.evaluate`` is wrapped too (it runs
both the periodic ``--eval-interval`` evaluation and the final one): between round boundaries each
cluster's params hold θ (with the one-step delay θ = φ − δ: the global model plus this cluster's unsynced
progress; with overlap none θ drifts from φ between boundaries as well), and what a run should report is the
model the clusters share. So around each evaluation ``DiLoCoXOptimizer.global_model()`` saves θ (every main
param view this rank holds, on the outer-state device), copies φ (``DiLoCoXSync.global_params()``) into the
main params this rank owns, refreshes the model params (round-robin broadcast inside the DP group, main ->
model copy, forced param all-gather under the distributed optimizer), evaluates, and then restores θ
bitwise and refreshes again, so training continues exactly as without the evaluation
(``tests/test_megatron_dilocox.py::test_evaluation_measures_the_global_model``). Where θ == φ (overlap none
at a boundary, after the final flush) the swap changes nothing.

Checkpoints: the DiLoCoX state rides inside the optimizer's state dict under ``"dilocox"`` (one object
per rank in ``torch_dist`` checkpoints, a plain entry in ``torch`` ones).
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
from typing import Optional

import torch

from megatron_dilocox.compression.layout import split_layout
from megatron_dilocox.config import PARALLEL_LAYOUT_ARGS, DiLoCoXConfig, DiLoCoXConfigError
from megatron_dilocox.glue import checkpoints, per_site, run_clock
from megatron_dilocox.glue.per_site import run_iters
from megatron_dilocox.glue.param_views import (inner_optimizers, layer_wise_optimizers, leaf_optimizers,
                                               shards_over_dp, tagged_param_views)
from megatron_dilocox.metrics import MetricsWriter
from megatron_dilocox.outer.cluster import TorchDistCluster
from megatron_dilocox.outer.auto import make_sync
from megatron_dilocox.outer.streaming import split_fragments
from megatron_dilocox.net.topology import PLATFORM, InterClusterGroup, connect_store, platform_of

log = logging.getLogger("megatron_dilocox")
STATE_KEY = "dilocox"


def fingerprint(cfg: DiLoCoXConfig, args, views, canonical=None) -> dict:
    """What every cluster must share, compared at rendezvous (differences are named). With the canonical exchange
    (``canonical``: its Layout) the parallel layout may differ: the model is compared instead, by its canonical
    units (every global tensor's name, layer and shape; a padded vocabulary shows there too)."""
    import megatron.core

    import megatron_dilocox
    keys = (*PARALLEL_LAYOUT_ARGS, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "swiglu", "normalization", "untie_embeddings_and_output_weights", "add_bias_linear", "num_experts", "moe_ffn_hidden_size",
            "moe_router_topk", "moe_layer_freq", "seq_length", "padded_vocab_size", "seed", "params_dtype",
            "optimizer")
    fp = {k: str(getattr(args, k, None)) for k in keys if canonical is None or k not in PARALLEL_LAYOUT_ARGS}
    # outer_lr_warmup_iters: the default follows each cluster's run length, and the outer step, which every
    # cluster takes itself, must not differ. megatron-core's version without its local part: it appends the
    # short hash of whatever git checkout holds the installed package (a venv inside a repository gets that
    # repository's HEAD), which says nothing about Megatron's code.
    fp.update(dilocox=cfg.agreement_dict(), outer_lr_warmup_iters=cfg.resolved_outer_lr_warmup_iters(run_iters(args)),
              outer_momentum=cfg.resolved_outer_momentum,  # (as resolved: a site of an older release resolves 0.3)
              megatron_core=megatron.core.__version__.split("+")[0], megatron_dilocox=megatron_dilocox.__version__)
    fp[PLATFORM] = platform_of(views[0].device if views else torch.device("cpu"))  # (logged, not compared)
    if canonical is None:
        fp["shapes"] = [list(v.shape) for v in views]
    else:
        fp["canonical_units"] = f"{len(canonical.units)} tensors, {canonical.numel} values, sha {canonical.digest()}"
    return fp


class DiLoCoXOptimizer:
    """Megatron optimizer wrapper: inner step, then the DiLoCoX round hook (see module docstring)."""

    def __init__(self, inner, cfg: DiLoCoXConfig, args, model_chunks=None):
        from megatron.core import mpu
        self.inner = inner
        self.cfg = cfg
        self.train_iters = getattr(args, "train_iters", None)
        self.marks_done: dict = {}  # per-site H: the evaluate/save/exit marks of the run taken so far (run_clock.py)
        self.scheduler = None  # Megatron's LR scheduler (set by setup_model_and_optimizer below)
        # each round's weight in the average (--dilocox-token-weights): the samples x tokens this site trains per step
        self.tokens_per_step = float(args.global_batch_size * args.seq_length)
        self.leaves = leaf_optimizers(inner)
        self.layer_wise = layer_wise_optimizers(inner)
        self._dp_owner: Optional[list[tuple]] = None  # (group, global rank of the owner) per view
        if cfg.exchange_layout == "canonical":
            self._start_canonical(cfg, args, model_chunks)
            return
        tagged = tagged_param_views(inner)
        if not shards_over_dp(inner) and mpu.get_data_parallel_world_size() > 1:
            self._dp_owner = _deal_over_replicas([kind for _, kind in tagged])
            self._all_views = [v for v, _ in tagged]
            me = torch.distributed.get_rank()
            tagged = [t for t, (_, owner) in zip(tagged, self._dp_owner) if owner == me]
        views, self.view_kinds = [v for v, _ in tagged], [k for _, k in tagged]
        split_layout([v.shape for v in views], cfg)  # a rank the matrices cannot hold fails here, not after the rendezvous
        split_fragments([v.shape for v in views], cfg.fragments)  # (as must too few rows for the fragments)
        rank = torch.distributed.get_rank()
        store = connect_store(cfg, host_store=(cfg.cluster_id == 0 and rank == 0)) if cfg.num_clusters > 1 else None
        group = (InterClusterGroup(cfg, rank, store, fingerprint(cfg, args, views),
                                   local_world=torch.distributed.get_world_size()) if store is not None else None)
        intra = TorchDistCluster()
        if group is None or not group.joining:  # a rejoining cluster takes the members' state instead
            checkpoints.agree_on_resume_iteration(cfg, args, group, intra)  # before Megatron loads
        metrics = MetricsWriter(cfg.metrics_file if intra.is_writer else None)
        self.sync = make_sync(views, cfg, group, intra, metrics, train_iters=run_iters(args))
        per_site.plan_tokens(self, args)
        with torch.no_grad():
            self.sync.start()  # every cluster starts from cluster 0's model
            self._refresh_model_params()
        layout = self.layout(rank)
        log.info("DiLoCoX on: cluster %d of %d, %d tensors (%d low-rank groups) on this rank, H=%d, overlap=%s",
                 cfg.cluster_id, cfg.num_clusters, len(views), len(layout["lowrank_groups"]), cfg.h, cfg.overlap)
        log.info("DiLoCoX layout %s", json.dumps(layout))

    def _start_canonical(self, cfg: DiLoCoXConfig, args, model_chunks):
        """Sites of different layouts (canonical.py): the canonical model in lanes over the site's ranks."""
        from megatron_dilocox.glue import canonical
        canonical.check_supported(cfg, args)
        layout = canonical.build_layout(model_chunks, self.inner)
        rank = torch.distributed.get_rank()
        site = canonical.CanonicalSite(layout, cfg, fingerprint(cfg, args, layout.views, layout))
        intra = TorchDistCluster()
        joining = intra.reduce([float(site.joining)], "max")[0]  # (the lanes' groups know)
        if not joining:  # a rejoining site takes the running sites' state instead
            checkpoints.agree_on_resume_iteration(cfg, args, site.lead_group, intra)  # (rank 0 decides for the site)
        self.view_kinds = ["dense"] * len(layout.views)
        site.make_syncs(cfg.metrics_file if rank == 0 else None, run_iters(args))
        self.sync = site
        per_site.plan_tokens(self, args)
        with torch.no_grad():
            self.sync.start()  # every site starts from cluster 0's model
            self._refresh_model_params()
        log.info("DiLoCoX on: cluster %d of %d, canonical exchange: %d global tensors, %d values (%d held here), "
                 "%d lanes (%s here), H=%d, overlap=%s", cfg.cluster_id, cfg.num_clusters, len(layout.units),
                 layout.numel, layout.runs.numel(), cfg.lanes, site.owned, cfg.h, cfg.overlap)
        log.info("DiLoCoX layout %s", json.dumps(self.sync.layout_summary(rank)))

    def layout(self, rank: int) -> dict:
        """What this rank syncs (elements by kind, low-rank groups, elements sent whole) and the codec's
        closed-form bytes per round: tests compare these with parameter counts and the bytes really sent."""
        codecs = [f.codec for f in getattr(self.sync, "fragments", [self.sync])]  # (one per fragment)
        numel = {kind: sum(v.numel() for v, k in zip(self.sync.params, self.view_kinds) if k == kind)
                 for kind in ("dense", "expert", "router")}
        return {"rank": rank, "numel": numel,
                "lowrank_groups": [[g.rows, g.cols, len(g.members)] for c in codecs for g in c.groups],
                "whole_numel": sum(c.numels[i] for c in codecs for i in c.whole),
                "lowrank_rank": codecs[0].rank if any(c.groups for c in codecs) else 0,
                "round_bytes": sum(c.round_bytes(c.rank, self.cfg.num_clusters) for c in codecs),
                "inner": inner_optimizers(self.inner)}

    # ------------------------------------------------------------------------------------ training
    def step(self):
        if self.train_iters is None:  # --train-samples: Megatron derives train_iters after building the optimizer
            from megatron.training import get_args
            self.train_iters = get_args().train_iters
        run_clock.before_step(self)
        success, grad_norm, num_zeros = self.inner.step()
        seen = len(self.sync.rows)
        if success and self.sync.after_inner_step(tokens=self.tokens_per_step):
            with torch.no_grad():
                self._refresh_model_params()
        if success:
            run_clock.after_step(self)  # the run's decisions at this step: end, LR, evaluate, save, exit
        if success and self.sync.iteration == self.train_iters:
            self.finalize()  # before Megatron's final evaluation and checkpoint
        if self.sync.stopped:
            from megatron.training import get_args
            get_args().exit_interval = 1  # Megatron saves a checkpoint (with --save) and exits this iteration
        for row in self.sync.rows[seen:]:
            log_row_to_megatron_writers(row)
        return success, grad_norm, num_zeros

    def _refresh_model_params(self, broadcast: bool = True, force_gather: bool = False):
        """Model params <- main params (and, round-robin, the owners' views to every DP rank; with
        ``broadcast=False`` every rank already holds them). ``force_gather``: all-gather the distributed
        optimizer's params even with --overlap-param-gather (evaluation runs with the pre-hooks off)."""
        if broadcast and self._dp_owner is not None:
            for view, (group, owner) in zip(self._all_views, self._dp_owner):
                torch.distributed.broadcast(view, owner, group=group)
        chunks = []  # every leaf first copies main -> model; then each model chunk gathers once
        for leaf in self.leaves:
            if getattr(leaf, "is_stub_optimizer", False):
                continue
            distributed = hasattr(leaf, "shard_fp32_from_float16_groups")
            if distributed or hasattr(leaf, "fp32_from_float16_groups"):  # main params are copies: copy back
                leaf._copy_main_params_to_model_params()
            if distributed and (force_gather or not leaf.ddp_config.overlap_param_gather):
                chunks += [c for c in leaf.model_chunks if not any(c is d for d in chunks)]
        for lw in self.layer_wise:  # Muon's layer-wise optimizer: each DP rank's own parameters to the others
            if lw.dp_cp_params_list is None and lw.expt_dp_params_list is None:
                continue  # DP 1: nothing to gather
            if lw.use_buffer_param_sync and (force_gather or not lw.overlap_param_gather):
                chunks += [c for c in lw.model_chunks if not any(c is d for d in chunks)]
            elif not lw.use_buffer_param_sync:  # (--no-use-layer-wise-param-layout)
                lw.allgather_params()
        for chunk in chunks:  # dense and expert buffers alike (DDP's bucket groups of both)
            chunk.start_param_sync(force_sync=True)

    @contextlib.contextmanager
    def global_model(self):
        """Inside: the model holds φ (the global model); after: θ again, bitwise (see module docstring)."""
        views = self._all_views if self._dp_owner is not None else self.sync.params
        with torch.no_grad():
            saved = [v.detach().to(self.sync.outer_device, copy=True) for v in views]  # θ
            for p, phi in zip(self.sync.params, self.sync.global_params()):
                p.copy_(phi)
            self._refresh_model_params(force_gather=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for v, theta in zip(views, saved):
                    v.copy_(theta)
                self._refresh_model_params(broadcast=False, force_gather=True)

    def adopt_running_position(self, args, scheduler):
        """(Rejoined mid-run) after Megatron's set-up and load: θ ← the members' global model, and the
        iteration, consumed samples and LR schedule moved to where the running clusters are."""
        if getattr(args, "rampup_batch_size", None):
            raise RuntimeError("DiLoCoX rejoin does not support --rampup-batch-size (consumed samples are "
                               "derived as iteration x --global-batch-size)")
        with torch.no_grad():
            for p, a in zip(self.sync.params, self.sync.anchor):
                p.copy_(a.to(p.device))
            self._refresh_model_params()
        args.iteration = self.sync.iteration
        args.consumed_train_samples = self.sync.iteration * args.global_batch_size
        run_clock.take_marks_passed(self)  # (the members' clock came with the hand-over)
        if scheduler is not None:
            scheduler.num_steps = args.consumed_train_samples
            scheduler.step(0)
        log.warning("DiLoCoX: this cluster continues from iteration %d with the running clusters", args.iteration)

    def finalize(self):
        """End of training: apply the in-flight round so every cluster holds the same global model.

        Progress since the last round boundary is not synced: make --train-iters a multiple of H (with
        --dilocox-fragments, whose rounds end at different steps, each fragment's partial round is sent)."""
        with torch.no_grad():
            self.sync.finalize()
            self._refresh_model_params()
        # done with the other clusters: stop the heartbeat now, not at exit, so that a cluster still evaluating
        # when cluster 0 (the store's host) exits does not beat into a closed socket (torch logs a stack each try)
        self.sync.close()

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self):
        state = self.inner.state_dict()
        state[STATE_KEY] = self.sync.state_dict()
        return state

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        state = self.inner.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, **kwargs)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        data = None if is_loading else self.sync.state_dict()
        if self.cfg.exchange_layout == "canonical":  # one object per lane, saved by its owner: a site may resume
            # with another process count (each rank loads the lanes it then owns)
            lanes = self.cfg.lanes
            state[STATE_KEY] = {k: ShardedObject(f"optimizer.{STATE_KEY}.canonical", None if data is None else data[k],
                                                 (lanes,), (k,), replica_id=0) for k in self.sync.owned}
        else:
            state[STATE_KEY] = ShardedObject(f"optimizer.{STATE_KEY}.state", data, (world,), (rank,), replica_id=0)
        return state

    def load_state_dict(self, state_dict):
        ours = state_dict.pop(STATE_KEY, None)
        self.inner.load_state_dict(state_dict)
        if self.sync.joined_midrun:
            log.warning("DiLoCoX: rejoined mid-run; the checkpoint's DiLoCoX state and model are superseded by "
                        "the running clusters' (its inner optimizer state is kept)")
            return
        if self.cfg.exchange_layout == "canonical":  # lane -> state, for the lanes this rank owns
            ours = {k: getattr(v, "data", v) for k, v in (ours or {}).items()}
            complete = float(all(ours.get(k) is not None for k in self.sync.owned))
            some = float(any(v is not None for v in ours.values()))
            complete, some = TorchDistCluster().reduce([complete, some], "sum")
            if complete < torch.distributed.get_world_size():
                if some:  # (on every rank alike) lanes saved, not these: another --dilocox-lanes
                    raise DiLoCoXConfigError(f"the checkpoint's DiLoCoX state has no object for some of the "
                                             f"{self.cfg.lanes} lanes this site owns: it was saved with another "
                                             f"--dilocox-lanes; resume with the value it was saved with")
                ours = None  # (on every rank of the site alike: start() is a collective)
        if ours is None:
            log.warning("DiLoCoX: the checkpoint has no DiLoCoX state; starting rounds afresh from its model")
            with torch.no_grad():
                self.sync.start()
            return
        if hasattr(ours, "data"):  # a ShardedObject that was not resolved
            ours = ours.data
        self.sync.load_state_dict(ours)
        run_clock.take_marks_passed(self)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _deal_over_replicas(kinds: list[str]) -> list[tuple]:
    """(group, owner's global rank) per view when every DP rank holds a full replica: dense (and router) views
    are dealt round-robin over the data-parallel group, expert views over the expert-data-parallel group (the
    ranks holding the same experts), so each replica group sends its views once and broadcasts them inside."""
    from megatron.core import mpu
    groups = {"dense": mpu.get_data_parallel_group(), "router": mpu.get_data_parallel_group(),
              "expert": mpu.get_expert_data_parallel_group()}
    seen = {"dense": 0, "expert": 0}
    owners = []
    for kind in kinds:
        group, count = groups[kind], "expert" if kind == "expert" else "dense"
        owners.append((group, torch.distributed.get_global_rank(group, seen[count] % group.size())))
        seen[count] += 1
    return owners


NUMERIC_ROW_KEYS = ("H", "lowrank_rank", "quant_bits", "sparse_k", "bytes_sent", "bytes_received",
                    "bytes_dense_fp32", "comm_seconds", "exposed_comm_seconds", "compression_rel_error", "pseudo_grad_norm")


def log_row_to_megatron_writers(row: dict):
    """Per-round metrics to Megatron's tensorboard and wandb writers (they exist on the last rank only)."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    tb, wb = get_tensorboard_writer(), get_wandb_writer()
    scalars = {f"dilocox/{k}": float(row[k]) for k in NUMERIC_ROW_KEYS}
    scalars["dilocox/round"] = float(row["round"])
    if tb is not None:
        for k, v in scalars.items():
            tb.add_scalar(k, v, row["iteration"])
    if wb is not None:
        wb.log(scalars, row["iteration"])


_installed: dict = {}


def install(cfg: DiLoCoXConfig, args, wrap_optimizer: bool = True):
    """Wrap the optimizer Megatron builds from now on (idempotent); ``wrap_optimizer=False``: a Megatron patched
    with the explicit hook wraps it itself (glue/explicit.py), and everything else here is installed alike."""
    import megatron.training.training as training
    if "original" not in _installed:
        _installed["original"] = training.get_megatron_optimizer

    def get_megatron_optimizer(*a, **kw):
        chunks = a[1] if len(a) > 1 else kw.get("model_chunks")
        return wrapped(_installed["original"](*a, **kw), args, model_chunks=chunks)

    if "setup" not in _installed:
        _installed["setup"] = training.setup_model_and_optimizer

    def setup_model_and_optimizer(*a, **kw):
        model, optimizer, scheduler = _installed["setup"](*a, **kw)
        if isinstance(optimizer, DiLoCoXOptimizer):
            optimizer.scheduler = scheduler
        if isinstance(optimizer, DiLoCoXOptimizer) and optimizer.sync.joined_midrun:
            optimizer.adopt_running_position(args, scheduler)
        return model, optimizer, scheduler

    if "evaluate" not in _installed:
        _installed["evaluate"] = training.evaluate

    def evaluate(*a, **kw):
        optimizer = _installed.get("optimizer")
        if not isinstance(optimizer, DiLoCoXOptimizer) or not optimizer.sync.anchor:
            return _installed["evaluate"](*a, **kw)
        with optimizer.global_model():  # evaluate φ, not this cluster's θ; θ restored bitwise after
            return _installed["evaluate"](*a, **kw)

    checkpoints.install(args)
    checkpoints.track(lambda: optimizer.sync.position() if (optimizer := _installed.get("optimizer")) else None)
    if wrap_optimizer:
        training.get_megatron_optimizer = get_megatron_optimizer
    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.evaluate = evaluate
    _installed["cfg"] = cfg
    return get_megatron_optimizer


def wrapped(inner, args, model_chunks=None) -> "DiLoCoXOptimizer":
    """``inner`` (Megatron's optimizer) wrapped with the installed config: the one optimizer of this process."""
    optimizer = DiLoCoXOptimizer(inner, _installed["cfg"], args, model_chunks=model_chunks)
    _installed["optimizer"] = optimizer
    return optimizer


def installed_config() -> Optional[DiLoCoXConfig]:
    """The config an entry installed the DiLoCoX hooks with in this process (install_from_args), or None."""
    return _installed.get("cfg")


def current_optimizer() -> Optional[DiLoCoXOptimizer]:
    return _installed.get("optimizer")


def install_from_args(args, wrap_optimizer: bool = True):
    """``install_hooks`` for the entry: validate the --dilocox-* flags, then, if enabled, decide the rounds
    (per-site or lockstep), plan this site's run and install the run's clock and the hooks (``install``)."""
    from megatron_dilocox.arguments import config_from_args
    cfg = config_from_args(args)  # raises DiLoCoXConfigError before any process group exists
    if cfg is None:
        return None
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[dilocox] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    cfg.per_site_h, why = per_site.resolve(cfg, args)
    log.info("DiLoCoX rounds: %s", why)
    args.dilocox_config = cfg.public_dict()  # shows in Megatron's argument dump / wandb config, no secret
    if cfg.per_site_h:
        per_site.plan(args)
    run_clock.install(args, cfg.num_clusters)
    install(cfg, args, wrap_optimizer=wrap_optimizer)
    return cfg
