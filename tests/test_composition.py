"""The composition matrix (docs/composition.md, megatron_dilocox/harness/matrix.py): every pair of levels that can
run together, in one of a few real-Megatron runs of the tiny GPT, two sites, the defaults plus the row's levels.

Each run passes when: every process exits 0 (after the event's restart), every round (and fragment) carries the
same global-model hash on both sites, every round is applied, and the event was survived: a restart resumes both
sites at the same round (``every cluster resumes at round R``), the newest both saved, each loading its own
iteration of it, and trains on with every round applied once (in the canonical layout site 1
comes back on one process instead of two); a lost site is admitted again and
from then on holds the survivor's global model. Rows with a site at half a core need the cgroup CPU quota (root)
and are skipped, saying so, where it cannot be set.
"""
import os
import re
import signal

import pytest

from megatron_dilocox.glue import checkpoints
from megatron_dilocox.harness import matrix, throttle
from megatron_dilocox.harness.spawn import free_port
from megatron_dilocox.metrics import hashes_by_landed
from tests.megatron_flags import failure_report, metrics_rows, run_on_cpu, start_on_cpu, tiny_gpt_flags

pytestmark = pytest.mark.composition

SECRET = "composition-secret"
RESUME_RE = re.compile(r"every cluster resumes at round (\d+); this cluster loads iteration (\d+)")
REJOIN_RE = re.compile(r"continues from iteration (\d+) with the running clusters")
# planned iterations per site: enough rounds for the event to land mid-run; a rejoin needs the survivor still
# training when the restarted site is up again (its start-up takes 10-20 s on the 2-core host, more at half a
# core): the survivor waits half of --dilocox-timeout before it goes on alone, so the rejoin rows wait 20 s
# (--dilocox-timeout 40; at 30 the survivor of a half-core rejoin row had finished its 80 iterations before the
# joiner asked, on a host loaded by a second test session; at 60 the joiners of both rows asked within the first
# rounds). More iterations would buy the same time dearer: after the rejoin every round waits for the joiner (120
# iterations: the two rejoin rows 190 s)
ITERS = {"none": 24, "restart": 32, "rejoin": 80}
TIMEOUT = {"none": "30", "restart": "30", "rejoin": "40"}
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]


def flags(row: dict, corpus: str, tmp_path) -> dict:
    """The run's launcher arguments for a matrix row: the defaults plus the row's levels."""
    megatron = tiny_gpt_flags(corpus, ITERS[row["event"]], *(MOE if row["model"] == "moe" else []))
    if row["event"] == "restart":
        ckpt = f"{tmp_path}/ckpt_c{{cluster}}"
        megatron += ["--save", ckpt, "--load", ckpt, "--save-interval", "4", "--ckpt-format", "torch_dist"]
    dilocox = ["--dilocox-h", "4", "--dilocox-metrics-file", f"{tmp_path}/metrics_c{{cluster}}.jsonl",
               "--dilocox-on-peer-failure", row["policy"], "--dilocox-timeout", TIMEOUT[row["event"]]]
    dilocox += ["--dilocox-no-per-site-h"] if row["rounds"] == "lockstep" else []
    dilocox += ["--dilocox-fragments", "2", "--dilocox-overlap", "one-step-delay"] if row["link"] == "slow" else []
    kw = {}
    if row["layout"] == "canonical":  # the sites' layouts differ: site 1 pipelines over two processes
        dilocox += ["--dilocox-exchange-layout", "canonical"]
        kw = dict(per_cluster_args={1: ["--pipeline-model-parallel-size", "2"]}, nproc_by_cluster={1: 2})
    return dict(megatron=megatron, dilocox=dilocox, env={"DILOCOX_SECRET": SECRET}, **kw)


def hashes(tmp_path, c, skip=0) -> dict:
    """{(round, fragment)s landed: global-model hash} of site c's rows after the first ``skip`` (metrics.py); every
    one applied."""
    rows = metrics_rows(tmp_path, c)[skip:]
    assert all(r["status"] == "applied" for r in rows), [r["status"] for r in rows]
    return hashes_by_landed(rows)


def agree(mine: dict, theirs: dict):
    """The same model wherever both sites landed the same rounds, and both landed all of them."""
    common = set(mine) & set(theirs)
    assert mine and max(mine, key=len) in common and all(mine[k] == theirs[k] for k in common), (mine, theirs)


