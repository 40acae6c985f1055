"""Sites with different parallel layouts: the round in a canonical layout (--dilocox-exchange-layout canonical).

With equal layouts local rank k of every site holds the same parameter slices, and the ranks exchange them pairwise
(``seam.py``). When the sites' TP/PP/DP differ no such pairing exists, so the pseudo-gradient travels in a layout
that no site's parallelism decides: every global tensor by its name in Megatron's own sharding metadata
(``sharded_state_dict``: each local shard's key, global shape and offsets, the fused SwiGLU fc1 split into its two
halves by Megatron's factory, the tied output layer marked as a replica of the embedding; layers stacked on a
leading axis that is cut off here, so a unit is one layer's matrix). Units are sorted by (key, layer), so every
site derives the same list, and the codec compresses these global matrices: every site encodes the same ones.

Inside a site, rank 0 is the exchange rank (one lane): at a step that changes θ it gathers θ from the ranks that
own each element (the first owner of a replicated element, e.g. a DP replica or the tied output layer), runs the
unmodified ``DiLoCoXSync`` on the canonical tensors with the other sites' rank 0, and scatters the new θ to every
holder. Which steps change θ (a boundary or a landing) rank 0 knows before it runs the hook and tells the site's
ranks each step (one small broadcast). The rows' hash is the hash of the whole global model in canonical layout,
so it is comparable across sites whatever their layouts.

Cost and limits: rank 0 keeps the outer state of the whole model (φ, momentum, round start, error feedback,
three codec slabs: ~7 fp32 copies in host memory), so this mode suits models whose copies fit one node's memory;
lanes over several exchange ranks are the way to larger models and are not built. Refused before training, each
naming its flag: --dilocox-fragments > 1 (and the slow-link switch to fragments is off) and MoE (--num-experts).
A site may rejoin a run in progress (--dilocox-on-peer-failure continue) with another layout than the one it left
with: what it is handed is canonical. Padded vocabularies that differ between sites
(--make-vocab-size-divisible-by x TP) are refused at the rendezvous, which compares the canonical units.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import logging
import os
from typing import Optional

import torch

from megatron_dilocox.config import DiLoCoXConfig, DiLoCoXConfigError
from megatron_dilocox.glue.param_views import leaf_optimizers, _owned_pairs
from megatron_dilocox.metrics import MetricsWriter
from megatron_dilocox.outer.clock import RunClock
from megatron_dilocox.outer.auto import make_sync
from megatron_dilocox.outer.cluster import SingleRank

log = logging.getLogger("megatron_dilocox")
DUMP_ENV = "DILOCOX_DUMP_ROUNDS"


def check_supported(cfg: DiLoCoXConfig, args):
    """Refuse, before any process group of ours, what the canonical exchange does not handle."""
    if getattr(args, "num_experts", None):
        raise DiLoCoXConfigError("--dilocox-exchange-layout canonical does not handle MoE (--num-experts) yet: give "
                                 "every site the same layout and use --dilocox-exchange-layout local")
    if cfg.fragments > 1:
        raise DiLoCoXConfigError("--dilocox-exchange-layout canonical needs --dilocox-fragments 1")


def _sharded_tensors(model_chunks) -> list:
    """Every ShardedTensor of the model chunks' sharded state dicts (factories built), in a stable order."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.utils import unwrap_model
    out = []

    def walk(x):
        if isinstance(x, ShardedTensorFactory):
            walk(x.build())
        elif isinstance(x, ShardedTensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    chunks = unwrap_model(list(model_chunks))
    for i, chunk in enumerate(chunks):
        if len(chunks) > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
        walk(chunk.sharded_state_dict())
    if len(chunks) > 1:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return out


def _piece_index(st) -> torch.Tensor:
    """Flat index inside its unit (one layer's global tensor) of every element of ``st.data``, row-major."""
    n = st.prepend_axis_num
    shape_g, offset, local = st.global_shape[n:], st.global_offset[n:], st.local_shape
    strides = [1] * len(shape_g)
    for d in range(len(shape_g) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape_g[d + 1]
    idx = torch.zeros((), dtype=torch.int64)
    for d, (o, m, s) in enumerate(zip(offset, local, strides)):
        view = [1] * len(local)
        view[d] = m
        idx = idx + ((o + torch.arange(m, dtype=torch.int64)) * s).view(view)
    return idx.expand(tuple(local)).reshape(-1)


@dataclasses.dataclass
class Layout:
    units: list  # (key, layer offsets, shape), sorted: identical on every site of the same model
    bases: list  # start of each unit in the canonical flat vector
    views: list  # this rank's fp32 main-param shards (flat), in order
    index: torch.Tensor  # canonical flat index of each element of cat(views)

    @property
    def numel(self) -> int:
        return sum(torch.Size(s).numel() for _, _, s in self.units)

    def digest(self) -> str:
        return hashlib.sha256(repr(self.units).encode()).hexdigest()[:16]


def build_layout(model_chunks, inner) -> Layout:
    """Map every fp32 main-param element this rank's optimizer steps to its canonical index (collective over the
    site: the unit lists of all pipeline stages are merged)."""
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i) for i, p in enumerate(params))
    starts = [s for s, _, _ in spans]
    pieces = []  # (param index, first element, unit, in-unit index)
    for st in _sharded_tensors(model_chunks):
        ptr = st.data.data_ptr()
        k = bisect.bisect_right(starts, ptr) - 1
        if k < 0 or not ptr < spans[k][1] or not st.data.is_contiguous():
            continue  # not a parameter of these chunks (a buffer)
        p = params[spans[k][2]]
        unit = (st.key, tuple(st.global_offset[:st.prepend_axis_num]), tuple(st.global_shape[st.prepend_axis_num:]))
        pieces.append((spans[k][2], (ptr - p.data_ptr()) // p.element_size(), unit, _piece_index(st)))
    mine = sorted({u for _, _, u, _ in pieces})
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    units = sorted({u for us in everyone for u in us})
    shapes = {}
    for key, _, shape in units:
        if shapes.setdefault(key, shape) != shape:
            raise RuntimeError(f"DiLoCoX canonical layout: {key} has layers of shapes {shapes[key]} and {shape}")
    bases, total = {}, 0
    for u in units:
        bases[u] = total
        total += torch.Size(u[2]).numel()
    element_map = {}
    for pi, first, unit, idx in pieces:
        m = element_map.setdefault(pi, torch.full((params[pi].numel(),), -1, dtype=torch.int64))
        m[first:first + idx.numel()] = idx + bases[unit]
    views, index = [], []
    by_id = {id(p): i for i, p in enumerate(params)}
    for leaf in leaf_optimizers(inner):
        if getattr(leaf, "is_stub_optimizer", False):
            continue
        for main, model_param, start, end in _owned_pairs(leaf):
            pi = by_id.get(id(model_param))
            idx = element_map.get(pi) if pi is not None else None
            if idx is None or bool((idx[start:end] < 0).any()):
                raise RuntimeError(f"DiLoCoX canonical layout: a parameter of shape {tuple(model_param.shape)} is not "
                                   f"(wholly) in Megatron's sharded state dict; use --dilocox-exchange-layout local")
            views.append(main.data.view(-1))
            index.append(idx[start:end])
    index = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)
    return Layout(units, [bases[u] for u in units], views, index)


class CanonicalSite:
    """The site's side of the canonical exchange; the interface the seam uses of a DiLoCoXSync (see module docstring)."""

    def __init__(self, layout: Layout, cfg: DiLoCoXConfig, group, metrics_file: Optional[str], train_iters):
        dist = torch.distributed
        self.layout, self.cfg = layout, cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = layout.views  # what this rank holds: θ for evaluation's save/restore
        self.outer_device = torch.device("cpu")
        self.iteration, self.stopped, self.joined_midrun = 0, None, False
        # (ranks but 0) rank 0's clock and round figures at the last change, and this rank's iteration then
        self._clock, self._site, self._site_at = RunClock(), {}, 0
        device = layout.views[0].device if layout.views else torch.device("cpu")
        self.device = device
        # who sends what: rank 0 learns every rank's indices once; each element is gathered from its first owner
        indices = [None] * self.world
        dist.gather_object(layout.index, indices if self.rank == 0 else None, dst=0)
        first = [None] * self.world
        if self.rank == 0:
            seen = torch.zeros(layout.numel, dtype=torch.bool)
            for r, idx in enumerate(indices):
                first[r] = ~seen[idx]
                seen[idx] = True
            if not bool(seen.all()):
                missing = int((~seen).sum())
                raise RuntimeError(f"DiLoCoX canonical layout: {missing} elements of the model are held by no rank")
            self.indices = indices
            self.primary_indices = [idx[f] for idx, f in zip(indices, first)]
        mask = [None]
        dist.scatter_object_list(mask, first if self.rank == 0 else None, src=0)
        self.primary = mask[0]
        sizes = [None] * self.world
        dist.all_gather_object(sizes, (int(self.primary.sum()), layout.index.numel()))
        self.send_max = max(s for s, _ in sizes)
        self.recv_max = max(n for _, n in sizes)
        self.sync = None
        if self.rank == 0:
            self.theta = torch.zeros(layout.numel, dtype=torch.float32)
            tensors = [self.theta[b:b + torch.Size(s).numel()].view(s) for b, (_, _, s) in zip(layout.bases, layout.units)]
            single = dataclasses.replace(cfg, slow_link_fragments=1)  # (fragments are refused in this mode)
            self.sync = make_sync(tensors, single, group, SingleRank(), MetricsWriter(metrics_file),
                                  train_iters=train_iters)

    # ------------------------------------------------------------------------------------ moving θ
    def _flag(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.broadcast(t, src=0)
        return t.tolist()

    @torch.no_grad()
    def _gather(self):
        """θ from the owners into rank 0's canonical vector."""
        mine = torch.cat([v.float() for v in self.layout.views])[self.primary] if self.layout.views else \
            torch.zeros(0, device=self.device)
        buf = torch.zeros(self.send_max, dtype=torch.float32, device=self.device)
        buf[:mine.numel()] = mine
        out = [torch.empty_like(buf) for _ in range(self.world)] if self.rank == 0 else None
        torch.distributed.gather(buf, out, dst=0)
        if self.rank == 0:
            for idx, vals in zip(self.primary_indices, out):
                self.theta[idx] = vals[:idx.numel()].cpu()

    @torch.no_grad()
    def _scatter(self, source: Optional[torch.Tensor] = None, into: Optional[list] = None):
        """``source`` (rank 0's canonical vector, default θ) to every holder: into ``into`` (default: the main
        params) on every rank."""
        parts = None
        if self.rank == 0:
            src = self.theta if source is None else source
            parts = []
            for idx in self.indices:
                buf = torch.zeros(self.recv_max, dtype=torch.float32, device=self.device)
                buf[:idx.numel()] = src[idx].to(self.device)
                parts.append(buf)
        buf = torch.empty(self.recv_max, dtype=torch.float32, device=self.device)
        torch.distributed.scatter(buf, parts, src=0)
        targets = self.layout.views if into is None else into
        at = 0
        for v in targets:
            v.copy_(buf[at:at + v.numel()].view_as(v))
            at += v.numel()

    # ------------------------------------------------------------------------------------ as DiLoCoXSync
    def start(self):
        """θ ← the global model: cluster 0's, or (a site restarted under --dilocox-on-peer-failure continue,
        perhaps with another layout) the running sites' state, handed to rank 0 in canonical layout."""
        self._gather()
        if self.sync is not None:
            self.sync.start()
        s = self.sync
        joined, iteration = self._flag([float(s.joined_midrun) if s else 0.0, float(s.iteration) if s else 0.0])
        self.joined_midrun, self.iteration = bool(joined), int(iteration)
        self._scatter()
        return self

    def after_inner_step(self, tokens=None) -> bool:
        self.iteration += 1
        s = self.sync
        due = 0.0
        if s is not None:  # the step changes θ: a boundary (H steps in) or a landing (τ steps in)
            n = s.steps_in_round + 1
            due = float(n >= s.h or (s.delayed and n == s.tau and (s._in_flight is not None or s._done is not None)))
        if not self._flag([due])[0]:
            if s is not None and s.after_inner_step(tokens=tokens):
                raise RuntimeError("DiLoCoX canonical exchange: the round changed θ at a step it had not announced")
            return False
        self._gather()
        if s is not None:
            before = (self.theta.clone(), self._phi()) if DUMP_ENV in os.environ else None
            s.after_inner_step(tokens=tokens)
            if before is not None:
                self._dump(*before)
        self._scatter()
        self._after_change()
        return True

    SITE_FIELDS = ("h", "steps_in_round", "token_budget", "tokens_per_step")

    def _after_change(self):
        """(Every rank, after a step that changed θ) what rank 0's round decided: a stop, and the run's clock with
        the site's round figures (its position, and its progress for the LR schedule)."""
        s = self.sync
        site = [float(getattr(s, k)) if s is not None else 0.0 for k in self.SITE_FIELDS]
        clock = s.clock.as_floats() if s is not None else self._clock.as_floats()
        vals = self._flag([float(bool(s is not None and s.stopped))] + site + clock)
        if vals[0] and self.stopped is None:
            self.stopped = s.stopped if s is not None else "DiLoCoX stopped on this site's rank 0 (see its log)"
        if s is None:
            self._site, self._site_at = dict(zip(self.SITE_FIELDS, vals[1:1 + len(site)])), self.iteration
            self._clock = RunClock.from_floats(vals[1 + len(site):])

    @property
    def clock(self) -> RunClock:
        """The run's clock: rank 0's, and on the other ranks its copy as of the last step that changed θ."""
        return self.sync.clock if self.sync is not None else self._clock

    def progress(self) -> Optional[float]:
        if self.sync is not None:
            return self.sync.progress()
        if not self._site:
            return None
        site = self._site
        return self._clock.progress(int(site["steps_in_round"]) + self.iteration - self._site_at, int(site["h"]),
                                    self.iteration, site["tokens_per_step"], site["token_budget"])

    def position(self) -> Optional[tuple[int, int]]:
        return self.sync.position() if self.sync is not None else None

    def request_end(self):
        if self.sync is not None:
            self.sync.request_end()

    def _phi(self) -> torch.Tensor:
        return torch.cat([a.reshape(-1) for a in self.sync.global_params()]).clone()

    def _dump(self, theta_before: torch.Tensor, phi_before: torch.Tensor):
        """$DILOCOX_DUMP_ROUNDS=DIR (an audit aid; the tests' float64 reference reads it): θ and φ as they were
        before the step's hook and φ after it, canonical layout, one file per changing step."""
        path = os.path.join(os.environ[DUMP_ENV], f"c{self.cfg.cluster_id}_it{self.iteration}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"iteration": self.iteration, "rounds": len(self.sync.rows), "theta": theta_before,
                    "phi_before": phi_before, "phi": self._phi(), "units": self.layout.units}, path)

    def finalize(self):
        self._gather()
        if self.sync is not None:
            self.sync.finalize()
        self._scatter()

    def close(self):
        if self.sync is not None:
            self.sync.close()

    @property
    def rows(self) -> list:
        return self.sync.rows if self.sync is not None else []

    @property
    def anchor(self) -> list:
        return self.layout.views  # (non-empty once started: the seam's "started" test)

    def global_params(self) -> list:
        """φ on this rank, in the shape of ``params`` (a collective: rank 0 scatters it)."""
        out = [torch.empty_like(v) for v in self.layout.views]
        anchor = None
        if self.rank == 0:
            anchor = torch.cat([a.reshape(-1) for a in self.sync.global_params()])
        self._scatter(anchor, out)
        return out

    def state_dict(self) -> dict:
        return self.sync.state_dict() if self.sync is not None else {}

    def load_state_dict(self, state: dict):
        if self.sync is not None:  # (θ is the checkpoint's model, in the main params: gathered at the next round)
            self.sync.load_state_dict(state)
            self.iteration = self.sync.iteration
        self.iteration = int(self._flag([float(self.iteration)])[0])
        self._after_change()  # the checkpoint's clock on every rank: their decisions agree from the first step

    def layout_summary(self, rank: int) -> dict:
        s = self.sync
        return {"rank": rank, "exchange_layout": "canonical", "units": len(self.layout.units),
                "numel": self.layout.numel, "owned": self.layout.index.numel(),
                "round_bytes": s.codec.round_bytes(s.codec.rank, self.cfg.num_clusters) if s is not None else 0}
