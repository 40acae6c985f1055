#!/usr/bin/env python3
"""Rewrite the flag table in docs/configuration.md from ``megatron_dilocox.arguments.flag_table()``.

The table sits between the lines ``<!-- flags:begin -->`` and ``<!-- flags:end -->``; generating it from the
parser is what keeps the documented flags, defaults and help text equal to what ``--help`` says
(tests/test_flag_table.py fails while it is stale). ``--check``: change nothing, exit 1 when it is out of date.

    .venv/bin/python scripts/update_flag_table.py [--check] [FILE]
"""
import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"


def render(text: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the region between the markers replaced by ``table`` (ValueError without markers); also
    scripts/composition_matrix.py's, with its own markers."""
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the file needs exactly one {begin} line followed by one {end} line")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?", default=str(DOC))
    ap.add_argument("--check", action="store_true", help="only report whether the table is current")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from megatron_dilocox.arguments import flag_table

    path = pathlib.Path(a.file)
    text = path.read_text()
    try:
        new = render(text, flag_table())
    except ValueError as e:
        print(f"update_flag_table: {path}: {e}", file=sys.stderr)
        return 2
    if new == text:
        print(f"update_flag_table: {path}: flag table is current")
        return 0
    if a.check:
        print(f"update_flag_table: {path}: flag table is out of date; run scripts/update_flag_table.py",
              file=sys.stderr)
        return 1
    path.write_text(new)
    print(f"update_flag_table: {path}: flag table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