def run_row(row: dict, corpus: str, tmp_path, slow_prefix):
    args = flags(row, corpus, tmp_path)
    prefix = {1: slow_prefix} if slow_prefix else None
    if row["event"] == "none":
        codes, logs = run_on_cpu(2, 1, prefix_by_cluster=prefix, timeout=600, **args)
        assert codes == [0, 0], failure_report(logs)
        mine, theirs = hashes(tmp_path, 0), hashes(tmp_path, 1)
        agree(mine, theirs)
        return f"{len(mine)} rounds"
    port = free_port()
    cl = start_on_cpu(2, 1, prefix_by_cluster=prefix, rendezvous_port=port, **args)
    again = None
    try:
        if row["event"] == "restart":  # every process of both sites, once site 1 has saved twice
            saved = lambda c: checkpoints.places(f"{tmp_path}/ckpt_c{c}") if os.path.isdir(f"{tmp_path}/ckpt_c{c}") else {}  # noqa: E731
            assert cl.logs[1].wait_for(lambda log: len(saved(1)) >= 2 and log.last_iteration >= 12, 400), \
                failure_report(cl.logs)
            for c in range(2):
                cl.kill(c, signal.SIGKILL)
            cl.wait(60)
            places = [saved(c) for c in range(2)]  # {iteration: (round, ...)} each site saved before the kill
            seen = [len(metrics_rows(tmp_path, c)) for c in range(2)]
            # the canonical layout lets a site come back with another process count: site 1 as TP1 PP1
            args = {k: v for k, v in args.items() if k not in ("per_cluster_args", "nproc_by_cluster")}
            codes, logs = run_on_cpu(2, 1, prefix_by_cluster=prefix, rendezvous_port=port, timeout=600, **args)
            assert codes == [0, 0], failure_report(logs)
            resumed = [RESUME_RE.search("\n".join(log.lines)) for log in logs]
            assert all(resumed) and resumed[0].group(1) == resumed[1].group(1), failure_report(logs)
            # saves land on the run's marks: the round both resume at is the newest saved on both, and each
            # site loads its own iteration of it (under per-site rounds, other iterations on each site)
            rounds = [{r for r, _ in p.values()} for p in places]
            at = int(resumed[0].group(1))
            assert at == max(rounds[0] & rounds[1]), (resumed, places)
            for c, m in enumerate(resumed):
                assert places[c][int(m.group(2))][0] == at, (c, m.group(0), places[c])
            mine, theirs = hashes(tmp_path, 0, seen[0]), hashes(tmp_path, 1, seen[1])
            agree(mine, theirs)
            # every round (and fragment) once: those before the second run's first from the first run (the one in
            # flight at the agreed round's checkpoint is applied again after it), the rest from the second; and the
            # run trained its planned total once (2 sites x ITERS x 8 samples x 128 tokens), within a round
            totals, lasts = [], []
            for c in range(2):
                rows = metrics_rows(tmp_path, c)
                start = rows[seen[c]]["round"]
                assert start in (at, at + 1), (c, start, at)
                kept = [r for r in rows[:seen[c]] if r["round"] < start] + rows[seen[c]:]
                keys = [(r["round"], r.get("fragment", 0)) for r in kept]
                assert len(keys) == len(set(keys)) and sorted({k[0] for k in keys}) == \
                    list(range(1, max(keys)[0] + 1)), (c, keys)
                whole = [r for r in kept if r.get("fragment", 0) == 0]  # (each fragment's rows carry every step)
                totals.append(sum(r["tokens"] for r in whole))
                lasts.append(whole[-1]["tokens"])
            budget = 2 * ITERS["restart"] * 8 * 128
            assert budget - max(lasts) <= sum(totals) <= budget + sum(lasts), (totals, budget, lasts)
            return f"resumed at round {resumed[0].group(1)}, {len(mine)} rounds after"
        # rejoin: site 1 lost mid-run (all of its processes), restarted; the survivor trains on
        assert cl.logs[1].wait_for(lambda log: log.last_iteration >= 8, 300), failure_report(cl.logs)
        cl.kill(1, signal.SIGKILL, rank=0)
        cl.procs[1].wait(60)
        seen = len(metrics_rows(tmp_path, 1))
        again = start_on_cpu(2, 1, prefix_by_cluster=prefix, rendezvous_port=port, only=[1], **args)
        codes = [cl.wait(900)[0]] + again.wait(600)
        assert codes == [0, 0], failure_report([cl.logs[0]] + again.logs)
        assert any(REJOIN_RE.search(line) for line in again.logs[0].lines), failure_report(again.logs)
        survivor = {(r["round"], r.get("fragment", 0)): r["global_model_hash"] for r in metrics_rows(tmp_path, 0)}
        joiner = metrics_rows(tmp_path, 1)[seen:]  # (with fragments: every fragment's rows, after fragment 0's round)
        assert joiner and all(survivor[(r["round"], r.get("fragment", 0))] == r["global_model_hash"]
                              for r in joiner), (joiner, survivor)
        return f"rejoined, {len(joiner)} rounds agreed after"
    finally:
        cl.stop()
        if again is not None:
            again.stop()


@pytest.fixture
def corpus(kjv):
    return str(kjv)


@pytest.mark.parametrize("row", matrix.covering_rows(), ids=matrix.row_id)
def test_every_pair_of_defaults_runs_together(row, corpus, tmp_path):
    if row["sites"] == "half-core":
        reason = throttle.unavailable()
        if reason:
            pytest.skip(f"a site at half a core needs a cgroup CPU quota: {reason}")
        with throttle.cpu_quota(f"dilocox_matrix_{os.getpid()}", 0.5) as slow:
            said = run_row(row, corpus, tmp_path, slow)
    else:
        said = run_row(row, corpus, tmp_path, None)
    print(f"MATRIX {matrix.row_id(row)}: {said}")
