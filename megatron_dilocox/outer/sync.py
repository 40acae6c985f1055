"""The DiLoCoX round, as a hook after each inner optimizer step (docs/algorithm.md#the-round).

θ are the fp32 parameters this rank's inner optimizer owns (updated in place); φ the global model
(anchor); e the error feedback inside the codec.

    start():   θ ← φ ← broadcast(θ) from cluster 0;  link budget: probe the link (sizes rounds 1-2)
    every H_t inner steps, boundary():
        δ_t ← θ_start − θ
        overlap=none:
            Δ_t ← exchange(δ_t)                          (compress δ_t + e, average over clusters, update e)
            φ ← Outer(φ, Δ_t);  θ ← φ
        overlap=one-step-delay or eager:
            if round t−1 in flight: land()                (τ = H: it lands at this boundary)
            launch exchange(δ_t) in the background
            one-step-delay:  θ ← φ − w δ_t                (newest global model + my unsynced progress, w = 1)
            eager:           c ← Outer_c(c, w (δ_t − δ_{t−1}));  θ ← φ + c
                             (Kale et al. 2025: Outer applied to the proxy Δ_{t−1} + (δ_t − δ_{t−1})/C, i.e. the
                             last average with my stale term replaced by my fresh one, is w = 1/C; the
                             default (1 + 1/C)/2 measured better)
            θ_s ← θ
    τ inner steps after the boundary (τ ≤ H), land():
        Δ_t ← wait();  φ ← Outer(φ, Δ_t)
        θ ← φ + (θ − θ_s);  θ_s ← φ                       (the real average replaces the stand-in; the τ
                                                           steps of local progress stay, and the next δ
                                                           counts them)
    after each landing: r, H, τ ← plan(values every cluster received in the same payload)   (plan.py)

The average is weighted by the tokens each cluster trained on in the round (codec.py; equal weights leave it
the plain mean). One global model: each round's header carries every cluster's hash of its outer state (φ and
momentum) at launch; a cluster whose hash differs from the majority's (with two, from the lower-numbered
cluster's) takes that state from a cluster that has it before it applies the round, so a corrupted or drifted
site is back in step within the round that notices it (repair.py, docs/fault_tolerance.md#one-global-model).

τ = H by default (the one-step delay); --dilocox-overlap-steps N lands it earlier, 0 as early as twice the
measured transfer allows (Streaming DiLoCo's overlap of τ inner steps, Douillard et al. 2025): the stand-in
is trained on only until the real average is here. Under 0 a round that could land only at its end (τ = H,
e.g. H = 1) lands at the boundary itself (τ = 0, synchronous) when its transfer takes under half a step.

The background exchange runs in one worker thread; the caller keeps training while it runs. Only that
thread uses the inter-cluster group and the codec's state until ``wait()`` returns it. With
--dilocox-fragments F, outer/streaming.py runs F of these rounds over disjoint runs of tensors, staggered.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from megatron_dilocox.compression.codec import ExchangeResult, PseudoGradientCodec
from megatron_dilocox.compression.collective import Collective, SoloCollective
from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.metrics import MetricsWriter
from megatron_dilocox.outer import entry, handover, membership_round, plan, repair, report, resume
from megatron_dilocox.outer.clock import RunClock
from megatron_dilocox.outer.link import LinkRate
from megatron_dilocox.outer.cluster import IntraCluster, SingleRank
from megatron_dilocox.outer.nesterov import LocalCorrection, OuterNesterov

log = logging.getLogger("megatron_dilocox")


class DivergedError(FloatingPointError):
    """This cluster's own pseudo-gradient is NaN/Inf: its inner training diverged."""


class RunStopped(RuntimeError):
    """A round stopped the run (a lost peer under --dilocox-on-peer-failure stop, a payload whose tag does not
    verify, ...): no step after it may pass for training (api.py raises it at the next step)."""

    def __init__(self, round_idx: int, reason: str):
        super().__init__(reason)
        self.round, self.reason = round_idx, reason


