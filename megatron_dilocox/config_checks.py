"""The checks of every DiLoCoX setting (config.py's ``DiLoCoXConfig.validate``), before any process group is made:
a bad value stops the run with a message that names the flag and what to change. The choices each setting
takes and the flag names are here too; config.py imports them (it defines the knobs, this module checks them)."""
from __future__ import annotations

import math

from megatron_dilocox.compression.sparse_form import MAX_CHUNK  # (no torch import)

OVERLAP_MODES = ("none", "one-step-delay", "eager")
LOWRANK_BASES = ("local", "shared")
QUANT_BITS = (1, 4, 8, 16, 32)
OUTER_STATE_DEVICES = ("cpu", "param")
PEER_FAILURE_POLICIES = ("stop", "continue")
COORDINATOR_MODES = ("embedded", "standalone")
EXCHANGE_LAYOUTS = ("local", "canonical")
EXCHANGE_SCHEMES = ("auto", "all-gather", "reduce-scatter")
SECRET_ENV = "DILOCOX_SECRET"


class DiLoCoXConfigError(ValueError):
    """A DiLoCoX setting is invalid; the message names the flag and the fix."""


DiLoCoXConfigError.__module__ = "megatron_dilocox.config"  # its public home: the last traceback line names it there


def flag_name(field_name: str) -> str:
    """The --dilocox-* flag of a config field (the parser, error messages and docs/configuration.md's table use it)."""
    return "--dilocox-" + field_name.replace("_", "-")


def no_flag_name(field_name: str) -> str:
    """The --dilocox-no-* form that sets a boolean field to False."""
    return "--dilocox-no-" + field_name.replace("_", "-")


