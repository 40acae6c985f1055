"""Sites with different parallel layouts: the round in a canonical layout (--dilocox-exchange-layout canonical).

With equal layouts local rank k of every site holds the same parameter slices, and the ranks exchange them pairwise
(``seam.py``). When the sites' TP/PP/DP differ no such pairing exists, so the pseudo-gradient travels in a layout
that no site's parallelism decides: every global tensor by its name in Megatron's own sharding metadata
(``sharded_state_dict``: each local shard's key, global shape and offsets, the fused SwiGLU fc1 split into its two
halves by Megatron's factory, the tied output layer marked as a replica of the embedding; layers stacked on a
leading axis that is cut off here, so a unit is one layer's matrix). Units are sorted by (key, layer), so every
site derives the same list, and the codec compresses these global matrices: every site encodes the same ones.

Inside a site the canonical model is cut into lanes (lanes.py; one by default, on rank 0): at a step that changes
θ the site gathers θ to each lane's owner from the main replica of every element (a DP replica or the tied output
layer is read once), each owner runs the unmodified ``DiLoCoXSync`` on its lanes' canonical tensors with the other
sites' owners of the same lanes, and the new θ goes back to every holder. Which steps change θ (a boundary or a
landing) rank 0, lane 0's owner, knows before it runs the hook and tells the site's ranks each step (one small
broadcast). The rows' hash is the hash of the whole global model in canonical layout, combined over the lanes, so
it is comparable across sites whatever their layouts.

Cost: each owner keeps its lanes' outer state (~7 fp32 copies of their values, on the host); with one lane that is
rank 0 holding the whole model's, which is what --dilocox-lanes spreads (docs/algorithm.md#lanes). Refused before
training, each naming its flag: --dilocox-fragments > 1 (and the slow-link switch to fragments is off) and MoE (--num-experts).
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
from megatron_dilocox.glue import lanes
from megatron_dilocox.glue.param_views import leaf_optimizers, shards_over_dp, _owned_pairs
from megatron_dilocox.metrics import MetricsWriter
from megatron_dilocox.outer.clock import RunClock
from megatron_dilocox.outer.auto import make_sync
from megatron_dilocox.net.topology import InterClusterGroup, connect_store

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


@dataclasses.dataclass
class Layout:
    units: list  # (key, layer offsets, shape), sorted: identical on every site of the same model
    bases: list  # start of each unit in the canonical flat vector
    views: list  # this rank's fp32 main-param shards (flat), in order
    runs: lanes.Runs  # where each run of the views lies in the canonical flat vector, and which are read here

    @property
    def numel(self) -> int:
        return sum(torch.Size(s).numel() for _, _, s in self.units)

    def digest(self) -> str:
        return hashlib.sha256(repr(self.units).encode()).hexdigest()[:16]


def build_layout(model_chunks, inner) -> Layout:
    """Map every fp32 main-param run this rank's optimizer steps to its canonical range (collective over the
    site: the unit lists of all pipeline stages are merged)."""
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i) for i, p in enumerate(params))
    starts = [s for s, _, _ in spans]
    pieces = []  # (param index, unit, parameter offsets, in-unit offsets, lengths, main replica)
    leaves = [leaf for leaf in leaf_optimizers(inner) if not getattr(leaf, "is_stub_optimizer", False)]
    distributed = shards_over_dp(inner)  # (the DP component of a replica id then names no copy)
    for st in _sharded_tensors(model_chunks):
        ptr = st.data.data_ptr()
        k = bisect.bisect_right(starts, ptr) - 1
        if k < 0 or not ptr < spans[k][1] or not st.data.is_contiguous():
            continue  # not a parameter of these chunks (a buffer)
        p = params[spans[k][2]]
        unit = (st.key, tuple(st.global_offset[:st.prepend_axis_num]), tuple(st.global_shape[st.prepend_axis_num:]))
        runs = lanes.piece_runs(st, (ptr - p.data_ptr()) // p.element_size())
        pieces.append((spans[k][2], unit, *runs, lanes.is_main_replica(st.replica_id, distributed)))
    mine = sorted({piece[1] for piece in pieces})
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
    by_param: dict = {}
    for pi, unit, p_off, u_off, length, main in pieces:
        by_param.setdefault(pi, []).append((p_off, u_off + bases[unit], length, main))
    views, parts = [], []
    by_id = {id(p): i for i, p in enumerate(params)}
    for leaf in leaves:
        for main_param, model_param, start, end in _owned_pairs(leaf):
            pi = by_id.get(id(model_param))
            found = by_param.get(pi, []) if pi is not None else []
            v = len(views)
            covered = 0
            for p_off, canon, length, main in found:
                at, canon, length = lanes.clip_to_shard(p_off, canon, length, start, end)
                covered += int(length.sum())
                parts.append((torch.full_like(at, v), at, canon, length, torch.full(at.shape, main, dtype=torch.bool)))
            if covered != end - start:
                raise RuntimeError(f"DiLoCoX canonical layout: a parameter of shape {tuple(model_param.shape)} is not "
                                   f"(wholly) in Megatron's sharded state dict; use --dilocox-exchange-layout local")
            views.append(main_param.data.view(-1))
    return Layout(units, [bases[u] for u in units], views, lanes.Runs.cat(parts))


class CanonicalSite:
    """The site's side of the canonical exchange; the interface the seam uses of a DiLoCoXSync (see module docstring).

    Built in two steps, so that the resume agreement (glue/checkpoints.py) runs between them over lane 0's group:
    ``CanonicalSite(...)`` places the lanes and joins each owned lane's inter-site group; ``make_syncs`` starts
    each owned lane's round logic."""

    def __init__(self, layout: Layout, cfg: DiLoCoXConfig, fingerprint: dict):
        dist = torch.distributed
        self.layout, self.cfg = layout, cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = layout.views  # what this rank holds: θ for evaluation's save/restore
        self.outer_device = torch.device("cpu")
        self.iteration, self.stopped, self.joined_midrun = 0, None, False
        # (ranks but 0) rank 0's clock and round figures at the last change, and this rank's iteration then
        self._clock, self._site, self._site_at = RunClock(), {}, 0
        self.device = layout.views[0].device if layout.views else torch.device("cpu")
        units = lanes.split_lanes([torch.Size(s).numel() for _, _, s in layout.units], cfg.lanes)
        self.lane_units = units
        bounds = [(layout.bases[a], layout.bases[b] if b < len(layout.units) else layout.numel) for a, b in units]
        self.mover = lanes.LaneMover(layout.views, layout.runs, bounds, self.world, self.rank, self.device)
        self.owned = [k for k, r in enumerate(self.mover.owner) if r == self.rank]
        self.threads = lanes.LaneThreads(self.owned)
        self.theta = {k: torch.zeros(hi - lo, dtype=torch.float32) for k, (lo, hi) in zip(range(cfg.lanes), bounds)
                      if k in self.owned}
        store = dist.distributed_c10d._get_default_store()

        def connect(k):
            intra = lanes.LaneIntra(store, k, cfg.lanes, cfg.timeout_seconds)
            group = None
            if cfg.num_clusters > 1:
                inter = connect_store(cfg, host_store=(cfg.cluster_id == 0 and k == 0))
                group = InterClusterGroup(cfg, k, inter, fingerprint, local_world=cfg.lanes)
            return intra, group
        joined = self.threads.map(connect)
        self.intra = {k: i for k, (i, _) in joined.items()}
        self.groups = {k: g for k, (_, g) in joined.items()}
        self.lanes: dict = {}  # lane -> its round logic (a DiLoCoXSync), on its owner
        self.sync = None  # lane 0's, on rank 0: it decides which steps change θ and holds the run's clock

    @property
    def lead_group(self):
        """Lane 0's inter-site group (rank 0; None elsewhere)."""
        return self.groups.get(0)

    @property
    def joining(self) -> bool:
        return any(g is not None and g.joining for g in self.groups.values())

    def make_syncs(self, metrics_file: Optional[str], train_iters):
        single = dataclasses.replace(self.cfg, slow_link_fragments=1)  # (fragments are refused in this mode)
        layout = self.layout
        for k in self.owned:
            a, b = self.lane_units[k]
            base = layout.bases[a]
            tensors = [self.theta[k][layout.bases[u] - base:layout.bases[u] - base + torch.Size(layout.units[u][2]).numel()]
                       .view(layout.units[u][2]) for u in range(a, b)]
            self.lanes[k] = make_sync(tensors, single, self.groups[k], self.intra[k],
                                      MetricsWriter(metrics_file if k == 0 else None), train_iters=train_iters)
        self.sync = self.lanes.get(0)

    def plan_tokens(self, token_budget: float, tokens_per_step: float):
        for s in self.lanes.values():
            s.plan_tokens(token_budget, tokens_per_step)

    def outer_state_bytes(self) -> int:
        """Bytes of the tensors this rank keeps for its lanes: their θ and everything their round logic holds."""
        return lanes.held_bytes([self.theta, self.lanes])

    # ------------------------------------------------------------------------------------ moving θ
    def _flag(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.broadcast(t, src=0)
        return t.tolist()

    def _gather(self):
        """θ from the main replicas into the owned lanes."""
        self.mover.gather(self.theta)

    def _scatter(self, source: Optional[dict] = None, into: Optional[list] = None):
        """``source`` (lane -> vector, default θ) to every holder: into ``into`` (default: the main params)."""
        self.mover.scatter(self.theta if source is None else source, into)

    def _each(self, fn):
        """``fn(sync)`` for every owned lane, at once (module lanes.py: LaneThreads)."""
        return self.threads.map(lambda k: fn(self.lanes[k]))

    # ------------------------------------------------------------------------------------ as DiLoCoXSync
    def start(self):
        """θ ← the global model: cluster 0's, or (a site restarted under --dilocox-on-peer-failure continue,
        perhaps with another layout) the running sites' state, handed to each lane's owner in canonical layout."""
        self._gather()
        self._each(lambda s: s.start())
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
            if any(self._each(lambda x: x.after_inner_step(tokens=tokens)).values()):
                raise RuntimeError("DiLoCoX canonical exchange: the round changed θ at a step it had not announced")
            return False
        self._gather()
        dump = DUMP_ENV in os.environ
        before = {k: (self.theta[k].clone(), self._phi(k)) for k in self.owned} if dump else None
        self._each(lambda x: x.after_inner_step(tokens=tokens))
        if before:
            for k, (theta, phi) in before.items():
                self._dump(k, theta, phi)
        self._scatter()
        self._after_change()
        return True

    SITE_FIELDS = ("h", "steps_in_round", "token_budget", "tokens_per_step")

    def _after_change(self):
        """(Every rank, after a step that changed θ) what lane 0's round decided: a stop (on any lane of the site),
        and the run's clock with the site's round figures (its position, and its progress for the LR schedule)."""
        s = self.sync
        site = [float(getattr(s, k)) if s is not None else 0.0 for k in self.SITE_FIELDS]
        clock = s.clock.as_floats() if s is not None else self._clock.as_floats()
        stopped = next((x.stopped for x in self.lanes.values() if x.stopped), None)
        t = torch.tensor([float(stopped is not None)], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        vals = self._flag(site + clock)
        if float(t.item()) and self.stopped is None:
            self.stopped = stopped or "DiLoCoX stopped on another rank of this site (see its log)"
        if s is None:
            self._site, self._site_at = dict(zip(self.SITE_FIELDS, vals[:len(site)])), self.iteration
            self._clock = RunClock.from_floats(vals[len(site):])

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
        for s in self.lanes.values():
            s.request_end()

    def _phi(self, k: int) -> torch.Tensor:
        return torch.cat([a.reshape(-1) for a in self.lanes[k].global_params()]).clone()

    def _dump(self, k: int, theta_before: torch.Tensor, phi_before: torch.Tensor):
        """$DILOCOX_DUMP_ROUNDS=DIR (an audit aid; the tests' float64 reference reads it): lane k's θ and φ as they
        were before the step's hook and φ after it, canonical layout, one file per lane and changing step."""
        a, b = self.lane_units[k]
        path = os.path.join(os.environ[DUMP_ENV], f"c{self.cfg.cluster_id}_it{self.iteration}_lane{k}.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"iteration": self.iteration, "rounds": len(self.lanes[k].rows), "theta": theta_before,
                    "phi_before": phi_before, "phi": self._phi(k), "units": self.layout.units[a:b]}, path)

    def finalize(self):
        self._gather()
        self._each(lambda s: s.finalize())
        self._scatter()

    def close(self):
        self._each(lambda s: s.close())
        self.threads.close()

    @property
    def rows(self) -> list:
        return self.sync.rows if self.sync is not None else []

    @property
    def anchor(self) -> list:
        return self.layout.views  # (non-empty once started: the seam's "started" test)

    def global_params(self) -> list:
        """φ on this rank, in the shape of ``params`` (a collective: each lane's owner sends its part)."""
        out = [torch.empty_like(v) for v in self.layout.views]
        self._scatter({k: torch.cat([a.reshape(-1) for a in s.global_params()]) for k, s in self.lanes.items()}, out)
        return out

    def state_dict(self) -> dict:
        """Lane -> its round state, for the lanes this rank owns (seam.py saves one object per lane)."""
        return {k: {**s.state_dict(), "lanes": self.cfg.lanes} for k, s in self.lanes.items()}

    def load_state_dict(self, state: dict):
        """``state``: lane -> its saved round state, for (at least) the lanes this rank owns."""
        for k, s in self.lanes.items():
            mine = dict(state[k])
            if mine.pop("lanes", self.cfg.lanes) != self.cfg.lanes:
                raise DiLoCoXConfigError(f"the checkpoint's DiLoCoX state was saved with another --dilocox-lanes than "
                                         f"{self.cfg.lanes}: resume with the value it was saved with")
            s.load_state_dict(mine)
        self.iteration = int(self._flag([float(self.sync.iteration if self.sync is not None else 0)])[0])
        self._after_change()  # the checkpoint's clock on every rank: their decisions agree from the first step

    def layout_summary(self, rank: int) -> dict:
        """(Logged by every rank) its lanes, their sizes and outer state, and its lanes' closed-form bytes per round
        (the site's are the sum over its ranks, as in the local layout)."""
        return {"rank": rank, "exchange_layout": "canonical", "units": len(self.layout.units),
                "numel": self.layout.numel, "owned": self.layout.runs.numel(), "lanes": self.owned,
                "lane_numel": [self.mover.numel(k) for k in self.owned], "outer_state_bytes": self.outer_state_bytes(),
                "round_bytes": sum(s.codec.round_bytes(s.codec.rank, self.cfg.num_clusters) for s in self.lanes.values())}
