"""HF ``datasets`` sources (the ``hf`` format, extra ``hf``), streamed once into a token cache.

Local ``json``/``jsonl``, ``text``, ``parquet`` or ``csv`` files (``data.hf_dataset`` names the builder,
``data.paths`` the files) or, where the hub can be reached, a dataset name. Documents are streamed
(``streaming: true``), tokenised in batches with ``data.tokenizer`` (a ``tokenizer.json`` or a folder holding
one) or a byte-level BPE trained on the first documents, and written once to a token cache
(``<cache>/hf-<key>/{train,val}.bin``), which is then memory-mapped like the ``tokens`` format
(:mod:`geomesh.data.tokens`). Every ``round(1/val_fraction)``-th document is held out (up to
``VAL_CAP_TOKENS``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ..errors import DataError
from ..extras import require
from .text import default_cache_dir, train_tokenizer
from .tokens import DTYPES, VAL_CAP_TOKENS, TokenCorpus, find_eot_id, load_tokenizer, open_token_files

__all__ = ["load_hf_corpus", "iter_hf_documents"]

FORMAT_VERSION = 1  # bump when the token cache layout changes
TOKENIZER_SAMPLE_CHARS = 20_000_000  # characters of the first documents a BPE is trained on
BATCH_DOCS = 256  # documents tokenised at once


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
