"""The results index and provenance: what stays in ``benchmarks/results/`` is cited, the rest is findable.

Pure and fast (git and the file system only; no benchmark runs). ``scripts/bench/results_index.py`` and
``scripts/bench/provenance.py`` are scripts, not package modules, so they are loaded from their files.
"""
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "scripts" / "bench"


def load(name):
    spec = importlib.util.spec_from_file_location(f"dlx_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ri = load("results_index")
prov = load("provenance")
HAS_GIT = shutil.which("git") is not None and (REPO / ".git").exists()


def git(root, *args):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(root)}
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


# ---- provenance ----

@pytest.mark.skipif(not HAS_GIT, reason="no git checkout here (a tarball): provenance is null by design")
def test_provenance_names_this_checkouts_commit():
    p = prov.provenance()
    assert p["commit"] == git(REPO, "rev-parse", "HEAD").strip()
    assert isinstance(p["dirty"], bool)


def test_provenance_without_git_is_unknown_not_clean(tmp_path):
    assert prov.provenance(str(tmp_path)) == {"commit": None, "dirty": None}


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_provenance_counts_tracked_edits_and_untracked_code_only(tmp_path):
    (tmp_path / "megatron_dilocox").mkdir()
    (tmp_path / "megatron_dilocox" / "x.py").write_text("a = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "one")
    head = git(tmp_path, "rev-parse", "HEAD").strip()
    assert prov.provenance(str(tmp_path)) == {"commit": head, "dirty": False}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.bin").write_text("tokens")  # data and run folders do not change the code
    assert prov.provenance(str(tmp_path))["dirty"] is False
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "new.py").write_text("")  # untracked code does
    assert prov.provenance(str(tmp_path))["dirty"] is True
    (tmp_path / "scripts" / "new.py").unlink()
    (tmp_path / "megatron_dilocox" / "x.py").write_text("a = 2\n")  # and so does an edit to tracked code
    assert prov.provenance(str(tmp_path)) == {"commit": head, "dirty": True}


# ---- citations ----

def test_a_citation_names_a_folder_exactly_or_by_glob():
    folders = ["wan_r325", "wan_r325_i4000", "convergence/pydoc_i4000_allreduce", "convergence/kjv_h1",
               "convergence/kjv_h10_final"]
    cited = ri.citations(folders, {
        "README.md": "[table](benchmarks/results/wan_r325_i4000/) and `benchmarks/results/convergence/kjv_h10_final`.",
        "docs/convergence.md": "(../benchmarks/results/convergence/pydoc_i4000_*; "
                               "../benchmarks/results/wan_r325_i4000/results.json)"})
    assert cited == {"wan_r325_i4000": ["README.md", "docs/convergence.md"],
                     "convergence/kjv_h10_final": ["README.md"],
                     "convergence/pydoc_i4000_allreduce": ["docs/convergence.md"]}


# ---- the repository's own results ----

def test_every_results_folder_in_the_tree_is_cited_by_the_readme_or_docs():
    repo = ri.Repo(REPO)
    present = sorted(repo.work_folders())
    cited = ri.citations(present, ri.pages(repo))
    uncited = [f for f in present if f not in cited]
    assert not uncited, (f"{len(uncited)} folders under benchmarks/results/ are cited by neither README.md nor "
                         f"docs/ (cite them, or `scripts/bench/results_index.py --prune --apply`): {uncited}")


def test_the_results_index_is_current(capsys):
    assert ri.main(["--check"]) == 0, capsys.readouterr()


def test_every_archived_row_names_a_commit_that_holds_the_folder():
    repo = ri.Repo(REPO)
    if not repo.git_ok or repo.shallow:
        pytest.skip("needs the git history (no .git here, or a shallow clone)")
    text = (REPO / ri.RESULTS_REL / "README.md").read_text()
    rows = re.findall(r"\| `([^`]+)/` \|.*\| archived: `git show ([0-9a-f]+):benchmarks/results/([^`]+)/` \|",
                         text)
    assert rows, "no archived rows in benchmarks/results/README.md"
    assert all(folder == path for folder, _, path in rows)
    spec = "".join(f"{commit}:{ri.RESULTS_REL}/{path}\n" for _, commit, path in rows)
    out = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch-check"], input=spec, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    missing = [line for line in out if line.endswith(" missing")]
    assert not missing and len(out) == len(rows), missing
