"""Lanes: the canonical exchange spread over a site's ranks (--dilocox-lanes L, docs/algorithm.md#lanes).

The canonical space (every global tensor by name, in the order every site derives: canonical.py) is cut into L
lanes of whole tensors, balanced by size; L is a setting every site must share (the rendezvous compares it). Each
lane lives on one rank of a site (lane_plan.owners: lane 0 on rank 0, the others by size over the site's ranks),
which keeps that lane's θ and outer state only, and the sites'
owners of lane k exchange lane k in their own inter-site group, exactly as local rank k of every site does in the
local layout (a lane is a virtual rank: its group's membership counts L ranks per site). A rank that owns several
lanes (a site with fewer ranks than L) runs each lane's round in its own thread, so that every lane reaches the
same collectives at the same step; the lanes of a site agree on H, rank and the metrics row over a gloo group of
the L lanes (``LaneIntra``), as a site's ranks do in the local layout.

Inside a site θ moves between the ranks that hold it and the lanes' owners by ranges: each rank describes what it
holds as runs (this rank's flat offset, canonical offset, length), derived from Megatron's own sharding metadata
(each ShardedTensor's global offsets, rows merged where they are contiguous), and never as per-element index
lists. A replicated element (a DP replica without the distributed optimizer, a TP-replicated norm, the tied
output layer) is read once, from its main replica (``replica_id`` all zero but, with the distributed optimizer,
the data-parallel rank, whose shards are disjoint); the new θ goes back to every holder by the same runs. The
transfers are point-to-point over the site's own default group, one (source, lane) pair at a time in one order on
every rank, in chunks of at most ``CHUNK`` values.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from datetime import timedelta
from typing import Callable, Optional

import torch

from megatron_dilocox.outer.lane_plan import owners, split_lanes  # noqa: F401  (the plan the planner prices too)

# values per point-to-point message inside a site (64 MiB of fp32); $DILOCOX_LANE_CHUNK sets another (the tests cut
# runs across chunks with a small one)
CHUNK = max(1, int(os.environ.get("DILOCOX_LANE_CHUNK", 1 << 24)))


# ------------------------------------------------------------------------------------------------ runs
def piece_runs(st, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parameter offsets, in-unit offsets, lengths) of the contiguous runs of ShardedTensor ``st``, whose data
    starts ``first`` elements into its parameter: one run per row of its last axis, merged where consecutive rows
    are consecutive in the global tensor (a piece split on the first axis is one run)."""
    n = st.prepend_axis_num
    shape_g, offset, local = list(st.global_shape[n:]), list(st.global_offset[n:]), list(st.local_shape)
    if not local:
        return (torch.tensor([first]), torch.tensor([0]), torch.tensor([1]))
    strides = [1] * len(shape_g)
    for d in range(len(shape_g) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape_g[d + 1]
    row = local[-1]
    starts = torch.full((), offset[-1], dtype=torch.int64)
    for d in range(len(local) - 1):
        view = [1] * (len(local) - 1)
        view[d] = local[d]
        starts = starts + ((offset[d] + torch.arange(local[d], dtype=torch.int64)) * strides[d]).view(view)
    starts = starts.expand(tuple(local[:-1])).reshape(-1)
    if starts.numel() == 0 or row == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    new = torch.ones(starts.numel(), dtype=torch.bool)
    new[1:] = starts[1:] != starts[:-1] + row
    heads = torch.nonzero(new).view(-1)
    counts = torch.diff(heads, append=torch.tensor([starts.numel()]))
    return first + heads * row, starts[heads], counts * row


def is_main_replica(replica_id, distributed: bool) -> bool:
    """Whether a piece is read from this rank: Megatron's main replica, ignoring the data-parallel rank (the last
    component) when the distributed optimizer shards the main params over it."""
    ids = list(replica_id) if isinstance(replica_id, (tuple, list)) else [replica_id]
    if distributed and len(ids) > 1:
        ids = ids[:-1]
    return all(int(i) == 0 for i in ids)


@dataclasses.dataclass
class Runs:
    """What one rank holds, as runs: ``view`` (index into its views), ``at`` (offset in that view), ``canon``
    (offset in the canonical flat vector), ``length``, ``main`` (read from here)."""
    view: torch.Tensor
    at: torch.Tensor
    canon: torch.Tensor
    length: torch.Tensor
    main: torch.Tensor

    @staticmethod
    def cat(parts: list[tuple]) -> "Runs":
        cols = list(zip(*parts)) if parts else [[]] * 5
        return Runs(*[torch.cat(c) if c else torch.zeros(0, dtype=torch.int64 if i < 4 else torch.bool)
                      for i, c in enumerate(cols)])

    def numel(self) -> int:
        return int(self.length.sum())

    def clip(self, lo: int, hi: int, main_only: bool) -> torch.Tensor:
        """(R, 4) int64 rows (view, offset in view, offset from ``lo``, length) of the runs' parts in [lo, hi)."""
        keep = self.main if main_only else torch.ones_like(self.main)
        a = torch.maximum(self.canon, torch.tensor(lo))
        b = torch.minimum(self.canon + self.length, torch.tensor(hi))
        keep = keep & (b > a)
        a, b = a[keep], b[keep]
        return torch.stack([self.view[keep], self.at[keep] + (a - self.canon[keep]), a - lo, b - a], dim=1)


def clip_to_shard(p_off, u_off, length, start: int, end: int):
    """The runs' parts inside [start, end) of the parameter (a distributed optimizer's shard), as (offset in the
    shard, in-unit offset, length)."""
    a = torch.clamp(p_off, min=start)
    b = torch.clamp(p_off + length, max=end)
    keep = b > a
    a, b, p_off, u_off = a[keep], b[keep], p_off[keep], u_off[keep]
    return a - start, u_off + (a - p_off), b - a


# ------------------------------------------------------------------------------------------------ moving θ
class LaneMover:
    """θ between the site's holders and the lanes' owners (see module docstring). Collective over the site: every
    rank calls ``gather``/``scatter`` at the same step."""

    def __init__(self, views: list, runs: Runs, bounds: list[tuple[int, int]], world: int, rank: int, device):
        dist = torch.distributed
        self.views, self.bounds, self.world, self.rank, self.device = views, bounds, world, rank, device
        self.lanes = len(bounds)
        self.owner = owners([hi - lo for lo, hi in bounds], world)
        # mine[k][main_only]: this rank's rows for lane k; theirs[k][r][main_only] at lane k's owner: rank r's
        self.mine = [{m: runs.clip(lo, hi, m) for m in (True, False)} for lo, hi in bounds]
        self.theirs: dict = {}
        for k in range(self.lanes):
            for src in range(world):
                for m in (True, False):
                    self._describe(k, src, m)
        dist.barrier()
        for k in range(self.lanes):
            if self.owner[k] == rank:
                self._check_cover(k)
        # one device buffer and one host buffer (pinned with CUDA) of at most CHUNK values, allocated once: the
        # largest piece this rank sends or receives (fresh ones per chunk would page in at every boundary)
        sizes = [int(r[:, 3].sum()) for m in self.mine for r in m.values()] + \
                [int(r[:, 1].sum()) for r in self.theirs.values()]
        n = max(1, min(CHUNK, max(sizes, default=1)))
        self._buf = torch.empty(n, dtype=torch.float32, device=device)
        self._host = torch.empty(n, dtype=torch.float32, pin_memory=torch.device(device).type == "cuda")

    def _p2p(self, k: int, src: int):
        """Whether this rank takes part in the (lane k, rank src) transfer, and its partner."""
        if self.rank == self.owner[k] and src != self.rank:
            return src
        if self.rank == src and src != self.owner[k]:
            return self.owner[k]
        return None

    def _describe(self, k: int, src: int, main: bool):
        """Rank ``src``'s rows for lane k, at the lane's owner (sent once; ranges, not elements)."""
        rows = self.mine[k][main]
        if self.rank == src == self.owner[k]:
            self.theirs[(k, src, main)] = rows[:, 2:]
            return
        peer = self._p2p(k, src)
        if peer is None:
            return
        if self.rank == src:
            n = torch.tensor([rows.shape[0]], dtype=torch.int64)
            torch.distributed.send(self._dev(n), peer)
            if rows.shape[0]:
                torch.distributed.send(self._dev(rows[:, 2:].contiguous()), peer)
        else:
            n = self._dev(torch.zeros(1, dtype=torch.int64))
            torch.distributed.recv(n, peer)
            out = self._dev(torch.zeros((int(n.item()), 2), dtype=torch.int64))
            if out.shape[0]:
                torch.distributed.recv(out, peer)
            self.theirs[(k, src, main)] = out.cpu()

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def _check_cover(self, k: int):
        """Lane k is covered by the main replicas' runs exactly once (by ranges: no per-value array)."""
        lo, hi = self.bounds[k]
        rows = torch.cat([self.theirs[(k, src, True)] for src in range(self.world)])
        rows = rows[rows[:, 0].argsort()] if rows.numel() else rows.view(0, 2)
        ends = rows[:, 0] + rows[:, 1]
        gaps = int(rows[0, 0]) if rows.numel() else hi - lo
        gaps += int((rows[1:, 0] - ends[:-1]).clamp(min=0).sum()) + (hi - lo - int(ends[-1]) if rows.numel() else 0)
        twice = int((ends[:-1] - rows[1:, 0]).clamp(min=0).sum()) if rows.numel() else 0
        if gaps or twice:
            raise RuntimeError(f"DiLoCoX lanes: lane {k} has {gaps} values held by no main replica and {twice} read "
                               f"from two (Megatron's replica ids; use --dilocox-exchange-layout local)")

    def numel(self, k: int) -> int:
        lo, hi = self.bounds[k]
        return hi - lo

    @torch.no_grad()
    def gather(self, lanes: dict):
        """Every owned lane's vector in ``lanes`` (k -> fp32 host vector) <- the main replicas' θ."""
        for k in range(self.lanes):
            for src in range(self.world):
                if self.rank == src:
                    rows, owner = self.mine[k][True].tolist(), self.owner[k]
                    for piece in chunks([r[3] for r in rows]):
                        values = self._take([(rows[i][0], rows[i][1] + a, n) for i, a, n in piece])
                        if owner == self.rank:
                            self._put_lane(lanes[k], self.theirs[(k, src, True)].tolist(), piece,
                                           self._to_host(values))
                        else:
                            torch.distributed.send(values, owner)
                elif self.rank == self.owner[k]:
                    rows = self.theirs[(k, src, True)].tolist()
                    for piece in chunks([r[1] for r in rows]):
                        self._put_lane(lanes[k], rows, piece, self._to_host(self._recv(piece, src)))

    @torch.no_grad()
    def scatter(self, lanes: dict, into: Optional[list] = None):
        """Every holder's views (or ``into``, shaped like them) <- the owned lanes' vectors in ``lanes``."""
        targets = self.views if into is None else into
        for k in range(self.lanes):
            for dst in range(self.world):
                if self.rank == self.owner[k]:
                    rows, mine = self.theirs[(k, dst, False)].tolist(), self.mine[k][False].tolist()
                    for piece in chunks([r[1] for r in rows]):
                        values = self._buffer(piece)
                        staged = values if values.device.type == "cpu" else self._host[:values.numel()]
                        at = 0
                        for i, a, n in piece:  # (host lane -> a host buffer, run by run; then one copy to the device)
                            off = rows[i][0] + a
                            staged[at:at + n].copy_(lanes[k][off:off + n])
                            at += n
                        if staged is not values:
                            values.copy_(staged)
                        if dst == self.rank:
                            self._put_views(targets, mine, piece, values)
                        else:
                            torch.distributed.send(values, dst)
                elif self.rank == dst:
                    rows = self.mine[k][False].tolist()
                    for piece in chunks([r[3] for r in rows]):
                        self._put_views(targets, rows, piece, self._recv(piece, self.owner[k]))

    def _buffer(self, piece) -> torch.Tensor:
        return self._buf[:sum(m for _, _, m in piece)]

    def _to_host(self, values: torch.Tensor) -> torch.Tensor:
        """A chunk on the host: itself on CPU, else one copy into the reused host buffer."""
        if values.device.type == "cpu":
            return values
        out = self._host[:values.numel()]
        out.copy_(values)
        return out

    def _take(self, parts) -> torch.Tensor:
        out = self._buf[:sum(n for _, _, n in parts)]
        at = 0
        for v, a, n in parts:
            out[at:at + n].copy_(self.views[v].view(-1)[a:a + n])
            at += n
        return out

    def _recv(self, piece, peer: int) -> torch.Tensor:
        out = self._buffer(piece)
        if out.numel():
            torch.distributed.recv(out, peer)
        return out

    @staticmethod
    def _put_lane(lane: torch.Tensor, rows: list, piece, values: torch.Tensor):
        at = 0
        for i, a, n in piece:
            off = rows[i][0] + a
            lane[off:off + n] = values[at:at + n]
            at += n

    @staticmethod
    def _put_views(targets: list, rows: list, piece, values: torch.Tensor):
        at = 0
        for i, a, n in piece:
            v, off = rows[i][0], rows[i][1] + a
            targets[v].view(-1)[off:off + n].copy_(values[at:at + n])
            at += n


def chunks(lengths: list[int], size: int = None):
    """The runs of ``lengths`` in pieces of at most ``size`` values (default CHUNK): each piece a list of (run,
    offset in the run, count). Both ends of a transfer cut the same runs alike."""
    size = size or CHUNK
    piece, room = [], size
    for i, n in enumerate(lengths):
        at = 0
        while at < n:
            m = min(n - at, room)
            piece.append((i, at, m))
            at, room = at + m, room - m
            if room == 0:
                yield piece
                piece, room = [], size
    if piece:
        yield piece


# ------------------------------------------------------------------------------------------------ lanes agree
class LaneIntra:
    """How the L lanes of a site agree (the IntraCluster of outer/cluster.py over a gloo group whose members are
    lanes, not processes: a rank that owns two lanes is two members)."""

    def __init__(self, store, lane: int, lanes: int, timeout_seconds: float):
        from torch.distributed import PrefixStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo
        self.lane, self.lanes, self.is_writer = lane, lanes, lane == 0
        # (a connection of its own: lanes in one process wait on the store at once, which one client does not take)
        self.pg = ProcessGroupGloo(PrefixStore("dilocox/lanes", store.clone()), lane, lanes,
                                   timedelta(seconds=timeout_seconds))

    def reduce(self, values, op):
        from torch.distributed import AllreduceOptions, ReduceOp
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        opts = AllreduceOptions()
        opts.reduceOp = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX}[op]
        self.pg.allreduce([t], opts).wait()
        return t.tolist()

    def gather_str(self, text):
        raw = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
        n = int(self.reduce([raw.numel()], "max")[0])
        buf = torch.zeros(n + 8, dtype=torch.uint8)
        buf[:8] = torch.tensor([raw.numel()], dtype=torch.int64).view(torch.uint8)
        buf[8:8 + raw.numel()] = raw
        out = [torch.empty_like(buf) for _ in range(self.lanes)]
        self.pg.allgather([out], [buf]).wait()
        texts = []
        for b in out:
            m = int(b[:8].view(torch.int64).item())
            texts.append(bytes(b[8:8 + m].tolist()).decode())
        return texts


