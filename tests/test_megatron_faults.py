"""A cluster lost in real Megatron runs: the stop policy end to end, and the chaos soak's quick version.

(The core protocol — stop/continue/rejoin in both overlap modes — is pinned by tests/test_peer_failure.py
on a small model; here the same code runs inside ``pretrain()`` with its checkpointing and exit path.)
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron_dilocox.harness.launch import start
from megatron_dilocox.metrics import read_rows
from tests.megatron_flags import tiny_dilocox_flags, tiny_gpt_flags
import pytest

pytestmark = pytest.mark.megatron

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 10


def test_stop_policy_saves_a_checkpoint_and_exits_non_zero_naming_the_lost_cluster(kjv, tmp_path):
    megatron = tiny_gpt_flags(str(kjv), 40, "--save", f"{tmp_path}/ckpt_c{{cluster}}", "--save-interval", "1000",
                              "--ckpt-format", "torch_dist")
    dilocox = tiny_dilocox_flags(tmp_path, "--dilocox-on-peer-failure", "stop", "--dilocox-timeout", str(TIMEOUT))
    with start(2, 1, megatron, dilocox, echo=False, env={"CUDA_VISIBLE_DEVICES": ""}) as cl:
        assert cl.logs[1].wait_for(lambda log: log.last_iteration >= 10, 300), "\n".join(cl.logs[1].lines[-30:])
        cl.kill(1, signal.SIGKILL, rank=0)  # mid-round: rounds launch at 4, 8, 12, ...
        codes = cl.wait(120)
    out = "\n".join(cl.logs[0].lines)
    assert codes[0] != 0 and "(exitcode: 3)" in out, out[-3000:]  # the worker's code, as torchrun reports it
    err = [ln for ln in cl.logs[0].lines if "[dilocox] ERROR: DiLoCoX round" in ln]
    assert err and "stopped: lost cluster(s) 1: no answer within" in err[0], out[-3000:]
    rows = read_rows(f"{tmp_path}/metrics_c0.jsonl")
    assert rows[-1]["status"].startswith("stopped: lost cluster(s) 1")
    assert all(r["status"] == "applied" for r in rows[:-1]) and len(rows) >= 2
    # Megatron saved a checkpoint at the iteration where the run stopped, and it is complete
    stopped_at = cl.logs[0].last_iteration
    tracker = Path(f"{tmp_path}/ckpt_c0/latest_checkpointed_iteration.txt")
    assert tracker.read_text().strip() == str(stopped_at)
    assert (tracker.parent / f"iter_{stopped_at:07d}" / ".metadata").exists()
    assert stopped_at < 40


@pytest.mark.slow  # CI: the composition matrix's rejoin rows (a site SIGKILLed and restarted, real Megatron) and
# tests/test_link_cut.py (a site cut off and rejoining)
def test_chaos_quick_kill_and_rejoin_loses_nothing_on_the_survivors(kjv, tmp_path):
    """One SIGKILL of cluster 1 mid-run, restart, rejoin (scripts/chaos/chaos.py --quick)."""
    data = tmp_path / "kjv"
    data.symlink_to(kjv)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "chaos" / "chaos.py"), "--quick", "--timeout",
                           str(TIMEOUT), "--data", str(data), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads((tmp_path / "out" / "chaos.json").read_text())
    assert (s["faults_injected"], s["faults_survived"], s["rounds_dropped"], s["survivor_tokens_lost"]) == (1, 1, 0, 0)
    assert s["final_agreement"] and s["exit_codes"] == {"0": 0, "1": 0}
    fault = s["faults"][0]
    assert fault["detection_s"] is not None and fault["detection_s"] < TIMEOUT + 10, fault
    assert s["rounds_with_fewer_clusters"] >= 1  # the survivor really went on alone for a while
