"""The offline corpora prepare.py can build: each one Debian package set -> a list of {"text", "ref"} documents.

  kjv    King James Bible (public domain), `bible-kjv` + `bible-kjv-text`: one document per chapter.
  pydoc  Python 3.11 documentation (PSF licence), `python3.11-doc`: the reST sources under
         html/_sources/, one document per page in sorted path order; pages longer than MAX_DOC_CHARS
         are cut at paragraph boundaries into near-equal documents of at most MAX_DOC_CHARS.
  kjv+pydoc  both, for sites whose data differ: one tokenizer over both, cluster c's shard from one
         corpus (the KJV for even c, the docs for odd c), each corpus's own validation split beside the
         joint one (prepare.split_by_source).
Both are cleaned so that every document is one line with single spaces (no leading/trailing space),
which is what sentencepiece's whitespace handling gives back from decode(encode(text)).
"""
import logging
import math
import os
import re
import shutil
import subprocess

N_CHAPTERS, N_VERSES = 1189, 31102
PACKAGES = ("bible-kjv", "bible-kjv-text")
PYDOC_PACKAGES = ("python3.11-doc",)
PYDOC_SOURCES = "/usr/share/doc/python3.11/html/_sources"
MAX_DOC_CHARS = 20_000
log = logging.getLogger("megatron_dilocox.data.prepare")


class CorpusUnavailableError(RuntimeError):
    """A corpus's Debian package is missing and could not be installed here."""


def _apt_install(packages: tuple, present, what: str) -> None:
    """Install packages with apt-get unless present() already holds; raise CorpusUnavailableError naming
    the packages (and the command) when they cannot be had."""
    if present():
        return
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    hint = f"install the Debian packages {', '.join(packages)} as root: {' '.join(cmd)}"
    if shutil.which("apt-get") is None:
        raise CorpusUnavailableError(f"{what} not found and apt-get is unavailable; {hint}")
    if os.geteuid() != 0:
        raise CorpusUnavailableError(f"{what} not found and this process is not root; {hint}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log.info("installing %s with apt-get", " ".join(packages))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # most often stale package lists: update once and retry
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not present():
        raise CorpusUnavailableError(f"{' '.join(cmd)} failed (rc {r.returncode}): {r.stderr[-1500:]}")


# ---- King James Bible ----------------------------------------------------------------------------------

def ensure_bible() -> str:
    """Path of the `bible` program, installing the Debian packages with apt-get if it is missing."""
    _apt_install(PACKAGES, lambda: shutil.which("bible"), "`bible`")
    return shutil.which("bible")


_HEADING = re.compile(r"^(\S.*) (\d+)$")   # "1 Samuel 3"
_VERSE = re.compile(r"^\s+(\d+) (.*)$")      # "  12 And the earth brought forth ..."


def extract_chapters(bible: str) -> list:
    """All 1189 chapters as {"text", "ref"}, verse references stripped; checks the verse numbering."""
    out = subprocess.run([bible, "-l0", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                         check=True).stdout
    chapters = []
    for line in out.splitlines():
        if not line.strip():
            continue
        if _HEADING.match(line):
            chapters.append((line.strip(), []))
        elif (m := _VERSE.match(line)) and chapters:
            ref, verses = chapters[-1]
            if int(m.group(1)) != len(verses) + 1:
                raise ValueError(f"verse numbering broken at {ref}:{m.group(1)}")
            verses.append(" ".join(m.group(2).split()))
        else:
            raise ValueError(f"unexpected line in `bible` output: {line!r}")
    n_verses = sum(len(v) for _, v in chapters)
    if (len(chapters), n_verses) != (N_CHAPTERS, N_VERSES):
        raise ValueError(f"expected {N_CHAPTERS} chapters / {N_VERSES} verses, got {len(chapters)} / {n_verses}")
    return [{"text": " ".join(v), "ref": ref} for ref, v in chapters]


# ---- Python 3.11 documentation --------------------------------------------------------------------------

def _pydoc_pages(src: str) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src)
                  for f in fs if f.endswith(".rst.txt"))


