"""Which codec a link needs: the choice among the codecs whose loss was measured (pure Python).

For a setup (model, layout, C, link, H) every candidate codec is priced by the cost model (bytes per site per
round, the round's transfer, what of it is exposed beyond H steps of training, tokens/s against the ceiling) and
carries its loss against int4 whole as measured by the convergence benchmark (``LOSS_VS_INT4``; the figures and
their commands: docs/convergence.md#the-codec-a-link-needs). The rule:

    among the codecs that reach ``target`` of the ceiling's tokens/s, the one of least measured loss (ties: the
    fewer bytes); a codec whose loss was not measured at this model's proportions only when no measured one
    reaches the target; if none does, the most tokens/s.

Low rank's loss depends on the rank against the matrices' width and spectra (rank 6 of the benchmark's 128-wide
model is 4.7% of each spectrum; rank 8 of a width-8192 model 0.1%): the one point the benchmark measured says
nothing of another model's rank, so low rank counts as not measured. The sparse codec keeps k of every chunk
whatever the model's size, and int4 whole every value, so their losses are carried over (at the benchmark's H
and horizon: a caveat the report repeats).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from megatron_dilocox.config import LINK_MARGIN
from megatron_dilocox.sim.cost_model import Setup, predict, round_bytes

# loss at 1000 iterations against int4 whole at the same C and H (%), by the H it was measured at, then (k, chunk)
# of the sparse codec: two sites, the KJV (docs/convergence.md#the-codec-a-link-needs). A codec priced at H takes the
# figures of the largest measured H not above it (the smallest where H is below them all): fewer rounds leave error
# feedback less time to deliver what a round held back, so a figure from shorter rounds would flatter it
LOSS_VS_INT4: dict = {
    10: {(64, 4096): 8.30, (96, 4096): 6.65, (256, 4096): 3.32},
    100: {(64, 4096): 15.64, (96, 4096): 13.64, (256, 4096): 7.64},
}


def candidates(s: Setup) -> dict:
    """name -> the setup that codec runs with (the user's H, link and layout)."""
    out = {"int4 whole": replace(s, lowrank=False, bits=4, sparse_k=0)}
    for k in (256, 96, 64):
        out[f"sparse {k}/4096"] = replace(s, sparse_k=k, sparse_chunk=4096)
    for r in (1024, 256, 64, 32, 8):
        out[f"low rank {r}"] = replace(s, lowrank=True, rank=r, bits=4, sparse_k=0)
    return out


def measured_loss(name: str, c: Setup) -> Optional[float]:
    """The codec's measured loss against int4 whole (%) at about its H, or None where it was not measured at these
    proportions (or at that H)."""
    if name.startswith("low rank"):
        return None
    if name == "int4 whole":
        return 0.0
    hs = sorted(LOSS_VS_INT4)
    at = max([h for h in hs if h <= c.h] or hs[:1])
    return LOSS_VS_INT4[at].get((c.sparse_k, c.sparse_chunk))


def choose(s: Setup, target: float = 0.9, h_max: Optional[int] = None) -> dict:
    """Every candidate priced, the chosen one, and why. Each codec runs at the smallest H from ``s.h`` up to
    ``h_max`` (default ``s.h``) whose H steps hide its transfer with the link budget's margin (its transfer in H /
    (1 + LINK_MARGIN) steps: the rule by which a run's link budget sizes its rounds, outer/plan.py), so that a run
    given ``run_flags`` takes the chosen codec on this link."""
    rows = []
    for name, c in candidates(s).items():
        p = predict(c)
        if p["views_rank_too_large"]:
            continue
        step = p["step_seconds"]
        need = math.ceil(p["methods"]["dilocox"]["comm_seconds"] / step * (1 + LINK_MARGIN))
        c = replace(c, h=min(max(s.h, need), max(h_max or s.h, s.h)))
        p = predict(c)
        x, ceiling = p["methods"]["dilocox"], p["methods"]["ceiling"]["tokens_per_s"]
        rows.append({"codec": name, "h": c.h, "bytes_per_site": x["bytes_per_cluster"],
                     "comm_seconds": x["comm_seconds"],
                     "exposed_seconds": x["exposed_seconds"], "of_ceiling": x["tokens_per_s"] / ceiling,
                     "tokens_per_s": x["tokens_per_s"], "loss_vs_int4_pct": measured_loss(name, c),
                     # one site's payload per parameter (what one peer receives from it: the round at C = 2)
                     "bits_per_param": 8 * round_bytes(replace(c, clusters=2))["dilocox"] / p["params"],
                     # a run's link budget sends whole only where it hides within H max (else sparse or low rank)
                     "runs": not (name == "int4 whole" and need > c.h)})
    fast = [r for r in rows if r["of_ceiling"] >= target and r["runs"]]
    known = [r for r in fast if r["loss_vs_int4_pct"] is not None]
    if known:
        best = min(known, key=lambda r: (r["loss_vs_int4_pct"], r["bytes_per_site"]))
        why = (f"the least measured loss ({best['loss_vs_int4_pct']:+.2f}% vs int4 whole) among the codecs at "
               f">= {target:g} of the ceiling")
    elif fast:  # (as the planner: the shortest round, then the most bytes it can carry)
        best = min(fast, key=lambda r: (r["h"], -r["bytes_per_site"]))
        why = (f"no codec of measured loss reaches {target:g} of the ceiling: of those that do, the shortest round, "
               f"its loss not measured")
    else:
        best = max(rows, key=lambda r: r["of_ceiling"])
        why = f"no codec reaches {target:g} of the ceiling: the most tokens/s"
    return {"chosen": best["codec"], "why": why, "target": target, "candidates": rows, "step_seconds": step,
            "flags": run_flags(best["codec"], s.h, max(h_max or s.h, s.h))}


def run_flags(codec: str, h: int, h_max: int) -> str:
    """The flags that make a run's link budget follow this choice (outer/plan.py): it sends a round whole when the
    measured link carries it within --dilocox-h-max steps, else, with --dilocox-sparse-k, sparse at the shortest H
    that hides it, else the rank the link carries: so on the link priced here a run takes the chosen codec, and
    follows the link if it turns faster or slower."""
    flags = f"--dilocox-h {h} --dilocox-h-max {h_max}"
    if codec.startswith("sparse"):
        k, chunk = codec.split()[1].split("/")
        flags = f"--dilocox-sparse-k {k}" + ("" if chunk == "4096" else f" --dilocox-sparse-chunk {chunk}") + " " + flags
    return flags


def report(out: dict) -> list[str]:
    lines = [f"{'codec':<16}{'H':>5}{'GB/round':>10}{'bits/param':>11}{'comm s':>9}{'exposed s':>10}{'of ceiling':>11}"
             f"{'loss vs int4':>13}"]
    for r in out["candidates"]:
        loss = "not measured" if r["loss_vs_int4_pct"] is None else f"{r['loss_vs_int4_pct']:+.2f}%"
        mark = " <-" if r["codec"] == out["chosen"] else "" if r["runs"] else " (a run goes sparse: H max too short)"
        lines.append(f"{r['codec']:<16}{r['h']:>5}{r['bytes_per_site'] / 1e9:>10.2f}{r['bits_per_param']:>11.3f}"
                     f"{r['comm_seconds']:>9.0f}{r['exposed_seconds']:>10.0f}{r['of_ceiling']:>11.3f}{loss:>13}{mark}")
    lines.append(f"codec: {out['chosen']} ({out['why']}; losses at 1000 iterations, two sites, at the largest measured "
                 f"H ({', '.join(map(str, sorted(LOSS_VS_INT4)))}) not above the codec's: "
                 "docs/convergence.md#the-codec-a-link-needs)")
    lines.append(f"run with: {out['flags']} (the link budget sends whole when the link carries it within H max, else "
                 f"{'sparse' if out['flags'].startswith('--dilocox-sparse') else 'low rank'}: outer/plan.py)")
    return lines
