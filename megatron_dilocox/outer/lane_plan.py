"""The lanes' plan: which whole tensors each lane holds, and which rank of a site owns each lane (pure Python).

The canonical exchange (``glue/lanes.py``, docs/algorithm.md#lanes) and the planner (``sim/canonical.py``) must cut
the model alike, so the rule lives here, with no torch import: the planner stays pure Python and prices the lanes
the run builds (``glue/lanes.py`` imports them from here).
"""
from __future__ import annotations


def split_lanes(sizes: list[int], lanes: int) -> list[tuple[int, int]]:
    """[first, end) unit ranges of ``lanes`` contiguous lanes over units of ``sizes`` values: the cut whose largest
    lane is smallest (a lane cannot be smaller than its largest tensor), every lane at least one unit."""
    if lanes > len(sizes):
        raise ValueError(f"--dilocox-lanes {lanes} is more than the model's {len(sizes)} global tensors: use at "
                         f"most {len(sizes)}")

    def pack(cap: int) -> list[tuple[int, int]]:
        out, first, acc = [], 0, 0
        for u, n in enumerate(sizes):
            if acc + n > cap and u > first:
                out.append((first, u))
                first, acc = u, 0
            acc += n
        return out + [(first, len(sizes))]
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # the smallest cap that packs into at most ``lanes`` lanes
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(pack(mid)) <= lanes else (mid + 1, hi)
    out = pack(lo)
    while len(out) < lanes:  # fewer lanes than asked: halve the largest lane of two units or more (under the cap)
        i = max((j for j in range(len(out)) if out[j][1] - out[j][0] > 1), key=lambda j: sum(sizes[slice(*out[j])]))
        a, b = out[i]
        half, acc, cut = sum(sizes[a:b]) / 2, 0, a + 1
        for u in range(a, b - 1):
            acc += sizes[u]
            cut = u + 1
            if acc >= half:
                break
        out[i:i + 1] = [(a, cut), (cut, b)]
    return out


def owners(lane_sizes: list[int], world: int) -> list[int]:
    """The rank of a ``world``-rank site that owns each lane: lane 0 on rank 0 (it leads the site's rounds), the
    others largest first to the rank holding the fewest values (the lowest such rank): the same on every rank."""
    load, out = [0] * world, [0] * len(lane_sizes)
    load[0] = lane_sizes[0]
    for k in sorted(range(1, len(lane_sizes)), key=lambda j: (-lane_sizes[j], j)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[k] = r
        load[r] += lane_sizes[k]
    return out

