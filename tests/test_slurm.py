"""scripts/pretrain_gpt_dilocox.sh under a real SLURM (tests/slurm_cluster.py: munged, slurmctld and four
slurmd as fake nodes ci0..ci3 on this host), training a tiny GPT on the KJV corpus on CPU.

(a) one 2-node allocation split into 2 clusters; (b) two concurrent 1-node jobs in multi-job mode meeting
at one rendezvous; (c) one 4-node allocation split into 2 clusters of 2 nodes (each cluster one torchrun
world across its 2 nodes, pipeline parallel 2). Both: the jobs exit 0, the job logs show Megatron iterations and DiLoCoX rounds, both
clusters' metrics carry the same global model hash every round, and the shared secret reaches the
training processes by environment only (never on any process's command line, never in the log).
The script's early errors are checked by running it directly with fake SLURM variables (no sbatch).
"""
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron_dilocox.metrics import read_rows
from tests.slurm_cluster import SlurmCluster, SlurmUnavailable, free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pretrain_gpt_dilocox.sh"
ITERS, H = 8, 4
ROUNDS = ITERS // H
JOB_TIMEOUT = 420  # seconds a test waits for its job(s); the job's own --time is the backstop
ITER_RE = re.compile(r"^(\d+): .*\biteration\s+(\d+)/\s*(\d+) .*lm loss: ([\d.Ee+-]+)", re.M)
ROUND_RE = re.compile(r"^(\d+): \[dilocox\] DiLoCoX round (\d+) @ iter \d+: applied.*hash=(\w+)", re.M)


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("the SLURM test cluster needs root")
    cluster = SlurmCluster(nodes=4, cpus_per_node=2)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.fail(f"could not start the test SLURM cluster: {exc}")
    yield cluster
    cluster.stop()


def data_env(corpus: Path, log_dir: Path) -> dict:
    return {"DATA_PREFIX": f"{corpus}/train_c{{cluster}}_text_document",
            "VALID_DATA_PREFIX": f"{corpus}/valid_text_document",
            "TOKENIZER_MODEL": f"{corpus}/tokenizer.model",
            "LOG_DIR": str(log_dir), "WANDB_MODE": "offline", "CUDA_VISIBLE_DEVICES": ""}


def tiny_gpt(metrics_dir: Path) -> list[str]:
    """Extra Megatron flags (they come last and override the script's 125M defaults)."""
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(ITERS), "--lr", "3e-3", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
            "--log-interval", "1", "--eval-interval", str(ITERS), "--eval-iters", "2", "--num-workers", "0",
            "--dilocox-h", str(H), "--dilocox-no-adaptive-h", "--dilocox-lowrank-rank", "4",
            "--dilocox-lowrank-min-dim", "32", "--dilocox-quant-block-size", "64",
            "--dilocox-timeout-seconds", "180",
            "--dilocox-metrics-file", f"{metrics_dir}/metrics_c{{cluster}}.jsonl"]


def sbatch_args(out: Path, *extra: str) -> list[str]:
    # --gpus-per-node=0 overrides the script's "#SBATCH --gpus-per-node=8" (these fake nodes have none)
    return ["--gpus-per-node=0", "--time=10", f"--output={out}", *extra, str(SCRIPT)]


class ProcWatch(threading.Thread):
    """While jobs run: every process's command line, and DILOCOX_SECRET from the environment of the
    processes of the given jobs (what a user on the node could see with ps, and what the trainers got)."""

    def __init__(self, jobs):
        super().__init__(daemon=True)
        self.jobs = set(jobs)
        self.cmdlines: set[str] = set()
        self.secrets: dict[str, set] = {}  # job -> secrets seen in its processes
        self.trainers = 0
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                self.cmdlines.add(cmd.replace(b"\0", b" ").decode(errors="replace"))
                env = dict(kv.decode(errors="replace").split("=", 1) for kv in env if b"=" in kv)
                job = env.get("SLURM_JOB_ID")
                if job in self.jobs and "megatron_dilocox.pretrain_gpt" in cmd.decode(errors="replace"):
                    self.trainers += 1
                    self.secrets.setdefault(job, set()).add(env.get("DILOCOX_SECRET"))
            self._halt.wait(0.25)

    def stop(self):
        self._halt.set()
        self.join(timeout=10)