class DiLoCoXSync:
    def __init__(self, params: Sequence[torch.Tensor], config: DiLoCoXConfig,
                 group: Optional[Collective] = None, intra: Optional[IntraCluster] = None,
                 metrics: Optional[MetricsWriter] = None, train_iters: Optional[int] = None,
                 executor: Optional[concurrent.futures.Executor] = None, fragment: int = 0,
                 hash_of: Optional[Callable[[], str]] = None):
        """``executor``, ``fragment``, ``hash_of``: set by StreamingSync (streaming.py) for fragment j of F,
        whose rounds share its one exchange thread and whose rows hash the whole global model."""
        self.cfg = config.validate()
        self.fragment, self._hash_of, self._owns_executor = fragment, hash_of, executor is None
        self.link_share = 1.0  # (a fragment: the whole model's size over its own; set by StreamingSync)
        self.leader: Optional[DiLoCoXSync] = None  # (fragments 1..: fragment 0, whose plan they follow)
        self.train_iters = train_iters  # the run's length, if known: sets the default outer-lr warm-up
        self.params = list(params)
        self.group = group or SoloCollective()
        self.intra = intra or SingleRank()
        self.metrics = metrics or MetricsWriter(config.metrics_file)
        self.device = self.params[0].device
        self.outer_device = torch.device("cpu") if config.outer_state_device == "cpu" else self.device
        self.codec = PseudoGradientCodec([p.shape for p in self.params], config, device=self.device)
        self.codec.fragment = fragment  # (its messages' tags name the fragment)
        self.delayed = config.overlap != "none"  # one-step-delay or eager: the exchange overlaps the next round
        # a synchronous round cannot hide its transfer, so only an overlapped one is sized to the link
        self.link_budget = config.link_sizes_rounds
        self.eager = config.overlap == "eager"
        self.local_weight = config.resolved_local_weight  # w: 1 for one-step-delay, (1 + 1/C)/2 for eager
        self.correction: Optional[LocalCorrection] = None  # eager: this cluster's fresh-term proxy
        self.h = config.h
        self.tau = plan.initial_tau(config, config.h)  # τ: landing step of the round in flight (≤ H)
        # the plan (H, τ) in the slowest site's steps, the same on every site; H, τ above are this site's share of
        # it (per-site H: plan.per_site; otherwise equal)
        self.shared = (self.h, self.tau)
        # (H, rank) and the shared plan each recent round was sent with: fragments 1.. follow fragment 0's as of
        # the round they land (plan.follow), which is the same on every site whatever the order of landings
        self.sent: dict[int, tuple[int, int]] = {}
        self.shared_sent: dict[int, tuple[int, int]] = {}
        self.round = 0  # rounds completed (launched) so far
        self.steps_in_round = 0
        self.iteration = 0
        self.anchor: list[torch.Tensor] = []
        self.round_start: list[torch.Tensor] = []
        self.outer: Optional[OuterNesterov] = None
        self.comm_seconds_prev = 0.0
        self.link = LinkRate()  # the link's measured rate, for --dilocox-link-budget (fragments share one)
        self.step_seconds = 0.0  # EMA of the inner-step time (between hooks)
        self.tokens_per_step = 1.0  # this cluster's tokens per inner step (glue: global batch x sequence length)
        self.round_tokens = 0.0  # tokens trained since the last launched round (its header; the run's clock)
        self.round_steps = 0  # and the inner steps they took: the round's weight is their ratio (codec.py)
        self._launched_tokens, self._launched_steps = 0.0, 0
        # where the run is, in numbers every site holds alike (clock.py); per-site H: the run ends at a token total
        self.clock = RunClock()
        self.token_budget = 0.0  # this site's planned tokens (the glue: --train-iters x tokens per step)
        self.own_tokens = 0.0  # this site's tokens in applied rounds (its plan left: token_budget - own_tokens)
        self.end_request = False  # this site asks the run to end at a boundary (--exit-duration-in-mins)
        self._last_hook = None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dilocox-exchange")
        self._in_flight: Optional[concurrent.futures.Future] = None
        self._done: Optional[ExchangeResult] = None  # finished but not yet applied (after state_dict())
        self.exchange_spans: list[tuple[float, float]] = []  # wall-clock (start, end) of each exchange
        # a joiner's hand-over (handover.py) reads every fragment's state in the exchange thread while the main
        # thread may be applying another fragment's round: both hold this lock (one per site: StreamingSync's)
        self.state_lock = threading.Lock()
        self.applied_round = 0  # the last round applied here (main thread)
        # the last round the members committed (exchange thread), and its result until the main thread applies it
        self.committed_round, self.committed = -1, None
        self.siblings: list[DiLoCoXSync] = [self]  # the rounds whose state a joiner is handed (every fragment)
        self.admits = True  # False once this site sends its last rounds (finalize): no joiner may come in then
        self.last_row: Optional[dict] = None
        self.rows: list[dict] = []  # every round's metrics row, in order (small dicts; one per round)
        self.stopped: Optional[str] = None  # why the run must stop (a peer lost under policy stop, ...)
        self.stopped_round = 0  # the round that stopped it
        self.repairs_in_a_row = 0  # consecutive applied rounds that repaired a cluster (repair.judge)
        self.stop_after_hook: Optional[tuple[int, str]] = None  # (round, why): repairs went on (repair.judge)
        self._launched_delta = None  # δ of the round in flight (kept as error feedback if it is dropped)
        self.joined_midrun = False
        self.start_broadcast = False  # whether start() had to send cluster 0's model (it differed somewhere)

    # ------------------------------------------------------------------------------------------ start
    def start(self):
        """Make θ the global model: cluster 0's parameters, everywhere (or the members' state when this
        cluster was restarted and rejoins a run in progress): entry.py."""
        if self.group.joining:
            return self.join()
        return entry.start(self)

    @torch.no_grad()
    def join(self):
        """(Admitted mid-run) take φ, momentum, Q, H and round t's Δ from the members (handover.py)."""
        return self.joined(handover.receive([self])[0])

    def joined(self, result: Optional[ExchangeResult]):
        """The state handed over is in place: θ ← φ, and round t's Δ applied as the members apply it."""
        return entry.joined(self, result)

    # ------------------------------------------------------------------------------------------ hook
    def after_inner_step(self, boundary_due: Optional[bool] = None, tokens: Optional[float] = None,
                         step_ended: Optional[float] = None) -> bool:
        """Call after every inner optimizer step; returns True when θ was changed (a round boundary or a
        landing). ``boundary_due``: whether this step ends the round (default: H steps into it); ``tokens``:
        what the step trained on (default ``tokens_per_step``), the round's weight in the average;
        ``step_ended``: when the step ended (perf_counter; default now), which with the end of the last hook
        times the step (the hook's own waits are not step time)."""
        now = time.perf_counter() if step_ended is None else step_ended
        if self._last_hook is not None:
            dt = now - self._last_hook
            self.step_seconds = dt if self.step_seconds == 0 else 0.8 * self.step_seconds + 0.2 * dt
        self.iteration += 1
        self.steps_in_round += 1
        if tokens is not None:
            self.tokens_per_step = tokens
        self.round_tokens += self.tokens_per_step
        self.round_steps += 1
        changed = False
        if self.steps_in_round >= self.h if boundary_due is None else boundary_due:
            self.boundary()
            changed = True
        elif self.delayed and self.steps_in_round == self.tau and (self._in_flight or self._done):
            self.land()
            changed = True
        if self.stop_after_hook is not None and not self.stopped:
            self.stopped_round, self.stopped = self.stop_after_hook
            log.error("%s", self.stopped)
        self._last_hook = time.perf_counter()
        return changed

    @torch.no_grad()
    def boundary(self):
        delta = [s.to(p.device) - p.float() for s, p in zip(self.round_start, self.params)]  # δ_t
        self.round += 1
        self.steps_in_round = 0
        tokens, self.round_tokens = self.round_tokens, 0.0
        steps, self.round_steps = self.round_steps, 0
        end = self.end_request  # (fixed here, on the main thread: every rank of the cluster sends the same)
        self._record_sent()
        if not self.delayed:
            t0 = time.perf_counter()
            result = self._exchange(delta, self.round, self.iteration, tokens, steps, end)
            self._apply(result, exposed=time.perf_counter() - t0)
            if self.stopped:
                self.round -= 1  # dropped: θ keeps δ_t, the next δ (measured from φ) carries it
                self.round_tokens += tokens
                self.round_steps += steps
                return
            self._set_params(self.anchor)  # θ ← φ
            with self.state_lock:  # (a joiner's hand-over reads the clock: handover.send)
                self.clock.at_boundary(self.round, in_flight=False)
        else:
            if self._in_flight is not None or self._done is not None:
                t0 = time.perf_counter()
                result = self.wait()
                self._apply(result, exposed=time.perf_counter() - t0)
                if self.stopped:  # round t−1 dropped everywhere: keep its δ as error feedback, launch nothing
                    self._keep_dropped_delta()
                    self.round -= 2
                    return
            self._launched_delta, self._launched_tokens, self._launched_steps = delta, tokens, steps
            self._in_flight = self._executor.submit(self._exchange, delta, self.round, self.iteration, tokens, steps,
                                                    end)
            self._set_params(self._local_start(delta))
            self.round_start = [p.detach().to(self.outer_device, torch.float32, copy=True) for p in self.params]
            with self.state_lock:
                self.clock.at_boundary(self.round, in_flight=True)
            if self.tau == 0:  # synchronous landing (plan.SYNC_LANDING_STEPS): θ = φ + (θ − θ_s) = φ exactly
                self.land()

    def _record_sent(self):
        self.sent[self.round], self.shared_sent[self.round] = (self.h, self.codec.rank), self.shared
        for old in [r for r in self.sent if r < self.round - 4]:
            del self.sent[old], self.shared_sent[old]

    @torch.no_grad()
    def land(self):
        """τ < H steps into the round: apply the round in flight now, and keep the τ steps of progress made
        from the stand-in on top of the real φ (θ ← φ + θ − θ_s; θ_s ← φ)."""
        t0 = time.perf_counter()
        result = self.wait()
        self._apply(result, exposed=time.perf_counter() - t0)
        if self.stopped:  # dropped everywhere: its δ stays as error feedback, θ goes on from the stand-in
            self._keep_dropped_delta()
            self.round -= 1
            return
        self._launched_delta = None
        theta = [a.to(p.device) + (p.float() - s.to(p.device))
                 for a, p, s in zip(self.anchor, self.params, self.round_start)]
        self._set_params(theta)
        for s, a in zip(self.round_start, self.anchor):
            s.copy_(a)

    def _keep_dropped_delta(self):
        """A round dropped everywhere: its δ joins the error feedback, so the next round sends it."""
        self.codec.error = [e + d.to(e.device) for e, d in zip(self.codec.error, self._launched_delta)]
        self.round_tokens += self._launched_tokens  # (and its tokens and steps with it)
        self.round_steps += self._launched_steps
        self._launched_delta = None

    def _local_start(self, delta) -> list:
        """θ for the next round while round t's average is in flight: φ plus a local stand-in for it.

        one-step-delay: θ ← φ − w δ_t (w = 1: all of my unsynced progress, as is).
        eager (Kale et al., 2025): the outer step of round t would use Δ̄_t, which is not here yet; its proxy
        is the last average with my stale term replaced by my fresh one, Δ̄_{t−1} + (δ_t − δ_{t−1})/C. φ
        already took Δ̄_{t−1}; the outer optimizer is linear, so the rest is the same optimizer (lr, momentum)
        run locally on (δ_t − δ_{t−1})/C: θ ← φ + c_t, and c_t is this cluster's only private state."""
        if self.eager:
            if self.correction is None:
                self.correction = LocalCorrection([a.shape for a in self.anchor], self.cfg, self.outer_device)
            self.correction.step(delta, self.local_weight, lr=self.outer_lr(self.iteration, self.clock.tokens_applied))
            return [a.to(d.device) + c.to(d.device) for a, c, d in zip(self.anchor, self.correction.value, delta)]
        # θ ← φ − w δ_t in one pass (w = 1: 1.0 * δ is exact, so bitwise φ − δ_t)
        return [torch.sub(a.to(d.device), d, alpha=self.local_weight) for a, d in zip(self.anchor, delta)]

    def wait(self) -> ExchangeResult:
        """The finished in-flight round (blocks until the transfer is done)."""
        if self._done is None and self._in_flight is not None:
            self._done = self._in_flight.result()
            self._in_flight = None
        result, self._done = self._done, None
        return result

    @torch.no_grad()
    def finalize(self):
        """End of training: finish and apply the in-flight round, then θ ← φ (all clusters agree)."""
        if not self.stopped and (self._in_flight is not None or self._done is not None):
            t0 = time.perf_counter()
            result = self.wait()
            self._apply(result, exposed=time.perf_counter() - t0, adapt=False)
            if self.stopped:
                return
            self._set_params([a.to(p.device) for a, p in zip(self.anchor, self.params)])
            self._restart_round_at_anchor()

    def close(self):
        if self._in_flight is not None:
            try:
                self._in_flight.result()
            except Exception:  # closing after a failure: the caller already has the error
                pass
        if self._owns_executor:  # (a fragment's executor and group are closed by its StreamingSync)
            self._executor.shutdown(wait=True)
            self.group.close()

    # ------------------------------------------------------------------------------------------ pieces
    def _exchange(self, delta, round_idx, iteration, tokens: float = 1.0, steps: int = 1,
                  end_request: bool = False) -> ExchangeResult:
        """One round's exchange, committed only when every member agrees (net/membership.py); a failed
        attempt leaves the codec as it was and, per the verdict, is retried by the survivors or dropped.
        (Runs in the exchange thread: φ and the momentum are not written until the main thread applies it.)"""
        t0, wall0 = time.perf_counter(), time.time()
        launched_tokens = self.clock.tokens_applied  # (the main thread changes it only when it applies this round)
        plan_left = max(self.token_budget - self.own_tokens, 0.0)  # (and this)
        state_hash = self.state_hash()
        # round 1 under the link budget is sized by the codec, from the probed rate and the step time in the
        # header every cluster shares (no landing has run _adapt yet)
        first_link_steps = plan.link_steps(self.cfg, self.link_share) if self.link_budget and round_idx == 1 else 0.0

        def attempt() -> ExchangeResult:
            return self.codec.exchange(delta, self.group, round_idx, self.comm_seconds_prev, self.step_seconds,
                                       self.link.seconds_per_byte, link_steps=first_link_steps,
                                       tokens=max(tokens, 1e-30), steps=max(steps, 1), state_hash=state_hash,
                                       end_request=end_request, plan_left=plan_left)
        result, verdict = membership_round.settled(self, round_idx, attempt, state_hash)
        result.comm_seconds, result.launched_at = time.perf_counter() - t0, iteration
        result.launched_tokens = launched_tokens
        self.exchange_spans.append((wall0, time.time()))
        self.committed, self.committed_round = result, result.round
        if verdict["admitted"]:
            log.warning("DiLoCoX round %d: cluster(s) %s rejoin; handing them the global state", round_idx,
                        verdict["admitted"])
            self.group.reform(verdict)
            handover.send(self, result, iteration)
        return result

    def state_hash(self) -> int:
        return repair.state_hash(self)

    def progress(self) -> Optional[float]:
        """--dilocox-per-site-h: the run's fraction trained so far (clock.py); None otherwise."""
        return self.clock.progress(self.steps_in_round, self.h, self.iteration, self.tokens_per_step, self.token_budget)

    def position(self) -> tuple[int, int]:
        """Where this site is in the run: (rounds launched, steps into the next); a checkpoint records it."""
        return self.round, self.steps_in_round

    def request_end(self):
        """Ask every site to end the run at a boundary (the next round's header carries it; clock.py)."""
        self.end_request = True

    def plan_tokens(self, token_budget: float, tokens_per_step: float):
        """Per-site H: this site's planned tokens for the run and its tokens per step, before start() adds the
        sites' plans up (clock.agree). A method, so that the wrappers (fragments, the slow-link switch) pass it on."""
        self.token_budget, self.tokens_per_step = float(token_budget), float(tokens_per_step)

    def outer_lr(self, launched_at: int, launched_tokens: float) -> float:
        return self.clock.outer_lr(self.cfg, launched_at, launched_tokens, self.train_iters)

    def _apply(self, result: ExchangeResult, exposed: float, adapt: bool = True):
        """φ ← Outer(φ, Δ) at the outer lr of the round's start iteration (config.outer_lr_at), then the next
        round's plan."""
        with self.state_lock:
            self._apply_round(result, exposed, adapt)
            if result.deltas is not None and not result.status.startswith("stopped"):
                self.applied_round = result.round
            if self.committed is result:  # (not held past its use: it is a model's worth of Δ)
                self.committed = None

    def _apply_round(self, result: ExchangeResult, exposed: float, adapt: bool):
        # the transfer alone: waiting for a peer that reached the boundary later is not link time (counting
        # it let a compute offset between clusters inflate H for good); smoothed, so that one slow transfer
        # (a busy host) does not swing H alone
        transfer = result.transfer_seconds
        self.comm_seconds_prev = (transfer if self.comm_seconds_prev == 0
                                  else 0.5 * self.comm_seconds_prev + 0.5 * transfer)
        if result.wire_bytes > 0:
            self.link.update(result.wire_seconds / result.wire_bytes)
        if result.status.startswith("stopped"):
            self.stopped_round = result.round
            self.stopped = (f"DiLoCoX round {result.round} {result.status} (--dilocox-on-peer-failure "
                            f"{self.cfg.on_peer_failure}); the global model was not changed")
            log.error("%s", self.stopped)
            self._write_row(result, exposed, self.h, result.rank)
            return
        if not result.local_ok:
            raise DivergedError(f"DiLoCoX round {result.round}: this cluster's pseudo-gradient has NaN/Inf "
                                f"(inner training diverged); the global model was not changed")
        if result.repair is not None:
            repair.install(self, result.repair)
            result.repair = None
        if result.deltas is not None:
            self.clock.applied(result.member_tokens, result.end_requested, result.member_plans_left,
                               result.launched_tokens)
            self.own_tokens += result.tokens
            lr = self.outer_lr(result.launched_at, result.launched_tokens)
            self.outer.step(result.deltas, lr=lr)  # φ ← Outer(φ, Δ)
            why = repair.judge(self, result)
            if why:  # (the round is applied: the run stops after this hook, holding one global model)
                self.stop_after_hook = (result.round, f"DiLoCoX round {result.round} stopped: {why}")
        else:
            log.warning("DiLoCoX round %d %s; the global model was not changed", result.round, result.status)
        h_used, rank_used = self.h, result.rank
        if adapt:
            self._adapt(result)
        self._write_row(result, exposed, h_used, rank_used)

    def _adapt(self, result: ExchangeResult):
        """The next round's H, rank and τ (plan.py): the same on every rank of every cluster."""
        self.h, rank, self.tau = plan.next_round(self, result)
        self.codec.set_rank(rank, result.round)

    def _restart_round_at_anchor(self):
        """The next δ is measured from φ (in none mode the round start *is* the anchor); no local proxy."""
        self.correction = None
        self.round_start = [a.clone() for a in self.anchor] if self.delayed else self.anchor

    def _set_params(self, values):
        for p, v in zip(self.params, values):
            p.copy_(v)

    def global_params(self) -> list[torch.Tensor]:
        """φ, the global model: fp32 tensors in the order of ``self.params`` (the anchor itself, on
        ``outer_device``; read only). Between boundaries in delay mode θ = φ − δ, so evaluation swaps φ in."""
        return self.anchor

    def model_hash(self) -> str:
        return self._hash_of() if self._hash_of else report.tensors_hash(self.anchor)

    def _write_row(self, r: ExchangeResult, exposed: float, h_used: int, rank_used: int):
        row = report.round_row(self, r, exposed, h_used, rank_used)
        self.last_row = row
        self.rows.append(row)
        if self.intra.is_writer:
            self.metrics.write(row)
            report.log_row(row)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to resume (resume.py); an in-flight round is finished first and saved as its result."""
        return resume.save(self)

    def load_state_dict(self, state: dict):
        resume.load(self, state)
