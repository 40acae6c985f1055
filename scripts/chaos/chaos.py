"""Chaos soak: a real multi-cluster Megatron run with random faults, and what they cost.

C clusters (one torchrun each, real Megatron on the KJV corpus, ``--dilocox-on-peer-failure continue``)
train for ``--iters`` iterations. At random iterations a random rank of a random cluster other than 0 is
SIGKILLed (torchrun takes the rest of that cluster down); after a random pause the cluster is started
again with its usual command and rejoins (README: "When a cluster fails"). One fault at a time: the
next one waits until every cluster is back in the rounds.

Printed at the end (and written to ``--out``/chaos.json): one line per fault (what, when, detection
time = kill until the survivors' "retrying with clusters" line, rejoin time, outcome) and a summary:

    faults injected / survived    survived = the run went on and the cluster was back in the rounds
    rounds dropped                rounds the survivors did not apply (goal: 0; retries keep them)
    survivor tokens lost          tokens the survivors trained that no committed round carried (goal: 0)
    killed-cluster tokens lost    work that died with the killed processes: its iterations since the
                                  launch of its last committed round (lost with the process, not by us)
    final agreement               every cluster ended on the same global-model hash

    python scripts/chaos/chaos.py [--quick] [--clusters 2] [--iters 200] [--faults 4] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron_dilocox.launch import start  # noqa: E402
from megatron_dilocox.local_launch import free_port  # noqa: E402
from megatron_dilocox.main_job import gpt_flags  # noqa: E402
from megatron_dilocox.metrics import read_rows  # noqa: E402


def dilocox_flags(out: str, h: int, timeout: float) -> list[str]:
    return ["--dilocox-h", str(h), "--dilocox-no-adaptive-h", "--dilocox-lowrank-rank", "8",
            "--dilocox-quant-bits", "4", "--dilocox-on-peer-failure", "continue",
            "--dilocox-timeout", str(timeout), "--dilocox-metrics-file", f"{out}/metrics_c{{cluster}}.jsonl"]


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.port = free_port()
        self.env = {"DILOCOX_SECRET": secrets.token_hex(16), "CUDA_VISIBLE_DEVICES": ""}
        self.megatron = gpt_flags(a.data, a.iters, 1, 1) + ["--log-interval", "1"]
        self.dilocox = dilocox_flags(a.out, a.h, a.timeout)
        self.incarnations = []  # (cluster, Clusters handle, position in it)
        self.faults = []

    def launch(self, only=None):
        cl = start(self.a.clusters, self.a.nproc, self.megatron, self.dilocox, env=self.env, echo=False,
                   rendezvous_port=self.port, only=only)
        for pos, c in enumerate(only or range(self.a.clusters)):
            self.incarnations.append((c, cl, pos))
        return cl

    def current(self, cluster):
        return [(cl, pos) for c, cl, pos in self.incarnations if c == cluster][-1]

    def rows(self, cluster):
        path = f"{self.a.out}/metrics_c{cluster}.jsonl"
        return read_rows(path) if os.path.exists(path) else []

    def all_in(self) -> bool:
        rows = self.rows(0)
        return bool(rows) and rows[-1]["num_clusters"] == self.a.clusters

    def inject(self, at_iteration: int):
        a = self.a
        cl0, pos0 = self.current(0)
        log0 = cl0.logs[pos0]
        if not log0.wait_for(lambda log: log.last_iteration >= at_iteration or log.ended, 1800) or log0.ended:
            return
        victim, rank = self.rng.randrange(1, a.clusters), self.rng.randrange(a.nproc)
        cl, pos = self.current(victim)
        fault = {"fault": f"SIGKILL cluster {victim} rank {rank}", "cluster": victim,
                 "at_iteration": cl.logs[pos].last_iteration}
        n_retry = sum("retrying with clusters" in ln for ln in log0.lines)
        t_kill = time.monotonic()
        cl.kill(pos, signal.SIGKILL, rank=rank)
        seen = log0.wait_for(lambda log: sum("retrying with clusters" in ln for ln in log.lines) > n_retry,
                             a.timeout * 3)
        fault["detection_s"] = round(time.monotonic() - t_kill, 1) if seen else None
        cl.procs[pos].wait(60)  # the victim's torchrun only (Clusters.wait would stop the survivors too)
        pause = self.rng.uniform(1.0, 5.0)
        time.sleep(pause)
        t_restart = time.monotonic()
        self.launch(only=[victim])
        back = False
        while time.monotonic() - t_restart < a.timeout + 300 and not log0.ended:
            if self.all_in() and self.rows(0)[-1]["launched_at"] > fault["at_iteration"]:
                back = True
                break
            time.sleep(0.5)
        fault["rejoined_after_s"] = round(time.monotonic() - t_restart, 1) if back else None
        fault["outcome"] = "survived, rejoined" if back and seen else "NOT survived"
        self.faults.append(fault)
        print("fault:", json.dumps(fault), flush=True)

    def run(self):
        a = self.a
        t0 = time.time()
        self.launch()
        # faults in the first part of the run: a restarted cluster needs time to start and rejoin
        lo, hi = 2 * a.h + 1, max(2 * a.h + 2, a.iters // 8 if a.faults == 1 else a.iters - a.iters // 4)
        spots = sorted(self.rng.sample(range(lo, max(lo + 1, hi)), min(a.faults, max(1, hi - lo))))
        for at in spots:
            self.inject(at)
        codes = {}
        for c in range(a.clusters):
            cl, pos = self.current(c)
            codes[c] = cl.wait(3600)[pos]
        for k, (c, cl, pos) in enumerate(self.incarnations):
            cl.stop()
            with open(f"{a.out}/log_{k}_cluster{c}.txt", "w") as f:
                f.write("\n".join(cl.logs[pos].lines) + "\n")
        return self.summary(codes, time.time() - t0)

    def summary(self, codes, wall):
        a = self.a
        rows = {c: self.rows(c) for c in range(a.clusters)}
        final = {c: r[-1]["global_model_hash"] if r else None for c, r in rows.items()}
        survivor = rows[0]
        dropped = [r["round"] for r in survivor if r["status"] != "applied"]
        covered = max((r["launched_at"] for r in survivor if r["status"] == "applied"), default=0)
        tokens = a.global_batch * a.seq
        killed_lost = 0
        for f in self.faults:  # its iterations after the launch of the last round that still counted it
            with_victim = [r["launched_at"] for r in survivor
                           if r["num_clusters"] == a.clusters and r["launched_at"] <= f["at_iteration"]]
            killed_lost += (f["at_iteration"] - max(with_victim, default=0)) * tokens
        summary = {
            "faults_injected": len(self.faults),
            "faults_survived": sum(f["outcome"].startswith("survived") for f in self.faults),
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
    a = ap.parse_args(argv)
    if a.quick:
        a.clusters, a.iters, a.h, a.faults = 2, 300, 5, 1
    a.out = a.out or tempfile.mkdtemp(prefix="dilocox_chaos_")
    os.makedirs(a.out, exist_ok=True)
    a.global_batch, a.seq = 8, 128  # main_job.gpt_flags
    from megatron_dilocox.data.prepare import prepare
    prepare(a.data, num_clusters=a.clusters)
    s = Soak(a).run()
    ok = s["faults_survived"] == s["faults_injected"] and s["rounds_dropped"] == 0 and s["final_agreement"] \
        and s["survivor_tokens_lost"] == 0 and all(c == 0 for c in s["exit_codes"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