def wait_all(slurm, jobs, logs):
    """Wait for every job; assert each COMPLETED with exit code 0 (the job log tail in the message)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    for job, log in zip(jobs, logs):
        try:
            state, code = slurm.wait(job, timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            pytest.fail(f"{exc}\n{tail(log)}")
        assert (state, code) == ("COMPLETED", 0), f"job {job}: {state} exit {code}\n{tail(log)}"


def tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"(no log {path})"


def check_log(text: str, labels, round_labels=None):
    """labels: the srun task labels (= node index in the job) that log Megatron iterations (a cluster's
    last pipeline stage), round_labels those that log DiLoCoX rounds (a cluster's rank 0; default: the
    same). Each trained ITERS iterations and ran ROUNDS rounds; returns {label: {round: hash}}."""
    iters = {}
    for label, it, total, _ in ITER_RE.findall(text):
        assert int(total) == ITERS
        iters.setdefault(int(label), set()).add(int(it))
    rounds = {}
    for label, rnd, h in ROUND_RE.findall(text):
        rounds.setdefault(int(label), {})[int(rnd)] = h
    for label in labels:
        assert iters.get(label) == set(range(1, ITERS + 1)), (label, iters)
    for label in labels if round_labels is None else round_labels:
        assert sorted(rounds.get(label, {})) == list(range(1, ROUNDS + 1)), (label, rounds)
    return rounds


def check_metrics(metrics_dir: Path):
    rows = [read_rows(f"{metrics_dir}/metrics_c{c}.jsonl") for c in (0, 1)]
    for c, r in enumerate(rows):
        assert [x["round"] for x in r] == list(range(1, ROUNDS + 1)), (c, r)
        assert all(x["cluster"] == c and x["num_clusters"] == 2 and x["status"] == "applied" for x in r)
    hashes = [[x["global_model_hash"] for x in r] for r in rows]
    assert hashes[0] == hashes[1] and len(set(hashes[0])) == ROUNDS, hashes
    return hashes[0]


def check_secret(watch: ProcWatch, secret: str | None, logs: list[Path]):
    """One secret for all clusters, seen in the trainers' environment, on no command line, in no log."""
    seen = set().union(*watch.secrets.values()) if watch.secrets else set()
    assert watch.trainers and len(seen) == 1 and None not in seen, watch.secrets
    (value,) = seen
    if secret is not None:
        assert value == secret
    assert len(value) >= 32
    assert not [c for c in watch.cmdlines if value in c], "the secret is visible on a command line"
    for log in logs:
        assert value not in log.read_text(errors="replace"), f"the secret is in {log}"


# ------------------------------------------------------------------------------------------ real jobs
@pytest.mark.slurm
def test_one_allocation_split_into_two_clusters(slurm, kjv, tmp_path):
    """sbatch --nodes=2 with DILOCOX_NUM_CLUSTERS=2: two 1-node blocks, two torchrun worlds; no
    DILOCOX_SECRET given, so the script makes one for the job."""
    log = tmp_path / "job.out"
    env = {**data_env(kjv, tmp_path / "logs"), "DILOCOX_NUM_CLUSTERS": "2"}
    job = slurm.sbatch(sbatch_args(log, "--nodes=2", "--job-name=dlx-single") + tiny_gpt(tmp_path),
                       env={**env, "DILOCOX_SECRET": ""}, cwd=str(REPO))
    watch = ProcWatch([job])
    watch.start()
    try:
        wait_all(slurm, [job], [log])
    finally:
        watch.stop()
    text = log.read_text()
    assert "mode single, 2 cluster(s) in total" in text and "(CPU, gloo)" in text
    assert "0: [dilocox-launch] node ci0: cluster 0" in text and "1: [dilocox-launch] node ci1: cluster 1" in text
    rounds = check_log(text, [0, 1])
    hashes = check_metrics(tmp_path)
    assert [rounds[0][r] for r in range(1, ROUNDS + 1)] == [h[:len(rounds[0][1])] for h in hashes]
    assert rounds[0] == rounds[1]
    check_secret(watch, None, [log])


