"""The WAN benchmark's --quick mode (real Megatron, 2 clusters in network namespaces behind a tbf link).

Asserts the table's invariants from its JSON: DiLoCoX sends >= 50x fewer bytes than AllReduce and has
higher tokens/s; every method trained the same number of tokens; the cost model's prediction is there.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(os.geteuid() != 0, reason="the WAN testbed needs root (network namespaces, tc)")
def test_wan_benchmark_quick(tmp_path, kjv):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench", "wan_benchmark.py"), "--quick",
                           "--data", str(kjv), "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "quick invariants: ok" in proc.stdout
    out = json.load(open(tmp_path / "results.json"))
    r = out["results"]
    assert r["dilocox"]["bytes_fewer_than_allreduce"] >= 50
    assert r["dilocox"]["tokens_per_s"] > r["allreduce"]["tokens_per_s"]
    assert max(r["dilocox"]["bytes_total"], r["diloco_comp"]["bytes_total"]) * 50 <= r["diloco"]["bytes_total"]
    assert out["meta"]["predicted"]["speedup_vs_allreduce"] > 1
    assert (tmp_path / "wan_benchmark.png").stat().st_size > 10_000
