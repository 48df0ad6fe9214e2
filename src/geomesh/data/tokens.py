"""Pre-tokenised binary token files (the ``tokens`` format, no extra), memory-mapped so a corpus larger than
memory trains, and tokenizers loaded from a ``tokenizer.json``.

``data.tokens_file`` is one file, a folder (its ``*.bin`` files, sorted) or a glob of flat little-endian
``uint16`` or ``uint32`` token ids with no header (the nanoGPT ``train.bin`` layout); shards are read with
``numpy.memmap`` and never loaded whole. Held-out tokens come from ``data.val_tokens_file`` or else the last
``val_fraction`` of the tokens. HF ``datasets`` sources (:mod:`geomesh.data.hf`) are written once to such
files and then read the same way.

Either way the result is a :class:`TokenCorpus` with the interface the runtimes use from
:class:`~geomesh.data.Corpus` (``vocab_size``, ``shard``, ``val_batches``, ``val_tokens``, ``tokenizer``) plus
``batch_stream``: a :class:`MemmapBatchStream` that reads only the windows it serves. Each worker's shard is a
contiguous, equal slice of the training tokens, as for the text corpus.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from ..errors import DataError
from .stream import BatchStream, shard_bounds
from .text import EOT

__all__ = [
    "TokenArray",
    "TokenCorpus",
    "MemmapBatchStream",
    "open_token_files",
    "write_token_file",
    "load_tokenizer",
    "find_eot_id",
    "load_token_corpus",
]

VAL_CAP_TOKENS = 1 << 21  # held-out tokens kept in memory (validation loss and the zero-shot task read them)
CHECK_TOKENS = 1 << 20  # training tokens checked against the vocabulary when a corpus opens
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


# ---------------------------------------------------------------------------------------------------------
# Token files


class TokenArray:
    """A read-only 1-D run of token ids over one or more memory-mapped files; slicing gives a lazy view."""

    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        total = int(self.offsets[-1])
        self.start = start
        self.stop = total if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, s: slice) -> "TokenArray":
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("TokenArray supports contiguous slices only")
        a, b, _ = s.indices(len(self))
        return TokenArray(self.parts, self.start + a, self.start + max(a, b)) if self.parts else self

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of this view as int64 (a copy)."""
        a, b = self.start + a, self.start + b
        out = np.empty(max(b - a, 0), dtype=np.int64)
        k = int(np.searchsorted(self.offsets, a, side="right")) - 1
        pos = 0
        while pos < len(out):
            lo = a + pos - int(self.offsets[k])
            take = min(len(out) - pos, len(self.parts[k]) - lo)
            out[pos : pos + take] = self.parts[k][lo : lo + take]
            pos += take
            k += 1
        return out

    def to_tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.read(0, len(self)))


def _token_paths(spec: str | Path) -> list[Path]:
    p = Path(spec).expanduser()
    if p.is_dir():
        paths = sorted(f for f in p.iterdir() if f.is_file() and f.suffix == ".bin")
        if not paths:
            raise DataError(f"{p}: folder has no .bin token files")
        return paths
    if p.is_file():
        return [p]
    if any(c in str(spec) for c in "*?["):
        paths = sorted(Path(f) for f in glob.glob(str(p)) if Path(f).is_file())
        if not paths:
            raise DataError(f"{spec}: no file matches")
        return paths
    raise DataError(f"{p}: no such token file or folder")


def open_token_files(spec: str | Path, dtype: str = "uint16") -> TokenArray:
    """The token files of ``spec`` (a file, a folder of ``*.bin`` or a glob), memory-mapped, as one run."""
    np_dtype = DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    parts = []
    for path in _token_paths(spec):
        size = path.stat().st_size
        if size % itemsize:
            raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens (wrong data.token_dtype?)")
        if size:
            parts.append(np.memmap(path, dtype=np.dtype(np_dtype).newbyteorder("<"), mode="r"))
    array = TokenArray(parts)
    if len(array) == 0:
        raise DataError(f"{spec}: the token files are empty")
    return array


