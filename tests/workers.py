"""A small real training workload for the core tests, run in separate processes (one world per cluster), and the
same workload in this process for the single-cluster tests.

Each simulated cluster trains the same two-layer network on its own regression data; ``batch`` is a
pure function of (cluster, local rank, step) so single-process references can replay exactly the same
data. Every process returns plain tensors/dicts for the parent test to check.
"""
from __future__ import annotations

import dataclasses
import copy
import logging
import os
import signal
import time

import torch

from megatron_dilocox.config import DiLoCoXConfig
from megatron_dilocox.harness.spawn import free_port, run_clusters
from megatron_dilocox.metrics import MetricsWriter
from megatron_dilocox.outer.cluster import TorchDistCluster
from megatron_dilocox.outer.auto import make_sync
from megatron_dilocox.net.topology import InterClusterGroup, connect_store

IN, HIDDEN, OUT = 16, 32, 8
SECRET = "test-secret"


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def batch(cluster: int, local_rank: int, step: int, size: int = 32):
    g = torch.Generator().manual_seed(1_000_000 * cluster + 1000 * local_rank + step)
    x = torch.randn(size, IN, generator=g)
    w = torch.linspace(-1, 1, IN * OUT).view(IN, OUT) + 0.3 * cluster  # clusters see different tasks
    return x, torch.tanh(x @ w)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def make_inner(model, kind: str, lr: float):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    return torch.optim.Adam(model.parameters(), lr=lr)


def inner_step(model, opt, step):
    """One inner step of the test network on cluster 0's data."""
    loss = loss_fn(model, *batch(0, 0, step))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def train_one_cluster(steps, dilocox=None, inner="adam", save_at=None, load=None):
    """Train the test network on cluster 0's data in this process; optionally with DiLoCoX (C = 1), its sync made
    by this module's ``make_sync`` (a test may monkeypatch it). Returns (losses, final parameters, the state saved
    after step ``save_at``, the sync); ``load``: such a state to resume from."""
    model = make_model(0)
    opt = make_inner(model, inner, 0.01)
    sync = None
    if dilocox is not None:
        sync = make_sync([p.data for p in model.parameters()], DiLoCoXConfig(**dilocox)).start()
    first = 0
    if load is not None:
        model.load_state_dict(load["model"])
        opt.load_state_dict(load["opt"])
        sync.load_state_dict(load["sync"])
        first = load["step"]
    losses, saved = [], None
    for step in range(first, steps):
        loss = inner_step(model, opt, step)
        if sync is not None:
            sync.after_inner_step()
        losses.append(float(loss.detach()))
        if save_at == step + 1:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "opt": copy.deepcopy(opt.state_dict()), "sync": sync.state_dict(), "step": step + 1}
    if sync is not None:
        sync.close()
    return losses, [p.detach().clone() for p in model.parameters()], saved, sync


class SlowGroup(InterClusterGroup):
    """The real gloo group with added latency per all-gather from the ``start``-th on (1: every one): stands in for a
    slow WAN link, or one that turns slow mid-run."""

    delay, start, calls = 0.0, 1, 0

    def _all_gather(self, buf):
        SlowGroup.calls += 1
        if SlowGroup.calls >= SlowGroup.start:
            time.sleep(self.delay)
        return super()._all_gather(buf)


class FlakyGroup(InterClusterGroup):
    """The real gloo group, whose ``fail_at``-th all-gather on cluster ``fail_cluster`` raises before it starts:
    a transport error on one side only, the other members are left inside the collective waiting for it."""

    fail_cluster, fail_at, calls, failed = -1, 0, 0, False

    def _all_gather(self, buf):
        FlakyGroup.calls += 1
        if self.cluster == FlakyGroup.fail_cluster and FlakyGroup.calls == FlakyGroup.fail_at:
            FlakyGroup.failed = True
            raise RuntimeError("injected transport error")
        return super()._all_gather(buf)


