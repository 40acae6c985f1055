"""``scripts/gpu/validate.sh --cpu``: the GPU validation's CPU form, end to end, and its pass/fail rule."""
import copy
import importlib.util
import json
import os
import subprocess
from pathlib import Path
import pytest

pytestmark = pytest.mark.megatron

REPO = Path(__file__).resolve().parents[1]


def load_validate():
    spec = importlib.util.spec_from_file_location("validate", REPO / "scripts" / "gpu" / "validate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_validate_cpu_form_runs_its_configurations_and_agrees(kjv, tmp_path):
    """The configurations the first lent GPU will run (scripts/gpu/validate.py: three sites by the tagged
    reduce-scatter, two layouts in the canonical layout in two lanes with per-site rounds), in the CPU form: exit
    codes 0, the same global model on every cluster every round, the bytes of every round the closed form, loss
    falling. CI leaves two CPU forms to tests that check more: moe to the composition matrix's MoE rows and
    tests/test_moe.py, dense (two sites of the 107B shape's GPT, bf16, distributed optimizer) to
    tests/test_moe.py's dense_107b (the same model features at DP2: hashes, bytes, the parameter partition); the
    dense model itself runs here in both configurations. About 15 s each."""
    proc = subprocess.run(["bash", "scripts/gpu/validate.sh", "--cpu", "--data", str(kjv), "--out", str(tmp_path),
                           "--configs", "three-sites,canonical"],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("VALIDATE "))[9:])
    assert summary["device"] == "cpu" and summary["ok"]
    assert [r["config"] for r in summary["results"]] == ["three-sites", "canonical"]
    for r in summary["results"]:
        clusters = 3 if r["config"] == "three-sites" else 2
        assert r["exit_codes"] == [0] * clusters and r["problems"] == []
        assert all(h == r["hashes"][0] for h in r["hashes"]), r["config"]
        if r["config"] != "canonical":  # (per-site rounds on sites of two speeds: as many rounds as the plan gives)
            assert len(set(r["hashes"][0])) == 2, r["config"]  # 8 iterations, H = 4
        rounds = len(r["hashes"][0])
        assert rounds >= 1 and r["bytes_sent"] == [[r["closed_form_bytes"][c]] * rounds for c in range(clusters)]
        assert all(last < first - 0.5 for first, last in r["first_last_loss"])
    assert "exposed" in proc.stdout and "planner DiLoCoX state per GPU" in proc.stdout


def test_any_disagreement_fails_validation():
    v = load_validate()
    row = {"round": 1, "status": "applied", "bytes_sent": 100, "global_model_hash": "a"}
    good = {"exit_codes": [0, 0], "rows": [[dict(row)], [dict(row)]], "layouts": [{0: {"round_bytes": 100}}] * 2,
            "losses": [{1: 8.0, 2: 7.0}, {1: 8.0, 2: 7.5}]}
    assert v.problems(good, iters=2, h=2) == []
    hashes = copy.deepcopy(good)
    hashes["rows"][1][0]["global_model_hash"] = "b"
    assert v.problems(hashes, 2, 2) == ["global-model hashes differ between the clusters"]
    sent = copy.deepcopy(good)
    sent["rows"][0][0]["bytes_sent"] = 101
    assert v.problems(sent, 2, 2) == ["cluster 0 round 1: sent 101 B, closed form 100 B"]
    flat = copy.deepcopy(good)
    flat["losses"][1][2] = 8.1
    assert v.problems(flat, 2, 2) == ["cluster 1: loss did not fall (8.0 -> 8.1)"]
    assert v.problems(good, 4, 2)[0] == "cluster 0 rounds [1], expected 1..2"
    assert v.problems(dict(good, exit_codes=[0, 1]), 2, 2) == ["exit codes [0, 1]"]
    three = dict(good, exit_codes=[0, 0, 0], rows=[[dict(row)], [dict(row)], [dict(row, global_model_hash="c")]],
                 layouts=[{0: {"round_bytes": 100}}] * 3, losses=good["losses"] + [{1: 8.0, 2: 7.0}])
    assert v.problems(three, 2, 2) == ["global-model hashes differ between the clusters"]  # (the third counts too)
    per_site = copy.deepcopy(good)  # per-site rounds: R from the run, the same R everywhere; layouts may differ
    per_site["layouts"] = [{0: {"round_bytes": 100}}, {0: {"round_bytes": 100}, 1: {"round_bytes": 0}}]
    per_site["losses"][1] = {1: 8.0, 3: 7.0}  # (a site of another speed trains other iterations)
    assert v.problems(per_site, 2, 2, per_site=True) == []
    per_site["rows"][1].append(dict(row, round=2))
    assert v.problems(per_site, 2, 2, per_site=True)[0] == "cluster 1 rounds [1, 2], expected 1..1"


def test_gpu_form_without_a_gpu_says_to_use_cpu():
    proc = subprocess.run(["bash", "scripts/gpu/validate.sh"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2 and "no GPU visible; run with --cpu" in proc.stderr
