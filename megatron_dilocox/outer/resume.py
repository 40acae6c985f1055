"""Saving and restoring a DiLoCoXSync with the inner optimizer's checkpoint (Megatron's or yours).

The state is everything a resumed run needs to continue bitwise: the round counters, H and τ, the link
measurements, φ and the round start, the outer momentum, the codec (error feedback, Q, rank) and a finished
round not yet applied. An in-flight round is finished first and saved as its result, so a checkpoint never
holds a transfer half done. A checkpoint written with different settings is refused, naming the settings (a
setting the checkpoint lacks, added to the package after it was written, counts as its default).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from megatron_dilocox.compression.codec import ExchangeResult
from megatron_dilocox.config import DiLoCoXConfig, flag_name, no_flag_name
from megatron_dilocox.outer import plan
from megatron_dilocox.outer.nesterov import LocalCorrection, OuterNesterov

_FIELDS = {f.name: f for f in dataclasses.fields(DiLoCoXConfig)}


def save(sync) -> dict:
    if sync._in_flight is not None:
        sync._done = sync._in_flight.result()
        sync._in_flight = None
    done = sync._done
    return {
        "config": sync.cfg.agreement_dict(), "outer_momentum": sync.cfg.resolved_outer_momentum,
        "round": sync.round, "steps_in_round": sync.steps_in_round, "iteration": sync.iteration,
        "round_tokens": sync.round_tokens, "launched_tokens": sync._launched_tokens,
        "round_steps": sync.round_steps, "launched_steps": sync._launched_steps,
        "clock": sync.clock.state_dict(),
        "h": sync.h, "tau": sync.tau, "shared_plan": list(sync.shared), "own_tokens": sync.own_tokens,
        "sent": dict(sync.sent), "shared_sent": dict(sync.shared_sent), "comm_seconds_prev": sync.comm_seconds_prev, "step_seconds": sync.step_seconds,
        "seconds_per_byte_prev": sync.link.seconds_per_byte,
        "anchor": [a.clone() for a in sync.anchor],
        "round_start": [s.clone() for s in sync.round_start] if sync.delayed else None,
        "outer": sync.outer.state_dict(),
        "codec": sync.codec.state_dict(),
        "pending": None if done is None else dict(vars(done), deltas=done.deltas and [d.clone() for d in done.deltas]),
        "correction": None if sync.correction is None else sync.correction.state_dict(),
    }


def _as_flag(name: str, value) -> str:
    """The command-line form of ``name = value`` (None: the flag left out, i.e. its default)."""
    if isinstance(value, bool):
        return flag_name(name) if value else no_flag_name(name)
    return f"(no {flag_name(name)})" if value is None else f"{flag_name(name)} {value}"


@torch.no_grad()
def load(sync, state: dict):
    mine = sync.cfg.agreement_dict()
    # a knob added since the checkpoint was written ran at its default then
    saved = state["config"] if "config" in state else state["fragments"][0]["config"]  # (streaming.py's state)
    theirs = {**{k: f.default for k, f in _FIELDS.items() if k in mine}, **saved}
    if mine.get("outer_lr") is None and theirs.get("outer_lr") == sync.cfg.resolved_outer_lr:
        theirs["outer_lr"] = None  # written when the default was a number (1.0, before 2026-12-05): the same lr
    if theirs.get("outer_momentum") is None:  # the default then: as resolved (0.3 at any C before 2026-12-07)
        theirs["outer_momentum"] = (state if "config" in state else state["fragments"][0]).get("outer_momentum", 0.3)
    if mine.get("outer_momentum") is None and theirs["outer_momentum"] == sync.cfg.resolved_outer_momentum:
        theirs["outer_momentum"] = None  # (the default now resolves to the same momentum)
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if diff:
        raise ValueError(f"DiLoCoX checkpoint was written with different settings: {diff}; to resume it, run "
                         f"with the saved ones: {' '.join(_as_flag(k, theirs.get(k)) for k in diff)} (in Python: "
                         f"{', '.join(f'{k}={theirs.get(k)!r}' for k in diff)}; now "
                         f"{', '.join(f'{k}={mine.get(k)!r}' for k in diff)})")
    sync.round, sync.steps_in_round, sync.iteration = state["round"], state["steps_in_round"], state["iteration"]
    # (checkpoints from before token weights: the steps of the round so far)
    sync.round_tokens = state.get("round_tokens", sync.steps_in_round * sync.tokens_per_step)
    sync._launched_tokens = state.get("launched_tokens", 0.0)
    # (checkpoints from before steps travelled with tokens: the steps of the round so far, of the round in flight)
    sync.round_steps = state.get("round_steps", sync.steps_in_round)
    sync._launched_steps = state.get("launched_steps", state.get("h", 1))
    sync.clock.load_state_dict(state.get("clock", state.get("budget", {})))  # ("budget": before the clock)
    sync.h, sync.comm_seconds_prev, sync.step_seconds = state["h"], state["comm_seconds_prev"], state["step_seconds"]
    sync.tau = state.get("tau", plan.fixed_tau(sync.cfg, sync.h))  # checkpoints from before τ was saved (τ was H)
    sync.shared = tuple(state.get("shared_plan", (sync.h, sync.tau)))  # (before the shared plan: this site's)
    sync.own_tokens = state.get("own_tokens", 0.0)
    sync.sent, sync.shared_sent = dict(state.get("sent", {})), dict(state.get("shared_sent", {}))
    sync.link.seconds_per_byte = state.get("seconds_per_byte_prev", 0.0)  # (from before the link budget)
    cfg, device = sync.cfg, sync.outer_device
    sync.anchor = [a.to(device, torch.float32).clone() for a in state["anchor"]]
    sync.outer = OuterNesterov.from_config(sync.anchor, cfg)
    sync.outer.load_state_dict(state["outer"])
    sync.round_start = ([s.to(device, torch.float32).clone() for s in state["round_start"]]
                        if sync.delayed else sync.anchor)
    sync.codec.load_state_dict(state["codec"])
    sync._done = None if state["pending"] is None else ExchangeResult(**state["pending"])
    if sync._done is not None:  # (a request to end belonged to the job that saved it: clock.py)
        sync._done.end_requested = False
    sync.correction = None
    if state.get("correction") is not None:
        sync.correction = LocalCorrection([a.shape for a in sync.anchor], cfg, device)
        sync.correction.load_state_dict(state["correction"])
    sync._last_hook = time.perf_counter()
