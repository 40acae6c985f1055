"""Chaos soak: a real multi-cluster Megatron run with random faults, and what they cost.

C clusters (one torchrun each, real Megatron on the KJV corpus, ``--dilocox-on-peer-failure continue``)
train for ``--iters`` iterations. At random iterations a random rank of a random cluster is SIGKILLed
(torchrun takes the rest of that cluster down); after a random pause the cluster is started again with its
usual command and rejoins (docs/fault_tolerance.md#rejoin). With the embedded coordinator cluster 0 is
never a victim (it hosts the store); with ``--coordinator standalone`` (``python -m
megatron_dilocox.coordinator``) any cluster is, cluster 0 at least 3 times and the coordinator itself at
least twice when there are 10 faults or more (SIGKILL, restart at the same address after a pause). One
fault at a time: the next one waits until every cluster is back in the rounds.

Printed at the end (and written to ``--out``/chaos.json): one line per fault (what, when, detection
time = kill until a survivor's "retrying with clusters" line, or for the coordinator its "lost the
coordinator" line; rejoin time = restart until the cluster is back in the rounds, or until a survivor's
"coordinator at ... after" line; outcome) and a summary:

    faults injected / survived    survived = the run went on and the cluster was back in the rounds
    rounds dropped                rounds the survivors did not apply (goal: 0; retries keep them)
    survivor tokens lost          tokens the survivors trained that no committed round carried (goal: 0)
    killed-cluster tokens lost    work that died with the killed processes: its iterations since the
                                  launch of its last committed round (lost with the process, not by us)
    final agreement               every cluster ended on the same global-model hash

With ``--rate R`` every cluster runs in its own network namespace behind a shaped link of rate R
(scripts/wan/wan.py), so an exchange takes a good part of a round and a kill lands inside one: each fault
records the round the survivors retried, when it was launched, and ``mid_exchange`` (the victim had launched
that round and died before its collectives ended). E.g. four sites, the reduce-scatter exchange (int4 whole: every
site owns a quarter of the chunks), each owner killed once:

    python scripts/chaos/chaos.py --clusters 4 --victims 1,2,3 --rate 3mbit \
        --dilocox-extra '--dilocox-no-lowrank --dilocox-exchange-scheme reduce-scatter'

    python scripts/chaos/chaos.py [--quick] [--clusters 2] [--iters 200] [--faults 4] [--seed 0]
        [--coordinator standalone] [--rate 3mbit] [--dilocox-extra '--dilocox-...']
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts", "bench"))  # provenance.py
sys.path.insert(0, os.path.join(REPO, "scripts", "wan"))  # wan.py (--rate)

from megatron_dilocox.harness.launch import start  # noqa: E402
from megatron_dilocox.harness.spawn import free_port  # noqa: E402
from megatron_dilocox.harness.main_job import gpt_flags  # noqa: E402
from megatron_dilocox.metrics import read_rows  # noqa: E402
from megatron_dilocox.net.rendezvous import listening  # noqa: E402
from provenance import provenance  # noqa: E402


RETRY = re.compile(r"DiLoCoX round (\d+): .*retrying with clusters")


def dilocox_flags(out: str, h: int, timeout: float, extra: str = "") -> list[str]:
    return ["--dilocox-h", str(h), "--dilocox-no-adaptive-h", "--dilocox-lowrank-rank", "8",
            "--dilocox-quant-bits", "4", "--dilocox-on-peer-failure", "continue",
            "--dilocox-timeout", str(timeout), "--dilocox-metrics-file", f"{out}/metrics_c{{cluster}}.jsonl",
            *shlex.split(extra)]


class Soak:
    def __init__(self, a, wan=None):
        self.a = a
        self.wan = wan  # a WanTestbed (--rate) or None: loopback
        self.prov = provenance()
        self.rng = random.Random(a.seed)
        self.port = free_port()
        # NO_VCS_VERSION: Megatron appends the git HEAD of the checkout it is installed in to its version, which
        # the fingerprint compares; a commit there mid-soak would make a restarted cluster's version differ
        self.env = {"DILOCOX_SECRET": secrets.token_hex(16), "CUDA_VISIBLE_DEVICES": "", "NO_VCS_VERSION": "1"}
        self.megatron = gpt_flags(a.data, a.iters, 1, 1) + ["--log-interval", "1"]
        self.dilocox = dilocox_flags(a.out, a.h, a.timeout, a.dilocox_extra)
        if a.save_interval:  # each cluster saves (atomically) and a restarted one resumes its own checkpoint
            self.megatron += ["--save", f"{a.out}/ckpt_c{{cluster}}", "--load", f"{a.out}/ckpt_c{{cluster}}",
                              "--save-interval", str(a.save_interval)]
        self.t_restart: dict = {}
        self.incarnations = []  # (cluster, Clusters handle, position in it)
        self.faults = []
        self.coordinators = []  # standalone: every coordinator process started, the live one last
        if a.coordinator == "standalone":
            self.dilocox += ["--dilocox-coordinator", "standalone"]
            self.start_coordinator()

    def start_coordinator(self):
        out = open(f"{self.a.out}/coordinator_{len(self.coordinators)}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "megatron_dilocox.coordinator", "--listen",
                              f"127.0.0.1:{self.port}"], env=dict(os.environ, PYTHONPATH=REPO, **self.env),
                             cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        self.coordinators.append(p)
        deadline = time.monotonic() + 120
        while not listening(f"127.0.0.1:{self.port}") and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)

    def launch(self, only=None):
        where = {} if self.wan is None else dict(
            prefix_by_cluster={c: self.wan.prefix(c) for c in range(self.a.clusters)},
            env_by_cluster={c: {"GLOO_SOCKET_IFNAME": "wan0"} for c in range(self.a.clusters)},
            rendezvous_host=self.wan.addr(0))
        cl = start(self.a.clusters, self.a.nproc, self.megatron, self.dilocox, env=self.env, echo=False,
                   rendezvous_port=self.port, only=only, **where)
        for pos, c in enumerate(only or range(self.a.clusters)):
            self.incarnations.append((c, cl, pos))
        return cl

    def current(self, cluster):
        return [(cl, pos) for c, cl, pos in self.incarnations if c == cluster][-1]

    def rows(self, cluster):
        path = f"{self.a.out}/metrics_c{cluster}.jsonl"
        return read_rows(path) if os.path.exists(path) else []

    def all_in(self, cluster: int) -> bool:
        rows = self.rows(cluster)
        return bool(rows) and rows[-1]["num_clusters"] == self.a.clusters

    def plan(self) -> list[tuple]:
        """(victim, moment) per fault. Victims: a cluster id or "coordinator"; cluster 0 >= 3 and the
        coordinator >= 2 times when the standalone coordinator runs and there are >= 10 faults. Moments (from
        --moments): the first two cluster victims die inside a checkpoint save ("save", with
        --save-interval); one coordinator victim and, with 3 clusters or more, one cluster victim die while
        another cluster rejoins ("rejoin"); the rest mid-round."""
        a = self.a
        if a.victims:
            victims = [v if v == "coordinator" else int(v) for v in a.victims.split(",")]
        elif a.coordinator != "standalone":
            victims = [self.rng.randrange(1, a.clusters) for _ in range(a.faults)]
        else:
            pool = list(range(a.clusters)) + ["coordinator"]
            fixed = [0, 0, 0, "coordinator", "coordinator"] if a.faults >= 10 else []
            victims = fixed + [self.rng.choice(pool) for _ in range(a.faults - len(fixed))]
            self.rng.shuffle(victims)
        moments = ["mid-round"] * len(victims)
        wanted = a.moments.split(",")
        clusters = [i for i, v in enumerate(victims) if v != "coordinator"]
        if "save" in wanted:
            for i in clusters[:2]:
                moments[i] = "save"
        if "rejoin" in wanted:
            coordinator = [i for i, v in enumerate(victims) if v == "coordinator"]
            for i in coordinator[:1] + (clusters[2:3] if a.clusters >= 3 else []):
                moments[i] = "rejoin"
        return list(zip(victims, moments))

    @staticmethod
    def count(log, text: str) -> int:
        return sum(text in ln for ln in log.lines)

    def log_of(self, cluster: int):
        cl, pos = self.current(cluster)
        return cl.logs[pos]

    def inject(self, at_iteration: int, victim, moment: str = "mid-round"):
        """One fault at ``moment``: mid-round (at an iteration), save (the victim cluster inside a checkpoint
        save), rejoin (another cluster is killed first and restarted; the victim dies while that one waits to
        be admitted: a second fault)."""
        a = self.a
        joiner = None
        if moment == "rejoin":
            joiner = self.rng.choice([c for c in range(a.clusters) if c != victim])
        watcher = min(c for c in range(a.clusters) if c not in (victim, joiner))  # a survivor that tells
        logw = self.log_of(watcher)
        if not logw.wait_for(lambda log: log.last_iteration >= at_iteration or log.ended, 1800) or logw.ended:
            return
        if joiner is not None:
            fault = self.kill_cluster(joiner, watcher, "mid-round")
            if fault is None:
                return
            jlog = self.restart_cluster(joiner)
            waiting = jlog.wait_for(lambda log: self.count(log, "waiting to be admitted") > 0 or log.ended,
                                    a.timeout + 300)
            second = self.kill_coordinator(logw, f"rejoin of cluster {joiner}") if victim == "coordinator" else \
                self.kill_cluster(victim, watcher, f"rejoin of cluster {joiner}")
            if second is not None and victim != "coordinator":
                self.restart_cluster(victim)
            self.wait_back(fault, watcher, joiner)
            if second is not None and victim != "coordinator":
                self.wait_back(second, watcher, victim)
            for f in (fault, second):
                if f is not None:
                    f["joiner_was_waiting"] = bool(waiting) if f is second else None
                    self.record(f)
            return
        if victim == "coordinator":
            return self.record(self.kill_coordinator(logw, moment))
        fault = self.kill_cluster(victim, watcher, moment)
        if fault is not None:
            self.restart_cluster(victim)
            self.wait_back(fault, watcher, victim)
            self.record(fault)

    def record(self, fault: dict):
        self.faults.append(fault)
        print("fault:", json.dumps(fault), flush=True)

    def kill_cluster(self, victim: int, watcher: int, moment: str):
        a = self.a
        logw, logv = self.log_of(watcher), self.log_of(victim)
        if moment == "save":  # SIGKILL as the victim starts writing its next checkpoint
            n = self.count(logv, "saving checkpoint at iteration")
            if not logv.wait_for(lambda log: self.count(log, "saving checkpoint at iteration") > n or log.ended,
                                 a.save_interval * 10 + 300) or logv.ended:
                return None
        rank = self.rng.randrange(a.nproc)
        cl, pos = self.current(victim)
        fault = {"fault": f"SIGKILL cluster {victim} rank {rank}", "cluster": victim, "moment": moment,
                 "at_iteration": logv.last_iteration}
        n_retry = self.count(logw, "retrying with clusters")
        t_kill = time.monotonic()
        cl.kill(pos, signal.SIGKILL, rank=rank)
        seen = logw.wait_for(lambda log: self.count(log, "retrying with clusters") > n_retry, a.timeout * 3)
        fault["detection_s"] = round(time.monotonic() - t_kill, 1) if seen else None
        retried = [int(m.group(1)) for m in map(RETRY.search, logw.lines) if m]
        fault["retried_round"] = retried[n_retry] if seen and len(retried) > n_retry else None
        # read once the survivors retried: every round committed with the victim has its row by then (read
        # before the kill, a round applied a moment later was missed: 105 iterations for 5, just after a rejoin)
        with_victim = [r["launched_at"] for r in self.rows(watcher)
                       if r["num_clusters"] == a.clusters and r["launched_at"] <= fault["at_iteration"]]
        fault["victim_tokens_lost"] = (fault["at_iteration"] - max(with_victim, default=0)) * a.global_batch * a.seq
        cl.procs[pos].wait(60)  # the victim's torchrun only (Clusters.wait would stop the survivors too)
        fault["_seen"] = seen
        return fault

    def restart_cluster(self, victim: int):
        time.sleep(self.rng.uniform(1.0, 5.0))
        self.launch(only=[victim])
        self.t_restart[victim] = time.monotonic()
        return self.log_of(victim)

    def wait_back(self, fault: dict, watcher: int, victim: int):
        """Until the watcher's rounds count every cluster again, after the kill; then the victim's checkpoint
        (which one it resumed from, when the run saves)."""
        a, t_restart, logw = self.a, self.t_restart[victim], self.log_of(watcher)
        back = False
        while time.monotonic() - t_restart < a.timeout + 300 and not logw.ended:
            if self.all_in(watcher) and self.rows(watcher)[-1]["launched_at"] > fault["at_iteration"]:
                back = True
                break
            time.sleep(0.5)
        fault["rejoined_after_s"] = round(time.monotonic() - t_restart, 1) if back else None
        fault["outcome"] = "survived, rejoined" if back and fault.pop("_seen") else "NOT survived"
        # the retried round's launch: at or before the victim's last iteration, the victim had launched it and died
        # while its collectives ran (mid-exchange); after it, the victim died between exchanges
        launched = [r["launched_at"] for r in self.rows(watcher) if r["round"] == fault.get("retried_round")]
        fault["retried_round_launched_at"] = launched[-1] if launched else None
        fault["mid_exchange"] = bool(launched) and launched[-1] <= fault["at_iteration"]
        if a.save_interval:
            loaded = [ln for ln in self.log_of(victim).lines if "successfully loaded checkpoint" in ln]
            fault["resumed_from"] = loaded[-1].split("at iteration")[-1].strip() if loaded else "no checkpoint"

    def kill_coordinator(self, logw, moment: str):
        fault = {"fault": "SIGKILL the coordinator", "cluster": "coordinator", "moment": moment,
                 "at_iteration": logw.last_iteration, "victim_tokens_lost": 0}
        n_lost, n_back = self.count(logw, "lost the coordinator"), self.count(logw, ": coordinator at ")
        noticed = {}

        def watch():  # while the coordinator restarts (its start-up must not count as detection time)
            if logw.wait_for(lambda log: self.count(log, "lost the coordinator") > n_lost, self.a.timeout * 3):
                noticed["at"] = time.monotonic()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t_kill = time.monotonic()
        self.coordinators[-1].send_signal(signal.SIGKILL)
        self.coordinators[-1].wait(30)
        pause = self.rng.uniform(1.0, 5.0)
        time.sleep(pause)
        t_restart = time.monotonic()
        self.start_coordinator()
        fault["coordinator_startup_s"] = round(time.monotonic() - t_restart, 1)  # until it listens
        watcher.join(self.a.timeout * 3)
        seen = "at" in noticed
        fault["detection_s"] = round(noticed["at"] - t_kill, 1) if seen else None
        back = logw.wait_for(lambda log: self.count(log, ": coordinator at ") > n_back, self.a.timeout * 3)
        fault["rejoined_after_s"] = round(time.monotonic() - t_restart, 1) if back else None
        fault["outcome"] = "survived, back with the restarted coordinator" if back and seen else "NOT survived"
        return fault

    def run(self):
        a = self.a
        t0 = time.time()
        self.launch()
        # faults in the first part of the run: a restarted cluster needs time to start and rejoin
        lo, hi = 2 * a.h + 1, max(2 * a.h + 2, a.iters // 8 if a.faults == 1 else a.iters - a.iters // 4)
        spots = sorted(self.rng.sample(range(lo, max(lo + 1, hi)), min(a.faults, max(1, hi - lo))))
        for at, (victim, moment) in zip(spots, self.plan()):
            self.inject(at, victim, moment)
        codes = {}
        for c in range(a.clusters):
            cl, pos = self.current(c)
            codes[c] = cl.wait(3600)[pos]
        if self.coordinators:
            try:
                codes["coordinator"] = self.coordinators[-1].wait(120)
            except subprocess.TimeoutExpired:
                self.coordinators[-1].kill()
                codes["coordinator"] = "did not exit"
        for k, (c, cl, pos) in enumerate(self.incarnations):
            cl.stop()
            with open(f"{a.out}/log_{k}_cluster{c}.txt", "w") as f:
                f.write("\n".join(cl.logs[pos].lines) + "\n")
        return self.summary(codes, time.time() - t0)

    def summary(self, codes, wall):
        a = self.a
        rows = {c: self.rows(c) for c in range(a.clusters)}
        final = {c: r[-1]["global_model_hash"] if r else None for c, r in rows.items()}
        hits = {c: sum(f["cluster"] == c for f in self.faults) for c in range(a.clusters)}
        # the cluster killed least speaks for the survivors (each round once: a rejoined one's latest row)
        survivor = sorted({r["round"]: r for r in rows[min(hits, key=lambda c: (hits[c], c))]}.items())
        survivor = [r for _, r in survivor]
        dropped = [r["round"] for r in survivor if r["status"] != "applied"]
        covered = max((r["launched_at"] for r in survivor if r["status"] == "applied"), default=0)
        tokens = a.global_batch * a.seq
        # the killed cluster's iterations after the launch of the last round that still counted it
        killed_lost = sum(f.get("victim_tokens_lost", 0) for f in self.faults)
        detect = [f["detection_s"] for f in self.faults if f["detection_s"] is not None]
        back = [f["rejoined_after_s"] for f in self.faults if f["rejoined_after_s"] is not None]
        summary = {
            **self.prov, "coordinator": a.coordinator, "clusters": a.clusters, "rate": a.rate,
            "dilocox_extra": a.dilocox_extra,
            "faults_by_victim": {str(k): sum(f["cluster"] == k for f in self.faults)
                                 for k in list(range(a.clusters)) + ["coordinator"]},
            "faults_by_moment": {m: sum(f.get("moment", "mid-round").startswith(m) for f in self.faults)
                                 for m in ("mid-round", "save", "rejoin")},
            "detection_s_max": max(detect, default=None), "rejoin_s_max": max(back, default=None),
            "faults_injected": len(self.faults),
            "faults_survived": sum(f["outcome"].startswith("survived") for f in self.faults),
            "faults_mid_exchange": sum(bool(f.get("mid_exchange")) for f in self.faults),
            "rounds": len(survivor), "rounds_dropped": len(dropped),
            "rounds_with_fewer_clusters": sum(r["num_clusters"] < a.clusters for r in survivor),
            "survivor_tokens_lost": (a.iters - covered) * tokens,
            "killed_cluster_tokens_lost": killed_lost,
            "final_agreement": len(set(final.values())) == 1 and None not in final.values(),
            "exit_codes": codes, "wall_seconds": round(wall, 1), "faults": self.faults,
        }
        with open(f"{a.out}/chaos.json", "w") as f:
            json.dump(summary, f, indent=1)
        print("CHAOS SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "faults"}), flush=True)
        return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: 2 clusters, 300 iterations, 1 fault")
    ap.add_argument("--clusters", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=1, help="processes per cluster")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--h", type=int, default=5)
    ap.add_argument("--faults", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=15.0, help="--dilocox-timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=os.path.join(REPO, "data", "kjv"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--coordinator", choices=("embedded", "standalone"), default="embedded",
                    help="standalone: a coordinator process; cluster 0 and the coordinator are victims too")
    ap.add_argument("--victims", default=None, help="comma-separated victims in order instead of random ones: "
                                                     "cluster ids and/or 'coordinator' (e.g. 0,coordinator)")
    ap.add_argument("--moments", default="mid-round",
                    help="comma-separated from mid-round, save, rejoin: when faults strike (see Soak.plan)")
    ap.add_argument("--rate", default=None, help="each cluster behind a shaped link of this rate (e.g. 3mbit; "
                                                 "scripts/wan/wan.py, needs root): exchanges take long enough to be hit")
    ap.add_argument("--dilocox-extra", default="", help="more --dilocox flags for every cluster, e.g. "
                                                         "'--dilocox-no-lowrank --dilocox-exchange-scheme reduce-scatter'")
    ap.add_argument("--save-interval", type=int, default=0,
                    help="Megatron --save-interval for every cluster (0: no checkpoints); 'save' needs it")
    a = ap.parse_args(argv)
    bad = set(a.moments.split(",")) - {"mid-round", "save", "rejoin"}
    if bad:
        ap.error(f"--moments takes mid-round, save and rejoin, not {', '.join(sorted(bad))}")
    if "save" in a.moments.split(",") and not a.save_interval:
        ap.error("--moments save needs --save-interval N (the clusters only save with it)")
    if a.quick:
        a.clusters, a.iters, a.h, a.faults = 2, 300, 5, 1
    if a.victims:
        a.faults = len(a.victims.split(","))
        if "coordinator" in a.victims and a.coordinator != "standalone" or "0" in a.victims.split(",") \
                and a.coordinator != "standalone":
            ap.error("--victims 0 or coordinator needs --coordinator standalone (embedded: cluster 0 hosts the store)")
    a.out = a.out or tempfile.mkdtemp(prefix="dilocox_chaos_")
    os.makedirs(a.out, exist_ok=True)
    a.global_batch, a.seq = 8, 128  # main_job.gpt_flags
    from megatron_dilocox.data.prepare import prepare
    if a.rate and a.coordinator == "standalone":
        ap.error("--rate runs the embedded coordinator (the standalone one would need its own namespace)")
    prepare(a.data, num_clusters=a.clusters)
    with contextlib.ExitStack() as stack:
        wan = None
        if a.rate:
            from wan import WanTestbed
            wan = stack.enter_context(WanTestbed(a.clusters, a.rate))
        s = Soak(a, wan).run()
    ok = s["faults_survived"] == s["faults_injected"] and s["rounds_dropped"] == 0 and s["final_agreement"] \
        and s["survivor_tokens_lost"] == 0 and all(c == 0 for c in s["exit_codes"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
