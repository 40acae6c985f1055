"""The adaptation rules (docs/algorithm.md#adaptation). Pure functions of values every cluster holds identically.

Rank: from the cumulative energy the current rank captures (summed over clusters), grow (double) when
even the full rank keeps less than the threshold τ; shrink (at most by half per round) to the smallest
rank that keeps τ + (1 − τ)/2. The gap between the two levels is hysteresis: a rank that keeps just
about τ is neither dropped nor re-grown the next round. H: make a round's compute at least as long as the transfer it must hide. Link budget: send the most the
measured link carries in the time the round has to hide it (dense when it fits, else the largest rank).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence


def choose_rank(cum_energy: Sequence[float], total_energy: float, rank: int, threshold: float,
                rank_min: int, rank_max: int) -> int:
    """Next rank, in [rank_min, rank_max]. ``cum_energy[k-1]`` is the energy the top k components keep."""
    if total_energy <= 0 or not cum_energy:
        return rank
    kept = [c / total_energy for c in cum_energy]
    if kept[-1] < threshold:
        return min(rank_max, max(rank_min, 2 * rank))
    keep_on_shrink = threshold + 0.5 * (1.0 - threshold)
    enough = next((k for k, frac in enumerate(kept, start=1) if frac >= keep_on_shrink), rank)
    return max(rank_min, enough, rank // 2)


def steps_to_hide(comm_seconds: float, step_seconds: float, margin: float) -> int:
    """Inner steps a transfer of ``comm_seconds`` needs to hide behind, ``margin`` to spare: ceil(T_comm / T_step
    * (1 + margin)), rounding off the last bits of float error first (a product that is a whole number of steps in
    exact arithmetic must not gain a step from its last bit)."""
    return math.ceil(round(comm_seconds / step_seconds * (1.0 + margin), 9))


def choose_h(comm_seconds: float, step_seconds: float, h: int, margin: float, h_min: int, h_max: int) -> int:
    """Next H: ``steps_to_hide``, clamped to [h_min, h_max]; unchanged without data."""
    if comm_seconds <= 0 or step_seconds <= 0:
        return h
    return min(h_max, max(h_min, steps_to_hide(comm_seconds, step_seconds, margin)))


def choose_rank_for_link(round_bytes: Callable[[int], int], seconds: float, seconds_per_byte: float,
                         rank: int, rank_min: int, rank_max: int) -> int:
    """Next rank for a link that moves a byte in ``seconds_per_byte`` when a round's transfer has ``seconds`` to
    hide in: 0 (no low rank: every tensor sent whole, quantized) when that fits, else the largest rank in
    [rank_min, rank_max] that fits, else rank_min; unchanged without a measurement. ``round_bytes(r)`` is what
    a round sends at rank r (0: whole). The rate is measured on the payloads actually sent, latency included,
    so a link measured on small payloads looks slower than it is: the rule errs toward compressing."""
    if seconds_per_byte <= 0 or seconds <= 0:
        return rank
    fits = lambda r: round_bytes(r) * seconds_per_byte <= seconds  # noqa: E731
    if fits(0):
        return 0
    return next((r for r in range(rank_max, rank_min - 1, -1) if fits(r)), rank_min)