def validate(cfg):  # cfg: a config.DiLoCoXConfig
    """Raise DiLoCoXConfigError for the first invalid setting; return ``cfg`` when all are valid."""

    def fail(name: str, msg: str):
        raise DiLoCoXConfigError(f"{flag_name(name)}: {msg}")

    def need_int(name: str, lo: int):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int):
            fail(name, f"must be an integer, got {v!r}")
        if v < lo:
            fail(name, f"must be >= {lo}, got {v}")

    need_int("num_clusters", 1)
    need_int("cluster_id", 0)
    if cfg.cluster_id >= cfg.num_clusters:
        fail("cluster_id", f"must be < --dilocox-num-clusters ({cfg.num_clusters}), got {cfg.cluster_id}")
    if cfg.num_clusters > 1:
        if not cfg.rendezvous:
            fail("rendezvous", "is required with more than one cluster: give HOST:PORT of cluster 0")
        addresses = cfg.rendezvous.split(",")
        for address in addresses:
            host, sep, port = address.strip().rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                fail("rendezvous", f"must be HOST:PORT with a port in 1..65535, got {cfg.rendezvous!r}")
        if len(addresses) > 1 and cfg.coordinator != "standalone":
            fail("rendezvous", f"lists {len(addresses)} addresses, but a standby address needs "
                               f"--dilocox-coordinator standalone (embedded: cluster 0's HOST:PORT only)")
        if not cfg.secret:
            fail("secret", f"is required with more than one cluster: set ${SECRET_ENV} on every cluster")
    if not (isinstance(cfg.timeout_seconds, (int, float)) and math.isfinite(cfg.timeout_seconds)
            and cfg.timeout_seconds > 0):
        fail("timeout_seconds", f"must be a positive number of seconds, got {cfg.timeout_seconds!r}")

    if cfg.coordinator not in COORDINATOR_MODES:
        fail("coordinator", f"must be one of {', '.join(COORDINATOR_MODES)}, got {cfg.coordinator!r}")
    if cfg.on_peer_failure not in PEER_FAILURE_POLICIES:
        fail("on_peer_failure", f"must be one of {', '.join(PEER_FAILURE_POLICIES)}, got {cfg.on_peer_failure!r}")

    need_int("h", 1)
    need_int("fragments", 1)
    need_int("slow_link_fragments", 1)
    if cfg.fragments > 1:
        if cfg.overlap == "eager":  # (validated before --dilocox-overlap itself: name what it is)
            fail("fragments", "needs --dilocox-overlap one-step-delay (or none): eager's stand-in moves a "
                              "fragment against the rest of the model at each of its boundaries (Python docs, "
                              "H = 100, F = 4, τ = 25: validation 4.93 with eager, 4.66 with one-step-delay)")
        if min(cfg.h, cfg.resolved_h_min) < cfg.fragments:
            fail("fragments", f"needs --dilocox-h and --dilocox-h-min >= {cfg.fragments} (a fragment's round "
                              f"ends every H/F inner steps), got H = {cfg.h}, H min = {cfg.resolved_h_min}")
    for name in ("h_min", "h_max"):
        if getattr(cfg, name) is not None:
            need_int(name, 1)
    if not cfg.resolved_h_min <= cfg.h <= cfg.resolved_h_max:
        fail("h", f"must lie within [--dilocox-h-min, --dilocox-h-max] = "
                  f"[{cfg.resolved_h_min}, {cfg.resolved_h_max}], got {cfg.h}")
    if not (0.0 <= cfg.adaptive_h_margin <= 10.0):
        fail("adaptive_h_margin", f"must be in [0, 10], got {cfg.adaptive_h_margin}")
    if cfg.overlap not in OVERLAP_MODES:
        fail("overlap", f"must be one of {', '.join(OVERLAP_MODES)}, got {cfg.overlap!r}")
    if cfg.overlap_steps is not None:
        need_int("overlap_steps", 0)

    if cfg.delay_local_weight is not None and not (
            isinstance(cfg.delay_local_weight, (int, float)) and 0.0 <= cfg.delay_local_weight <= 1.0):
        fail("delay_local_weight", f"must be in [0, 1], got {cfg.delay_local_weight!r}")
    if cfg.outer_lr is not None and not (
            isinstance(cfg.outer_lr, (int, float)) and math.isfinite(cfg.outer_lr) and cfg.outer_lr > 0):
        fail("outer_lr", f"must be a positive finite number, got {cfg.outer_lr!r}")
    if cfg.outer_lr_warmup_iters is not None and not (
            isinstance(cfg.outer_lr_warmup_iters, int) and cfg.outer_lr_warmup_iters >= 0):
        fail("outer_lr_warmup_iters", f"must be a whole number of iterations >= 0, got {cfg.outer_lr_warmup_iters!r}")
    if not (0.0 <= cfg.resolved_outer_momentum < 1.0):
        fail("outer_momentum", f"must be in [0, 1), got {cfg.outer_momentum}")
    if cfg.outer_state_device not in OUTER_STATE_DEVICES:
        fail("outer_state_device", f"must be one of {', '.join(OUTER_STATE_DEVICES)}, "
                                   f"got {cfg.outer_state_device!r}")

    need_int("lowrank_rank", 1)
    for name in ("lowrank_rank_min", "lowrank_rank_max"):
        if getattr(cfg, name) is not None:
            need_int(name, 1)
    if not cfg.resolved_rank_min <= cfg.lowrank_rank <= cfg.resolved_rank_max:
        fail("lowrank_rank", f"must lie within [--dilocox-lowrank-rank-min, --dilocox-lowrank-rank-max] = "
                             f"[{cfg.resolved_rank_min}, {cfg.resolved_rank_max}], got {cfg.lowrank_rank}")
    if cfg.lowrank_basis not in LOWRANK_BASES:
        fail("lowrank_basis", f"must be one of {', '.join(LOWRANK_BASES)}, got {cfg.lowrank_basis!r}")
    need_int("lowrank_local_iters", 1)
    need_int("lowrank_min_dim", 2)
    if not (isinstance(cfg.min_compression, (int, float)) and math.isfinite(cfg.min_compression)
            and cfg.min_compression >= 1):
        fail("min_compression", f"must be a number >= 1 (1 = no byte budget), got {cfg.min_compression!r}")
    if not (0.0 < cfg.energy_threshold <= 1.0):
        fail("energy_threshold", f"must be in (0, 1], got {cfg.energy_threshold}")
    if not (isinstance(cfg.error_decay, (int, float)) and 0.0 <= cfg.error_decay <= 1.0):
        fail("error_decay", f"must be in [0, 1], got {cfg.error_decay!r}")
    if cfg.quant_bits not in QUANT_BITS:
        fail("quant_bits", f"must be one of {', '.join(map(str, QUANT_BITS))} (32 = off), got {cfg.quant_bits!r}")
    need_int("quant_block_size", 2)
    if cfg.quant_bits == 4 and cfg.quant_block_size % 2:
        fail("quant_block_size", f"must be even with 4-bit quantization, got {cfg.quant_block_size}")
    need_int("seed", 0)
    need_int("sparse_k", 0)
    if cfg.sparse_k:
        need_int("sparse_chunk", 2)
        if not cfg.sparse_k <= cfg.sparse_chunk <= MAX_CHUNK:
            fail("sparse_chunk", f"must lie within [--dilocox-sparse-k, {MAX_CHUNK}] = [{cfg.sparse_k}, "
                                 f"{MAX_CHUNK}] (an index is 16 bits), got {cfg.sparse_chunk}")
        if cfg.exchange_scheme == "reduce-scatter" and not cfg.link_sizes_rounds:
            fail("exchange_scheme", "reduce-scatter sums payloads on the way, and sparse payloads (each site's "
                                    "own indices) cannot be summed; without the link budget every round is "
                                    "sparse: leave it auto, or drop --dilocox-sparse-k")
    if cfg.per_site_h:
        if not cfg.adaptive_h:
            fail("per_site_h", "needs --dilocox-adaptive-h (per-site H follows the measured step times)")
    if cfg.token_weight_unit not in ("step", "round"):
        fail("token_weight_unit", f"must be step or round, got {cfg.token_weight_unit!r}")
    if cfg.exchange_scheme not in EXCHANGE_SCHEMES:
        fail("exchange_scheme", f"must be one of {', '.join(EXCHANGE_SCHEMES)}, got {cfg.exchange_scheme!r}")
    if cfg.exchange_layout not in EXCHANGE_LAYOUTS:
        fail("exchange_layout", f"must be one of {', '.join(EXCHANGE_LAYOUTS)}, got {cfg.exchange_layout!r}")
    if cfg.lanes < 1:
        fail("lanes", f"must be at least 1, got {cfg.lanes}")
    if cfg.lanes > 1 and cfg.exchange_layout != "canonical":
        fail("lanes", "spreads the canonical exchange over a site's ranks: add --dilocox-exchange-layout canonical "
                      "(the local layout already exchanges on every rank)")
    return cfg
