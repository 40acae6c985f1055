"""The documentation holds together: every relative link in README.md, CHANGELOG.md and docs/*.md resolves (a file
or folder in the repository, and a heading of the target page where the link names one), the README stays a
front page (at most 12,500 bytes), and nothing cites the design notes' sections, which are not in the repository
(code cites docs/ pages and their headings instead). Pure Python: reads files, starts nothing."""
import pathlib
import re
from collections import Counter

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 12_500
DESIGN_CITE = "DESIGN " + "\u00a7"  # spelled apart so that this file does not cite it
NO_DESIGN_CITES = ["megatron_dilocox", "tests", "scripts", "docs", "README.md", "setup.py"]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str):
    """The lines outside fenced code blocks and HTML comments, with code spans blanked out."""
    fence, in_comment = None, False
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        if in_comment or "<!--" in line:
            in_comment = "-->" not in line.split("<!--")[-1]
            continue
        yield CODE_SPAN.sub(lambda c: " " * len(c.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (code spans, links and emphasis unwrapped),
    lower-cased, everything but letters, digits, '_', '-' and spaces dropped, each space a hyphen."""
    text = CODE_SPAN.sub(lambda c: c.group(2), heading)
    text = INLINE_LINK.sub(lambda l: l.group(1), text)
    text = re.sub(r"(\*+)(.+?)\1", r"\2", text)
    text = "".join(ch for ch in text.lower() if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of a Markdown page; a repeated slug gets -1, -2, ... as on GitHub."""
    seen, out = Counter(), set()
    fence = None
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if fence or m:
            if fence is None:
                fence = m.group(1)
            elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        h = HEADING.match(line)
        if h:
            s = slug(h.group(2))
            out.add(s if not seen[s] else f"{s}-{seen[s]}")
            seen[s] += 1
    return out


def links(path: pathlib.Path):
    """(line number, target) of every inline, image and reference-definition link on a page."""
    for n, line in enumerate(prose_lines(path.read_text()), 1):
        ref = REF_DEF.match(line)
        targets = [ref.group(1)] if ref else [m.group(2) for m in INLINE_LINK.finditer(line)]
        for t in targets:
            yield n, t


def relative(target: str) -> bool:
    return bool(target) and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("//")


def broken_links(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    problems = []
    for _, target in links(page):
        if not relative(target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(root)}: ({target})"
        if root not in dest.parents and dest != root:
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file or folder")
        elif fragment:
            if dest.suffix != ".md" or not dest.is_file():
                problems.append(f"{where}: a #fragment needs a Markdown page")
            elif fragment not in anchors(dest):
                problems.append(f"{where}: {dest.relative_to(root)} has no heading #{fragment}")
    return problems


def test_pages_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"README.md", "algorithm.md", "configuration.md", "megatron.md", "slurm.md", "fault_tolerance.md",
            "security.md", "benchmarks.md", "convergence.md", "testing.md", "architecture.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert page.exists(), page
    assert not broken_links(page), "\n".join(broken_links(page))


def test_readme_is_a_front_page():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to docs/"


def test_nothing_cites_the_design_notes():
    hits = []
    for name in NO_DESIGN_CITES:
        base = ROOT / name
        for f in ([base] if base.is_file() else base.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix in {".py", ".md", ".sh", ".txt", ".cfg",
                                                                              ".toml", ".ini", ".patch", ""}:
                for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                    if DESIGN_CITE in line:
                        hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "cite a docs/ page and heading instead:\n" + "\n".join(hits)


CODE_CITE = re.compile(r"docs/([a-z_]+\.md)(?:#([\w-]+))?")


def test_code_citations_of_docs_pages_resolve():
    """Docstrings and comments cite docs pages (``docs/algorithm.md#the-round``): the page and heading exist."""
    bad = []
    for name in ["megatron_dilocox", "scripts", "tests", "setup.py"]:
        base = ROOT / name
        for f in ([base] if base.is_file() else base.rglob("*.py")):
            if f == pathlib.Path(__file__).resolve():  # its own self-test names made-up pages
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                for page, fragment in CODE_CITE.findall(line):
                    dest = ROOT / "docs" / page
                    if not dest.is_file() or fragment and fragment not in anchors(dest):
                        bad.append(f"{f.relative_to(ROOT)}:{n}: docs/{page}{'#' + fragment if fragment else ''}")
    assert not bad, "\n".join(bad)


def test_the_link_checker_itself(tmp_path):
    assert slug("The round") == "the-round"
    assert slug("Overlap: one-step delay and eager") == "overlap-one-step-delay-and-eager"
    assert slug("patches/ (for Megatron forks)") == "patches-for-megatron-forks"
    assert slug("Mode 1: one allocation, C clusters") == "mode-1-one-allocation-c-clusters"
    assert slug("`compression_micro.py`: codec throughput") == "compression_micropy-codec-throughput"
    assert slug("**Bold** and [a link](x.md)") == "bold-and-a-link"
    assert not relative("https://arxiv.org/abs/2506.21263") and relative("docs/x.md#y")
    (tmp_path / "dir").mkdir()
    (tmp_path / "other.md").write_text("# Title\n## Notes\n```\n## Not a heading\n```\n## Notes\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#notes) [dup](other.md#notes-1) [folder](dir/) ![img](other.md) [self](#here)\n"
                    "# Here\n`[in code](missing.md)` [web](https://example.org/x.md)\n"
                    "```\n[fenced](missing.md)\n```\n<!-- [comment](missing.md) -->\n[ref]: other.md#title\n")
    assert broken_links(page, tmp_path) == []
    page.write_text("[a](nope.md) [b](other.md#not-a-heading) [c](other.md#notes-2) [d](dir/#x) [e](../out.md)\n")
    assert len(broken_links(page, tmp_path)) == 5, broken_links(page, tmp_path)
