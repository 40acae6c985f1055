"""DiLoCoX for a plain PyTorch training loop: wrap any ``torch.optim`` optimizer.

    cfg = DiLoCoXConfig(num_clusters=2, cluster_id=k, rendezvous="host:29400", h=50)   # $DILOCOX_SECRET
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DiLoCoX(model, inner, cfg, train_iters=len(data)) as dl:  # joins; θ ← the global model φ
        for x, y in data:
            loss_fn(model(x), y).backward()
            inner.step()                            # inner step; every H steps the DiLoCoX round runs
            inner.zero_grad()
        with dl.global_model():                     # φ in the model for evaluation, θ restored after
            evaluate(model)
    # leaving the block applies the round in flight: every cluster ends with the same model

A round that stops the run (a lost peer under ``on_peer_failure="stop"``, a payload whose tag does not verify)
makes the next ``inner.step()`` raise ``RunStopped`` naming the round and the reason, before it changes anything
(and so does leaving the block, if the loop ended first): a script that does not catch it exits non-zero, as
the Megatron entry does, so a scheduler sees the failure. Training never goes on silently as local training.

As in torchft's ``DiLoCo``, the round is a post-hook on the inner optimizer's ``step`` (nothing else in the
loop changes); the Megatron seam (``glue/seam.py``) drives the same ``DiLoCoXSync`` hook after Megatron's
own optimizer step. Each process syncs the parameters it passes in, with the process of the same rank
(``torch.distributed`` rank inside its cluster, 0 without one) in every other cluster: give each process
the parameters it owns (one process per cluster, or a model-parallel shard per rank). The cluster that is
``cluster_id`` 0 on rank 0 hosts the rendezvous store unless ``host_store`` says otherwise.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional, Union

import torch

from megatron_dilocox.compression.collective import Collective
from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.metrics import MetricsWriter
from megatron_dilocox.outer.cluster import IntraCluster, SingleRank, TorchDistCluster
from megatron_dilocox.outer.auto import make_sync
from megatron_dilocox.outer.sync import DiLoCoXSync, RunStopped


def _params(source) -> list:
    if isinstance(source, torch.nn.Module):
        return [p for p in source.parameters() if p.requires_grad]
    return list(source)


class DiLoCoX:
    """Context manager: inner optimizer + DiLoCoX rounds (see the module docstring)."""

    def __init__(self, model: Union[torch.nn.Module, Iterable[torch.Tensor]], inner: torch.optim.Optimizer,
                 config: DiLoCoXConfig, group: Optional[Collective] = None, intra: Optional[IntraCluster] = None,
                 host_store: Optional[bool] = None, train_iters: Optional[int] = None, tokens_per_step: float = 1.0):
        self.config = config.validate()
        self.inner = inner
        self.params = _params(model)
        owned = {id(p) for g in inner.param_groups for p in g["params"]}
        missing = [i for i, p in enumerate(self.params) if id(p) not in owned]
        if missing:
            raise ValueError(f"DiLoCoX: parameters {missing[:5]} are not stepped by the inner optimizer; pass the "
                             f"parameters the optimizer owns (or a model whose trainable parameters it owns)")
        self._group, self._intra, self._host_store = group, intra, host_store
        self.train_iters = train_iters  # inner steps in the run, if known: the default outer-lr warm-up is a fifth
        # what one inner step trains on (e.g. batch x sequence length): each round's weight in the average is its
        # steps' sum; ``step(tokens=...)``-style variation goes through ``dl.sync.after_inner_step(tokens=...)``
        self.tokens_per_step = float(tokens_per_step)
        self.sync: Optional[DiLoCoXSync] = None
        self._hooks: list = []

    # ---------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> "DiLoCoX":
        dist = torch.distributed
        in_world = dist.is_available() and dist.is_initialized()
        local_rank = dist.get_rank() if in_world else 0
        intra = self._intra or (TorchDistCluster() if in_world else SingleRank())
        group = self._group
        if group is None and self.config.num_clusters > 1:
            from megatron_dilocox.net.topology import PLATFORM, InterClusterGroup, connect_store, platform_of
            host = self._host_store if self._host_store is not None else (self.config.cluster_id == 0 and local_rank == 0)
            world = dist.get_world_size() if in_world else 1
            group = InterClusterGroup(self.config, local_rank, connect_store(self.config, host),
                                      fingerprint={"shapes": [list(p.shape) for p in self.params],
                                                   PLATFORM: platform_of(self.params[0].device)}, local_world=world)
        metrics = MetricsWriter(self.config.metrics_file if intra.is_writer else None)
        self.sync = make_sync([p.data for p in self.params], self.config, group, intra, metrics,
                                train_iters=self.train_iters).start()
        self._hooks = [self.inner.register_step_pre_hook(lambda *_: self._raise_if_stopped()),
                       self.inner.register_step_post_hook(lambda *_: self.sync.after_inner_step(tokens=self.tokens_per_step))]
        return self

    def _raise_if_stopped(self):
        if self.sync.stopped:
            raise RunStopped(self.sync.stopped_round, self.sync.stopped)

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self._raise_if_stopped()  # (the loop ended right after the round that stopped the run)
                self.sync.finalize()
                self._raise_if_stopped()  # (or the final round stopped it)
        finally:
            for hook in self._hooks:
                hook.remove()
            self.sync.close()
        return False

    # ---------------------------------------------------------------------------------- views
    @property
    def rows(self) -> list:
        """Every round's metrics row so far (bytes, rank, H, compression error, hash, ...)."""
        return self.sync.rows

    @contextlib.contextmanager
    @torch.no_grad()
    def global_model(self):
        """The global model φ in the parameters for the block (evaluation); this cluster's θ after it, bitwise.
        With overlap none θ = φ right after a boundary; with the delay θ = φ + this cluster's unsynced part."""
        saved = [p.detach().clone() for p in self.params]
        try:
            for p, a in zip(self.params, self.sync.global_params()):
                p.data.copy_(a)
            yield self
        finally:
            for p, s in zip(self.params, saved):
                p.data.copy_(s)
