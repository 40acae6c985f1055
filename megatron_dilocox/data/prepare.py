"""Prepare a small real-English corpus (King James Bible or Python docs) for DiLoCoX runs, fully offline.

Why these corpora: these machines reach only package registries, so Hub data sets cannot be downloaded.
  --corpus kjv (default)  the King James Bible (public domain), Debian `bible-kjv` + `bible-kjv-text`:
                          archaic English, ~1M tokens.
  --corpus pydoc          the Python 3.11 documentation (PSF licence: the docs are distributed under the
                          Python Software Foundation License Version 2, which permits copying, modifying
                          and redistributing), Debian `python3.11-doc`: the reST sources of its 497 pages
                          (html/_sources/, 11 MB): modern technical English with code, ~2.6M tokens.
  --corpus kjv+pydoc      both, for sites whose data differ: one tokenizer over both corpora's training
                          documents; cluster k's shard from one corpus only (the KJV for even k, the docs
                          for odd k); valid_kjv_text_document and valid_pydoc_text_document beside the
                          joint valid_text_document (split_by_source).
Each is installed with apt-get when missing (when root); otherwise CorpusUnavailableError names the
packages to install. The extraction of each lives in corpora.py. A DIR holds one corpus: manifest.json
records which, and asking a DIR built for one corpus for the other raises CorpusMismatchError.

Layout of DIR. Every file is written atomically (temp file + os.replace) and every step is skipped when
its outputs exist, are complete and came from the same inputs, so rerunning is cheap and safe:
  kjv.jsonl                 1189 lines {"text", "ref"}, one document per chapter in canonical order.
                            Verse numbers and chapter headings are stripped, verses joined by one space
                            and whitespace collapsed, so sentencepiece decode(encode(text)) == text.
  pydoc.jsonl               (pydoc instead of kjv.jsonl) one line per page, pages sorted by path; a page
                            over 20000 characters is cut between paragraphs into near-equal documents of
                            at most 20000 (ref "library/os.rst [2/10]") so that strided shards balance.
                            Section adornment and table-rule lines ("=====", "+---+") are dropped and
                            whitespace collapsed; the tokenizer uses identity normalization + byte
                            fallback, so decode(encode(text)) == text here too (NFKC would alter some
                            non-ASCII text, and a character unseen in training would decode as <unk>).
  tokenizer.model, .vocab   sentencepiece BPE (default 4096 pieces) trained on the training chapters
                            only; unk=0, bos=1, eos=2. Megatron's SentencePieceTokenizer reports eod = eos.
  valid_text_document       held-out validation: every 20th chapter (chapter index i, i % 20 == 19).
  train_all_text_document   all other (training) chapters: the AllReduce / single-world baseline.
  train_c{k}_text_document  cluster k's shard, STRIDED by cluster id: the j-th training chapter goes to
                            cluster j % C. Strided rather than contiguous so each cluster sees the same
                            mix of books in near-equal amounts (contiguous shards would give cluster 0
                            mostly Old Testament). Shards are disjoint; their union is train_all. Shards
                            of an earlier, larger C are deleted.
  manifest.json             corpus, counts, hashes and the document indices of every split (the key is
                            "chapters" for both corpora). "chapter" above means document for pydoc.
Each .bin/.idx pair is written by megatron-core's IndexedDatasetBuilder: one sequence per document,
its sentencepiece ids followed by one EOD id, dtype uint16 -- what Megatron's tools/preprocess_data.py
--append-eod writes. Token counts in the manifest include the EOD tokens.

Train with: --tokenizer-type SentencePieceTokenizer --tokenizer-model DIR/tokenizer.model
  --train-data-path DIR/train_c{k}_text_document --valid-data-path DIR/valid_text_document
"""
import argparse
import hashlib
import json
import logging
import os
import re
import shutil  # also patched by the tests (prep.shutil.which; corpora.py uses the same module)
import sys
import time

import numpy as np

