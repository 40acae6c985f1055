"""Run C simulated clusters on this host: C separate torch.distributed worlds, one process per rank.

Each cluster gets its own MASTER_ADDR/MASTER_PORT and gloo world, exactly as C independent torchrun
jobs would; the clusters only meet through the DiLoCoX rendezvous store. Used by the core tests.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, cluster_id, local_rank, ranks_per_cluster, master_port, args, queue, env):
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
                 env: dict | None = None) -> dict[tuple[int, int], Any]:
    """Call ``fn(cluster_id, local_rank, *args)`` in every process; return {(cluster, rank): result}.

    Raises RuntimeError with each failing process's traceback if any process fails or times out."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for c in range(num_clusters):
        port = free_port()
        cargs = per_cluster_args(c) if per_cluster_args else args
        for r in range(ranks_per_cluster):
            p = ctx.Process(target=_entry, args=(fn, c, r, ranks_per_cluster, port, cargs, queue, env or {}),
                            daemon=True)
            p.start()
            procs.append(p)
    results, errors = {}, []
    import queue as queue_mod
    import time
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < len(procs):
            try:
                c, r, status, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = sum(1 for p in procs if not p.is_alive())
                if dead > len(results) + len(errors) + queue.qsize():  # died without reporting
                    time.sleep(1.0)  # its report may still be in flight
                    if queue.empty():
                        errors.append(f"{dead - len(results) - len(errors)} process(es) died without a report")
                        break
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for "
                                  f"{len(procs) - len(results) - len(errors)} process(es)")
                    break
                continue
            if status == "ok":
                import torch
                results[(c, r)] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"cluster {c} rank {r}: {value}")
                # the others are likely blocked on the failed one: give them a short grace only
                deadline = min(deadline, time.monotonic() + 20)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("simulated clusters failed:\n" + "\n".join(errors))
    return results
