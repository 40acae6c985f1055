"""Run C DiLoCoX clusters on this host: one ``torchrun`` world per cluster, as C sites would.

Each cluster is its own ``torchrun --nproc-per-node N`` with its own master port; the clusters meet only
at the DiLoCoX rendezvous (cluster 0, rank 0). Output lines are prefixed with the cluster id. After the
run, the Megatron logs and the metrics JSONL are summarised (validation loss, tokens/s, bytes vs dense).

    python -m megatron_dilocox.launch --clusters 2 --nproc 2 -- <Megatron GPT flags with {cluster}>

``{cluster}`` in any Megatron flag is replaced by the cluster id (e.g. a per-cluster data path).
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from megatron_dilocox.local_launch import free_port

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+).*?elapsed time per iteration \(ms\): ([\d.]+).*?"
                     r"global batch size:\s+(\d+).*?lm loss: ([\d.Ee+-]+)")
VALID_RE = re.compile(r"validation loss at .*?lm loss value: ([\d.Ee+-]+)")


@dataclass
class ClusterLog:
    lines: list = field(default_factory=list)
    losses: dict = field(default_factory=dict)  # iteration -> lm loss
    iter_ms: dict = field(default_factory=dict)
    global_batch: int = 0
    valid_losses: list = field(default_factory=list)

    def feed(self, line: str):
        self.lines.append(line)
        m = ITER_RE.search(line)
        if m:
            it = int(m.group(1))
            self.losses[it] = float(m.group(5))
            self.iter_ms[it] = float(m.group(3))
            self.global_batch = int(m.group(4))
        m = VALID_RE.search(line)
        if m:
            self.valid_losses.append(float(m.group(1)))


def _pump(stream, prefix: str, log: ClusterLog, echo: bool, filter_re):
    for raw in iter(stream.readline, ""):
        line = raw.rstrip("\n")
        log.feed(line)
        if echo and (filter_re is None or filter_re.search(line)):
            print(f"{prefix}{line}", flush=True)


def run(clusters: int, nproc: int, megatron_args: list[str], dilocox_args: list[str] | None = None,
        env: dict | None = None, timeout: float = 3600, echo: bool = True, echo_filter: str | None = None,
        module: str = "megatron_dilocox.pretrain_gpt", per_cluster_args: dict | None = None,
        nproc_by_cluster: dict | None = None, prefix_by_cluster: dict | None = None,
        env_by_cluster: dict | None = None, rendezvous_host: str = "127.0.0.1") -> tuple[list[int], list[ClusterLog]]:
    """Start every cluster, wait for all; return (exit codes, parsed logs).

    ``per_cluster_args``: {cluster: extra flags} (tests use it to make clusters disagree);
    ``prefix_by_cluster``: {cluster: command prefix}, e.g. ``ip netns exec dlx1`` to put a cluster behind
    an emulated WAN link (then ``rendezvous_host`` is cluster 0's address on that link)."""
    rendezvous = f"{rendezvous_host}:{free_port()}"
    base_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    base_env.setdefault("DILOCOX_SECRET", secrets.token_hex(16))  # same for every cluster of this run
    base_env.update(env or {})
    procs, logs, threads = [], [], []
    filter_re = re.compile(echo_filter) if echo_filter else None
    for c in range(clusters):
        n = (nproc_by_cluster or {}).get(c, nproc)
        cmd = list((prefix_by_cluster or {}).get(c, []))
        cmd += [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(n),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module]
        cmd += [a.replace("{cluster}", str(c)) for a in megatron_args] + list((per_cluster_args or {}).get(c, []))
        if dilocox_args is not None:
            cmd += ["--dilocox", "--dilocox-num-clusters", str(clusters), "--dilocox-cluster-id", str(c),
                    "--dilocox-rendezvous", rendezvous] + [a.replace("{cluster}", str(c)) for a in dilocox_args]
        p = subprocess.Popen(cmd, env=dict(base_env, **(env_by_cluster or {}).get(c, {})),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        log = ClusterLog()
        t = threading.Thread(target=_pump, args=(p.stdout, f"[cluster {c}] ", log, echo, filter_re), daemon=True)
        t.start()
        procs.append(p)
        logs.append(log)
        threads.append(t)
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        codes += [None] * (len(procs) - len(codes))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        for t in threads:
            t.join(timeout=5)
    return [c if c is not None else -9 for c in codes], logs


def split_passthrough(argv=None) -> tuple[list[str], list[str]]:
    """(our own arguments, the ones after "--" that go to every cluster's Megatron)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def main(argv=None):
    own, rest = split_passthrough(argv)
    ap = argparse.ArgumentParser(description="run C DiLoCoX clusters on this host")
    ap.add_argument("--clusters", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2, help="processes per cluster")
    ap.add_argument("--timeout", type=float, default=3600)
    a = ap.parse_args(own)
    dl = [x for x in rest if x.startswith("--dilocox")]
    codes, _ = run(a.clusters, a.nproc, rest, dilocox_args=None if not dl else [], timeout=a.timeout)
    sys.exit(max(abs(c) for c in codes))


if __name__ == "__main__":
    main()
