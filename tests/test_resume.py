"""Exact resume after SIGKILL (``glue/checkpoints.py``): real Megatron, 2 clusters x 1 process, tiny GPT.

One uninterrupted reference run (shared by the module). Then a cluster's rank is SIGKILLed (a) between round
boundaries while a delayed round is outstanding, (b) while its checkpoint is being written; both clusters are
restarted with the same flags and the continuation must equal the reference bitwise: every printed lm loss and
grad norm after the resume point, and every later round's ``global_model_hash`` (SHA-256 of the whole global
model) and ``bytes_sent``. Megatron prints the loss with 7 significant digits and the grad norm with 3 decimals;
the per-round hash covers every bit of the model.

One Megatron quirk: a process's first logged iteration does not reset the loss accumulator, so the *second*
iteration after any (re)start prints the mean of the first two losses (the reference does the same at iteration
2). At that one iteration the test checks the printed value against that mean of the reference's losses.
"""
import json
import os
import re
import shutil
import signal
import time
from types import SimpleNamespace

import pytest

from megatron_dilocox.glue import checkpoints as ck
from megatron_dilocox.harness.launch import start
from tests.megatron_flags import failure_report, metrics_rows, start_on_cpu, tiny_dilocox_flags, tiny_gpt_flags

ITERS, H, SAVE_INTERVAL = 16, 4, 4
RUN_TIMEOUT = 400
AGREED_RE = re.compile(r"DiLoCoX resume: every cluster resumes at .*; this cluster loads iteration (\d+)")


def launch(corpus, out):
    """Both clusters, checkpointing every SAVE_INTERVAL iterations to out/ckpt_c{k}, metrics to out/."""
    ckpt = f"{out}/ckpt_c{{cluster}}"
    flags = tiny_gpt_flags(str(corpus), ITERS, "--save", ckpt, "--load", ckpt, "--save-interval", str(SAVE_INTERVAL),
                           "--ckpt-format", "torch_dist")
    return start_on_cpu(2, 1, flags, tiny_dilocox_flags(out, h=H))


def finish(clusters):
    codes = clusters.wait(RUN_TIMEOUT)
    assert codes == [0, 0], failure_report(clusters.logs)
    return clusters.logs