def ensure_pydoc() -> str:
    """The reST sources directory of python3.11-doc, installing the package with apt-get if it is missing."""
    _apt_install(PYDOC_PACKAGES, lambda: os.path.isdir(PYDOC_SOURCES) and _pydoc_pages(PYDOC_SOURCES),
                 f"the Python 3.11 documentation sources ({PYDOC_SOURCES})")
    return PYDOC_SOURCES


# a line that is only markup: a reST section adornment ("=====", "~~~~", ...) or a table rule
# ("+=====+====+", "+-----+----+", "=====  =====")
_ADORNMENT = re.compile(r"^[ \t]*(?:([=\-~^\"'`#*+_])\1{3,}|[-=+ ]*[-=]{3,}[-=+ ]*)[ \t]*$", re.MULTILINE)


def split_page(text: str, limit: int = MAX_DOC_CHARS) -> list:
    """A page's cleaned text as documents of at most `limit` characters, cut between paragraphs (blank
    lines) into near-equal parts; a paragraph longer than that is cut between words."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", _ADORNMENT.sub("", text))]
    words_total = sum(len(p) + 1 for p in paras if p) - 1
    if words_total <= 0:
        return []
    target = math.ceil(words_total / math.ceil(words_total / limit))  # near-equal parts, each <= limit
    units = []
    for p in filter(None, paras):
        while len(p) > target:  # an over-long paragraph: cut at the last space before target
            cut = p.rfind(" ", 0, target + 1)
            cut = cut if cut > 0 else target
            units.append(p[:cut].strip())
            p = p[cut:].strip()
        units.append(p)
    docs, cur = [], ""
    for u in filter(None, units):
        if cur and len(cur) + 1 + len(u) > target:
            docs.append(cur)
            cur = u
        else:
            cur = f"{cur} {u}" if cur else u
    return docs + ([cur] if cur else [])


def extract_pydoc(src: str) -> list:
    """Every page under src (sorted by path) as one or more {"text", "ref"}; ref is the page path, with
    " [j/n]" when the page was split into n documents."""
    pages = _pydoc_pages(src)
    if not pages:
        raise ValueError(f"no .rst.txt pages under {src}")
    docs = []
    for page in pages:
        with open(os.path.join(src, page), encoding="utf-8") as f:
            parts = split_page(f.read())
        ref = page[: -len(".txt")]
        docs += [{"text": t, "ref": ref if len(parts) == 1 else f"{ref} [{j + 1}/{len(parts)}]"}
                 for j, t in enumerate(parts)]
    return docs


# name -> what prepare() needs; "trainer" are extra sentencepiece options. The KJV text is ASCII and the
# default NFKC normalization leaves it alone; the docs hold non-ASCII (NFKC would change 14 pages, and a
# character seen only in validation would become <unk>), so pydoc uses identity normalization and byte
# fallback, which makes decode(encode(text)) == text for any single-spaced text.
CORPORA = {
    "kjv": {"file": "kjv.jsonl", "unit": "chapters", "count": N_CHAPTERS, "trainer": {},
            "source": "King James Bible (Debian bible-kjv-text), one document per chapter",
            "extract": lambda: extract_chapters(ensure_bible())},
    "pydoc": {"file": "pydoc.jsonl", "unit": "documents", "count": None,
              "trainer": {"normalization_rule_name": "identity", "byte_fallback": True},
              "source": "Python 3.11 documentation reST sources (Debian python3.11-doc, PSF licence), one "
                        f"document per page, pages over {MAX_DOC_CHARS} characters split at paragraphs",
              "extract": lambda: extract_pydoc(ensure_pydoc())},
}
# Sites whose data differ (docs/algorithm.md#weights measures the vote on it): every document keeps its corpus
# in "source"; the joint tokenizer needs the docs' options (the KJV is ASCII, so they change nothing for it).
CORPORA["kjv+pydoc"] = {
    "file": "kjv+pydoc.jsonl", "unit": "documents", "count": None, "trainer": CORPORA["pydoc"]["trainer"],
    "sources": ("kjv", "pydoc"),
    "source": "the King James Bible and the Python 3.11 documentation, as kjv and pydoc; cluster c trains on "
              "one of them (the KJV for even c, the docs for odd c)",
    "extract": lambda: [dict(d, source=name) for name in ("kjv", "pydoc") for d in CORPORA[name]["extract"]()],
}