@pytest.mark.slurm
def test_two_jobs_multi_job_mode_meet_at_one_rendezvous(slurm, kjv, tmp_path):
    """Two concurrent 1-node jobs, one per cluster, as two sites would submit them: the same script with
    DILOCOX_MODE=multi-job, their cluster id, the rendezvous on cluster 0's (pinned) first node, and the
    shared secret in the environment. Cluster 1 is submitted first: it waits at the rendezvous."""
    secret = os.urandom(24).hex()
    rendezvous = f"ci0:{free_port()}"
    jobs, logs = [], []
    for c, node in ((1, "ci1"), (0, "ci0")):
        log = tmp_path / f"job_c{c}.out"
        env = {**data_env(kjv, tmp_path / "logs"), "DILOCOX_MODE": "multi-job", "DILOCOX_NUM_CLUSTERS": "2",
               "DILOCOX_CLUSTER_ID": str(c), "DILOCOX_RENDEZVOUS": rendezvous, "DILOCOX_SECRET": secret}
        jobs.append(slurm.sbatch(sbatch_args(log, "--nodes=1", f"--nodelist={node}", f"--job-name=dlx-c{c}")
                                 + tiny_gpt(tmp_path), env=env, cwd=str(REPO)))
        logs.append(log)
    watch = ProcWatch(jobs)
    watch.start()
    try:
        wait_all(slurm, jobs, logs)
    finally:
        watch.stop()
    per_cluster = {}
    for c, log in zip((1, 0), logs):
        text = log.read_text()
        assert f"mode multi-job, 2 cluster(s) in total, 1 here (id {c}..{c})" in text
        assert f"0: [dilocox-launch] node ci{c}: cluster {c}" in text
        per_cluster[c] = check_log(text, [0])[0]
    assert per_cluster[0] == per_cluster[1]
    check_metrics(tmp_path)
    check_secret(watch, secret, logs)


@pytest.mark.slurm
def test_two_node_clusters_pipeline_across_nodes(slurm, kjv, tmp_path):
    """sbatch --nodes=4, 2 clusters: blocks ci0+ci1 and ci2+ci3, torchrun --nnodes 2 in each (node rank
    0 and 1, the block's first node as master), PP=2 so every cluster's model spans its two nodes."""
    log = tmp_path / "job.out"
    env = {**data_env(kjv, tmp_path / "logs"), "DILOCOX_NUM_CLUSTERS": "2", "PP": "2", "DILOCOX_SECRET": ""}
    job = slurm.sbatch(sbatch_args(log, "--nodes=4", "--job-name=dlx-pp") + tiny_gpt(tmp_path),
                       env=env, cwd=str(REPO))
    wait_all(slurm, [job], [log])
    text = log.read_text()
    assert "2 node(s) x 1 proc each" in text
    for task, (node, cluster, rank, master) in enumerate((("ci0", 0, 0, "ci0"), ("ci1", 0, 1, "ci0"),
                                                          ("ci2", 1, 0, "ci2"), ("ci3", 1, 1, "ci2"))):
        assert re.search(rf"^{task}: \[dilocox-launch\] node {node}: cluster {cluster}, node {rank} of 2, "
                         rf"1 proc/node, master {master}:\d+$", text, re.M), text[:3000]
    # Megatron logs iterations on the last pipeline stage (node rank 1), DiLoCoX rounds on rank 0
    rounds = check_log(text, [1, 3], round_labels=[0, 2])
    assert rounds[0] == rounds[2]
    check_metrics(tmp_path)