def write_token_file(path: str | Path, tokens: Iterable[int] | np.ndarray, dtype: str = "uint16") -> Path:
    """Write token ids as a flat little-endian binary file (the ``tokens`` format); returns the path."""
    arr = np.asarray(tokens)
    top = np.iinfo(DTYPES[dtype]).max
    if arr.size and (arr.min() < 0 or arr.max() > top):
        raise ValueError(f"token ids must lie in [0, {top}] for {dtype}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arr.astype(np.dtype(DTYPES[dtype]).newbyteorder("<")).tofile(path)
    return path


# ---------------------------------------------------------------------------------------------------------
# Tokenizers


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """A ``tokenizers`` tokenizer from a ``tokenizer.json``, a folder holding one (e.g. what
    ``save_pretrained`` writes for a fast tokenizer) or, where the hub can be reached, a hub id."""
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise DataError(f"data.tokenizer: {spec} has no tokenizer.json (save a fast tokenizer with save_pretrained)")
    if p.is_file():
        try:
            return Tokenizer.from_file(str(p))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise DataError(f"data.tokenizer: {p} is not a tokenizer.json ({exc})") from None
    try:
        return Tokenizer.from_pretrained(str(spec))
    except Exception as exc:
        raise DataError(f"data.tokenizer: {spec!r} is no local file or folder and cannot be fetched ({exc})") from None


def find_eot_id(tokenizer: Tokenizer) -> int | None:
    """The id of the document separator (``<|endoftext|>``, ``</s>``, ...), or None when it has none."""
    for token in EOT_CANDIDATES:
        i = tokenizer.token_to_id(token)
        if i is not None:
            return i
    return None


class _LengthDecoder:
    """Stands in for a tokenizer when token files come without one: a piece decodes to one character per
    token, so the zero-shot task's length normalisation counts tokens instead of characters."""

    def __init__(self, vocab_size: int):
        self._vocab = vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "\u2591" * len(ids)

    def get_vocab_size(self) -> int:
        return self._vocab

    def token_to_id(self, token: str) -> int | None:
        return None


# ---------------------------------------------------------------------------------------------------------
# The corpus and its batches


class MemmapBatchStream(BatchStream):
    """Training batches from a memory-mapped shard, in :class:`~geomesh.data.BatchStream`'s order (and with
    its ``state_dict``); only the windows served are read from the files."""

    def __init__(self, tokens: TokenArray, seq_len: int, seed: int, vocab_size: int | None = None):
        self._init_order(len(tokens), seq_len, seed)
        self.tokens = tokens
        self.window = seq_len + 1
        self.vocab_size = vocab_size

    def _rows(self, picks: torch.Tensor) -> torch.Tensor:
        w = self.window
        rows = torch.from_numpy(np.stack([self.tokens.read(k * w, (k + 1) * w) for k in picks.tolist()])).long()
        if self.vocab_size is not None and int(rows.max()) >= self.vocab_size:
            raise DataError(f"token id {int(rows.max())} in the token files is >= the vocabulary size "
                            f"{self.vocab_size} (set data.vocab_size or data.tokenizer)")  # fmt: skip
        return rows


class TokenCorpus:
    """Memory-mapped training tokens, held-out tokens, the vocabulary size and (optionally) a tokenizer.

    ``val`` None: the last ``val_fraction`` of ``train`` is held out. ``val_tokens`` (a tensor, what the
    validation loss and the zero-shot task read) holds at most ``VAL_CAP_TOKENS`` of the held-out tokens.
    Without a tokenizer, ``tokenizer.decode`` gives one character per token (see :class:`_LengthDecoder`).
    """

    def __init__(self, train: TokenArray, val: TokenArray | None, vocab_size: int, val_fraction: float,
                 tokenizer: Tokenizer | None = None, key: str = "", eot_id: int | None = None):  # fmt: skip
        if val is None or len(val) == 0:
            n_val = max(1, int(round(len(train) * val_fraction)))
            if n_val >= len(train):
                raise DataError(f"{len(train)} tokens are too few to hold out a validation part")
            train, val = train[: len(train) - n_val], train[len(train) - n_val :]
        self.train = train
        self.val = val
        self.vocab_size = int(vocab_size)
        self.val_fraction = val_fraction
        self.key = key
        self.tokenizer = tokenizer if tokenizer is not None else _LengthDecoder(vocab_size)
        self.eot_id = eot_id if eot_id is not None else (find_eot_id(tokenizer) if tokenizer is not None else None)
        self.val_tokens = val[: min(len(val), VAL_CAP_TOKENS)].to_tensor()
        seen = [self.val_tokens, train[: min(len(train), CHECK_TOKENS)].to_tensor()]
        top = max(int(t.max()) for t in seen if t.numel())
        if top >= self.vocab_size:
            raise DataError(f"token id {top} is >= the vocabulary size {self.vocab_size}: set data.vocab_size above "
                            "the largest id, or data.tokenizer to the tokenizer that made the files")  # fmt: skip

    @property
    def n_train_tokens(self) -> int:
        return len(self.train)

    def shard(self, worker: int, n_workers: int) -> TokenArray:
        """Worker ``worker``'s contiguous slice of the training tokens (a lazy view)."""
        start, end = shard_bounds(len(self.train), worker, n_workers)
        return self.train[start:end]

    def batch_stream(self, worker: int, n_workers: int, seq_len: int, seed: int) -> MemmapBatchStream:
        return MemmapBatchStream(self.shard(worker, n_workers), seq_len, seed, vocab_size=self.vocab_size)

    def val_batches(self, seq_len: int, max_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed validation set: the first ``max_sequences`` non-overlapping windows of ``val_tokens``."""
        window = seq_len + 1
        n = min(max_sequences, len(self.val_tokens) // window)
        if n < 1:
            raise DataError(f"validation part has {len(self.val_tokens)} tokens, fewer than one window of "
                            f"seq_len + 1 = {window}: use more tokens or a larger val_fraction")  # fmt: skip
        rows = self.val_tokens[: n * window].view(n, window)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def load_token_corpus(d: Any, cache_dir: str | Path | None = None) -> TokenCorpus:
    """The ``tokens`` format: ``d`` is a :class:`~geomesh.config.DataConfig` (or anything with its fields)."""
    train = open_token_files(d.tokens_file, d.token_dtype)
    val = open_token_files(d.val_tokens_file, d.token_dtype) if d.val_tokens_file else None
    tokenizer = load_tokenizer(d.tokenizer) if d.tokenizer else None
    vocab = tokenizer.get_vocab_size() if tokenizer is not None else d.vocab_size
    return TokenCorpus(train, val, vocab, d.val_fraction, tokenizer=tokenizer, key=f"tokens:{d.tokens_file}")
