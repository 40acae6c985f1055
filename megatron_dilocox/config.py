"""Every DiLoCoX knob in one dataclass.

The Megatron flags (``--dilocox-*``) map one-to-one onto these fields; the core library (``outer/``,
``compression/``, ``net/``) takes nothing else. ``validate()`` (config_checks.py) is called before any process
group is made, so a bad value stops the run with a message that names the flag and what to change.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

# the choices of each setting, the flag names and the checks: config_checks.py (imported from here too)
from megatron_dilocox.config_checks import (COORDINATOR_MODES, EXCHANGE_LAYOUTS, EXCHANGE_SCHEMES,  # noqa: F401
                                            LOWRANK_BASES, OUTER_STATE_DEVICES, OVERLAP_MODES, PEER_FAILURE_POLICIES,
                                            QUANT_BITS, SECRET_ENV, DiLoCoXConfigError, flag_name, no_flag_name,
                                            validate)

# Megatron's parallel-layout arguments: what --dilocox-exchange-layout canonical lets sites differ in (the glue's
# fingerprint leaves them out then; the rendezvous names the flag when only they differ)
PARALLEL_LAYOUT_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                        "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
                        "expert_tensor_parallel_size", "data_parallel_size", "use_distributed_optimizer",
                        "use_layer_wise_distributed_optimizer")
# the link budget sizes a round's transfer to half the steps it has to hide in: the rate it scales comes from
# earlier rounds' payloads and varies (a tbf bucket's burst, host load, the other cluster's compute); with the
# adaptive-H margin (10%) instead, the ratio-325 link at H=10 exposed ~10% of wall time and H rose to 15. Here
# (no torch) so that the codec choice (sim/codec_choice.py) sizes rounds as a run's link budget will
LINK_MARGIN = 1.0
# default --dilocox-h-max = this x --dilocox-h. Adaptive H may lengthen rounds this far; the link budget does so
# to send them whole rather than cut the rank (outer/plan.py). On the ratio-325 link the main job's whole int4
# round took 18.1 s of 0.316 s steps, so at --dilocox-h 10 it hides at H = 115 (4x left it at 40, with rank 24)
H_MAX_FACTOR = 20
# default --dilocox-outer-lr-warmup-iters: a fifth of the run, at most this many iterations (docs/convergence.md)
OUTER_LR_WARMUP_CAP = 200
OUTER_LR_WARMUP_FRACTION = 0.2
# default --dilocox-outer-lr: whole rounds and synchronous fragments / fragments that overlap
# (DiLoCoXConfig.resolved_outer_lr)
OUTER_LR = 1.0
OUTER_LR_FRAGMENTS = 1.3
# default --dilocox-outer-momentum by the number of sites: (sites, momentum) where it was measured, linear between,
# flat outside (DiLoCoXConfig.resolved_outer_momentum; docs/convergence.md#many-sites)
OUTER_MOMENTUM_BY_SITES = ((2, 0.3), (4, 0.5))


def knob(default, help: str, **kw):
    """A config field with its flag help text (the --dilocox-* parser and docs/configuration.md's table read it)."""
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class DiLoCoXConfig:
    # Topology: which cluster this process belongs to, and where the clusters meet.
    num_clusters: int = knob(1, "number of clusters training together")
    cluster_id: int = knob(0, "this cluster's id, 0..num_clusters-1 (cluster 0 hosts the rendezvous)")
    rendezvous: Optional[str] = knob(None, "HOST:PORT of the rendezvous store: cluster 0's first node (embedded) or the "
                                           "standalone coordinator (then HOST:PORT,HOST2:PORT2 lists a standby)")
    coordinator: str = knob("embedded", "embedded (cluster 0's first rank hosts the store and decides the rounds) or "
                                        "standalone (python -m megatron_dilocox.coordinator at --dilocox-rendezvous "
                                        "does; any cluster, cluster 0 included, may then be lost)")
    secret: Optional[str] = knob(None, "shared secret; from $DILOCOX_SECRET, never a flag", repr=False)
    timeout_seconds: float = knob(600.0, "rendezvous and inter-cluster collective timeout, seconds")
    on_peer_failure: str = knob("stop", "when a cluster is lost mid-run: stop (drop the round, checkpoint, exit "
                                        "non-zero naming it) or continue (survivors carry on; it may rejoin)")

    # Rounds: H inner steps per outer round, adapted within [h_min, h_max].
    h: int = knob(50, "inner steps per outer round (initial H)")
    h_min: Optional[int] = knob(None, "lower bound for adaptive H (default: --dilocox-h)")
    h_max: Optional[int] = knob(None, "upper bound for adaptive H (default: 20 x --dilocox-h, room for the link "
                                      "budget's whole rounds on a slow link)")
    adaptive_h: bool = knob(True, "raise H when the transfer takes longer than H inner steps")
    adaptive_h_margin: float = knob(0.1, "adaptive H keeps the transfer this fraction shorter than a round")
    per_site_h: Optional[bool] = knob(None, "sites of different speeds: the slowest site runs H steps per round "
                                            "and every other site as many as fit in the same wall time (its own "
                                            "measured step time, up to 4x H), weighted by its tokens per step; the "
                                            "run ends when the sites' tokens together reach the planned total "
                                            "(under continue: what was trained plus what the sites training it "
                                            "still plan), and Megatron's LR schedule, evaluations, saves "
                                            "and exits follow that total. auto (unset): on in Megatron wherever the "
                                            "run allows it (adaptive H, no --rampup-batch-size), else "
                                            "lockstep, said in the log; off in the plain-PyTorch API "
                                            "(docs/algorithm.md#sites-of-different-speeds). "
                                            "--dilocox-no-per-site-h: lockstep rounds, every site H steps")
    overlap: str = knob("eager", "none (synchronous DiLoCo), one-step-delay or eager (both: the transfer hidden "
                                 "behind the next round, applied one round late; eager starts that round from a "
                                 "local proxy of the missing average)")
    fragments: int = knob(1, "Streaming DiLoCo: sync the model as this many fragments (equal runs of the "
                             "tensors laid end to end, cut between rows), each on its own round, their "
                             "boundaries H/F inner steps apart: "
                             "the same bytes per step, but each fragment's transfer is 1/F as long, so it lands "
                             "about H/F steps after it leaves; needs --dilocox-overlap one-step-delay or none "
                             "(docs/convergence.md)")
    slow_link_fragments: int = knob(8, "with --dilocox-fragments 1: once a landed round shows the link holds a "
                                       "round sent whole at least half-way into the next one, sync as this many "
                                       "fragments from the next boundary on, with one-step-delay (the state "
                                       "carried over exactly); 1: never. Only with adaptive τ (overlap-steps 0) "
                                       "and the link budget, and where fragments are allowed "
                                       "(H min >= it); not with --dilocox-sparse-k")
    # (None, from Python: always at the boundary, timing-free)
    overlap_steps: Optional[int] = knob(0, "τ: the average of a round is applied τ inner steps into the next "
                                           "round (the local progress of those τ steps is kept on top of it). "
                                           "0: twice the measured transfer in steps, in [1, H], each round (the "
                                           "first two, before a transfer is measured, at 1), and 0 "
                                           "(synchronous) where that is H and the transfer takes under half a "
                                           "step (always the case at H = 1 on a fast link); N: min(N, H) "
                                           "(N >= --dilocox-h-max: at the next boundary, the paper's one-step "
                                           "delay)")

    delay_local_weight: Optional[float] = knob(None, "weight w of the cluster's own unsynced progress while its "
                                                     "round is in flight: one-step-delay starts the next round at "
                                                     "φ − w δ_t (default 1); eager weighs δ_t − δ_{t−1} by w "
                                                     "(default (1 + 1/C)/2; the paper's proxy is 1/C)")

    # Outer optimizer: Nesterov SGD on the averaged pseudo-gradient.
    outer_lr: Optional[float] = knob(None, "outer learning rate, reached after --dilocox-outer-lr-warmup-iters "
                                           "(default 1.0; 1.3 for fragments that overlap: --dilocox-fragments "
                                           "with overlap, or after the slow-link switch; docs/convergence.md)")
    outer_lr_warmup_iters: Optional[int] = knob(None, "inner iterations over which the outer lr rises linearly to "
                                                      "--dilocox-outer-lr (a round launched at iteration i steps at "
                                                      "lr x min(1, i / N)); default: a fifth of --train-iters, at "
                                                      "most 200 (200 when the run length is unknown); 0: none")
    outer_momentum: Optional[float] = knob(None, "outer momentum (default by the number of sites: 0.3 up to "
                                                 "2, 0.5 from 4, linear between; docs/convergence.md#many-sites)")
    outer_nesterov: bool = knob(True, "Nesterov momentum for the outer step")
    outer_state_device: str = knob("cpu", "where anchor, momentum and round start live: cpu or param "
                                          "(beside the parameters)")

    # Compression: low-rank (PowerSGD-style) + block quantization, with error feedback.
    lowrank: bool = knob(True, "low-rank compression of matrices (with error feedback)")
    lowrank_rank: int = knob(16, "initial low-rank rank")
    lowrank_rank_min: Optional[int] = knob(None, "lower bound for adaptive rank (default: 1)")
    lowrank_rank_max: Optional[int] = knob(None, "upper bound for adaptive rank (default: 4 x --dilocox-lowrank-rank, "
                                                 "capped by each matrix's min(rows, cols) and by "
                                                 "--dilocox-min-compression)")
    min_compression: float = knob(100.0, "adaptive rank grows only while a round sends at most dense fp32 "
                                         "all-reduce bytes / this (with --dilocox-link-budget: until the link "
                                         "is measured)")
    link_budget: bool = knob(True, "with overlap and adaptive rank: size each round to the measured link, i.e. "
                                   "send the matrices whole (quantized) when that transfer takes at most half of "
                                   "--dilocox-overlap-steps (or --dilocox-h-min) inner steps; with adaptive H and "
                                   "τ, first lengthen the rounds (up to --dilocox-h-max) until it does; else the "
                                   "largest rank that does, or with --dilocox-sparse-k a sparse round "
                                   "(docs/convergence.md)")
    lowrank_basis: str = knob("local", "local: each cluster sends its own best rank-r factors (subspace iteration, "
                                        "all-gathered); shared: PowerSGD's one power iteration in a basis all "
                                        "clusters share (docs/convergence.md)")
    lowrank_local_iters: int = knob(4, "block power iterations per round for --dilocox-lowrank-basis local "
                                       "(local compute, no bytes)")
    lowrank_min_dim: int = knob(64, "matrices with min(rows, cols) below this are sent whole (quantized)")
    adaptive_rank: bool = knob(True, "adapt the rank to keep --dilocox-energy-threshold of the energy")
    energy_threshold: float = knob(0.9, "fraction of the pseudo-gradient energy adaptive rank keeps")
    error_decay: float = knob(1.0, "error feedback carries beta x the last residual into the next round "
                                   "(1 = classic error feedback; < 1 forgets old residual)")
    quant_bits: int = knob(4, "bits per transmitted value: 1 (sign x block mean |x|), 4, 8, 16 (bf16) or 32 (no quantization)")
    quant_block_size: int = knob(128, "values per quantization block (one fp32 scale each)")
    sparse_k: int = knob(0, "sparse exchange: every chunk of --dilocox-sparse-chunk values of a tensor sends its k "
                            "largest entries (of δ + e) with one sign bit each and 4 magnitudes per chunk, "
                            "all-gathered; replaces low rank. Under --dilocox-link-budget a round goes sparse "
                            "only when the link cannot carry it whole in the steps it has to hide in (adaptive H: "
                            "within --dilocox-h-max); without it every round; 0: off "
                            "(docs/algorithm.md#sparse-exchange)")
    sparse_chunk: int = knob(4096, "values per chunk of the sparse exchange (at most 32768; a tensor's last chunk "
                                   "is shorter)")
    seed: int = knob(1234, "seed shared by all clusters (warm-start Q)")
    exchange_scheme: str = knob("auto", "how summable payloads travel between clusters: reduce-scatter then "
                                        "all-gather of quantized chunks (each cluster sends about 2(C-1)/C of its "
                                        "payload, the average quantized once more by its chunk's owner) or "
                                        "all-gather ((C-1)x its payload); auto: reduce-scatter from 3 clusters on "
                                        "(docs/algorithm.md#reduce-scatter-exchange)")
    payload_auth: bool = knob(True, "an HMAC-SHA256 tag (key from the shared secret, per session and group epoch) "
                                    "on every message between clusters; a message that does not verify is refused, "
                                    "naming its sender and round, and the sender is lost for that round "
                                    "(docs/security.md#authenticated-payloads)")
    token_weights: bool = knob(True, "weigh each cluster's pseudo-gradient in the average by its tokens per inner "
                                     "step (its round's tokens / its steps, both in the round's header: one token, "
                                     "one vote, since the pseudo-gradient already grows with the steps); "
                                     "--dilocox-no-token-weights: equal weights (docs/algorithm.md#weights)")
    token_weight_unit: str = knob("step", "what a cluster's token weight counts: step (its tokens per inner step) or "
                                          "round (its tokens in the round, the rule before the run's clock: a fast "
                                          "site's steps count twice; kept to measure against, docs/algorithm.md#weights)")

    exchange_layout: str = knob("local", "local: local rank k of every site exchanges its own parameter slices (every "
                                          "site needs the same TP/PP/DP layout); canonical: sites may differ in "
                                          "layout: each site's rank 0 exchanges the whole model as global tensors "
                                          "by name (docs/algorithm.md#canonical-exchange-layout)")

    lanes: int = knob(1, "canonical layout: the model is exchanged in this many lanes of whole tensors, spread over "
                         "each site's ranks (lane 0 on rank 0), each rank keeping only its lanes' outer state; every "
                         "site must give the same value (docs/algorithm.md#lanes)")

    # Output.
    metrics_file: Optional[str] = knob(None, "JSONL file for per-round metrics (one row per round per cluster)")

    # ----------------------------------------------------------------------------------------------
    def __post_init__(self):
        if self.secret is None:
            self.secret = os.environ.get(SECRET_ENV) or None

    @property
    def resolved_h_min(self) -> int:
        return self.h if self.h_min is None else self.h_min

    @property
    def resolved_h_max(self) -> int:
        return max(H_MAX_FACTOR * self.h, self.resolved_h_min) if self.h_max is None else self.h_max

    def resolved_outer_lr_warmup_iters(self, train_iters: Optional[int] = None) -> int:
        """--dilocox-outer-lr-warmup-iters, or by default a fifth of the run (``train_iters``), at most 200.
        The early outer steps, while the loss falls fast, are the ones a large outer step throws off: outer lr
        1.0 from the start made the Python docs worse than training alone at H=10 (+15.1% vs AllReduce over
        1000 iterations), and with 200 iterations of warm-up every H from 1 to 200 ended better than at lr
        0.7 on both corpora. A fixed 200 would leave a short run (a test, a 60-iteration benchmark) with the
        global model nearly still, hence the fifth. Counted in iterations, not rounds, so that it covers the
        same stretch of training at every H (docs/convergence.md)."""
        if self.outer_lr_warmup_iters is not None:
            return self.outer_lr_warmup_iters
        if not train_iters:
            return OUTER_LR_WARMUP_CAP
        return min(OUTER_LR_WARMUP_CAP, int(OUTER_LR_WARMUP_FRACTION * train_iters))

    def outer_lr_at(self, iteration: int, train_iters: Optional[int] = None) -> float:
        """The outer lr of a round launched at inner iteration ``iteration`` of a run of ``train_iters``
        (None: unknown): a linear warm-up over resolved_outer_lr_warmup_iters. (A lower lr for rounds that
        land late, lr x (1 − 0.3 τ/H), measured worse at τ = H and was not kept.)"""
        warmup = self.resolved_outer_lr_warmup_iters(train_iters)
        if warmup <= 0:
            return self.resolved_outer_lr
        return self.resolved_outer_lr * min(1.0, max(iteration, 1) / warmup)

    @property
    def resolved_outer_lr(self) -> float:
        """1.0 for whole rounds (DiLoCo's value; with the warm-up every H from 1 to 200 trains on both corpora)
        and for synchronous fragments (overlap none: nothing lands late). 1.3 for overlapped fragments: each
        fragment's update is applied ~H/F steps after it leaves, and a larger step makes up part of what the
        delay costs. Main job's GPT, 1000 iterations, F = 8, H = 100: 1.3 vs 1.0 on loopback
        KJV -0.90% / -0.37%, docs +0.31% / -0.68% (seeds 1234 / 4321); on the ratio-325 link +2.35% vs +3.19%
        from AllReduce (+2.14% at 2000 iterations, against +2.77% before; docs/convergence.md)."""
        if self.outer_lr is not None:
            return self.outer_lr
        return OUTER_LR_FRAGMENTS if self.fragments > 1 and self.overlap != "none" else OUTER_LR

    @property
    def resolved_outer_momentum(self) -> float:
        """By the number of sites C the run is configured with (so a lost or rejoining site changes nothing):
        0.3 up to two sites, 0.5 from four, linear between. At two sites 0.3 in every overlap mode and at every
        H (DiLoCo's 0.9 failed to train at H = 10 on the Python docs; 0.5 was better on the KJV and worse on the
        docs); at four sites 0.5 was better than 0.3 on both corpora with Adam, and on the KJV with Muon as the
        inner optimizer (the measured figures: docs/convergence.md#many-sites)."""
        if self.outer_momentum is not None:
            return self.outer_momentum
        (c_lo, m_lo), (c_hi, m_hi) = OUTER_MOMENTUM_BY_SITES
        sites = min(max(self.num_clusters, c_lo), c_hi)
        return m_lo + (m_hi - m_lo) * (sites - c_lo) / (c_hi - c_lo)

    @property
    def resolved_local_weight(self) -> float:
        """w: 1 for one-step-delay; (1 + 1/C)/2 for eager (0.75 at C=2 beat the paper's 1/C by 1.0% and 1 by
        1.0% at H=20 in the byte model, benchmarks/NOTEBOOK.md)."""
        if self.delay_local_weight is not None:
            return self.delay_local_weight
        return 0.5 * (1.0 + 1.0 / self.num_clusters) if self.overlap == "eager" else 1.0

    @property
    def resolved_rank_min(self) -> int:
        return 1 if self.lowrank_rank_min is None else self.lowrank_rank_min

    @property
    def resolved_rank_max(self) -> int:
        return 4 * self.lowrank_rank if self.lowrank_rank_max is None else self.lowrank_rank_max

    def validate(self) -> "DiLoCoXConfig":
        """Raise DiLoCoXConfigError for the first invalid setting; return self when all are valid
        (config_checks.py)."""
        return validate(self)

    @property
    def addresses(self) -> list[str]:
        """--dilocox-rendezvous as a list: the coordinator first, then any standby."""
        return [a.strip() for a in (self.rendezvous or "").split(",") if a.strip()]

    @property
    def link_sizes_rounds(self) -> bool:
        """--dilocox-link-budget in effect: only an overlapped round can hide its transfer, and the budget picks
        among the ranks adaptive rank may take (outer/sync.py)."""
        return self.link_budget and self.overlap != "none" and self.adaptive_rank

    @property
    def compresses(self) -> bool:
        return self.lowrank or self.quant_bits != 32 or self.sparse_k > 0

    def public_dict(self) -> dict:
        """Every knob except the secret: safe for logs, checkpoints and wandb config."""
        d = dataclasses.asdict(self)
        d.pop("secret")
        return d

    def agreement_dict(self) -> dict:
        """The knobs every cluster must share (checked at rendezvous)."""
        d = self.public_dict()
        for local_only in ("cluster_id", "metrics_file", "rendezvous", "timeout_seconds"):
            d.pop(local_only)
        return d
