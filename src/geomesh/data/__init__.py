"""Training data (training layer): token sources, the tokenizer, worker shards and batch streams.

- :mod:`.text`: the built-in text corpus: ``.txt``/``.jsonl`` documents (default: Shakespeare), a byte-level
  BPE tokenizer trained locally and cached, the validation split rule, :class:`Corpus`;
- :mod:`.stream`: worker shards (:func:`shard_bounds`) and :class:`BatchStream`, the seeded, resumable order
  of a worker's training windows;
- :mod:`.tokens`: pre-tokenised binary token files, memory-mapped (:class:`TokenCorpus`,
  :class:`MemmapBatchStream`), and tokenizers loaded from a ``tokenizer.json`` (:func:`load_tokenizer`);
- :mod:`.hf`: HF ``datasets`` sources streamed once into a token cache (extra ``hf``);
- :mod:`.source`: a scenario's ``data`` section to a corpus (:func:`load_corpus`) and a worker's stream
  (:func:`worker_stream`), whatever the source.

Every name the rest of the code uses is exported here (``from geomesh.data import ...``). Imports point down
only: to facts (:mod:`geomesh.errors`, :mod:`geomesh.extras`), never to the models, methods, runtimes or
faces. docs/ecosystem.md describes the formats.
"""

from ..errors import DataError
from .hf import iter_hf_documents, load_hf_corpus
from .source import load_corpus, worker_stream
from .stream import BatchStream, shard_bounds
from .text import (
    EOT,
    FORMAT_VERSION,
    INSTALL_HINT,
    Corpus,
    CorpusSpec,
    cache_key,
    content_hash,
    default_cache_dir,
    default_corpus_files,
    load_or_train_tokenizer,
    read_documents,
    train_tokenizer,
)
from .tokens import (
    MemmapBatchStream,
    TokenArray,
    TokenCorpus,
    find_eot_id,
    load_token_corpus,
    load_tokenizer,
    open_token_files,
    write_token_file,
)

__all__ = [
    "EOT",
    "FORMAT_VERSION",
    "INSTALL_HINT",
    "BatchStream",
    "Corpus",
    "CorpusSpec",
    "DataError",
    "MemmapBatchStream",
    "TokenArray",
    "TokenCorpus",
    "cache_key",
    "content_hash",
    "default_cache_dir",
    "default_corpus_files",
    "find_eot_id",
    "iter_hf_documents",
    "load_corpus",
    "load_hf_corpus",
    "load_or_train_tokenizer",
    "load_token_corpus",
    "load_tokenizer",
    "open_token_files",
    "read_documents",
    "shard_bounds",
    "train_tokenizer",
    "worker_stream",
    "write_token_file",
]
