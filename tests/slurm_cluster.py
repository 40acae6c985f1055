"""A real SLURM (22.05, Debian packages) on this one host, for tests: munged + slurmctld + N slurmd.

Each slurmd is a fake node (``NodeName=ciK NodeAddr=127.0.0.1 Port=<distinct>``, started with
``slurmd -N ciK``), so an sbatch job can ask for several nodes and srun starts one task per "node".
Everything lives in a private directory and is found through ``SLURM_CONF`` (never /etc/slurm): a
private munged (own key, own socket, ``AuthInfo=socket=...``), slurmctld, the slurmd, their state,
spool, logs and pid files. The fake node names are added to /etc/hosts (the job scripts use them as
MASTER_ADDR) and removed again at :meth:`SlurmCluster.stop`, which also cancels the jobs and stops every
daemon this object started: the machine is left as it was found, apart from the Debian packages that
:func:`ensure_installed` may have installed.

Pitfalls this follows (measured on these machines, see the project notes): munged runs as user munge
with a key owned by munge and no group/other access, and with ``--force`` (a stale socket from a hard
kill otherwise stops it); ``SlurmdParameters=config_overrides`` (declared CPUs above the hardware would
mark the node invalid); ``EnforcePartLimits=ALL`` (an impossible request is rejected at submission
instead of pending forever); slurmctld forks before it listens, so ``scontrol ping`` is awaited before
the slurmd start; the nodes are awaited idle in ``sinfo``; the daemons run in the foreground as our own
children, so a pid we signal is always the daemon we started (checked against /proc before each kill).

    with SlurmCluster(tmpdir, nodes=2) as cluster:
        job = cluster.sbatch(["--nodes=2", "script.sh"], env=...)
        state, exit_code = cluster.wait(job, timeout=300)
"""
from __future__ import annotations

