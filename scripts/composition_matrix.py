#!/usr/bin/env python3
"""Rewrite the composition matrix in docs/composition.md from ``megatron_dilocox.harness.matrix.render()``.

The matrix sits between ``<!-- matrix:begin -->`` and ``<!-- matrix:end -->``; the rows are the ones
tests/test_composition.py runs, so the page lists what CI runs (tests/test_composition_page.py fails while it is
stale). ``--check``: change nothing, exit 1 when it is out of date.

    .venv/bin/python scripts/composition_matrix.py [--check]
"""
import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "composition.md"
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only report whether the page is current")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from megatron_dilocox.harness.matrix import render
    from update_flag_table import render as into_region  # (the same marker-delimited region)
    text = DOC.read_text()
    new = into_region(text, render(), BEGIN, END)
    if new == text:
        return 0
    if a.check:
        print(f"composition_matrix: {DOC} is stale; run scripts/composition_matrix.py", file=sys.stderr)
        return 1
    DOC.write_text(new)
    print(f"composition_matrix: {DOC}: matrix rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
