"""Run C DiLoCoX clusters on this host: one ``torchrun`` world per cluster, as C sites would.

Each cluster is its own ``torchrun --nproc-per-node N`` with its own master port; the clusters meet only
at the DiLoCoX rendezvous (cluster 0, rank 0). Output lines are prefixed with the cluster id. After the
run, the Megatron logs and the metrics JSONL are summarised (validation loss, tokens/s, bytes vs dense).

    python -m megatron_dilocox.launch --clusters 2 --nproc 2 -- <Megatron GPT flags with {cluster}>

``{cluster}`` in any Megatron flag is replaced by the cluster id (e.g. a per-cluster data path).

``run()`` starts the clusters and waits for them; ``start()`` returns at once with a ``Clusters`` handle
whose ``logs`` fill in as the clusters print (``ClusterLog.wait_for``), whose ``kill(cluster, signal,
rank=None)`` stops one rank (torchrun then takes its cluster down) or a whole cluster, and whose
``wait(timeout)`` returns the exit codes (-9 for a cluster it had to kill at the timeout).
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from megatron_dilocox.harness.spawn import free_port

ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+).*?elapsed time per iteration \(ms\): ([\d.]+).*?"
                     r"global batch size:\s+(\d+).*?lm loss: ([\d.Ee+-]+)")
GRAD_NORM_RE = re.compile(r"\| grad norm: ([^\s|]+) \|")
# "validation loss at iteration N | lm loss value: X" (periodic), "... at iteration N on validation set | ..." (final)
VALID_RE = re.compile(r"validation loss at (?:iteration (\d+)( on validation set)?)?.*?lm loss value: ([\d.Ee+-]+)")


@dataclass
class ClusterLog:
    """One cluster's output, parsed as it arrives (``start()`` feeds it from a reader thread)."""
    lines: list = field(default_factory=list)
    losses: dict = field(default_factory=dict)  # iteration -> lm loss (as printed)
    grad_norms: dict = field(default_factory=dict)  # iteration -> grad norm (as printed)
    iter_ms: dict = field(default_factory=dict)
    iter_wall: dict = field(default_factory=dict)  # iteration -> time.time() when its line arrived
    global_batch: int = 0
    valid_losses: list = field(default_factory=list)
    valid_at: list = field(default_factory=list)  # (iteration, final?) of each valid_losses entry
    test_losses: list = field(default_factory=list)  # "... on test set" (Megatron's test split, --test-data-path)
    ended: bool = False  # the output stream closed (the cluster's torchrun exited)
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False, compare=False)

    def feed(self, line: str):
        with self._cond:
            self.lines.append(line)
            m = ITER_RE.search(line)
            if m:
                it = int(m.group(1))
                self.losses[it] = float(m.group(5))
                self.iter_ms[it] = float(m.group(3))
                self.iter_wall[it] = time.time()
                self.global_batch = int(m.group(4))
                g = GRAD_NORM_RE.search(line)
                if g:
                    self.grad_norms[it] = float(g.group(1))
            m = VALID_RE.search(line)
            if m and " on test set " in line:
                self.test_losses.append(float(m.group(3)))
            elif m:
                self.valid_losses.append(float(m.group(3)))
                self.valid_at.append((int(m.group(1)) if m.group(1) else None, bool(m.group(2))))
            self._cond.notify_all()

    def end(self):
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    @property
    def last_iteration(self) -> int:
        return max(self.losses, default=0)

    def wait_for(self, predicate, timeout: float) -> bool:
        """Block until ``predicate(self)`` holds (True), or the output ends or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    return bool(predicate(self))
                self._cond.wait(min(left, 1.0))
            return True


def _pump(stream, prefix: str, log: ClusterLog, echo: bool, filter_re):
    try:
        for raw in iter(stream.readline, ""):
            line = raw.rstrip("\n")
            log.feed(line)
            if echo and (filter_re is None or filter_re.search(line)):
                print(f"{prefix}{line}", flush=True)
    finally:
        log.end()


class Clusters:
    """Clusters started by :func:`start`: their parsed logs, their ranks, kill, wait."""

    def __init__(self, procs, logs, threads):
        self.procs, self.logs, self._threads = procs, logs, threads
        self._seen: list[dict] = [{} for _ in procs]  # per cluster: every process seen under it (psutil)
        self._ranks: dict = {}  # (cluster, rank) -> the psutil process last seen with that RANK

    def _tree(self, cluster: int) -> list:
        """torchrun and all its descendants now (psutil processes); remembered for :meth:`stop`."""
        import psutil
        if self.procs[cluster].poll() is not None:  # reaped: its pid may belong to someone else by now
            return []
        try:
            root = psutil.Process(self.procs[cluster].pid)
            tree = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for proc in tree:
            self._seen[cluster].setdefault(proc.pid, proc)
        return tree

    def rank_pids(self, cluster: int) -> dict[int, int]:
        """{rank: pid} of the cluster's workers (torchrun's children, by their RANK)."""
        import psutil
        out = {}
        for child in self._tree(cluster)[1:]:
            try:
                if child.ppid() == self.procs[cluster].pid and "RANK" in (env := child.environ()):
                    out[int(env["RANK"])] = child.pid
                    self._ranks[(cluster, int(env["RANK"]))] = child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return out

    def kill(self, cluster: int, sig: int = signal.SIGKILL, rank: int | None = None, timeout: float = 60):
        """Send ``sig`` to one rank of ``cluster`` (its process group: torchrun starts each worker in its own
        session, with any helper processes it forks), or with ``rank=None`` to torchrun and everything under it.
        torchrun takes the rest of a cluster down when one of its ranks dies."""
        if rank is None:
            self._tree(cluster)
            self._signal_all(cluster, sig)
            return
        known = self._ranks.get((cluster, rank))  # looked up before (rank_pids): no tree walk between cue and kill
        pid = known.pid if known is not None and known.is_running() else None  # psutil: not a reused pid
        deadline = time.monotonic() + timeout
        while pid is None and (pid := self.rank_pids(cluster).get(rank)) is None:
            if time.monotonic() > deadline or self.procs[cluster].poll() is not None:
                raise RuntimeError(f"cluster {cluster} has no rank {rank} to kill")
            time.sleep(0.05)
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)

    def _signal_all(self, cluster: int, sig: int):
        import psutil
        for proc in list(self._seen[cluster].values()):
            try:
                proc.send_signal(sig)  # psutil refuses a pid that now names another process
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                pass

    def poll(self) -> list:
        return [p.poll() for p in self.procs]

    def wait(self, timeout: float) -> list[int]:
        """Exit codes, waiting at most ``timeout`` seconds in all; a cluster still running then is killed
        (with everything under it) and reported as -9. Never blocks much past the timeout."""
        deadline = time.monotonic() + timeout
        codes = []
        for c, p in enumerate(self.procs):
            while p.poll() is None and time.monotonic() < deadline:
                self._tree(c)
                try:
                    p.wait(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
            codes.append(p.poll())
        self.stop()
        return [c if c is not None else -9 for c in codes]

    def stop(self):
        """Kill whatever is left of every cluster (workers orphaned by a killed torchrun included)."""
        for c, p in enumerate(self.procs):
            self._tree(c)
            self._signal_all(c, signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start(clusters: int, nproc: int, megatron_args: list[str], dilocox_args: list[str] | None = None,
          env: dict | None = None, echo: bool = True, echo_filter: str | None = None,
          module: str = "megatron_dilocox.pretrain_gpt", per_cluster_args: dict | None = None,
          nproc_by_cluster: dict | None = None, prefix_by_cluster: dict | None = None,
          env_by_cluster: dict | None = None, rendezvous_host: str = "127.0.0.1",
          rendezvous_port: int | None = None, only: list[int] | None = None) -> Clusters:
    """Start every cluster (one torchrun each) and return at once; see :func:`run` for the arguments.

    ``rendezvous_port``: fixed port for the DiLoCoX rendezvous (default: a free one); ``only``: start just
    these cluster ids (e.g. one cluster restarted into a running set; positions in the handle follow it)."""
    rendezvous = f"{rendezvous_host}:{rendezvous_port or free_port()}"
    base_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    base_env.setdefault("DILOCOX_SECRET", secrets.token_hex(16))  # same for every cluster of this run
    base_env.update(env or {})
    procs, logs, threads = [], [], []
    filter_re = re.compile(echo_filter) if echo_filter else None
    for c in (range(clusters) if only is None else only):
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
    return Clusters(procs, logs, threads)


def run(clusters: int, nproc: int, megatron_args: list[str], dilocox_args: list[str] | None = None,
        env: dict | None = None, timeout: float = 3600, echo: bool = True, echo_filter: str | None = None,
        module: str = "megatron_dilocox.pretrain_gpt", per_cluster_args: dict | None = None,
        nproc_by_cluster: dict | None = None, prefix_by_cluster: dict | None = None,
        env_by_cluster: dict | None = None, rendezvous_host: str = "127.0.0.1",
        rendezvous_port: int | None = None) -> tuple[list[int], list[ClusterLog]]:
    """Start every cluster, wait for all; return (exit codes, parsed logs).

    ``per_cluster_args``: {cluster: extra flags} (tests use it to make clusters disagree);
    ``prefix_by_cluster``: {cluster: command prefix}, e.g. ``ip netns exec dlx1`` to put a cluster behind
    an emulated WAN link (then ``rendezvous_host`` is cluster 0's address on that link).
    A cluster still running at ``timeout`` is killed and reported as -9."""
    cl = start(clusters, nproc, megatron_args, dilocox_args, env=env, echo=echo, echo_filter=echo_filter,
               module=module, per_cluster_args=per_cluster_args, nproc_by_cluster=nproc_by_cluster,
               prefix_by_cluster=prefix_by_cluster, env_by_cluster=env_by_cluster, rendezvous_host=rendezvous_host,
               rendezvous_port=rendezvous_port)
    try:
        return cl.wait(timeout), cl.logs
    finally:
        cl.stop()


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
