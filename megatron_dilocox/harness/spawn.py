"""Run C simulated clusters on this host: C separate torch.distributed worlds, one process per rank.

Each cluster gets its own MASTER_ADDR/MASTER_PORT and gloo world, exactly as C independent torchrun
jobs would; the clusters only meet through the DiLoCoX rendezvous store. Used by the core tests.

Processes start from a fork server that has imported torch once (``forkserver`` with a preload), not from a
fresh interpreter each (``spawn``): a fresh interpreter spends about 1.5 s of CPU importing torch, which the core
tier paid for every process it started. Each process's ``os.environ`` is the caller's as it is at the call (as
``spawn`` gives), not the fork server's; what torch itself read from the environment at import (OMP_NUM_THREADS,
TORCH_*) is the fork server's, started by the first call in the process.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import random
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nobody listens on, chosen *below* the kernel's ephemeral range.

    ``bind(0)`` hands out a port from the ephemeral range, the same range every outgoing connection
    (gloo opens thousands) draws its source port from: between our probe and the server's bind, a
    client socket can take the port, and the server then fails or a client meets a stranger (a CI run
    saw "Connection reset by peer" on a torchrun master port). Ports below that range are never
    auto-assigned, so only another explicit bind can collide, which the probe catches."""
    high = _ephemeral_low() - 1
    low = max(1024, high - 16000)
    # pytest-xdist workers (and every process they start) draw from disjoint quarters of the range: two workers
    # once drew the same port between one's probe and its server's bind (EADDRINUSE in CI)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        quarter = (high - low) // 4
        low += (int(worker[2:]) % 4) * quarter
        high = low + quarter - 1
    rng = random.Random()  # fresh OS entropy: forked workers must not share one sequence
    for _ in range(200):
        port = rng.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {low}..{high} after 200 tries")


def _entry(fn, cluster_id, local_rank, ranks_per_cluster, master_port, args, queue, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(ranks_per_cluster))
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=local_rank, world_size=ranks_per_cluster,
                                timeout=timedelta(seconds=120))
        try:
            result = fn(cluster_id, local_rank, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()  # plain bytes: tensors sent as shared memory die with this process
        torch.save(result, buf)
        queue.put((cluster_id, local_rank, "ok", buf.getvalue()))
    except BaseException as exc:  # report everything, including the traceback, to the parent
        queue.put((cluster_id, local_rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_clusters(fn: Callable, num_clusters: int, ranks_per_cluster: int = 1, args: tuple = (),
                 per_cluster_args: Callable[[int], tuple] | None = None, timeout: float = 300,
                 env: dict | None = None, may_die: tuple = ()) -> dict[tuple[int, int], Any]:
    """Call ``fn(cluster_id, local_rank, *args)`` in every process; return {(cluster, rank): result}.

    ``may_die``: clusters whose processes are expected to be killed (fault tests); they are left out of
    the result when they die without a report. Raises RuntimeError with each failing process's
    traceback if any other process fails, dies or times out."""
    import queue as queue_mod
    import time

    import torch
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    env = {**os.environ, **(env or {})}  # the caller's, now (the fork server's dates from its start)
    queue = ctx.Queue()
    procs = {}
    for c in range(num_clusters):
        port = free_port()
        cargs = per_cluster_args(c) if per_cluster_args else args
        for r in range(ranks_per_cluster):
            p = ctx.Process(target=_entry, args=(fn, c, r, ranks_per_cluster, port, cargs, queue, env),
                            daemon=True)
            p.start()
            procs[(c, r)] = p
    started = list(procs.values())
    results, errors = {}, []
    deadline = time.monotonic() + timeout

    def take(item):
        c, r, status, value = item
        procs.pop((c, r), None)
        if status == "ok":
            results[(c, r)] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"cluster {c} rank {r}: {value}")
    try:
        while procs:
            try:
                take(queue.get(timeout=1.0))
                if errors:  # the others are likely blocked on the failed one: a short grace only
                    deadline = min(deadline, time.monotonic() + 20)
                continue
            except queue_mod.Empty:
                pass
            dead = [k for k, p in procs.items() if not p.is_alive()]
            if dead:
                time.sleep(1.0)  # a report may still be in flight
                while not queue.empty():
                    take(queue.get())
                for k in dead:
                    if k in procs:
                        procs.pop(k)
                        if k[0] not in may_die:
                            errors.append(f"cluster {k[0]} rank {k[1]} died without a report")
            if time.monotonic() > deadline:
                errors.append(f"timed out after {timeout}s waiting for {sorted(procs)}")
                break
    finally:
        for p in started:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("simulated clusters failed:\n" + "\n".join(errors))
    return results