class CorruptingGroup(InterClusterGroup):
    """The real gloo group, which on cluster ``to_cluster`` flips the lowest bit of one byte of another member's
    message (``from_cluster``'s; default the next member's) in its ``at_call``-th payload collective (an
    all-gather of more than 200 bytes: not a header, digest or proof; or an all-to-all), as a corrupting link
    would; nothing else changes."""

    to_cluster, at_call, from_cluster, calls = -1, 0, None, 0

    def _flip(self, out):
        if self.cluster == CorruptingGroup.to_cluster:
            CorruptingGroup.calls += 1
            if CorruptingGroup.calls == CorruptingGroup.at_call:
                other = (self.rank + 1) % self.size if CorruptingGroup.from_cluster is None else \
                    self.membership.members.index(CorruptingGroup.from_cluster)
                out[other] = out[other].clone()
                out[other][out[other].numel() // 3] ^= 1
        return out

    def _all_gather(self, buf):
        out = super()._all_gather(buf)
        return self._flip(out) if buf.numel() > 200 else out

    def _all_to_all(self, pieces, sizes_in):
        return self._flip(super()._all_to_all(pieces, sizes_in))


class ReplayingGroup(InterClusterGroup):
    """The real gloo group, which on cluster ``to_cluster`` keeps another member's first payload message (over 200
    bytes, tag included) and puts it in place of that member's second: a payload replayed from round 1 in
    round 2, as a man in the middle could."""

    to_cluster, calls, kept = -1, 0, None

    def _all_gather(self, buf):
        out = super()._all_gather(buf)
        if self.cluster == ReplayingGroup.to_cluster and buf.numel() > 200:
            ReplayingGroup.calls += 1
            other = (self.rank + 1) % self.size
            if ReplayingGroup.calls == 1:
                ReplayingGroup.kept = out[other].clone()
            elif ReplayingGroup.calls == 2:
                out[other] = ReplayingGroup.kept
        return out


class DyingOwnerGroup(InterClusterGroup):
    """The real gloo group, whose process on cluster ``die_cluster`` SIGKILLs itself as soon as its ``at_call``-th
    all-to-all has returned: with the reduce-scatter exchange, a chunk owner that holds the other members' pieces
    of its chunks and dies before it sends their average back (the others wait for it in the all-gather)."""

    die_cluster, at_call, calls = -1, 0, 0

    def _all_to_all(self, pieces, sizes_in):
        out = super()._all_to_all(pieces, sizes_in)
        if self.cluster == DyingOwnerGroup.die_cluster:
            DyingOwnerGroup.calls += 1
            if DyingOwnerGroup.calls == DyingOwnerGroup.at_call:
                os.kill(os.getpid(), signal.SIGKILL)
        return out


class RecordingGroup(InterClusterGroup):
    """The real gloo group, keeping what every all-to-all returned (the verified payloads, tags removed)."""

    received: list = []

    def all_to_all(self, pieces, sizes_in, context=None):
        got = super().all_to_all(pieces, sizes_in, context)
        RecordingGroup.received.append({"context": list(context or ()), "got": [g.clone() for g in got]})
        return got


def train_worker(slot: int, local_rank: int, spec: dict) -> dict:
    """Run spec['steps'] inner steps with DiLoCoX; return per-round rows, anchors and losses.

    Fault tests: ``die`` = {"slot", "step"} SIGKILLs that slot's processes before that step;
    ``as_cluster`` = {slot: cluster} starts a slot as another cluster's restart (after ``start_delay``).
    ``tokens_by_cluster`` = {cluster: tokens per step} (the round's weight); ``corrupt`` = {"cluster", "round"}
    adds 1 to one element of that cluster's global model once that round has been applied ("every": True: after
    every round from then on, as arithmetic that differs every round would)."""
    cluster = int(spec.get("as_cluster", {}).get(str(slot), slot))
    if spec.get("off_host"):  # the model and its batches on a device that is not the host (tests/off_host.py)
        from tests.off_host import install
        install()
    if spec.get("start_after_kill", {}).get(str(slot)):  # a restart: only once the killed slot is gone
        while not os.path.exists(spec["start_after_kill"][str(slot)]):
            time.sleep(0.1)
    time.sleep(spec.get("start_delay", {}).get(str(slot), 0.0))
    t_started = time.time()
    settings = dict(spec["dilocox"], **spec.get("dilocox_by_cluster", {}).get(str(cluster), {}))
    cfg = DiLoCoXConfig(cluster_id=cluster, **settings).validate()
    store = connect_store(cfg, host_store=(cluster == 0 and local_rank == 0))
    group_cls = SlowGroup if spec.get("slow_gather") else FlakyGroup if spec.get("fail_gather") else \
        CorruptingGroup if spec.get("corrupt_payload") else ReplayingGroup if spec.get("replay_payload") is not None \
        else RecordingGroup if spec.get("record_all_to_all") else DyingOwnerGroup if spec.get("die_in_all_to_all") \
        else InterClusterGroup
    CorruptingGroup.to_cluster, CorruptingGroup.at_call, *rest = spec.get("corrupt_payload", (-1, 0))
    CorruptingGroup.from_cluster = rest[0] if rest else None
    ReplayingGroup.to_cluster = spec.get("replay_payload", -1)
    DyingOwnerGroup.die_cluster, DyingOwnerGroup.at_call = spec.get("die_in_all_to_all", (-1, 0))
    SlowGroup.delay, SlowGroup.start = spec.get("slow_gather", 0.0), spec.get("slow_gather_from", 1)
    FlakyGroup.fail_cluster, FlakyGroup.fail_at = spec.get("fail_gather", (-1, 0))
    fingerprint = dict(spec.get("fingerprint", {}), **spec.get("fingerprint_by_cluster", {}).get(str(cluster), {}))
    group = group_cls(cfg, local_rank, store, fingerprint=fingerprint,
                      local_world=torch.distributed.get_world_size())
    model = make_model(spec.get("init_seed", 0) + (0 if spec.get("same_init") else 17 * cluster) + local_rank)
    if spec.get("wrong_shape_on_cluster") == cluster:
        model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN + 1), torch.nn.Tanh(), torch.nn.Linear(HIDDEN + 1, OUT))
    if spec.get("off_host"):
        model.to("meta")
    inner = make_inner(model, spec.get("inner", "adam"), spec.get("inner_lr", 0.01))
    metrics = MetricsWriter(spec.get("metrics_dir") and f"{spec['metrics_dir']}/metrics_c{cluster}.jsonl")
    sync = make_sync([p.data for p in model.parameters()], cfg, group, TorchDistCluster(), metrics)
    tokens_per_step = spec.get("tokens_by_cluster", {}).get(str(cluster)) or 1.0
    sync.plan_tokens(spec["steps"] * tokens_per_step, tokens_per_step)
    sync.start()
    warnings: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megatron_dilocox").addHandler(handler)
    tokens = spec.get("tokens_by_cluster", {}).get(str(cluster))
    corrupt = spec.get("corrupt", {})
    out = {"rows": [], "anchors": [], "params": [], "losses": [], "step_times": [], "error": None, "pre": [],
           "planned": [],  # (members of the last applied round, the clock's planned total) at each boundary
           "warnings": warnings,
           "cluster": cluster, "joined_midrun": sync.joined_midrun, "first_iteration": sync.iteration,
           "start_broadcast": sync.start_broadcast, "t_started": t_started, "t_synced": time.time(),
           "start_params": [p.detach().clone() for p in model.parameters()]}
    if spec.get("round_offset_cluster") == cluster:  # e.g. resumed from another round's checkpoint
        sync.round += 1
    die = spec.get("die", {})
    try:
        last = spec["steps"] * (4 if cfg.per_site_h else 1)  # per-site H: the run ends at the sites' token total
        for step in range(sync.iteration, last):
            if die.get("slot") == slot and die.get("step") == step:
                if die.get("flag"):
                    open(die["flag"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if spec.get("end_request") == [cluster, step]:  # e.g. its --exit-duration-in-mins is up
                sync.request_end()
            if spec.get("nan_at_step") is not None and cluster == spec.get("nan_cluster") \
                    and step == spec["nan_at_step"]:
                with torch.no_grad():
                    next(model.parameters())[0, 0] = float("nan")
            x, y = batch(cluster, local_rank, step)
            if spec.get("off_host"):
                x, y = x.to("meta"), y.to("meta")
            loss = loss_fn(model, x, y)
            inner.zero_grad()
            loss.backward()
            inner.step()
            if spec.get("step_sleep"):
                time.sleep(spec["step_sleep"])
            time.sleep(spec.get("step_sleep_by_cluster", {}).get(str(cluster), 0.0))
            pre = [p.detach().clone() for p in model.parameters()] if spec.get("record_pre") else None
            if sync.after_inner_step(tokens=tokens):
                out["planned"].append((sync.rows[-1]["num_clusters"] if sync.rows else 0, sync.clock.planned_total))
                out["pre"].append(pre)  # θ just before the boundary (or landing)
                out["anchors"].append([a.clone() for a in sync.anchor])
                out["params"].append([p.detach().clone() for p in model.parameters()])
            out["losses"].append(float(loss.detach()))
            out["step_times"].append(time.time())
            if corrupt.get("cluster") == cluster and (len(sync.rows) == corrupt["round"] and not out.get("corrupted")
                                                      or corrupt.get("every") and out.get("corrupted")
                                                      and len(sync.rows) > out["corrupted"]["round"]
                                                      and not sync.stopped):
                with torch.no_grad():
                    sync.global_params()[0].view(-1)[0] += 1.0  # e.g. an altered payload, or other hardware
                out["corrupted"] = {"step": step, "round": len(sync.rows)}
            if sync.stopped:
                out["error"] = sync.stopped
                break
            if sync.clock.complete or sync.clock.ending:
                out["ended"] = {"round": sync.clock.round, "iteration": step + 1, "ending": sync.clock.ending}
                break
        if spec.get("finalize", True) and not sync.stopped:
            sync.finalize()
        out["final_params"] = [p.detach().clone() for p in model.parameters()]
        out["final_hash"] = sync.model_hash()
        out["final_anchor"] = [a.clone() for a in sync.anchor]
        out["clock"] = dataclasses.asdict(sync.clock)
    except Exception as exc:  # the test asserts on the message; the model must be untouched by a refused round
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["final_anchor"] = [a.clone() for a in sync.anchor]
    finally:
        out["rows"] = sync.rows
        out["exchange_spans"] = sync.exchange_spans
        out["failovers"] = list(getattr(group, "failovers", []))  # (lost, back) wall times, standalone
        out["injected_failure"] = FlakyGroup.failed
        out["received"] = RecordingGroup.received
        out["devices"] = sorted({str(p.device) for p in model.parameters()} | {str(a.device) for a in sync.anchor})
        sync.close()
    if spec.get("off_host"):  # (the parent has no OffHost: hand back host tensors)
        from torch.utils._pytree import tree_map
        out = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, out)
    return out


def rendezvous_worker(cluster: int, local_rank: int, spec: dict) -> str:
    """Only join the group; return 'joined' or the error message."""
    cfg = DiLoCoXConfig(cluster_id=cluster, **spec["dilocox"])
    cfg.secret = spec["secrets"][cluster]
    cfg.validate()
    try:
        store = connect_store(cfg, host_store=(cluster == 0 and local_rank == 0))
        fp = spec.get("fingerprints", [{}] * cfg.num_clusters)[cluster]
        InterClusterGroup(cfg, local_rank, store, fingerprint=fp)
        return "joined"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def dilocox_spec(C, **dilocox):
    """The DiLoCoX settings of a C-cluster run of ``train_worker`` on loopback, timing-free: fixed H, and a delayed
    round lands at the boundary (adaptive H and τ follow wall times); ``dilocox`` overrides."""
    base = dict(num_clusters=C, rendezvous=f"127.0.0.1:{free_port()}", secret=SECRET, timeout_seconds=60,
                adaptive_h=False, overlap_steps=None)
    base.update(dilocox)
    return base


def train_clusters(C, ranks=1, timeout=240, may_die=(), **spec):
    """``train_worker`` in C clusters of ``ranks`` processes each: {(cluster, local rank): its result}."""
    return run_clusters(train_worker, C, ranks, args=(spec,), timeout=timeout, may_die=may_die)


def assert_no_errors(res):
    errors = {k: v["error"] for k, v in res.items() if v["error"]}
    assert not errors, errors
