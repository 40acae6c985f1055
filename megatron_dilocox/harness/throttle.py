"""A slower site on one machine: its processes in a cgroup (v1 cpu controller) with a CPU quota.

``with cpu_quota("site1", 0.5) as prefix:`` gives a command prefix that puts the command it starts (and its
children: a whole torchrun world) in a group allowed half a core; ``harness.launch`` takes it per cluster
(``prefix_by_cluster``), as it takes ``ip netns exec`` for a slow link. Needs root and a writable
/sys/fs/cgroup/cpu; ``unavailable()`` says why not where it is not. The group is removed on exit (its
processes must have exited: a group with members cannot be removed, so stragglers are killed first).
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Iterator, Optional

CPU_ROOT = "/sys/fs/cgroup/cpu"
PERIOD_US = 100_000


def unavailable() -> Optional[str]:
    """None where a cpu-quota group can be made here, else the reason."""
    if not os.path.isfile(os.path.join(CPU_ROOT, "cpu.cfs_period_us")):
        return f"no cgroup v1 cpu controller at {CPU_ROOT}"
    if not os.access(CPU_ROOT, os.W_OK):
        return f"{CPU_ROOT} is not writable (needs root)"
    return None


@contextlib.contextmanager
def cpu_quota(name: str, cores: float) -> Iterator[list[str]]:
    """A cgroup allowing ``cores`` CPUs (e.g. 0.5); yields the command prefix that starts a command inside it."""
    reason = unavailable()
    if reason:
        raise RuntimeError(f"cannot throttle a site by CPU quota: {reason}")
    if not cores > 0:
        raise ValueError(f"cores must be positive, got {cores}")
    path = os.path.join(CPU_ROOT, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
        f.write(str(PERIOD_US))
    with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
        f.write(str(int(cores * PERIOD_US)))
    try:
        yield ["sh", "-c", f'echo $$ > {path}/cgroup.procs; exec "$@"', "sh"]
    finally:
        for _ in range(50):
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)
