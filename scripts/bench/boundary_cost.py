"""What the round boundary's host-side work costs (megatron_dilocox/sim/boundary.py): the rates of one core on this
machine, and the package's real outer step and hash timed against what the model predicts from those rates.

One torch thread (torchrun starts each rank with OMP_NUM_THREADS=1), fp32 tensors of --melems M values, best of
--repeats, timed in the thread's CPU time (user + system: page faults included, time spent waiting for a busy
host's cores not; on an idle host it is the wall time, printed beside it). Rates are memory traffic, bytes read +
written per second (STREAM's convention): a copy of B bytes moves 2B, ``b.mul_(m).add_(d)`` 5 x 4 bytes per value.
"First touch" is what a freshly allocated host tensor costs on top (page faults and the kernel zeroing each page:
large CPU tensors are mmap'ed anew every time). Use tensors well above the caches (at 4M values the model is off by
up to 3x).

    .venv/bin/python scripts/bench/boundary_cost.py [--melems 64] [--repeats 5]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from megatron_dilocox.outer.nesterov import LocalCorrection, OuterNesterov  # noqa: E402
from megatron_dilocox.outer.report import tensors_hash  # noqa: E402
from megatron_dilocox.sim import boundary  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--melems", type=int, default=64, help="values per tensor, millions (2^20)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = a.melems << 20
    B = 4 * n
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (1 min) at start; one torch thread;"
          f" {a.melems}M fp32 values ({B / 1e6:.0f} MB) per tensor, best of {a.repeats}")
    x, y, z, out = (torch.rand(n) for _ in range(4))

    def best(fn) -> tuple[float, float]:
        """(CPU, wall) seconds, each the best of the repeats, after a warm-up call."""
        fn()
        times = [_timed(fn) for _ in range(a.repeats)]
        return min(c for _, c in times), min(w for w, _ in times)

    ops = [("b.mul_(m).add_(d)", 5, lambda: y.mul_(0.3).add_(x)), ("torch.add(d, b, alpha, out=u)", 3,
           lambda: torch.add(x, y, alpha=0.3, out=out)), ("a.add_(u, alpha)", 3, lambda: z.add_(out, alpha=-1e-9))]
    copy_t = best(lambda: out.copy_(x))
    elem_t = [best(fn) for _, _, fn in ops]
    fresh_t = best(lambda: x.add(y, alpha=0.3))  # the middle add again, into a new tensor
    sha_t = best(lambda: hashlib.sha256(memoryview(x.numpy()).cast("B")).digest())
    copy, sha = 2 * B / copy_t[0], B / sha_t[0]
    elem = sum(k for _, k, _ in ops) * B / sum(t for t, _ in elem_t)
    touch = B / max(fresh_t[0] - elem_t[1][0], 1e-9)
    rows = [("copy (dst.copy_(src))", 2, copy_t)] + [(name, k, t) for (name, k, _), t in zip(ops, elem_t)]
    for name, k, (cpu, wall) in rows + [("sha256 (hashlib)", 1, sha_t)]:
        print(f"  {name:<36}{k * B / cpu / 1e6:>10,.0f} MB/s   (wall time: {k * B / wall / 1e6:,.0f} MB/s)")
    print(f"  {'elementwise, the three together':<36}{elem / 1e6:>10,.0f} MB/s")
    print(f"  {'first touch of a fresh tensor':<36}{touch / 1e6:>10,.0f} MB/s   (its bytes / extra CPU time of the"
          " fresh add)")
    print(f"defaults (megatron_dilocox/sim/boundary.py): HOST_COPY_GB_S = {copy / 1e9:.1f}, HOST_ELEMENTWISE_GB_S ="
          f" {elem / 1e9:.1f}, HOST_FIRST_TOUCH_GB_S = {touch / 1e9:.1f}, SHA256_GB_S = {sha / 1e9:.2f}")

    # the package's own code against the model's count (boundary.py's OUTER_STEP, EAGER_CORRECTION, hash)
    rates = SimpleNamespace(host_copy_gb_s=copy / 1e9, host_elementwise_gb_s=elem / 1e9,
                            host_first_touch_gb_s=touch / 1e9, sha256_gb_s=sha / 1e9, node_memory_gb_s=1e9,
                            gpus_per_node=1, pcie_gb_s=1e9)
    outer = OuterNesterov([z], lr=0.7, momentum=0.3, nesterov=True)
    outer.step([x])  # the first step makes the momentum buffer; the model counts the steps after it
    cfg = SimpleNamespace(resolved_outer_lr=0.7, resolved_outer_momentum=0.3, outer_nesterov=True)
    corr = LocalCorrection([(n,)], cfg, "cpu")
    corr.step([x], 0.625)
    checks = [("OuterNesterov.step (Nesterov, momentum 0.3)", lambda: outer.step([x]), boundary.OUTER_STEP),
              ("LocalCorrection.step (eager's c)", lambda: corr.step([y], 0.625), boundary.EAGER_CORRECTION),
              ("report.tensors_hash (the global-model hash)", lambda: tensors_hash([x]), boundary.HASH)]
    for name, fn, work in checks:
        (t, wall), model = best(fn), boundary.host_seconds(work, n, rates)
        print(f"  {name:<44} measured {t:.3f} s (wall {wall:.3f} s), model {model:.3f} s ({t / model:.2f}x)")
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")


def _timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of one call: torch runs it in this thread at one intra-op thread."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - t0, time.thread_time() - c0


if __name__ == "__main__":
    main()
