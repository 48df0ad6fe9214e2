"""Token sources beyond the built-in text corpus, memory-mapped so a corpus larger than memory trains.

Two sources (scenario field ``data.format``, docs/ecosystem.md):

- ``tokens``: pre-tokenised binary shards, flat little-endian ``uint16`` or ``uint32`` token ids with no
  header (the nanoGPT ``train.bin`` layout): ``data.tokens_file`` is one file, a folder (its ``*.bin`` files,
  sorted) or a glob; shards are read with ``numpy.memmap`` and never loaded whole. Held-out tokens come from
  ``data.val_tokens_file`` or else the last ``val_fraction`` of the tokens.
- ``hf``: a HF ``datasets`` source (extra ``hf``): local ``json``/``jsonl``, ``text``, ``parquet`` or ``csv``
  files (``data.hf_dataset`` names the builder, ``data.paths`` the files) or, where the hub can be reached, a
  dataset name. Documents are streamed (``streaming: true``), tokenised in batches with ``data.tokenizer`` (a
  ``tokenizer.json`` or a folder holding one) or a byte-level BPE trained on the first documents, and written
  once to a token cache (``<cache>/hf-<key>/{train,val}.bin``), which is then memory-mapped like the
  ``tokens`` format. Every ``round(1/val_fraction)``-th document is held out (up to ``VAL_CAP_TOKENS``).

Either way the result is a :class:`TokenCorpus` with the interface the runtimes use from
:class:`~geomesh.data.Corpus` (``vocab_size``, ``shard``, ``val_batches``, ``val_tokens``, ``tokenizer``) plus
``batch_stream``: a :class:`MemmapBatchStream` that reads only the windows it serves. Each worker's shard is a
contiguous, equal slice of the training tokens, as for the text corpus.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from ..data import EOT, BatchStream, DataError, shard_bounds, train_tokenizer

__all__ = [
    "TokenArray",
    "TokenCorpus",
    "MemmapBatchStream",
    "open_token_files",
    "write_token_file",
    "load_tokenizer",
    "find_eot_id",
    "load_token_corpus",
    "load_hf_corpus",
    "iter_hf_documents",
]

FORMAT_VERSION = 1  # bump when the token cache layout changes
VAL_CAP_TOKENS = 1 << 21  # held-out tokens kept in memory (validation loss and the zero-shot task read them)
TOKENIZER_SAMPLE_CHARS = 20_000_000  # characters of the first documents a BPE is trained on
BATCH_DOCS = 256  # documents tokenised at once
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


# ---------------------------------------------------------------------------------------------------------
# HF datasets -> token cache


def _data_files(paths: list[str] | None) -> list[str] | None:
    if not paths:
        return None
    files: list[str] = []
    for spec in paths:
        p = Path(spec).expanduser()
        if p.is_dir():
            found = sorted(str(f) for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
            if not found:
                raise DataError(f"{p}: folder has no files")
            files += found
        elif p.is_file():
            files.append(str(p))
        elif any(c in spec for c in "*?["):
            found = sorted(glob.glob(str(p)))
            if not found:
                raise DataError(f"{spec}: no file matches")
            files += found
        else:
            raise DataError(f"{p}: no such file or directory")
    return files


def iter_hf_documents(d: Any) -> Iterator[str]:
    """The documents (``d.text_field`` of each record) of a HF ``datasets`` source, streamed."""
    from . import require

    datasets = require("datasets", "data.format: hf (a HF datasets source)")
    files = _data_files(d.paths)
    kwargs: dict[str, Any] = {"split": d.split, "streaming": d.streaming}
    if files is not None:
        kwargs["data_files"] = files
    if d.hf_dataset == "text":
        kwargs["sample_by"] = "paragraph"  # a document per blank-line-separated paragraph, not per line
    try:
        ds = datasets.load_dataset(d.hf_dataset, d.hf_name, **kwargs)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"data.hf_dataset {d.hf_dataset!r}: cannot load ({first})") from None
    except Exception as exc:  # datasets' own errors (DatasetNotFoundError, ...) have no common base
        raise DataError(f"data.hf_dataset {d.hf_dataset!r}: cannot load ({type(exc).__name__}: {exc})") from None
    n = 0
    for n, record in enumerate(ds, start=1):
        if d.text_field not in record:
            raise DataError(f"data.hf_dataset {d.hf_dataset!r}: record {n} has no {d.text_field!r} field "
                            f"(fields: {', '.join(record)}); set data.text_field")  # fmt: skip
        text = record[d.text_field]
        if not isinstance(text, str):
            raise DataError(f"data.hf_dataset {d.hf_dataset!r}: record {n} field {d.text_field!r} is "
                            f"{type(text).__name__}, not a string")  # fmt: skip
        if text.strip():
            yield text
    if n == 0:
        raise DataError(f"data.hf_dataset {d.hf_dataset!r}: split {d.split!r} has no records")


def _source_identity(d: Any) -> dict[str, Any]:
    files = _data_files(d.paths)
    stats = []
    for f in files or []:
        st = os.stat(f)
        stats.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    tok = None
    if d.tokenizer:
        p = Path(d.tokenizer).expanduser()
        p = p / "tokenizer.json" if p.is_dir() else p
        tok = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else str(d.tokenizer)
    return {"v": FORMAT_VERSION, "dataset": d.hf_dataset, "name": d.hf_name, "split": d.split, "files": stats,
            "text_field": d.text_field, "tokenizer": tok, "vocab": None if tok else d.vocab_size,
            "max_tokens": d.max_tokens, "val_fraction": d.val_fraction}  # fmt: skip


def _sample(docs: Iterator[str], chars: int) -> list[str]:
    out, total = [], 0
    for doc in docs:
        out.append(doc)
        total += len(doc)
        if total >= chars:
            break
    return out


def load_hf_corpus(d: Any, cache_dir: str | Path | None = None) -> TokenCorpus:
    """The ``hf`` format: stream the dataset, tokenise it once into ``<cache>/hf-<key>/`` and memory-map it."""
    from ..data import default_cache_dir

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    ident = _source_identity(d)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    folder = cache_dir / f"hf-{key}"
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        _build_hf_cache(d, folder)
    meta = json.loads(meta_path.read_text())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    train = open_token_files(folder / "train.bin", meta["dtype"])
    val = open_token_files(folder / "val.bin", meta["dtype"]) if meta["val_tokens"] else None
    return TokenCorpus(train, val, meta["vocab_size"], d.val_fraction, tokenizer=tokenizer, key=key,
                       eot_id=meta["eot_id"])  # fmt: skip


def _build_hf_cache(d: Any, folder: Path) -> None:
    if d.tokenizer:
        tokenizer = load_tokenizer(d.tokenizer)
    else:
        sample = _sample(iter_hf_documents(d), TOKENIZER_SAMPLE_CHARS)
        tokenizer = train_tokenizer(sample, d.vocab_size)
    vocab = tokenizer.get_vocab_size()
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    np_dtype = np.dtype(DTYPES[dtype]).newbyteorder("<")
    eot = find_eot_id(tokenizer)
    every = max(2, round(1 / d.val_fraction))
    tmp = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {"train": 0, "val": 0}
    documents = 0
    try:
        with open(tmp / "train.bin", "wb") as ftrain, open(tmp / "val.bin", "wb") as fval:
            batch: list[str] = []

            def flush() -> bool:
                nonlocal documents
                pieces: dict[str, list[np.ndarray]] = {"train": [], "val": []}
                for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
                    ids = ([eot] if eot is not None else []) + enc.ids
                    part = "val" if documents % every == every - 1 and counts["val"] < VAL_CAP_TOKENS else "train"
                    documents += 1
                    if d.max_tokens is not None:
                        ids = ids[: max(0, d.max_tokens - counts["train"] - counts["val"])]
                    pieces[part].append(np.asarray(ids, dtype=np_dtype))
                    counts[part] += len(ids)
                for part, f in (("train", ftrain), ("val", fval)):
                    if pieces[part]:
                        np.concatenate(pieces[part]).tofile(f)
                batch.clear()
                return d.max_tokens is not None and counts["train"] + counts["val"] >= d.max_tokens

            for doc in iter_hf_documents(d):
                batch.append(doc)
                if len(batch) >= BATCH_DOCS and flush():
                    break
            else:
                if batch:
                    flush()
        if counts["train"] == 0:
            raise DataError(f"data.hf_dataset {d.hf_dataset!r}: no tokens (all documents are empty)")
        tokenizer.save(str(tmp / "tokenizer.json"))
        meta = {"vocab_size": vocab, "dtype": dtype, "eot_id": eot, "train_tokens": counts["train"],
                "val_tokens": counts["val"], "documents": documents, "source": _source_identity(d)}  # fmt: skip
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
