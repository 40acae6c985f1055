"""The composition matrix: the factors of a real run, the pairs of levels that cannot run together (and why), and the
runs that cover every other pair at least once (a pairwise covering array). docs/composition.md is rendered from
here (``scripts/composition_matrix.py``), and tests/test_composition.py runs each row with real Megatron.

Why pairs: a default that breaks another feature shows up when the two meet in one run; covering every pair of
levels at least once catches those with a handful of runs instead of every combination (2^6 x 3 = 192).

The rows are chosen from every valid combination by seeded greedy covers (``covering_rows``): the fewest rows
win, then the cheapest (fewer events, sites and processes). The same factors always give the same rows.
"""
from __future__ import annotations

import itertools
import random
from typing import Iterable

FACTORS: dict[str, tuple[str, ...]] = {
    "event": ("none", "restart", "rejoin"),  # none; every process killed and restarted; one site lost and rejoined
    "layout": ("local", "canonical"),  # --dilocox-exchange-layout (canonical: the sites' layouts differ)
    "rounds": ("per-site", "lockstep"),  # the default, or --dilocox-no-per-site-h
    "link": ("fast", "slow"),  # slow: the rounds go as fragments (what the slow-link switch moves to)
    "policy": ("stop", "continue"),  # --dilocox-on-peer-failure
    "model": ("dense", "moe"),  # the tiny GPT, or its MoE form (4 experts, top-2)
    "sites": ("equal", "half-core"),  # both unthrottled, or site 1 at half a core (a cgroup CPU quota)
}

# pairs of levels that cannot run together today, and why; a pair that only fails through a third factor is found by
# ``excluded()`` and named with its cause
APART: dict[frozenset, str] = {
    frozenset({("event", "rejoin"), ("policy", "stop")}):
        "impossible: under stop a lost site stops the run (saving), so nothing is left to rejoin; a restart of "
        "every site resumes it (event restart)",
    frozenset({("layout", "canonical"), ("model", "moe")}):
        "refused before training: the canonical exchange does not map expert parameters yet (glue/canonical.py)",
    frozenset({("layout", "canonical"), ("link", "slow")}):
        "refused before training: the canonical exchange needs --dilocox-fragments 1, and the slow-link switch "
        "stays off with it (outer/auto.py)",
}

# what a level costs in a run, to break ties toward cheaper rows (seconds of the tiny GPT on the 2-core host, roughly)
COST = {("event", "restart"): 40, ("event", "rejoin"): 40, ("layout", "canonical"): 15, ("model", "moe"): 15,
        ("sites", "half-core"): 10, ("link", "slow"): 5}


def _pairs(row: dict) -> set:
    items = sorted(row.items())
    return {frozenset({a, b}) for a, b in itertools.combinations(items, 2)}


def valid(row: dict) -> bool:
    """No pair of the row is apart."""
    return not any(p in APART for p in _pairs(row))


def all_rows() -> list[dict]:
    """Every valid combination of levels, in the fixed order of FACTORS."""
    names = list(FACTORS)
    rows = [dict(zip(names, levels)) for levels in itertools.product(*FACTORS.values())]
    return [r for r in rows if valid(r)]


def possible_pairs() -> set:
    """Every pair of levels (of two factors) that some valid row holds."""
    return set().union(*(_pairs(r) for r in all_rows()))


def excluded() -> dict[frozenset, str]:
    """Every pair no valid row holds: APART's, and those ruled out through a third factor (with the reasons)."""
    names = list(FACTORS)
    every = {frozenset({(a, x), (b, y)}) for a, b in itertools.combinations(names, 2)
             for x in FACTORS[a] for y in FACTORS[b]}
    out = {}
    for pair in sorted(every - possible_pairs(), key=sorted):
        out[pair] = APART.get(pair) or _through_a_third(pair)
    return out


def _through_a_third(pair: frozenset) -> str:
    """Why a pair that is not apart itself still has no valid row: a factor each of whose levels is apart from
    one of the two."""
    for name in FACTORS:
        if name in {k for k, _ in pair}:
            continue
        clash = {level: next((item for item in sorted(pair) if frozenset({item, (name, level)}) in APART), None)
                 for level in FACTORS[name]}
        if all(clash.values()):
            return (f"no {name} allows both: " + ", ".join(f"{name} {level} is apart from {k} {v}"
                                                            for level, (k, v) in clash.items()))
    return "no valid run holds it"


def cost(row: dict) -> int:
    return sum(COST.get(item, 0) for item in row.items())


def covering_rows(tries: int = 1000) -> list[dict]:
    """Rows (valid combinations) that together hold every possible pair, as few and as cheap as ``tries`` seeded
    greedy covers find: each next row covers the most pairs not yet covered (seed 0: exactly the most, ties to the
    cheaper row; seed k: any row within a random slack of 0-2 pairs of the most, picked by the seed), then rows
    the others already cover are dropped; the fewest rows win, then the cheapest. Deterministic. (Plain greedy
    needs 9 rows here, three of them restarts; the seeded covers find 7 with two.)"""
    rows = all_rows()
    need, pairs, costs = possible_pairs(), [_pairs(r) for r in rows], [cost(r) for r in rows]
    best = None
    for seed in range(tries):
        rng = random.Random(seed)
        left, chosen = set(need), []
        while left:
            gains = [len(p & left) for p in pairs]
            top = max(gains)
            slack = rng.choice((0, 0, 1, 2)) if seed else 0
            near = [i for i, g in enumerate(gains) if g >= top - slack]
            pick = rng.choice(near) if seed else min(near, key=lambda i: (costs[i], i))
            chosen.append(pick)
            left -= pairs[pick]
        for k in range(len(chosen) - 1, -1, -1):  # (a row the others cover is dropped)
            rest = chosen[:k] + chosen[k + 1:]
            if need <= set().union(*(pairs[i] for i in rest)):
                chosen = rest
        key = (len(chosen), sum(costs[i] for i in chosen))
        if best is None or key < best[0]:
            best = (key, chosen)
    return [rows[i] for i in best[1]]


def covered(rows: Iterable[dict]) -> set:
    return set().union(*(_pairs(r) for r in rows))


def row_id(row: dict) -> str:
    """A short name for a row, e.g. ``restart-canonical-per-site-fast-stop-dense-half-core``."""
    return "-".join(row[k] for k in FACTORS)


def render() -> str:
    """docs/composition.md's generated region: the rows, the pairs apart with their reasons, the count."""
    rows = covering_rows()
    lines = ["| run | " + " | ".join(FACTORS) + " |", "|---|" + "---|" * len(FACTORS)]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | " + " | ".join(r[k] for k in FACTORS) + " |")
    pairs = possible_pairs()
    lines += ["", f"{len(rows)} runs cover all {len(pairs)} pairs of levels that can run together "
                  f"(of {len(pairs) + len(excluded())}).", "",
              "| pair | why it is not run |", "|---|---|"]
    for pair, why in excluded().items():
        a, b = sorted(pair)
        lines.append(f"| {a[0]} {a[1]} + {b[0]} {b[1]} | {why} |")
    return "\n".join(lines)
