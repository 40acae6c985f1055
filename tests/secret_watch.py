"""The secret never leaks from a real run: watch the run's processes while it lives, then search everything it
printed and wrote (tests/test_megatron_dilocox.py::test_two_clusters_tp1_pp2 runs it on its own run;
docs/security.md).

A distinctive random ``$DILOCOX_SECRET`` and a marker in the run's environment; while the run lives, every process
holding the marker has its ``/proc/<pid>/cmdline`` read and ``ps`` is sampled; afterwards every output line and
every file under the run's folder is searched byte-wise (zip members decompressed, UTF-8 and UTF-16) for it.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import threading
import zipfile


class SecretWatch:
    def __init__(self):
        self.secret = "dlxsec-" + secrets.token_hex(24)
        self.marker = "run-" + secrets.token_hex(8)
        self.env = {"DILOCOX_SECRET": self.secret, "DILOCOX_SECURITY_MARKER": self.marker}
        self.seen: dict[int, list] = {}  # pid -> [every command line it showed, whether the secret was in its env]
        self.ps_hits: list[str] = []
        self.ps_samples: list[str] = []

    def run(self, train):
        """Call ``train()`` in a thread, watching the run's processes until it returns; its result."""
        result = {}

        def target():
            try:
                result["value"] = train()
            except BaseException as e:  # (raised again below, on the test's thread)
                result["error"] = e
        thread = threading.Thread(target=target)
        thread.start()
        while thread.is_alive():
            self._marked_processes()
            ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
            self.ps_samples.append(ps)
            self.ps_hits += [line for line in ps.splitlines() if self.secret in line]
            thread.join(timeout=0.3)
        if "error" in result:
            raise result["error"]
        return result["value"]

    def _marked_processes(self):
        """Every process whose environment holds the marker: seen[pid] = [every command line it showed (a fork
        shows its parent's until it execs), whether the secret was in its environment]."""
        marker, secret = self.marker.encode(), self.secret.encode()
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
                if marker not in environ:
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:  # gone, or not ours
                continue
            if cmdline:  # a zombie has none
                entry = self.seen.setdefault(int(pid), [[], False])
                if cmdline not in entry[0]:
                    entry[0].append(cmdline)
                entry[1] = entry[1] or secret in environ

    def assert_never_leaked(self, logs, folder: str, entry: bytes = b"megatron_dilocox.pretrain_gpt",
                            agents: int = 2, workers: int = 4) -> dict:
        """The secret is in no command line (of the run's processes, in ps), no output line, no file under
        ``folder``; it was really in every worker's environment. Returns the files by kind (checkpoint,
        metrics, tensorboard, wandb)."""
        seen, secret = self.seen, self.secret
        found_agents = [pid for pid, (cmds, _) in seen.items() if b"torch.distributed.run" in cmds[-1]]
        found_workers = {pid: has for pid, (cmds, has) in seen.items()
                         if entry in cmds[-1] and b"torch.distributed.run" not in cmds[-1]}
        assert len(found_agents) >= agents and len(found_workers) >= workers, \
            [cmds[-1][:120] for cmds, _ in seen.values()]
        assert all(found_workers.values())  # the secret was really there, in each worker's environment
        assert not [c for cmds, _ in seen.values() for c in cmds if secret.encode() in c]
        assert not self.ps_hits and any(entry.decode() in ps for ps in self.ps_samples)
        for c, log in enumerate(logs):
            assert not [line for line in log.lines if secret in line]
            with open(f"{folder}/output_c{c}.log", "w") as f:  # (searched below like every file)
                f.write("\n".join(log.lines))
        files = [os.path.join(root, f) for root, _, fs in os.walk(folder) for f in fs]
        needles = (secret.encode(), secret.encode("utf-16-le"))
        leaks = [name for f in files for name, blob in file_blobs(f) if any(n in blob for n in needles)]
        assert not leaks
        return {kind: [f for f in files if test(f)] for kind, test in {
            "checkpoint": lambda f: "/ckpt_c" in f and f.endswith(".distcp"),
            "metrics": lambda f: f.endswith(".jsonl"),
            "tensorboard": lambda f: "tfevents" in f,
            "wandb": lambda f: f.endswith(".wandb"),
        }.items()}


def file_blobs(path: str):
    """The file's bytes, and each member's decompressed bytes when it is a zip (torch.save archives)."""
    with open(path, "rb") as f:
        data = f.read()
    yield path, data
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                yield f"{path}!{name}", z.read(name)