import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from megatron_dilocox.harness.spawn import free_port  # noqa: F401  (tests import it from here)

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
HOSTS_FILE = "/etc/hosts"
MARKER = "dilocox-slurm-fixture"  # in the private dir's name and on our /etc/hosts line
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here (the message says why)."""


def _which_all() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None and not os.path.exists(f"/usr/sbin/{p}")]


def ensure_installed(timeout: float = 600) -> None:
    """apt-get install the SLURM and munge packages if any program is missing (root only)."""
    missing = _which_all()
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"missing {missing}; install as root: apt-get install --no-install-recommends "
                               + " ".join(PACKAGES))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:  # stale package lists: update once and retry
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True, timeout=timeout)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or _which_all():
        raise SlurmUnavailable(f"`{' '.join(cmd)}` failed (rc {r.returncode}): {r.stderr[-2000:]}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _remove_hosts_lines(predicate) -> None:
    """Rewrite /etc/hosts in place (it may be a bind mount: no rename) without the lines predicate picks."""
    with open(HOSTS_FILE, "r+") as f:
        lines = f.readlines()
        keep = [line for line in lines if not predicate(line)]
        if keep != lines:
            f.seek(0)
            f.write("".join(keep))
            f.truncate()


def cleanup_stale(base_dir: str | os.PathLike | None = None) -> None:
    """Remove what an earlier, killed test session of this fixture left: its /etc/hosts line, its
    daemons (recognised by the fixture's private directory on their command line) and that directory,
    when the session that made them is gone."""
    _remove_hosts_lines(lambda line: MARKER in line and not _hosts_line_owner_alive(line))
    for pid in _pids():
        cmd = _cmdline(pid)
        m = re.search(rf"(/\S*{MARKER}\S*?)/", cmd)
        if m and re.match(r"\S*(munged|slurmctld|slurmd)\b", cmd) and not _owner_alive(m.group(1)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for root in Path(base_dir or tempfile.gettempdir()).glob(f"{MARKER}-*"):
        if root.is_dir() and not _owner_alive(str(root)):
            shutil.rmtree(root, ignore_errors=True)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _owner_alive(root: str) -> bool:
    """The session that made ``root`` is still running (it wrote its pid into root/owner.pid)."""
    try:
        pid = int(Path(root, "owner.pid").read_text())
    except (OSError, ValueError):
        return False
    return pid == os.getpid() or Path(f"/proc/{pid}").exists()


def _hosts_line_owner_alive(line: str) -> bool:
    m = re.search(rf"{MARKER} pid=(\d+) root=(\S+)", line)
    return bool(m) and _owner_alive(m.group(2))


class SlurmCluster:
    """munged + slurmctld + ``nodes`` slurmd (fake nodes ci0..ciN-1) on this host; a context manager."""

    def __init__(self, base_dir: str | os.PathLike | None = None, nodes: int = 2, cpus_per_node: int = 2,
                 partition: str = "ci", node_prefix: str = "ci", gpus_per_node: int = 0):
        self.nodes = [f"{node_prefix}{k}" for k in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.partition = partition
        self.gpus_per_node = gpus_per_node
        self.base_dir = base_dir
        self.root: Path | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self._cmd_of: dict[str, str] = {}
        self._hosts_line: str | None = None
        self._stepd_before: set[int] = set()
        self.jobs: list[str] = []

    # ------------------------------------------------------------------------------------------ setup
    @property
    def conf(self) -> str:
        return str(self.root / "slurm.conf")

    @property
    def env(self) -> dict:
        """Environment for SLURM clients (sbatch, srun, ...) talking to this cluster."""
        env = dict(os.environ, SLURM_CONF=self.conf)
        for k in list(env):  # a client inside someone else's job would otherwise inherit its job
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del env[k]
        return env

    def start(self, timeout: float = 60) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise SlurmUnavailable("the SLURM test cluster needs root (munged as user munge, slurmd as root)")
        ensure_installed()
        cleanup_stale(self.base_dir)
        self.root = Path(tempfile.mkdtemp(prefix=f"{MARKER}-", dir=self.base_dir))
        self.root.chmod(0o755)  # munged (user munge) must reach its own subdirectory
        (self.root / "owner.pid").write_text(str(os.getpid()))
        self._stepd_before = {p for p in _pids() if "slurmstepd" in _cmdline(p)}
        try:
            self._write_config()
            self._add_hosts()
            self._start_munged()
            self._start_slurmctld(timeout)
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", self.conf])
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge", "dev"):
            (r / d).mkdir()
        self.ctld_port = free_port()
        # job scripts derive ports from SLURM_JOB_ID: start each session elsewhere, so ports of an
        # earlier session (TIME_WAIT, or a leftover process) are not reused
        self.first_job_id = random.randint(1000, 5_000_000)
        self.node_ports = {n: free_port() for n in self.nodes}
        gres_lines = []
        if self.gpus_per_node:
            # fake GPUs: GRES needs character devices; a copy of /dev/null's numbers (c 1 3) does
            for node in self.nodes:
                files = []
                for g in range(self.gpus_per_node):
                    path = r / "dev" / f"{node}-gpu{g}"
                    os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))
                    files.append(str(path))
                gres_lines.append(f"NodeName={node} Name=gpu File={','.join(files)}")
        nodes = "\n".join(
            f"NodeName={n} NodeAddr=127.0.0.1 Port={self.node_ports[n]} CPUs={self.cpus_per_node} "
            f"RealMemory=1000 State=UNKNOWN" + (f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else "")
            for n in self.nodes)
        (r / "slurm.conf").write_text(f"""\
# written by tests/slurm_cluster.py; private to this test session
ClusterName=dilocoxci
SlurmctldHost=localhost
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
ReturnToService=2
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
MinJobAge=600
FirstJobId={self.first_job_id}
KillWait=5
InactiveLimit=0
{"GresTypes=gpu" if self.gpus_per_node else ""}
{nodes}
PartitionName={self.partition} Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        (r / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        (r / "cgroup.conf").write_text("")

    def _add_hosts(self) -> None:
        names = [n for n in self.nodes if not self._resolves_locally(n)]
        if not names:
            return
        self._hosts_line = f"127.0.0.1 {' '.join(names)} # {MARKER} pid={os.getpid()} root={self.root}\n"
        with open(HOSTS_FILE, "a") as f:
            f.write(self._hosts_line)

    @staticmethod
    def _resolves_locally(name: str) -> bool:
        try:
            return socket.gethostbyname(name).startswith("127.")
        except OSError:
            return False

    def _start_munged(self) -> None:
        mdir = self.root / "munge"
        munge = pwd.getpwnam("munge")
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        for p in (mdir, key):
            os.chown(p, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)  # munged refuses a key that group/other can read
        mdir.chmod(0o755)  # clients reach the socket; munged refuses a socket dir others can write
        self._spawn("munged", ["munged", "--foreground", "--force",
                               f"--socket={mdir}/munge.socket", f"--key-file={key}",
                               f"--pid-file={mdir}/munged.pid", f"--log-file={mdir}/munged.log",
                               f"--seed-file={mdir}/munged.seed"], user=munge)
        deadline = time.monotonic() + 20
        while not (mdir / "munge.socket").exists():
            self._check_alive("munged", mdir / "munged.log")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"munged did not create its socket: {self._tail(mdir / 'munged.log')}")
            time.sleep(0.1)
        r = subprocess.run(f"munge -n -S {mdir}/munge.socket | unmunge -S {mdir}/munge.socket", shell=True,
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            raise SlurmUnavailable(f"munge round trip failed: {r.stdout}{r.stderr}")

    def _start_slurmctld(self, timeout: float) -> None:
        # -i: ignore state files (there are none: fresh directory); -D: foreground, our child
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        deadline = time.monotonic() + timeout
        while True:  # slurmctld forks its threads before it listens
            r = subprocess.run(["scontrol", "ping"], env=self.env, capture_output=True, text=True, timeout=30)
            if "UP" in r.stdout:
                return
            self._check_alive("slurmctld", self.root / "log" / "slurmctld.log")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"slurmctld did not answer: {r.stdout}{r.stderr}"
                                       f"{self._tail(self.root / 'log' / 'slurmctld.log')}")
            time.sleep(0.2)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True,
                               text=True, timeout=30)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            for n in self.nodes:
                self._check_alive(f"slurmd-{n}", self.root / "log" / f"slurmd-{n}.log")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"nodes not idle within {timeout}s: {states} {r.stderr}"
                                       f"{self._tail(self.root / 'log' / 'slurmctld.log')}")
            time.sleep(0.2)

    def _spawn(self, name: str, cmd: list[str], user: pwd.struct_passwd | None = None) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        if user is not None:
            os.chown(log.name, user.pw_uid, user.pw_gid)
        as_user = dict(user=user.pw_uid, group=user.pw_gid, extra_groups=[]) if user is not None else {}
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True, **as_user)
        log.close()
        self._cmd_of[name] = cmd[0]

    def _check_alive(self, name: str, log: Path) -> None:
        p = self.procs[name]
        if p.poll() is not None:
            raise SlurmUnavailable(f"{name} exited with {p.returncode}: "
                                   f"{self._tail(self.root / 'log' / f'{name}.stdout')}{self._tail(log)}")

    @staticmethod
    def _tail(path: Path, n: int = 3000) -> str:
        try:
            return f"\n--- {path} ---\n" + path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ------------------------------------------------------------------------------------------ jobs
    def run(self, cmd: list[str], env: dict | None = None, timeout: float = 60, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True,
                           timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{cmd} failed ({r.returncode}): {r.stdout}{r.stderr}")
        return r

    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | None = None) -> str:
        """Submit (``sbatch --parsable``); return the job id. The job inherits ``env`` (--export=ALL)."""
        r = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        job = r.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job_info(self, job: str) -> dict:
        r = self.run(["scontrol", "show", "job", "-o", job], check=False)
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)

    def wait(self, job: str, timeout: float, poll: float = 0.5) -> tuple[str, int]:
        """Wait for the job to end; return (JobState, exit code). On timeout cancel it and raise."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job)
            state = info.get("JobState", "")
            if state in FINAL_STATES:
                code, _, sig = info.get("ExitCode", "255:0").partition(":")
                return state, int(code) or (128 + int(sig) if sig and int(sig) else 0)
            if time.monotonic() > deadline:
                self.run(["scancel", job], check=False)
                raise TimeoutError(f"job {job} still {state or '?'} after {timeout}s: {info}")
            time.sleep(poll)

    # ------------------------------------------------------------------------------------------ teardown
    def stop(self) -> None:
        """Cancel the jobs, stop every daemon started here, remove the /etc/hosts line and the directory."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None and self.jobs:
            self.run(["scancel", *self.jobs], check=False, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=30)
                if not r.stdout.strip():
                    break
                time.sleep(0.3)
        # slurmd before slurmctld before munged (they talk to each other while they shut down)
        order = [f"slurmd-{n}" for n in self.nodes] + ["slurmctld", "munged"]
        for name in order:
            self._terminate(name)
        # job step daemons this cluster started (and, with them, any job process that outlived scancel)
        for pid in _pids():
            if pid not in self._stepd_before and "slurmstepd" in _cmdline(pid) and self._stepd_of_ours(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._hosts_line:
            line = self._hosts_line
            _remove_hosts_lines(lambda x: x == line)
            self._hosts_line = None
        if self.root and self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)

    def _stepd_of_ours(self, pid: int) -> bool:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return False
        return bool(self.root) and str(self.root).encode() in env

    def _terminate(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        if self._cmd_of[name] not in _cmdline(p.pid):  # never signal a pid that is not our daemon
            return
        try:
            p.terminate()
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