class LaneThreads:
    """Run a function for every lane this rank owns: at once, one thread per lane, when it owns several (each
    lane's collectives wait for the other sites' and lanes' members); on the caller's thread when it owns one."""

    def __init__(self, lanes: list[int]):
        self.lanes = lanes
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="dilocox-lane") \
            if len(lanes) > 1 else None

    def map(self, fn: Callable[[int], object]) -> dict:
        if self.pool is None:
            return {k: fn(k) for k in self.lanes}
        futures = {k: self.pool.submit(fn, k) for k in self.lanes}
        out, error = {}, None
        for k, f in futures.items():
            try:
                out[k] = f.result()
            except BaseException as exc:  # (every lane's outcome first: a lane may stop while another waits)
                error = error or exc
        if error is not None:
            raise error
        return out

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False)


def held_bytes(obj, seen: Optional[set] = None, depth: int = 0) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` through its attributes, dicts, lists and tuples
    (what a round object keeps: the tests count each rank's outer state with it; tracemalloc does not see torch
    storage). Storages shared with the model (views of θ) are counted too; callers pass objects that own theirs."""
    seen = set() if seen is None else seen
    if depth > 8 or id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        key = ("storage", s.data_ptr(), obj.device)
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return s.nbytes()
    if isinstance(obj, dict):
        return sum(held_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(held_bytes(v, seen, depth + 1) for v in obj)
    if type(obj).__module__.startswith("megatron_dilocox") and hasattr(obj, "__dict__"):
        return sum(held_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0