@pytest.fixture(scope="module")
def reference(kjv, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    logs = finish(launch(kjv, out))
    for c in range(2):
        assert sorted(logs[c].losses) == sorted(logs[c].grad_norms) == list(range(1, ITERS + 1))
        assert ck.complete_iterations(f"{out}/ckpt_c{c}") == list(range(SAVE_INTERVAL, ITERS + 1, SAVE_INTERVAL))
        assert ck.read_tracker(f"{out}/ckpt_c{c}") == ITERS
    return SimpleNamespace(out=out, logs=logs, rows=[metrics_rows(out, c) for c in range(2)])


def resume_and_compare(corpus, out, reference, expect_agreed):
    """Restart both clusters with the same flags; the continuation must equal the reference bitwise."""
    seen = [len(metrics_rows(out, c)) for c in range(2)]
    logs = finish(launch(corpus, out))
    for c, log in enumerate(logs):
        agreed = [int(m.group(1)) for line in log.lines if (m := AGREED_RE.search(line))]
        assert agreed == [expect_agreed], failure_report([log])
        ref = reference.logs[c]
        after = list(range(expect_agreed + 1, ITERS + 1))
        assert sorted(log.losses) == sorted(log.grad_norms) == after
        for it in after:
            assert log.grad_norms[it] == ref.grad_norms[it], (c, it)
            if it == expect_agreed + 2:  # Megatron prints the mean of a process's first two losses here
                mean = (ref.losses[it - 1] + ref.losses[it]) / 2
                assert float(f"{log.losses[it]:.6E}") == log.losses[it] and abs(log.losses[it] - mean) <= 1e-6 * mean
            else:
                assert log.losses[it] == ref.losses[it], (c, it, log.losses[it], ref.losses[it])
        rows = metrics_rows(out, c)[seen[c]:]
        ref_rows = [r for r in reference.rows[c] if r["iteration"] > expect_agreed]
        assert [r["round"] for r in rows] == [r["round"] for r in ref_rows] and rows, (c, rows)
        for new, old in zip(rows, ref_rows):
            for key in ("iteration", "status", "H", "lowrank_rank", "global_model_hash", "bytes_sent",
                        "bytes_received", "bytes_dense_fp32"):
                assert new[key] == old[key], (c, new["round"], key, new[key], old[key])
    return logs


def superseded(ckpt_dir):
    return sorted(n for n in os.listdir(ckpt_dir) if ck.SUPERSEDED in n)


@pytest.mark.megatron
def test_kill_between_boundaries_with_a_round_outstanding(kjv, tmp_path, reference):
    """(a) Cluster 1's rank dies in iterations 9-11: round 2 was launched at the boundary of iteration 8 (its
    result saved with checkpoint 8) and is applied at 12. Both clusters resume from 8 and replay bitwise.

    The rank's pid is looked up at the first iteration, so the kill follows the cue (iteration 9 printed) with
    no process-tree walk between them: on a loaded CI host that walk once let the rank reach iteration 12."""
    run = launch(kjv, tmp_path)
    try:
        assert run.logs[1].wait_for(lambda log: 1 in log.losses, RUN_TIMEOUT), failure_report(run.logs)
        assert 0 in run.rank_pids(1)
        assert run.logs[1].wait_for(lambda log: 9 in log.losses, RUN_TIMEOUT), failure_report(run.logs)
        run.kill(1, signal.SIGKILL, rank=0)
        killed_after = run.logs[1].last_iteration
        assert run.logs[1].wait_for(lambda log: log.ended, 60), "torchrun did not take cluster 1 down"
        run.logs[0].wait_for(lambda log: log.ended, 5)  # cluster 0 loses its peer at the next exchange
    finally:
        codes = run.wait(1)  # what is still running is killed
    assert codes[1] not in (0, None) and killed_after in (9, 10, 11), (codes, killed_after)
    assert ck.complete_iterations(f"{tmp_path}/ckpt_c1") == [4, 8]
    resume_and_compare(kjv, tmp_path, reference, expect_agreed=8)
    assert superseded(f"{tmp_path}/ckpt_c1") == []  # cluster 1 never got past 11


@pytest.mark.megatron
def test_kill_while_a_checkpoint_is_written(kjv, tmp_path, reference):
    """(b) Cluster 1's rank dies while it writes checkpoint 12; cluster 0 may have completed its own 12. The
    clusters agree on 8 (complete everywhere), set every iter_0000012 aside and replay bitwise.

    The killed run starts from the reference's checkpoint 8, so the save at 12 is its process's first
    (torch_dist then spends seconds starting its writer): the kill lands inside the save every time."""
    for c in range(2):
        src, dst = f"{reference.out}/ckpt_c{c}", f"{tmp_path}/ckpt_c{c}"
        for it in (4, 8):
            shutil.copytree(f"{src}/iter_{it:07d}", f"{dst}/iter_{it:07d}")
            ck.record_complete(dst, it)
        with open(f"{dst}/{ck.TRACKER}", "w") as f:
            f.write("8")
    target = f"{tmp_path}/ckpt_c1/iter_0000012"
    run = launch(kjv, tmp_path)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not os.path.exists(target):
            assert time.monotonic() < deadline and run.procs[1].poll() is None, failure_report(run.logs)
            time.sleep(0.002)
        run.kill(1, signal.SIGKILL, rank=0)
        assert run.logs[1].wait_for(lambda log: log.ended, 60), "torchrun did not take cluster 1 down"
        # mid-save for real: the directory exists, the registry does not list it, Megatron did not finish it
        assert os.path.isdir(target) and ck.complete_iterations(f"{tmp_path}/ckpt_c1") == [4, 8]
        assert not any("successfully saved checkpoint from iteration      12" in ln for ln in run.logs[1].lines)
        # cluster 0 finishes its own save at 12 (the round-3 transfer ended before either cluster wrote a byte)
        run.logs[0].wait_for(lambda log: log.ended or 12 in ck.complete_iterations(f"{tmp_path}/ckpt_c0"), 30)
    finally:
        run.wait(1)
    c0_had_12 = 12 in ck.complete_iterations(f"{tmp_path}/ckpt_c0")  # the usual case: clusters now disagree
    resume_and_compare(kjv, tmp_path, reference, expect_agreed=8)
    assert superseded(f"{tmp_path}/ckpt_c1") == ["iter_0000012.dilocox-superseded-0"]
    if c0_had_12:
        assert superseded(f"{tmp_path}/ckpt_c0") == ["iter_0000012.dilocox-superseded-0"]
    assert all(ck.complete_iterations(f"{tmp_path}/ckpt_c{c}") == [4, 8, 12, 16] for c in range(2))


# ----------------------------------------------------------------------------------------------- unit tests
def make_ckpt(root, complete=(), partial=(), tracker=None, places=None):
    """A checkpoint directory; ``places``: {iteration: (round, steps into the next)} registered with them."""
    root.mkdir(parents=True, exist_ok=True)
    for it in (*complete, *partial):
        (root / f"iter_{it:07d}").mkdir()
        (root / f"iter_{it:07d}" / "metadata.json").write_text("{}")
    for it in complete:
        ck.record_complete(str(root), it, (places or {}).get(it))
    if tracker is not None:
        (root / ck.TRACKER).write_text(tracker)
    return str(root)


@pytest.mark.unit
def test_registry_repairs_a_truncated_tracker_and_sets_an_incomplete_save_aside(tmp_path):
    d = make_ckpt(tmp_path / "c", complete=(4, 8), partial=(12,), tracker="")  # killed inside open('w')
    assert json.loads((tmp_path / "c" / ck.REGISTRY).read_text()) == {"complete": [4, 8], "places": {}}
    assert ck.read_tracker(d) is None and ck.complete_iterations(d) == [4, 8]
    moved = ck.prepare_resume(d, d, 8)
    assert ck.read_tracker(d) == 8 and moved == [f"{d}/iter_0000012.dilocox-superseded-0"]
    assert sorted(os.listdir(d)) == sorted([ck.REGISTRY, ck.TRACKER, "iter_0000004", "iter_0000008",
                                            "iter_0000012.dilocox-superseded-0"])
    assert not [n for n in os.listdir(d) if ".tmp-" in n]  # atomic writes leave no temporaries
    # a second leftover at 12 gets the next free name; nothing is ever deleted
    make_ckpt(tmp_path / "c", partial=(12,))
    ck.prepare_resume(d, d, 8)
    assert superseded(d) == ["iter_0000012.dilocox-superseded-0", "iter_0000012.dilocox-superseded-1"]
    # from scratch (no common iteration): tracker and every iter_ directory aside, registry emptied
    ck.prepare_resume(d, d, 0)
    assert ck.read_tracker(d) is None and ck.complete_iterations(d) == [] and not ck.iter_dirs(d)
    assert f"{ck.TRACKER}{ck.SUPERSEDED}0" in os.listdir(d)
    # without a registry (a checkpoint not written through the wrapper) a valid tracker counts
    assert ck.complete_iterations(make_ckpt(tmp_path / "plain", partial=(4, 8), tracker="8")) == [8]
    (tmp_path / "plain" / ck.TRACKER).write_text("")
    assert ck.complete_iterations(str(tmp_path / "plain")) == []
    # a 'release' checkpoint (a pretrained model to start from) is left for Megatron to load
    release = make_ckpt(tmp_path / "release", tracker="release")
    ck.prepare_resume(release, release, 0)
    assert (tmp_path / "release" / ck.TRACKER).read_text() == "release"


@pytest.mark.unit
def test_clusters_agree_on_the_newest_round_complete_everywhere(tmp_path):
    """The real agreement function: this process is one cluster (a world of 1), a stand-in group adds the other's
    offer, (place, iteration) per complete checkpoint. Lockstep: the place is the round and the iteration (the
    same on every site; a stop's own checkpoint after a dropped round has the round count of an earlier one).
    Per-site H: the round alone, each cluster loading its newest iteration of it (a fast site's iteration 12 is
    the slow site's 5), newer ones moved aside, the agreed one kept. A checkpoint without its round counts by its
    iteration."""
    import torch
    import torch.distributed as dist

    from megatron_dilocox.compression.collective import Collective
    from megatron_dilocox.outer.cluster import SingleRank

    class OtherCluster(Collective):
        rank, size = 0, 2

        def __init__(self, offers):
            super().__init__()
            vec = [v for o in offers for v in o] + [ck.PAD] * (3 * (ck.MAX_CANDIDATES - len(offers)))
            self.theirs = torch.tensor(vec, dtype=torch.int64).view(torch.uint8)

        def _all_gather(self, buf):
            assert buf.dtype == torch.uint8 and buf.shape == self.theirs.shape
            return [buf.clone(), self.theirs]

    lockstep, per_site = SimpleNamespace(per_site_h=False), SimpleNamespace(per_site_h=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        d = make_ckpt(tmp_path / "c0", complete=(4, 8, 12), partial=(16,), tracker="12",
                      places={4: (1, 0), 8: (2, 0), 12: (3, 0)})
        args = SimpleNamespace(load=d, save=d, ckpt_step=None)
        assert ck.agree_on_resume_iteration(lockstep, args, OtherCluster([(1, 4, 4), (2, 8, 8)]), SingleRank()) == 8
        assert ck.read_tracker(d) == 8 and ck.complete_iterations(d) == [4, 8]
        assert superseded(d) == ["iter_0000012.dilocox-superseded-0", "iter_0000016.dilocox-superseded-0"]
        # one cluster alone (num_clusters 1): same registry logic, no exchange
        assert ck.agree_on_resume_iteration(lockstep, args, None, SingleRank()) == 8
        # nothing in common: both start from scratch
        assert ck.agree_on_resume_iteration(lockstep, args, OtherCluster([(2, 12, 12)]), SingleRank()) == 0
        assert ck.read_tracker(d) is None and not ck.iter_dirs(d)

        # per-site H: this (fast) cluster saved rounds 1-3 at iterations 6, 12, 18 (and the stop's own checkpoint at
        # 14, two steps into round 3); the slow one rounds 1-2 at 3 and 5: both resume at round 2, here at 12
        d = make_ckpt(tmp_path / "fast", complete=(6, 12, 14, 18), places={6: (1, 0), 12: (2, 0), 14: (2, 2),
                                                                            18: (3, 0)})
        args = SimpleNamespace(load=d, save=d, ckpt_step=None)
        assert ck.agree_on_resume_iteration(per_site, args, OtherCluster([(1, 0, 3), (2, 0, 5)]), SingleRank()) == 14
        assert ck.complete_iterations(d) == [6, 12, 14] and ck.places(d)[14] == (2, 2)  # the agreed round's, kept
        assert superseded(d) == ["iter_0000018.dilocox-superseded-0"]
        # lockstep: round 2 at iteration 14 (a stop's checkpoint) is not round 2 at iteration 12
        assert ck.agree_on_resume_iteration(lockstep, args, OtherCluster([(2, 12, 12)]), SingleRank()) == 12
        assert superseded(d) == ["iter_0000014.dilocox-superseded-0", "iter_0000018.dilocox-superseded-0"]

        # checkpoints that did not record their round: by their iteration
        d = make_ckpt(tmp_path / "old", complete=(4, 8))
        args = SimpleNamespace(load=d, save=d, ckpt_step=None)
        assert ck.agree_on_resume_iteration(lockstep, args, OtherCluster([(-1, 4, 4), (-1, 8, 8)]), SingleRank()) == 8
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
def test_async_and_non_persistent_saves_are_refused():
    from megatron_dilocox.config import DiLoCoXConfigError
    with pytest.raises(DiLoCoXConfigError, match="--async-save: not supported with --dilocox"):
        ck.check_args(SimpleNamespace(async_save=True))
    with pytest.raises(DiLoCoXConfigError, match="--non-persistent-save-interval: not supported"):
        ck.check_args(SimpleNamespace(async_save=False, non_persistent_save_interval=10))
    ck.check_args(SimpleNamespace(async_save=False, non_persistent_save_interval=None))


@pytest.mark.unit
def test_legacy_torch_checkpoints_with_data_parallelism_are_refused():
    """Megatron's ``torch`` format writes the optimizer state dict (with each rank's DiLoCoX state) from DP rank 0
    only and every DP rank loads it: a 2 x DP2 dist-opt bf16 GPT saved that way stopped at resume with
    "DiLoCoX codec state does not match this model's parameter layout" on DP rank 1 (where the shards' shapes
    coincide it would load rank 0's state silently). DP1 (each TP/PP rank writes its own file) and torch_dist pass."""
    from megatron_dilocox.config import DiLoCoXConfigError

    def args(**kw):
        return SimpleNamespace(**dict(dict(async_save=False, non_persistent_save_interval=None, ckpt_format="torch",
                                           data_parallel_size=2, save="/ckpt", load=None), **kw))
    message = ("--ckpt-format torch: not supported with --dilocox and data parallelism (DP = 2); Megatron writes the "
               "optimizer state, where each rank's DiLoCoX state rides, from DP rank 0 only and every DP rank loads "
               "that one, so the other ranks would resume with rank 0's DiLoCoX state; use --ckpt-format torch_dist "
               "(one DiLoCoX state object per rank)")
    for kw in ({}, dict(save=None, load="/ckpt")):
        with pytest.raises(DiLoCoXConfigError) as err:
            ck.check_args(args(**kw))
        assert str(err.value) == message
    for kw in (dict(data_parallel_size=1), dict(ckpt_format="torch_dist"), dict(save=None)):
        ck.check_args(args(**kw))
    # Muon's layer-wise distributed optimizer (even at DP 1): Megatron saves and loads its state through the
    # optimizer's own files in the torch format, past the DiLoCoX state
    muon = dict(data_parallel_size=1, use_layer_wise_distributed_optimizer=True, optimizer="muon")
    with pytest.raises(DiLoCoXConfigError) as err:
        ck.check_args(args(**muon))
    assert str(err.value) == (
        "--ckpt-format torch: not supported with --dilocox and --optimizer muon --use-distributed-optimizer; Megatron "
        "saves and loads that (layer-wise) optimizer's state through its own files, past the DiLoCoX state; use "
        "--ckpt-format torch_dist")
    ck.check_args(args(**muon, ckpt_format="torch_dist"))


# ----------------------------------------------------------------------------------------------- the launcher
# Stand-in ranks: ``python -m timeit`` running one 10-minute sleep (no imports, nothing to clean up but processes).
SLEEPER = ("timeit", ["-n", "1", "-r", "1", "import time; time.sleep(600)"])


@pytest.mark.core
def test_killing_one_rank_takes_its_cluster_down():
    module, argv = SLEEPER
    run = start(1, 2, argv, module=module, echo=False)
    try:
        deadline = time.monotonic() + 60
        while len(pids := run.rank_pids(0)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run.kill(0, signal.SIGKILL, rank=1)
        t0 = time.monotonic()
        codes = run.wait(60)
        assert codes[0] not in (0, -9) and time.monotonic() - t0 < 45, codes  # torchrun stopped rank 0 itself
    finally:
        run.stop()
    assert not [p for p in pids.values() if _alive(p)]


@pytest.mark.core
def test_wait_kills_everything_at_its_timeout():
    module, argv = SLEEPER
    run = start(2, 1, argv, module=module, echo=False)
    deadline = time.monotonic() + 60
    while not all(run.rank_pids(c) for c in range(2)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    workers = [p for c in range(2) for p in run.rank_pids(c).values()]
    t0 = time.monotonic()
    assert run.wait(2) == [-9, -9] and time.monotonic() - t0 < 20
    assert not [p for p in workers + [proc.pid for proc in run.procs] if _alive(p)]


def _alive(pid):
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