from megatron_dilocox.data.corpora import (  # noqa: F401 (re-exported: the KJV API lives here)
    CORPORA, N_CHAPTERS, N_VERSES, PACKAGES, CorpusUnavailableError, ensure_bible, extract_chapters)

VALID_EVERY = 20
MANIFEST_VERSION = 1
log = logging.getLogger("megatron_dilocox.data.prepare")


class CorpusMismatchError(ValueError):
    """out_dir already holds a different corpus than the one asked for."""


def _corpus_in(out: str, manifest: dict):
    """Which corpus out already holds: the manifest's, else the one whose text file is there, else None."""
    if manifest.get("splits"):
        return manifest.get("corpus", "kjv")  # manifests before pydoc existed were all KJV
    have = [c for c, spec in CORPORA.items() if os.path.exists(os.path.join(out, spec["file"]))]
    return have[0] if have else None


def split_chapters(n_docs: int, num_clusters: int, valid_every: int = VALID_EVERY) -> dict:
    """Chapter indices per split: valid = every valid_every-th; cluster shards strided over the rest."""
    valid = [i for i in range(n_docs) if i % valid_every == valid_every - 1]
    train = [i for i in range(n_docs) if i % valid_every != valid_every - 1]
    splits = {"valid": valid, "train_all": train}
    for k in range(num_clusters):
        splits[f"train_c{k}"] = train[k::num_clusters]
    return splits


def split_by_source(sources: list, num_clusters: int, valid_every: int = VALID_EVERY) -> dict:
    """Sites whose data differ: each corpus split as split_chapters splits one (its every valid_every-th
    document to validation), cluster k's shard from corpus k % n alone (strided over the clusters that share
    it); "valid" is every corpus's validation together, "valid_<name>" each one's."""
    names = list(dict.fromkeys(sources))
    if num_clusters < len(names):
        raise ValueError(f"{len(names)} corpora need at least {len(names)} clusters, got {num_clusters}")
    splits = {"valid": [], "train_all": []}
    train = {}
    for name in names:
        idx = [i for i, s in enumerate(sources) if s == name]
        part = split_chapters(len(idx), 1, valid_every)
        splits[f"valid_{name}"] = [idx[i] for i in part["valid"]]
        train[name] = [idx[i] for i in part["train_all"]]
        splits["valid"] += splits[f"valid_{name}"]
        splits["train_all"] += train[name]
    for k in range(num_clusters):
        share = list(range(k % len(names), num_clusters, len(names)))
        splits[f"train_c{k}"] = train[names[k % len(names)]][share.index(k)::len(share)]
    return splits


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_docs(path: str, count=None):
    """The documents of a corpus's .jsonl, or None when the file is missing or incomplete (count: the
    number of documents the corpus must have, when known)."""
    try:
        with open(path, encoding="utf-8") as f:
            docs = [json.loads(line) for line in f]
    except (OSError, ValueError):
        return None
    ok = (len(docs) == count if count else bool(docs)) and all(
        isinstance(d, dict) and d.get("text") and d.get("ref") for d in docs)
    return docs if ok else None


def _train_tokenizer(out: str, texts: list, vocab_size: int, **options) -> None:
    """BPE on whole chapters. Written via model_writer with a fixed thread count so the model file is
    byte-identical on every machine (clusters preparing data separately get the same tokenizer sha)."""
    import io
    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, max_sentence_length=1 << 17,  # whole chapters (Psalm 119: ~25k chars)
        num_threads=4, minloglevel=2, **options)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    _atomic_write(os.path.join(out, "tokenizer.vocab"), vocab.encode("utf-8"))  # for humans only
    _atomic_write(os.path.join(out, "tokenizer.model"), buf.getvalue())


def _load_tokenizer(path: str, vocab_size: int):
    """The sentencepiece model at path if it loads and has vocab_size pieces, else None."""
    import sentencepiece as spm
    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError):  # missing or truncated
        return None
    return sp if sp.get_piece_size() == vocab_size else None


