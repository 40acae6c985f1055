"""The KJV corpus preparation yields exactly what Megatron reads: counts, tokens, shards, tokenizer.

The data are prepared once per test session into a fresh pytest tmp dir (no cache under data/), so a
stale or hand-edited corpus can never make these pass; that costs ~5 s beyond the megatron import.
Needs the `bible` program (installed by prepare() via apt-get when root); skipped where it cannot be had.
The second corpus (Python 3.11 docs, `python3.11-doc`) is built the same way at the end (~20 s more).
"""
import json
import os
import re
import sys

import numpy as np
import pytest

from megatron_dilocox.data import prepare as prep

pytestmark = pytest.mark.unit

GENESIS_1_1 = "In the beginning God created the heaven and the earth."
VOCAB = 4096
CLUSTERS = 3  # odd on purpose: shards of unequal size


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("kjv"))
    try:
        manifest = prep.prepare(out, num_clusters=CLUSTERS, vocab_size=VOCAB)
    except prep.CorpusUnavailableError as e:
        pytest.skip(f"KJV corpus unavailable here: {e}")
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "tokenizer.model"))
    with open(os.path.join(out, "kjv.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    ids = sp.encode([d["text"] for d in docs])
    return dict(out=out, manifest=manifest, sp=sp, docs=docs, ids=ids)


def _split_names():
    return ["valid", "train_all"] + [f"train_c{k}" for k in range(CLUSTERS)]


def test_documents_one_per_chapter(corpus):
    docs, m = corpus["docs"], corpus["manifest"]
    assert len(docs) == m["documents"] == 1189
    assert (docs[0]["ref"], docs[-1]["ref"]) == ("Genesis 1", "Revelation 22")
    assert docs[0]["text"].startswith(GENESIS_1_1 + " And the earth was without form")
    assert docs[-1]["text"].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    # verse numbers and headings are gone: the KJV text itself has no digits, and no double spaces
    assert not any(re.search(r"\d|  |^\s|\s$", d["text"]) for d in docs)
    s = m["splits"]
    assert s["valid"]["documents"] + s["train_all"]["documents"] == 1189
    assert (s["valid"]["documents"], s["train_all"]["documents"]) == (59, 1130)
    assert sum(s[f"train_c{k}"]["documents"] for k in range(CLUSTERS)) == 1130


def test_splits_disjoint_and_strided(corpus):
    s = corpus["manifest"]["splits"]
    valid, train = set(s["valid"]["chapters"]), set(s["train_all"]["chapters"])
    assert valid == {i for i in range(1189) if i % 20 == 19}
    assert not valid & train and valid | train == set(range(1189))
    shards = [s[f"train_c{k}"]["chapters"] for k in range(CLUSTERS)]
    for a in range(CLUSTERS):
        for b in range(a + 1, CLUSTERS):
            assert not set(shards[a]) & set(shards[b])
    assert set().union(*shards) == train
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shards[1] == s["train_all"]["chapters"][1::CLUSTERS]


def test_indexed_datasets_hold_sentencepiece_ids_plus_eod(corpus):
    """Each split read back with megatron-core's IndexedDataset equals encode(chapter) + [eod], in order."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    m, ids = corpus["manifest"], corpus["ids"]
    eod = corpus["sp"].eos_id()
    assert m["eod_id"] == eod == 2
    for name in _split_names():
        entry = m["splits"][name]
        ds = IndexedDataset(os.path.join(corpus["out"], entry["prefix"]))
        assert ds.index.dtype == np.uint16
        assert len(ds) == len(ds.document_indices) - 1 == entry["documents"]
        expected_tokens = sum(len(ids[c]) + 1 for c in entry["chapters"])
        assert int(ds.sequence_lengths.sum()) == entry["tokens"] == expected_tokens
        for j, c in enumerate(entry["chapters"]):
            assert ds[j].tolist() == ids[c] + [eod], (name, j)
    s = m["splits"]
    assert sum(s[f"train_c{k}"]["tokens"] for k in range(CLUSTERS)) == s["train_all"]["tokens"]
    assert 900_000 < s["train_all"]["tokens"] < 1_000_000  # ~1M tokens at a 4k vocabulary


def test_tokenizer_round_trips(corpus):
    sp = corpus["sp"]
    assert sp.get_piece_size() == corpus["manifest"]["vocab_size"] == VOCAB
    ids = sp.encode(GENESIS_1_1)
    assert sp.decode(ids) == GENESIS_1_1
    assert sp.encode(GENESIS_1_1, out_type=str)[:4] == ["▁In", "▁the", "▁beginning", "▁God"]
    for doc, doc_ids in zip(corpus["docs"], corpus["ids"]):
        assert sp.decode(doc_ids) == doc["text"], doc["ref"]


def test_megatron_reads_it_with_the_documented_flags(corpus, monkeypatch, tmp_path):
    """Megatron's own argument parser, tokenizer builder and GPT dataset builder accept the output."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import parse_args
    from megatron.training.utils import get_blend_and_blend_per_split
    d, m, sp = corpus["out"], corpus["manifest"], corpus["sp"]
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{d}/tokenizer.model",
             "--train-data-path", f"{d}/train_c1_text_document",
             "--valid-data-path", f"{d}/valid_text_document"]
    monkeypatch.setattr(sys, "argv", ["pretrain"] + flags)
    args = parse_args()
    tok = build_tokenizer(args)
    assert type(tok._tokenizer).__name__ == "SentencePieceTokenizer"
    assert (tok.vocab_size, tok.eod, args.padded_vocab_size) == (VOCAB, m["eod_id"], VOCAB)
    assert tok.tokenize(GENESIS_1_1) == sp.encode(GENESIS_1_1)
    assert tok.detokenize(sp.encode(GENESIS_1_1)) == GENESIS_1_1

    blend, per_split = get_blend_and_blend_per_split(args)
    assert blend is None and per_split[2] is None
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=256, blend=blend, blend_per_split=per_split,
                           tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=str(tmp_path))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [10, 10, 0], lambda: True, cfg).build()
    assert test is None
    assert len(train) == (m["splits"]["train_c1"]["tokens"] - 1) // 256
    assert len(valid) == (m["splits"]["valid"]["tokens"] - 1) // 256
    sample = train[0]
    assert sample["tokens"].shape == (256,) and int(sample["tokens"].max()) < VOCAB
    assert (sample["labels"][:-1] == sample["tokens"][1:]).all()


