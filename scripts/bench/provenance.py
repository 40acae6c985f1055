"""The commit a benchmark ran at, and whether the tree differed from it: recorded in every result JSON.

A number in ``benchmarks/results/`` is only as good as the code that produced it. ``commit`` alone would
claim that code for a run made with local edits, so ``dirty`` says whether the tree differed: any change
to a tracked file, or an untracked file under the directories whose code a run executes
(``megatron_dilocox/``, ``scripts/``, ``patches/``). Untracked files elsewhere (data, run folders, the
venv, a results folder being written) do not change what ran, so they do not count. Without git (a tarball,
a container without the history) both are ``None``: unknown, not clean.
"""
from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE_DIRS = ("megatron_dilocox/", "scripts/", "patches/")


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def provenance(repo: str = REPO) -> dict:
    """``{"commit": full hash, "dirty": bool}`` for ``repo``; ``{"commit": None, "dirty": None}`` without git."""
    try:
        commit = _git(repo, "rev-parse", "HEAD").strip()
        # -z: one NUL-terminated "XY path" entry per file, unquoted; untracked ones are "?? path".
        status = [e for e in _git(repo, "status", "--porcelain", "-z", "--untracked-files=all").split("\0") if e]
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    # Any tracked change makes it dirty, so the first entry that is not "?? <path>" decides (a rename's
    # second, NUL-separated path is never reached).
    dirty = any(e[:2] != "??" or e[3:].startswith(CODE_DIRS) for e in status)
    return {"commit": commit, "dirty": dirty}


if __name__ == "__main__":
    import json
    print(json.dumps(provenance()))