def _dataset_ok(prefix: str, n_docs: int, n_tokens: int) -> bool:
    """True when prefix.{bin,idx} exist and hold n_docs documents and n_tokens tokens in full."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        return False
    try:
        ds = IndexedDataset(prefix)
        itemsize = np.dtype(ds.index.dtype).itemsize
        return (len(ds.document_indices) - 1 == n_docs and int(ds.sequence_lengths.sum()) == n_tokens
                and os.path.getsize(prefix + ".bin") == n_tokens * itemsize)
    except Exception:  # a truncated or foreign .idx
        return False


def _build_dataset(prefix: str, docs_ids: list, eod: int, dtype) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    for ids in docs_ids:
        builder.add_document(np.asarray(ids + [eod], dtype=dtype), [len(ids) + 1])
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    _drop_index_cache(prefix)


def _drop_index_cache(prefix: str) -> None:
    """Megatron caches a dataset's sample/shuffle indices under PREFIX/cache, keyed by the dataset *config*
    (path, seed, lengths), not by the file's content: once a shard is rewritten (another --num-clusters splits
    the chapters differently), the old indices point past the new documents (IndexError at the first batch)."""
    cache = os.path.join(prefix, "cache")
    if os.path.isdir(cache):
        gone = f"{cache}.stale{os.getpid()}"
        os.replace(cache, gone)  # atomic: a job starting now sees no cache rather than half of one
        shutil.rmtree(gone, ignore_errors=True)


def prepare(out_dir: str, num_clusters: int = 2, vocab_size: int = 4096, corpus: str = "kjv") -> dict:
    """Build (or reuse) everything under out_dir; returns the manifest (also written to manifest.json).
    corpus: "kjv" or "pydoc"; a directory that holds the other one is refused (CorpusMismatchError)."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {', '.join(CORPORA)}, got {corpus!r}")
    spec = CORPORA[corpus]
    if num_clusters < 1:
        raise ValueError(f"num_clusters must be >= 1, got {num_clusters}")
    if not 256 <= vocab_size <= 65500:  # uint16 token ids
        raise ValueError(f"vocab_size must be in [256, 65500], got {vocab_size}")
    out = os.path.abspath(out_dir)
    os.makedirs(out, exist_ok=True)
    old = _read_json(os.path.join(out, "manifest.json"))
    old = old if isinstance(old, dict) else {}
    have = _corpus_in(out, old)
    if have not in (None, corpus):
        raise CorpusMismatchError(f"{out} already holds the {have} corpus; refusing to build {corpus} into it "
                                  f"(the splits would mix): use another output directory or delete {out}")
    if old.get("version") != MANIFEST_VERSION:
        old = {}

    # a/b. text: one document per chapter (kjv) / per page or page part (pydoc)
    text_path = os.path.join(out, spec["file"])
    docs = _read_docs(text_path, spec["count"])
    if docs is None:
        docs = spec["extract"]()
        _atomic_write(text_path, "".join(json.dumps(d) + "\n" for d in docs).encode("utf-8"))
        log.info("wrote %s (%d %s)", text_path, len(docs), spec["unit"])
    else:
        log.info("kept %s", text_path)
    text_sha = _sha256(text_path)
    texts = [d["text"] for d in docs]

    # c. splits (pure function of the chapter count and C; of each document's corpus where there are two)
    by_source = "sources" in spec
    splits = (split_by_source([d["source"] for d in docs], num_clusters) if by_source
              else split_chapters(len(docs), num_clusters))

    # d. tokenizer on the training chapters only
    tok_path = os.path.join(out, "tokenizer.model")
    sp = _load_tokenizer(tok_path, vocab_size) if old.get("text_sha256", text_sha) == text_sha else None
    if sp is None:
        _train_tokenizer(out, [texts[i] for i in splits["train_all"]], vocab_size, **spec["trainer"])
        sp = _load_tokenizer(tok_path, vocab_size)
        if sp is None:
            raise ValueError(f"sentencepiece did not produce {vocab_size} pieces in {tok_path}")
        log.info("trained %s (vocab %d)", tok_path, vocab_size)
    else:
        log.info("kept %s", tok_path)
    tok_sha, eod = _sha256(tok_path), sp.eos_id()
    if eod < 0:
        raise ValueError(f"{tok_path} has no eos piece, so Megatron would have no eod id")

    # e. Megatron indexed datasets; tokenize lazily, only when some split must be (re)built
    from megatron.core.datasets.indexed_dataset import DType
    dtype = DType.optimal_dtype(vocab_size)
    ids = None
    entries = {}
    for name, chapters in splits.items():
        prefix = os.path.join(out, f"{name}_text_document")
        prev = old.get("splits", {}).get(name, {})
        same = (old.get("tokenizer_sha256") == tok_sha and old.get("text_sha256") == text_sha
                and prev.get("chapters") == chapters)
        if same and _dataset_ok(prefix, len(chapters), prev.get("tokens", -1)):
            tokens = prev["tokens"]
            log.info("kept %s", prefix)
        else:
            if ids is None:
                ids = sp.encode(texts, num_threads=min(16, os.cpu_count() or 1))
            _build_dataset(prefix, [ids[i] for i in chapters], eod, dtype)
            tokens = sum(len(ids[i]) + 1 for i in chapters)
            log.info("wrote %s (%d documents, %d tokens)", prefix, len(chapters), tokens)
        entries[name] = {"prefix": f"{name}_text_document", "documents": len(chapters),
                         "tokens": tokens, "chapters": chapters}

    for fname in os.listdir(out):  # shards of an earlier, larger --num-clusters
        m = re.fullmatch(r"train_c(\d+)_text_document\.(bin|idx)", fname)
        if m and int(m.group(1)) >= num_clusters:
            os.remove(os.path.join(out, fname))
            _drop_index_cache(os.path.join(out, fname.rsplit(".", 1)[0]))

    # f. manifest (rewritten only when its content changes)
    manifest = {
        "version": MANIFEST_VERSION, "corpus": corpus, "source": spec["source"],
        "documents": len(docs), "text_sha256": text_sha, "num_clusters": num_clusters,
        "shard_mode": "by_source" if by_source else "strided", "valid_every": VALID_EVERY, "vocab_size": sp.get_piece_size(),
        "eod_id": eod, "tokenizer_model": "tokenizer.model", "tokenizer_sha256": tok_sha,
        "dtype": np.dtype(dtype).name, "tokens_include_eod": True, "splits": entries,
    }
    if manifest != old:
        _atomic_write(os.path.join(out, "manifest.json"), (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def summary(manifest: dict, out_dir: str, seconds: float) -> str:
    """One line: documents and tokens per split."""
    s = manifest["splits"]
    shards = ", ".join(f"c{k} {s[f'train_c{k}']['documents']}/{s[f'train_c{k}']['tokens']}"
                       for k in range(manifest["num_clusters"]))
    unit = CORPORA[manifest.get("corpus", "kjv")]["unit"]
    return (f"prepare: {out_dir}: {manifest['documents']} {unit}; docs/tokens train_all "
            f"{s['train_all']['documents']}/{s['train_all']['tokens']}, valid {s['valid']['documents']}/"
            f"{s['valid']['tokens']}, {shards}; vocab {manifest['vocab_size']}, eod {manifest['eod_id']}; "
            f"{seconds:.1f}s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num-clusters", type=int, default=2, help="number of per-cluster training shards")
    p.add_argument("--vocab-size", type=int, default=4096, help="sentencepiece BPE vocabulary size")
    p.add_argument("--corpus", choices=sorted(CORPORA), default="kjv",
                   help="kjv: King James Bible (bible-kjv); pydoc: Python 3.11 docs (python3.11-doc); "
                        "kjv+pydoc: both, cluster shards by corpus (sites whose data differ)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        manifest = prepare(a.out, a.num_clusters, a.vocab_size, a.corpus)
    except (CorpusUnavailableError, ValueError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 1
    print(summary(manifest, os.path.abspath(a.out), time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
