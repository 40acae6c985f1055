"""The canonical exchange layout's cost, per site: outer-state memory, the moves' device buffers, gather + scatter
time, beside the local layout's; and the refusal of a plan that does not fit a rank's host memory (pure Python;
docs/benchmarks.md#the-canonical-layouts-cost).

What a run in the canonical layout does (glue/canonical.py, glue/lanes.py), and what is priced here:

- The model's global tensors (units, sorted by Megatron name and layer: ``canonical_units``) are cut into L lanes
  and placed on a site's W ranks by ``outer/lane_plan.py``, the rule the run uses. A lane's owner keeps, on the
  host, the lane's θ (4 B per value) and its round logic's state: ``cost_model.memory`` of the lane's tensors, all
  of it on the host (θ is a host tensor, so the codec's slabs are too). With fp32 payloads, no low rank, overlap
  none and outer momentum 0 that is 16 B per value, as measured (tests/test_megatron_sites.py). A rank's figure is
  the sum over the lanes it owns. What must fit ``host_memory_gb`` is its peak: that, plus its lanes' δ and M
  while a round is in flight (8 B per value) and the one chunk the gather lands on the host at a time.
- At every step that changes θ (the boundary; with overlap, also the landing when it comes before the next
  boundary) θ goes from the main replicas to the owners and back to every holder, one (source rank, lane) pair at
  a time in a fixed order, chunk by chunk (at most ``CHUNK`` = 2^24 values; both ends cut the runs alike), through
  one device buffer and one host buffer per rank, allocated once: the device memory the moves add is that
  buffer, 4 B x min(CHUNK, the largest piece one rank holds or reads of one lane). No rank builds a whole piece.
  Each step waits for the one before (the owner copies a gathered chunk to the host before it posts the next
  receive; a source refills its buffer only once the send is done), so the time is the sum over all pairs,
  whatever L: the bytes over the site's fabric at ``intra_site_gb_s`` (a pair meets at one NIC each), plus each
  value's GPU-host copies and host copies at boundary.py's rates (``MOVE_WORK``). Not counted: the per-run cost
  of those copies (one small copy per run and end: a row-parallel weight is one run per row of its TP shard, some
  10M runs of 1,024 or 5,888 values each way at the paper's scale and TP8). (The defaults of the two rates the run
  adds, ``INTRA_SITE_GB_S`` and ``HOST_MEMORY_GB``, and why: boundary.py.)
- Who holds what (an approximation, like cost_model's distributed-optimizer shards): a TP-split tensor spreads
  evenly over its stage's TP x DP ranks under the distributed optimizer (disjoint: read once, written once), else
  over its TP ranks, replicated over DP (read from DP rank 0, written to every replica); a TP-replicated tensor
  (norms, row-parallel biases) is read from TP rank 0 and written to every TP rank; a tied output layer on the last
  stage (PP > 1) is written, never read.

Refused here as at run time: MoE (the canonical layout does not take experts), more lanes than units, sites whose
padded vocabularies differ (the rendezvous refuses them).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from megatron_dilocox.outer.lane_plan import owners, split_lanes
from megatron_dilocox.sim.boundary import boundary_seconds, host_seconds
from megatron_dilocox.sim.cost_model import memory, predict, round_bytes
from megatron_dilocox.sim.setup import Setup, _pad_vocab, _stage_layers, numel

CHUNK = 1 << 24  # glue/lanes.py: values per point-to-point message inside a site (what its device buffer holds)
# Work per value moved (boundary.py's units: a host copy is 2 passes, read and write), by (phase, whether the value
# crosses to another rank), as glue/lanes.py moves a chunk: the gather's owner copies it out of its device buffer
# into its reused host buffer (d2h; pinned with CUDA, allocated once: no fresh pages) and from there into the lane,
# run by run (a host copy); the scatter's owner copies the lane's runs into the host buffer (a host copy) and that
# into its device buffer (h2d). The same whether the value stays on the owner or not: a source's copies from its
# params into its buffer, and a receiver's from its buffer into its params, are device-side (not counted).
MOVE_WORK = {("gather", True): {"d2h": 1, "copy": 2}, ("gather", False): {"d2h": 1, "copy": 2},
             ("scatter", True): {"h2d": 1, "copy": 2}, ("scatter", False): {"h2d": 1, "copy": 2}}


def gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB" if x >= 1e10 else f"{x / 1e9:.3g} GB"


class PlanRefused(ValueError):
    """A canonical plan whose outer state does not fit; the message names what to change."""


def parse_layouts(text: str) -> list[tuple[int, int, int]]:
    """``TPxPPxDP,...`` (one per site) -> [(tp, pp, dp), ...]; ValueError naming the bad entry."""
    out = []
    for entry in text.split(","):
        try:
            tp, pp, dp = (int(x) for x in entry.strip().lower().split("x"))
            if min(tp, pp, dp) < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"--site-layouts: {entry.strip()!r} is not TPxPPxDP with positive integers "
                             f"(e.g. --site-layouts 8x4x4,8x8x2)") from None
        out.append((tp, pp, dp))
    return out


def canonical_units(s: Setup, tp: int) -> list[tuple]:
    """(key, layer, shape, TP-split) of every global tensor, sorted as the run sorts them (Megatron's names with
    Transformer Engine's fused norms; layer -1 for the tensors outside the layers). The vocabulary is padded for
    ``tp``, as at the site."""
    if s.experts:
        raise ValueError("the canonical layout does not handle MoE (--experts): give every site the same layout and "
                         "use --exchange-layout local")
    h, kv, hd = s.hidden, s.kv_heads or s.heads, s.hidden // s.heads
    qkv, fc1 = (s.heads + 2 * kv) * hd, (2 if s.swiglu else 1) * s.ffn
    layer = [("mlp.linear_fc1.layer_norm_weight", (h,), False), ("mlp.linear_fc1.weight", (fc1, h), True),
             ("mlp.linear_fc2.weight", (h, s.ffn), True), ("self_attention.linear_proj.weight", (h, h), True),
             ("self_attention.linear_qkv.layer_norm_weight", (h,), False),
             ("self_attention.linear_qkv.weight", (qkv, h), True)]
    if s.bias:
        layer += [("mlp.linear_fc1.layer_norm_bias", (h,), False), ("mlp.linear_fc1.bias", (fc1,), True),
                  ("mlp.linear_fc2.bias", (h,), False), ("self_attention.linear_proj.bias", (h,), False),
                  ("self_attention.linear_qkv.layer_norm_bias", (h,), False),
                  ("self_attention.linear_qkv.bias", (qkv,), True)]
    emb = (_pad_vocab(s.vocab, tp), h)
    units = [("decoder.layers." + k, i, shape, split) for i in range(s.layers) for k, shape, split in layer]
    units += [("decoder.final_layernorm.weight", -1, (h,), False), ("embedding.word_embeddings.weight", -1, emb, True)]
    units += [("decoder.final_layernorm.bias", -1, (h,), False)] if s.bias else []
    units += [] if s.tied_embeddings else [("output_layer.weight", -1, emb, True)]
    return sorted(units)


def _stages(units: list, s: Setup) -> list[tuple[int, Optional[int]]]:
    """(stage that reads it, stage holding a written-only replica or None) of every unit in a site of ``s``'s PP."""
    of_layer = [st for st in range(s.pp) for _ in range(_stage_layers(s, st, s.pp))]
    out = []
    for key, layer, _, _ in units:
        if layer >= 0:
            out.append((of_layer[layer], None))
        elif key.startswith("embedding"):
            out.append((0, s.pp - 1 if s.tied_embeddings and s.pp > 1 else None))
        else:
            out.append((s.pp - 1, None))
    return out


def _shares(s: Setup, n: int, split: bool) -> tuple[float, float, float]:
    """(values a rank reads if it is the main replica, a written replica's values, replicas written per value)."""
    t, d = s.tp, s.dp
    if s.distributed_optimizer:
        return (n / (t * d), n / (t * d), 1) if split else (n / d, n / d, t)
    return (n / t, n / t, d) if split else (n, n, t * d)


def _is_main(s: Setup, rank: int, split: bool) -> bool:
    tp, dp = rank % s.tp, (rank // s.tp) % s.dp  # Megatron's rank order: TP fastest, then DP, then PP
    return (split or tp == 0) and (s.distributed_optimizer or dp == 0)


def rank_loads(world: int, lanes: int, sizes: Optional[list] = None, numel_: Optional[int] = None) -> list[int]:
    """Values of the lanes each rank of a ``world``-rank site owns: cut from the model's global tensors ``sizes``
    when they are known, else ``numel_`` values in ``lanes`` equal lanes (N/L each, the remainder to the first)."""
    if sizes is not None:
        lane_sizes = [sum(sizes[a:b]) for a, b in split_lanes(sizes, lanes)]
    else:
        lane_sizes = [numel_ // lanes + (k < numel_ % lanes) for k in range(lanes)]
    load = [0] * world
    for k, r in enumerate(owners(lane_sizes, world)):
        load[r] += lane_sizes[k]
    return load


def unit_host_bytes(s: Setup, shape: tuple) -> int:
    """Host bytes a lane's owner keeps per unit: θ, and the round logic's state (``cost_model.memory``, which is
    additive over tensors)."""
    mem = memory(s, round_bytes(s, [(1, [shape])]))
    return 4 * numel(shape) + mem["gpu_bytes"] + mem["cpu_bytes"]


def lanes_of(s: Setup, units: list, lanes: int) -> dict:
    """The cut (``outer/lane_plan.py``) and, per rank of a site of ``s``'s layout: values owned, host bytes of outer
    state kept, and the host peak (that, plus δ and M of its lanes' rounds, 8 B per value, and the chunk the gather
    lands on the host: 4 B x min(CHUNK, the largest piece))."""
    sizes = [numel(u[2]) for u in units]
    cut = split_lanes(sizes, lanes)
    lane_sizes = [sum(sizes[a:b]) for a, b in cut]
    cache: dict = {}
    per_unit = [cache.setdefault(u[2], unit_host_bytes(s, u[2])) for u in units]
    owner = owners(lane_sizes, s.gpus_per_cluster)
    values, host = [0] * s.gpus_per_cluster, [0] * s.gpus_per_cluster
    for k, (a, b) in enumerate(cut):
        values[owner[k]] += lane_sizes[k]
        host[owner[k]] += sum(per_unit[a:b])
    chunk = moves(s, units, cut, owner)["chunk_bytes"]
    peak = [h + 8 * n + (chunk if n else 0) for h, n in zip(host, values)]
    return {"cut": cut, "lane_sizes": lane_sizes, "owner": owner, "values": values, "host": host, "peak": peak}


def moves(s: Setup, units: list, cut: list, owner: list) -> dict:
    """One gather + scatter of θ in a site of ``s``'s layout: values read and written, those that stay on their
    rank, the largest piece one rank holds or reads of one lane, the one reused device buffer (``device_bytes``,
    = ``chunk_bytes``: 4 B x min(CHUNK, piece)), and the serial seconds (module docstring)."""
    stages = _stages(units, s)
    got = {"in": 0.0, "out": 0.0, "local_in": 0.0, "local_out": 0.0}
    piece = 0.0
    for k, (a, b) in enumerate(cut):
        read = [0.0] * s.pp  # per stage: TP rank 0's main values in this lane (the most a rank reads)
        read_split = [0.0] * s.pp  # per stage: a main rank's values of TP-split units
        held = [0.0] * s.pp  # per stage: a rank's written values in this lane
        for u in range(a, b):
            n, split = numel(units[u][2]), units[u][3]
            main_share, held_share, replicas = _shares(s, n, split)
            stage, replica = stages[u]
            read[stage] += main_share
            read_split[stage] += main_share if split else 0.0
            got["in"] += n
            got["out"] += n * replicas * (1 if replica is None else 2)
            for st in (stage,) if replica is None else (stage, replica):
                held[st] += held_share
        r = owner[k]
        mine = r // (s.tp * s.dp)
        if _is_main(s, r, split=False):
            got["local_in"] += read[mine]
        elif _is_main(s, r, split=True):
            got["local_in"] += read_split[mine]
        got["local_out"] += held[mine]
        piece = max(piece, *held, *read)
    remote = {("gather", True): got["in"] - got["local_in"], ("gather", False): got["local_in"],
              ("scatter", True): got["out"] - got["local_out"], ("scatter", False): got["local_out"]}
    fabric = 4 * (remote[("gather", True)] + remote[("scatter", True)])
    host = sum(host_seconds(MOVE_WORK[key], n, s) for key, n in remote.items())
    pcie = 4 * sum((MOVE_WORK[key].get("h2d", 0) + MOVE_WORK[key].get("d2h", 0)) * n for key, n in remote.items())
    fabric_seconds = fabric / (s.intra_site_gb_s * 1e9)
    return {**got, "piece": piece, "fabric_bytes": fabric, "pcie_bytes": pcie, "fabric_seconds": fabric_seconds,
            "host_seconds": host, "seconds": fabric_seconds + host,
            "device_bytes": 4 * min(CHUNK, piece), "chunk_bytes": 4 * min(CHUNK, piece)}


def site_figures(s: Setup, units: list, lanes: int) -> dict:
    """One site's canonical figures at L = ``lanes`` beside the local layout's (as if every site had this layout)."""
    lo = lanes_of(s, units, lanes)
    busiest = max(range(len(lo["peak"])), key=lambda r: (lo["peak"][r], -r))
    load = lo["values"][busiest]
    local = predict(s)
    apart = local["boundary"]["lands_apart"]
    per_round = 2 if s.overlap != "none" and apart else 1  # θ changes at the boundary and at a landing apart
    mv = moves(s, units, lo["cut"], lo["owner"])
    # the round logic on the busiest owner, over its lanes' values, one core: boundary.py with θ on the host (the
    # local layout's GPU-host copies counted as host copies: an upper bound)
    logic = boundary_seconds(replace(s, outer_state_device="cpu", pcie_gb_s=1e12), {"max_rank_numel": load}, apart)
    lane_rb = round_bytes(s, [(1, [u[2] for u in units[a:b]]) for a, b in lo["cut"]])
    return {
        "layout": (s.tp, s.pp, s.dp), "ranks": s.gpus_per_cluster, "lanes": lanes,
        "lanes_per_rank": max(lo["owner"].count(r) for r in range(s.gpus_per_cluster)),
        "busiest_rank": busiest, "rank_values": load, "host_bytes": lo["host"][busiest],
        "host_bytes_per_value": lo["host"][busiest] / load, "host_peak_bytes": lo["peak"][busiest],
        "device_bytes": mv["device_bytes"], "chunk_bytes": mv["chunk_bytes"], "moves": mv, "moves_per_round": per_round,
        "moves_seconds_per_round": per_round * mv["seconds"], "round_logic_seconds": logic["seconds"],
        "bytes_per_round": lane_rb["dilocox"], "round_compute_seconds": local["round_compute_seconds"],
        "local": {"host_bytes": local["memory"]["cpu_bytes"], "device_bytes": local["memory"]["gpu_bytes"],
                  "rank_values": local["memory"]["rank_numel"], "boundary_seconds": local["boundary"]["seconds"],
                  "bytes_per_round": local["methods"]["dilocox"]["bytes_per_cluster"]},
    }


def price(s: Setup, layouts: Optional[list] = None) -> dict:
    """Every site's canonical figures at L = ``s.lanes`` (sites of ``layouts``, else C sites of ``s``'s layout),
    and the verdict: ``refusal`` (None when every site's busiest rank peaks within ``s.host_memory_gb``) and
    ``smallest_lanes`` (the smallest L that fits every site, None when none does)."""
    layouts = [tuple(x) for x in layouts] if layouts else [(s.tp, s.pp, s.dp)] * s.clusters
    sites = [replace(s, tp=tp, pp=pp, dp=dp, clusters=len(layouts)) for tp, pp, dp in layouts]
    units = canonical_units(sites[0], sites[0].tp)
    for site in sites[1:]:
        if canonical_units(site, site.tp) != units:
            raise ValueError(f"the sites' padded vocabularies differ ({_pad_vocab(s.vocab, sites[0].tp)} at TP"
                             f"{sites[0].tp}, {_pad_vocab(s.vocab, site.tp)} at TP{site.tp}): the rendezvous refuses "
                             f"them; give every site the same padded vocabulary (--make-vocab-size-divisible-by)")
    if not 1 <= s.lanes <= len(units):
        raise ValueError(f"--lanes {s.lanes}: the model has {len(units)} global tensors: use 1 to {len(units)}")
    cap = s.host_memory_gb * 1e9
    figures = [site_figures(site, units, s.lanes) for site in sites]
    out = {"lanes": s.lanes, "host_memory_gb": s.host_memory_gb, "intra_site_gb_s": s.intra_site_gb_s,
           "units": len(units), "numel": sum(numel(u[2]) for u in units), "sites": figures,
           "equal_layouts": len(set(layouts)) == 1, "smallest_lanes": None, "refusal": None}
    if any(f["host_peak_bytes"] > cap for f in figures):
        out["smallest_lanes"] = smallest_lanes(sites, units, cap)
        out["refusal"] = refusal(out, sites, units)
    return out


def smallest_lanes(sites: list, units: list, cap: float) -> Optional[int]:
    """The smallest L whose busiest rank peaks within ``cap`` bytes on every site. A lane keeps at least total / L
    bytes and a rank at least total / W, so the search starts at total / cap lanes and stops at once where a site's
    ranks cannot share the total."""
    total = sum(lanes_of(sites[0], units, 1)["host"])
    if any(total / site.gpus_per_cluster > cap for site in sites):
        return None
    for lanes in range(max(1, math.ceil(total / cap)), len(units) + 1):
        if all(max(lanes_of(site, units, lanes)["peak"]) <= cap for site in sites):
            return lanes
    return None


def refusal(out: dict, sites: list, units: list) -> str:
    """What to change, in words: the smallest L that fits, or (equal layouts) the local layout."""
    i = max(range(len(sites)), key=lambda j: out["sites"][j]["host_peak_bytes"])
    f = out["sites"][i]
    tp, pp, dp = f["layout"]
    head = (f"the canonical layout at --lanes {out['lanes']} needs {gb(f['host_peak_bytes'])} of host "
            f"memory on one rank (site {i}, TP{tp} PP{pp} DP{dp}, rank {f['busiest_rank']}: "
            f"{gb(f['host_bytes'])} of outer state for {f['rank_values'] / 1e9:.3f}B values, and its "
            f"rounds' and moves' buffers), above --host-memory-gb {out['host_memory_gb']:g}: ")
    local = ""
    if out["equal_layouts"]:
        loc = f["local"]
        local = (f"the local layout (--exchange-layout local, the default: {gb(loc['host_bytes'])} on the "
                 f"host and {gb(loc['device_bytes'])} on the GPU per rank), as the sites' layouts are equal")
    if out["smallest_lanes"] is not None:
        fit = max(max(lanes_of(site, units, out["smallest_lanes"])["peak"]) for site in sites)
        return head + (f"use --lanes {out['smallest_lanes']} (--dilocox-lanes in the run: the smallest L that fits "
                       f"every site, at most {gb(fit)} per rank)") + (f", or {local}" if local else "")
    total = sum(lanes_of(sites[0], units, 1)["host"])
    return head + (f"no lane count fits (a site keeps {gb(total)} of outer state over its ranks, the "
                   f"largest tensor alone {gb(max(unit_host_bytes(sites[0], u[2]) for u in units))}): more "
                   f"ranks per site or more host memory per rank" + (f"; or {local}" if local else ""))


def check(out: dict):
    """Raise ``PlanRefused`` with the refusal, if any."""
    if out["refusal"]:
        raise PlanRefused(out["refusal"])
