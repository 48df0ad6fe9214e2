"""A scenario's data section to a corpus and per-worker batch streams, whatever the source
(``data.format``: ``text``, ``tokens`` or ``hf``; docs/ecosystem.md).
"""

from __future__ import annotations

from pathlib import Path

from . import hf, tokens
from .stream import BatchStream
from .text import Corpus, CorpusSpec


def load_corpus(data, cache_dir: str | Path | None = None):
    """The corpus a scenario's ``data`` section (a :class:`~geomesh.config.DataConfig`) names.

    ``text`` (the default): :meth:`Corpus.load` on ``data.paths``; ``tokens`` and ``hf``: a memory-mapped
    :class:`~geomesh.data.tokens.TokenCorpus` with the same interface (see that module)."""
    source = data.source() if hasattr(data, "source") else "text"
    if source == "text":
        spec = CorpusSpec(paths=data.paths, vocab_size=data.vocab_size, val_fraction=data.val_fraction,
                          text_field=data.text_field)  # fmt: skip
        return Corpus.load(spec, cache_dir=cache_dir)
    if source == "tokens":
        return tokens.load_token_corpus(data, cache_dir)
    return hf.load_hf_corpus(data, cache_dir)


def worker_stream(corpus, worker: int, n_workers: int, seq_len: int, seed: int):
    """Worker ``worker``'s batch stream over its shard: a :class:`BatchStream`, or the corpus's own
    (memory-mapped) stream when it has one."""
    own = getattr(corpus, "batch_stream", None)
    if own is not None:
        return own(worker, n_workers, seq_len, seed)
    return BatchStream(corpus.shard(worker, n_workers), seq_len, seed=seed)