def _megatron_train_split(d, shard, tok_model):
    """Megatron's GPT train dataset of one shard, with its index cache where Megatron puts it by default
    (PREFIX/cache: no path_to_cache), as the main job and the SLURM script run it."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import parse_args
    from megatron.training.utils import get_blend_and_blend_per_split
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok_model,
             "--train-data-path", f"{d}/{shard}_text_document", "--valid-data-path", f"{d}/valid_text_document"]
    old_argv, sys.argv = sys.argv, ["pretrain"] + flags
    try:
        args = parse_args()
    finally:
        sys.argv = old_argv
    blend, per_split = get_blend_and_blend_per_split(args)
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=256, blend=blend, blend_per_split=per_split,
                           tokenizer=build_tokenizer(args), reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(GPTDataset, [10, 10, 0], lambda: True, cfg).build()[0]


def test_resplitting_drops_megatrons_stale_index_cache(corpus, tmp_path):
    """Preparing the same folder for another cluster count rewrites the shards; Megatron's cached indices of
    the old shard (keyed by config, not content) must go with it, or the next run reads past the new shard
    (seen: IndexError 'index 554 is out of bounds for axis 0 with size 377' after a 3-cluster re-split)."""
    import shutil
    d = str(tmp_path / "kjv")
    shutil.copytree(corpus["out"], d)
    tok = os.path.join(d, "tokenizer.model")
    before = _megatron_train_split(d, "train_c0", tok)
    assert os.path.isdir(os.path.join(d, "train_c0_text_document", "cache"))
    m = prep.prepare(d, num_clusters=2, vocab_size=VOCAB)
    assert not os.path.exists(os.path.join(d, "train_c0_text_document", "cache"))
    assert not os.path.exists(os.path.join(d, "train_c2_text_document.bin"))
    after = _megatron_train_split(d, "train_c0", tok)
    assert len(after) == (m["splits"]["train_c0"]["tokens"] - 1) // 256 != len(before)
    assert int(after[len(after) - 1]["tokens"].max()) < VOCAB  # the last sample reads inside the new shard
    kept = os.path.join(d, "train_c0_text_document", "cache")
    assert os.path.isdir(kept)
    prep.prepare(d, num_clusters=2, vocab_size=VOCAB)  # unchanged shards keep their cache
    assert os.path.isdir(kept)


def test_rerun_is_a_no_op(corpus):
    out = corpus["out"]
    before = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    assert prep.prepare(out, num_clusters=CLUSTERS, vocab_size=VOCAB) == corpus["manifest"]
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == before
    assert not any(".tmp" in f for f in before)


def test_split_chapters_is_strided_and_deterministic():
    s = prep.split_chapters(1189, 2)
    assert s == prep.split_chapters(1189, 2)
    assert s["train_c0"][:4] == [0, 2, 4, 6] and s["train_c1"][:4] == [1, 3, 5, 7]
    assert s["valid"][:3] == [19, 39, 59] and 19 not in s["train_all"] and 20 in s["train_c1"]


@pytest.mark.parametrize("root,apt,expect", [
    (False, True, "not root"), (True, False, "apt-get is unavailable")])
def test_missing_bible_says_what_to_install(monkeypatch, root, apt, expect):
    monkeypatch.setattr(prep.shutil, "which", lambda name: "/usr/bin/apt-get" if apt and name == "apt-get" else None)
    monkeypatch.setattr(prep.os, "geteuid", lambda: 0 if root else 1000)
    with pytest.raises(prep.CorpusUnavailableError) as e:
        prep.ensure_bible()
    assert expect in str(e.value)
    assert "apt-get install -y --no-install-recommends bible-kjv bible-kjv-text" in str(e.value)


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    assert prep.main(["--out", str(tmp_path), "--num-clusters", "0"]) == 1
    assert "num_clusters must be >= 1" in capsys.readouterr().err


# ---- the second corpus: the Python 3.11 documentation (python3.11-doc) ---------------------------------

from megatron_dilocox.data import corpora  # noqa: E402


@pytest.fixture(scope="session")
def pydoc(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pydoc"))
    try:
        manifest = prep.prepare(out, num_clusters=CLUSTERS, vocab_size=VOCAB, corpus="pydoc")
    except prep.CorpusUnavailableError as e:
        pytest.skip(f"pydoc corpus unavailable here: {e}")
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "tokenizer.model"))
    with open(os.path.join(out, "pydoc.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    return dict(out=out, manifest=manifest, sp=sp, docs=docs)


def test_pydoc_documents_are_the_extracted_pages(pydoc):
    docs, m = pydoc["docs"], pydoc["manifest"]
    extracted = corpora.extract_pydoc(corpora.ensure_pydoc())  # independently of the files written
    assert docs == extracted and len(docs) == m["documents"]
    assert (m["corpus"], m["vocab_size"], m["eod_id"]) == ("pydoc", VOCAB, 2)
    pages = [d["ref"].split(" [")[0] for d in docs]
    assert len(set(pages)) == 497 and pages == sorted(pages)  # one page per .rst.txt, in path order
    assert docs[0]["ref"] == "about.rst" and docs[0]["text"].startswith("About these documents These documents")
    assert 900 < len(docs) < 1100  # 497 pages, 163 of them over 20k characters and split (966 with 3.11.2)
    parts = [d for d in docs if d["ref"].startswith("library/os.rst [")]
    assert len(parts) > 5 and parts[-1]["ref"].endswith(f"[{len(parts)}/{len(parts)}]")
    assert max(len(d["text"]) for d in docs) <= corpora.MAX_DOC_CHARS
    assert not any(re.search(r"\s\s|^\s|\s$", d["text"]) for d in docs)  # one line, single spaces
    # section adornments and table rules are dropped ("====" inside code examples stays)
    assert not any(re.search(r"\+={3,}\+|={4,} ={4,}|^={4,}", d["text"]) for d in docs)


def test_pydoc_splits_and_shards(pydoc):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    m, n = pydoc["manifest"], pydoc["manifest"]["documents"]
    s = m["splits"]
    valid, train = s["valid"]["chapters"], s["train_all"]["chapters"]
    assert valid == [i for i in range(n) if i % 20 == 19] and len(valid) == n // 20
    assert not set(valid) & set(train) and set(valid) | set(train) == set(range(n))
    shards = [s[f"train_c{k}"]["chapters"] for k in range(CLUSTERS)]
    assert shards == [train[k::CLUSTERS] for k in range(CLUSTERS)]
    assert sum(map(len, shards)) == len(train) and set().union(*shards) == set(train)
    assert sum(s[f"train_c{k}"]["tokens"] for k in range(CLUSTERS)) == s["train_all"]["tokens"]
    toks = [s[f"train_c{k}"]["tokens"] for k in range(CLUSTERS)]
    assert max(toks) < 1.25 * min(toks)  # split pages keep the strided shards balanced
    assert 2_400_000 < s["train_all"]["tokens"] < 3_000_000  # ~2.7M tokens at a 4k vocabulary
    sp, eod = pydoc["sp"], m["eod_id"]
    ds = IndexedDataset(os.path.join(pydoc["out"], s["valid"]["prefix"]))
    assert len(ds) == len(valid) and int(ds.sequence_lengths.sum()) == s["valid"]["tokens"]
    for j in (0, len(valid) - 1):
        assert ds[j].tolist() == sp.encode(pydoc["docs"][valid[j]]["text"]) + [eod]


def test_pydoc_tokenizer_round_trips(pydoc):
    sp, docs = pydoc["sp"], pydoc["docs"]
    non_ascii = [d for d in docs if any(ord(c) > 127 for c in d["text"])]
    assert non_ascii  # the docs hold non-ASCII (NFKC would alter some; identity + byte fallback keep it)
    for d in docs[:20] + non_ascii + docs[19::20]:  # includes every validation document
        ids = sp.encode(d["text"])
        assert 0 not in ids and sp.decode(ids) == d["text"], d["ref"]


def test_pydoc_rerun_is_a_no_op(pydoc):
    out = pydoc["out"]
    before = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    assert prep.prepare(out, num_clusters=CLUSTERS, vocab_size=VOCAB, corpus="pydoc") == pydoc["manifest"]
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == before


def test_a_dir_of_one_corpus_is_refused_for_the_other(corpus, pydoc, capsys):
    for have, want, d in (("kjv", "pydoc", corpus["out"]), ("pydoc", "kjv", pydoc["out"])):
        before = {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in os.listdir(d)}
        with pytest.raises(prep.CorpusMismatchError, match=f"already holds the {have} corpus; refusing to build {want}"):
            prep.prepare(d, num_clusters=CLUSTERS, vocab_size=VOCAB, corpus=want)
        assert {f: os.stat(os.path.join(d, f)).st_mtime_ns for f in os.listdir(d)} == before
    assert prep.main(["--out", corpus["out"], "--corpus", "pydoc", "--num-clusters", str(CLUSTERS)]) == 1
    assert "already holds the kjv corpus" in capsys.readouterr().err
    assert corpus["manifest"]["corpus"] == "kjv"


def test_missing_pydoc_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(corpora, "PYDOC_SOURCES", str(tmp_path / "absent"))
    monkeypatch.setattr(corpora.shutil, "which", lambda name: None)
    with pytest.raises(prep.CorpusUnavailableError) as e:
        prep.prepare(str(tmp_path / "out"), corpus="pydoc")
    assert "apt-get is unavailable" in str(e.value)
    assert "apt-get install -y --no-install-recommends python3.11-doc" in str(e.value)
    with pytest.raises(ValueError, match="corpus must be one of"):
        prep.prepare(str(tmp_path / "out"), corpus="wiki")


def test_split_by_source_gives_each_cluster_one_corpus():
    """Sites whose data differ (--corpus kjv+pydoc): cluster k's shard holds corpus k % 2's training documents
    only, strided over the clusters that share it; each corpus keeps its own every-20th validation split, and
    the joint splits are their unions."""
    sources = ["kjv"] * 45 + ["pydoc"] * 23
    s = prep.split_by_source(sources, 4)
    kjv, doc = list(range(45)), list(range(45, 68))
    assert s["valid_kjv"] == [19, 39] and s["valid_pydoc"] == [45 + 19]
    assert s["valid"] == s["valid_kjv"] + s["valid_pydoc"]
    train_kjv = [i for i in kjv if i not in (19, 39)]
    train_doc = [i for i in doc if i != 64]
    assert s["train_all"] == train_kjv + train_doc
    assert (s["train_c0"], s["train_c2"]) == (train_kjv[0::2], train_kjv[1::2])
    assert (s["train_c1"], s["train_c3"]) == (train_doc[0::2], train_doc[1::2])
    with pytest.raises(ValueError, match="2 corpora need at least 2 clusters"):
        prep.split_by_source(sources, 1)
