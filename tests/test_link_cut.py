"""A cluster's link cut mid-round in the WAN testbed (real namespaces, real Megatron), policy continue.

Cluster 1's bridge port goes down while it trains (its packets are dropped, its sockets stay open). The
survivor must detect it within --dilocox-timeout (heartbeat silence; gloo waits at most the timeout) and
go on alone. When the link is back, cluster 1 learns that the others went on without it and stops (or,
if its store requests timed out first, stops naming the unreachable rendezvous host); started again, it
rejoins, and both end on the same global model.
Needs root and `ip netns` (skipped otherwise). About 2–3 minutes.
"""
import time

import pytest

from megatron_dilocox.harness.launch import start
from megatron_dilocox.harness.spawn import free_port
from megatron_dilocox.metrics import read_rows
from tests.megatron_flags import tiny_dilocox_flags, tiny_gpt_flags
from tests.wan_helpers import skip_reason

TIMEOUT = 10
ITERS = 240

pytestmark = [pytest.mark.netns, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]


@pytest.fixture
def testbed(wan):
    """Two clusters behind a 50 Mbit/s link, each in its own namespace."""
    with wan.WanTestbed(2, "50mbit") as tb:
        yield tb


def test_cut_link_survivor_goes_on_cut_cluster_stops_then_rejoins(kjv, tmp_path, testbed):
    megatron = tiny_gpt_flags(str(kjv), ITERS, layers=2)
    dilocox = tiny_dilocox_flags(tmp_path, "--dilocox-on-peer-failure", "continue", "--dilocox-timeout", str(TIMEOUT))
    kw = dict(echo=False, env={"CUDA_VISIBLE_DEVICES": "", "DILOCOX_SECRET": "link-cut-secret", "GLOO_SOCKET_IFNAME": "wan0"},
              prefix_by_cluster={c: testbed.prefix(c) for c in range(2)}, rendezvous_host=testbed.addr(0),
              rendezvous_port=free_port())
    with start(2, 1, megatron, dilocox, **kw) as cl:
        log0, log1 = cl.logs
        assert log1.wait_for(lambda log: log.last_iteration >= 10, 300), "\n".join(log1.lines[-120:])
        testbed.cut(1)
        t_cut = time.monotonic()
        log0.wait_for(lambda log: any("retrying with clusters [0]" in ln for ln in log.lines), 4 * TIMEOUT)
        detected = time.monotonic() - t_cut
        line = next((ln for ln in log0.lines if "retrying with clusters [0]" in ln), None)
        assert line and "lost cluster(s) 1" in line, "\n".join(log0.lines[-30:])
        # heartbeat silence is declared after TIMEOUT/2; the survivor's gloo op waits at most TIMEOUT
        assert detected < 1.5 * TIMEOUT + 5, detected
        print(f"link cut at iteration {log0.last_iteration}: survivor went on alone after {detected:.1f}s")
        testbed.restore(1)  # the link comes back: cluster 1 learns the others went on without it, and stops
        code1 = cl.procs[1].wait(6 * TIMEOUT)
        cut_off = "\n".join(log1.lines)
        assert code1 != 0 and "(exitcode: 3)" in cut_off, cut_off[-3000:]
        assert "stopped: lost the rendezvous host, cluster 0" in cut_off or \
               "went on without this one" in cut_off, cut_off[-3000:]
        iteration_at_cut = log0.last_iteration
        with start(2, 1, megatron, dilocox, only=[1], **kw) as again:
            codes = [cl.procs[0].wait(600), again.procs[0].wait(600)]
            joined = "\n".join(again.logs[0].lines)
    assert codes == [0, 0], "\n".join(log0.lines[-30:]) + joined[-3000:]
    assert "rejoined at round" in joined
    rows0, rows1 = read_rows(f"{tmp_path}/metrics_c0.jsonl"), read_rows(f"{tmp_path}/metrics_c1.jsonl")
    counts = [r["num_clusters"] for r in rows0]
    assert 1 in counts and counts[-1] == 2, counts
    assert all(r["status"] == "applied" for r in rows0)
    assert rows0[-1]["global_model_hash"] == rows1[-1]["global_model_hash"]
    assert rows0[-1]["round"] == rows1[-1]["round"] == ITERS // 4
    assert iteration_at_cut < ITERS