# ------------------------------------------------------------------------------------------ early errors
def run_script(env: dict, *args: str, cwd=None) -> subprocess.CompletedProcess:
    """The script outside SLURM with fake job variables: the checks run before any srun or Python."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "DILOCOX_", "DATA_PREFIX", "VALID_DATA_PREFIX", "TOKENIZER_MODEL"))}
    base.update({"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "2"})
    base.update(env)
    return subprocess.run(["bash", str(SCRIPT), *args], env=base, cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def fake_data(tmp_path):
    for name in ("train_c0_text_document", "train_c1_text_document", "valid_text_document"):
        for ext in ("bin", "idx"):
            (tmp_path / f"{name}.{ext}").write_bytes(b"")
    (tmp_path / "tokenizer.model").write_bytes(b"")
    return {"DATA_PREFIX": f"{tmp_path}/train_c{{cluster}}_text_document",
            "VALID_DATA_PREFIX": f"{tmp_path}/valid_text_document", "TOKENIZER_MODEL": f"{tmp_path}/tokenizer.model"}


@pytest.mark.parametrize("env,message", [
    ({"SLURM_JOB_NUM_NODES": "3", "DILOCOX_NUM_CLUSTERS": "2"},
     "the job has 3 nodes, which does not split into DILOCOX_NUM_CLUSTERS=2 equal clusters: "
     "submit with sbatch --nodes=<a multiple of 2> or change DILOCOX_NUM_CLUSTERS"),
    ({"DILOCOX_NUM_CLUSTERS": "0"}, "DILOCOX_NUM_CLUSTERS must be an integer >= 1, got '0'"),
    ({"DILOCOX_NUM_CLUSTERS": "two"}, "DILOCOX_NUM_CLUSTERS must be an integer >= 1, got 'two'"),
    ({"DILOCOX_MODE": "multi-job", "DILOCOX_CLUSTER_ID": "1", "DILOCOX_SECRET": "s3cret-value"},
     "multi-job mode: set DILOCOX_RENDEZVOUS=HOST:PORT"),
    ({"DILOCOX_MODE": "multi-job", "DILOCOX_CLUSTER_ID": "1", "DILOCOX_RENDEZVOUS": "site0:29400"},
     "multi-job mode: export DILOCOX_SECRET"),
    ({"DILOCOX_MODE": "multi-job", "DILOCOX_RENDEZVOUS": "site0:29400", "DILOCOX_SECRET": "x"},
     "multi-job mode: set DILOCOX_CLUSTER_ID to this site's cluster id, 0..1"),
    ({"DILOCOX_MODE": "multi-job", "DILOCOX_CLUSTER_ID": "0", "DILOCOX_RENDEZVOUS": "site0", "DILOCOX_SECRET": "x"},
     "DILOCOX_RENDEZVOUS must be HOST:PORT, got 'site0'"),
    ({"DILOCOX_MODE": "both"}, "DILOCOX_MODE must be 'single'"),
    ({"DILOCOX_COORDINATOR": "lighthouse"}, "DILOCOX_COORDINATOR must be 'embedded' (cluster 0 hosts the rendezvous)"),
    ({"DILOCOX_COORDINATOR": "standalone", "DILOCOX_SECRET": "s3cret-value"},
     "DILOCOX_COORDINATOR=standalone: set DILOCOX_RENDEZVOUS=HOST:PORT of 'python -m megatron_dilocox.coordinator"),
    ({"DILOCOX_COORDINATOR": "standalone", "DILOCOX_RENDEZVOUS": "login1:29400"},
     "DILOCOX_COORDINATOR=standalone: export DILOCOX_SECRET"),
    ({"SLURM_JOB_NUM_NODES": ""}, "not inside a SLURM job"),
])
@pytest.mark.unit
def test_early_errors(fake_data, env, message):
    t = time.monotonic()
    r = run_script({**fake_data, **env})
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert "srun" not in r.stderr and time.monotonic() - t < 10  # stopped before Python and srun
    assert "s3cret-value" not in r.stdout + r.stderr


@pytest.mark.unit
def test_missing_data_names_the_file_and_the_variable(fake_data, tmp_path):
    (tmp_path / "train_c1_text_document.idx").unlink()
    r = run_script({**fake_data, "DILOCOX_NUM_CLUSTERS": "2"})
    assert r.returncode == 2, r.stderr
    assert f"training data for cluster 1 not found: {tmp_path}/train_c1_text_document.idx" in r.stderr
    assert "set DATA_PREFIX" in r.stderr
    # multi-job mode checks only this site's cluster
    r = run_script({**fake_data, "DILOCOX_MODE": "multi-job", "DILOCOX_NUM_CLUSTERS": "2", "DILOCOX_CLUSTER_ID": "1",
                    "DILOCOX_RENDEZVOUS": "site0:29400", "DILOCOX_SECRET": "x"})
    assert r.returncode == 2 and "cluster 1 not found" in r.stderr
    (tmp_path / "valid_text_document.bin").unlink()
    r = run_script({**fake_data, "DILOCOX_NUM_CLUSTERS": "1", "SLURM_JOB_NUM_NODES": "1"})
    assert r.returncode == 2 and "validation data not found" in r.stderr and "set VALID_DATA_PREFIX" in r.stderr


@pytest.mark.unit
@pytest.mark.parametrize("coordinator", ["embedded", "standalone"])
def test_gpu_nodes_one_process_per_gpu_no_cpu_flags(fake_data, tmp_path, coordinator):
    """The launch the script builds, with stand-ins for nvidia-smi, scontrol and srun (srun prints what
    it was given): one cluster block per node pair, nproc = the GPUs Slurm gave the job, bf16, no CPU
    flags, the rendezvous on the first node, and the secret only in the environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "nvidia-smi": 'for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done',
        "scontrol": 'echo n001; echo n002; echo n003; echo n004',
        "srun": 'printf "%s\\n" "$@" > "$SRUN_ARGS_OUT"; env > "$SRUN_ENV_OUT"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    secret = "0123456789abcdef0123456789abcdef-gpu"
    env = {**fake_data, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "4",
           "SLURM_JOB_NODELIST": "n[001-004]", "SLURM_JOB_ID": "77", "SLURM_CPUS_ON_NODE": "96",
           "CUDA_VISIBLE_DEVICES": "0,1,2,3", "DILOCOX_SECRET": secret, "LOG_DIR": str(tmp_path / "logs"),
           "SRUN_ARGS_OUT": str(tmp_path / "srun_args"), "SRUN_ENV_OUT": str(tmp_path / "srun_env")}
    if coordinator == "standalone":  # python -m megatron_dilocox.coordinator on a login node, a standby second
        env.update(DILOCOX_COORDINATOR="standalone", DILOCOX_RENDEZVOUS="login1:29400,login2:29400")
    r = run_script(env, "--train-iters", "5")
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "srun_args").read_text().splitlines()
    srun_env = dict(line.split("=", 1) for line in (tmp_path / "srun_env").read_text().splitlines() if "=" in line)
    assert args[:6] == ["--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label",
                        "--cpus-per-task=96"]
    assert args[6:8] == ["bash", "-c"]
    megatron = args[9:]
    assert "--bf16" in megatron and "gloo" not in megatron and "--transformer-impl" not in megatron
    port = 15000 + (77 * 3) % (32768 - 15000 - 3)  # below the ephemeral range
    if coordinator == "standalone":
        assert megatron[megatron.index("--dilocox-rendezvous") + 1] == "login1:29400,login2:29400"
        assert megatron[megatron.index("--dilocox-coordinator") + 1] == "standalone"
    else:
        assert megatron[megatron.index("--dilocox-rendezvous") + 1] == f"n001:{port}"
        assert "--dilocox-coordinator" not in megatron
    assert megatron[megatron.index("--dilocox-num-clusters") + 1] == "2"
    assert megatron[-2:] == ["--train-iters", "5"]  # the user's flags come last
    assert srun_env["DX_NPROC"] == "4" and srun_env["DX_NODES_PER_CLUSTER"] == "2"
    assert srun_env["DX_NODES"] == "n001 n002 n003 n004" and srun_env["DX_PORT_BASE"] == str(port)
    assert srun_env["DILOCOX_SECRET"] == secret and not any(secret in a for a in args)
    assert "4 GPU/node" in r.stdout and secret not in r.stdout + r.stderr
