"""Sites that differ in size and speed: each site's H, its weight, and the run's throughput against lockstep.

A site's inner step takes s_c = (its tokens per step) / (its GPUs x tokens/s per GPU). In lockstep rounds every
site runs the same H, so a round lasts H x max_c s_c and a faster site waits the difference at every boundary.
Sized per site (docs/algorithm.md#sites-of-different-speeds; --dilocox-per-site-h runs the same rule), the slowest site runs H steps and sets the round's
wall time T = H x max_c s_c (at least the transfer's time with the margin, when it is given), and every site runs
H_c = floor(T / s_c) steps: the most that reach the boundary no later than the slowest site, so a site waits
less than one of its own steps per round. Each site's pseudo-gradient is weighted by its tokens per step (codec.py:
one token, one vote; the pseudo-gradient itself already grows with H_c), so the weight does not change with H.

The figures (tokens/s of the run) are what the compute gives; the exchange is assumed hidden behind the next
round (the overlap modes), as the cost model assumes for DiLoCoX rounds. Pure arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass
class Site:
    gpus: int
    tokens_per_gpu_s: float  # measured (or expected) training throughput per GPU
    tokens_per_step: float  # this site's global batch, in tokens

    @property
    def step_seconds(self) -> float:
        return self.tokens_per_step / (self.gpus * self.tokens_per_gpu_s)

    @property
    def tokens_per_s(self) -> float:
        return self.gpus * self.tokens_per_gpu_s


def parse_sites(text: str, default_tokens_per_step: float) -> list[Site]:
    """``GPUS:TOKENS_PER_GPU_S[:TOKENS_PER_STEP],...`` -> sites (tokens per step defaults to
    ``default_tokens_per_step``). Raises ValueError naming the bad entry."""
    sites = []
    for entry in text.split(","):
        parts = entry.strip().split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            gpus, rate = int(parts[0]), float(parts[1])
            tokens = float(parts[2]) if len(parts) == 3 else float(default_tokens_per_step)
            if gpus < 1 or not rate > 0 or not tokens > 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"--sites: {entry.strip()!r} is not GPUS:TOKENS_PER_GPU_S[:TOKENS_PER_STEP] with positive "
                             f"numbers (e.g. --sites 64:3200,128:1500)") from None
        sites.append(Site(gpus, rate, tokens))
    if len(sites) < 2:
        raise ValueError("--sites: give at least two sites, comma-separated (e.g. --sites 64:3200,128:1500)")
    return sites


def plan_sites(sites: list[Site], h: int, comm_seconds: float = 0.0, margin: float = 0.1) -> dict:
    """Per-site H and weights, and the run's tokens/s per site-sized rounds, in lockstep, and the ideal (every
    site at its own full speed)."""
    slowest = max(s.step_seconds for s in sites)
    round_seconds = max(h * slowest, comm_seconds * (1.0 + margin))
    hs = [max(1, math.floor(round_seconds / s.step_seconds + 1e-9)) for s in sites]
    tokens = [hc * s.tokens_per_step for hc, s in zip(hs, sites)]
    lock_h = max(h, math.ceil(round_seconds / slowest - 1e-9))  # lockstep: the slowest site's H for everyone
    lock_seconds = lock_h * slowest
    lock_tokens = [lock_h * s.tokens_per_step for s in sites]
    ideal = sum(s.tokens_per_s for s in sites)
    per_site = sum(tokens) / round_seconds
    lockstep = sum(lock_tokens) / lock_seconds
    return {
        "round_seconds": round_seconds,
        "sites": [{"gpus": s.gpus, "tokens_per_s": s.tokens_per_s, "step_seconds": s.step_seconds, "H": hc,
                   "weight": s.tokens_per_step / sum(x.tokens_per_step for x in sites), "wait_share": 1.0 - hc * s.step_seconds / round_seconds,
                   "lockstep_weight": lt / sum(lock_tokens),  # (equal H: the same weight)
                   "lockstep_wait_share": 1.0 - lock_h * s.step_seconds / lock_seconds}
                  for s, hc, lt in zip(sites, hs, lock_tokens)],
        "tokens_per_s": per_site, "lockstep_tokens_per_s": lockstep, "ideal_tokens_per_s": ideal,
        "vs_lockstep": per_site / lockstep, "vs_ideal": per_site / ideal, "lockstep_vs_ideal": lockstep / ideal,
    }


def report(p: dict, h: int, comm_seconds: Optional[float] = None) -> str:
    lines = [f"sites sized to their speed: round {p['round_seconds']:.2f} s (the slowest site's H = {h}"
             + (f", at least the transfer's {comm_seconds:.1f} s + margin" if comm_seconds else "") + ")",
             f"{'site':<6}{'GPUs':>6}{'tokens/s':>14}{'s/step':>9}{'H':>6}{'weight':>9}{'waits':>8}"
             f"{'lockstep weight':>17}{'lockstep waits':>16}"]
    for i, s in enumerate(p["sites"]):
        lines.append(f"{i:<6}{s['gpus']:>6}{s['tokens_per_s']:>14,.0f}{s['step_seconds']:>9.3f}{s['H']:>6}"
                     f"{s['weight']:>9.3f}{100 * s['wait_share']:>7.1f}%{s['lockstep_weight']:>17.3f}"
                     f"{100 * s['lockstep_wait_share']:>15.1f}%")
    lines.append(f"run: {p['tokens_per_s']:,.0f} tokens/s per-site H, {p['lockstep_tokens_per_s']:,.0f} lockstep "
                 f"({p['vs_lockstep']:.2f}x); every site at its own speed: {p['ideal_tokens_per_s']:,.0f} "
                 f"(per-site H reaches {100 * p['vs_ideal']:.1f}% of it, lockstep {100 * p['lockstep_vs_ideal']:.1f}%)")
    return "\n".join(lines)
