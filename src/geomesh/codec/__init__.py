"""Payload codecs: scaled-sign compression of pseudo-gradients, and the fp32 baseline.

Every worker forms a pseudo-gradient Δ_i (name -> tensor, θ_global − θ_local) and sends one
*payload*; every worker then combines all payloads into the same update

    Δ = Σ_i (n_i / Σ_j n_j) · s_i ⊙ sign(Δ_i)

where n_i is worker i's token count and s_i its magnitudes (one float per chunk). This package is
pure: no file I/O, no clock, no printing. It is used by both runtimes (the emulated one calls
``encode``/``combine`` in one process; the distributed one moves the bytes with an all-gather).

Public API
----------
``Manifest.from_tensors(tensors)``
    ordered tensor names, shapes and dtypes that every worker agrees on.
``SignCodec(manifest, *, chunk_size=4096, scale="l2", error_feedback=False,
combine_rule="weighted", key=None)``
    1 bit per element plus one float32 magnitude per chunk (~31.75x smaller than fp32).
``DenseCodec(manifest, *, weighting="equal", dtype=torch.float32, key=None)``
    the fp32 baseline (DiLoCo) with the same API; ``combine`` is exactly an average.
``SparseSignCodec(manifest, *, chunk_size=4096, k=64, value_bits=1, error_feedback=True, ef_decay=1.0,
weighting="tokens", key=None)``
    top-k per chunk: signs (or 2-bit values), Rice-coded positions, per-chunk magnitudes (~0.14 bits per
    parameter at k = 64 of 4096; geomesh-sparse, sparseloco).
``QuantCodec(manifest, *, fmt="int8", chunk_size=256, weighting="equal", key=None)``
    every value in int8 or FP4 (E2M1) with a float32 scale per chunk (diloco-int8, diloco-fp4).
All: ``encode(tensors, tokens) -> bytes``, ``decode(payload, device="cpu") -> DecodedPayload``,
``combine(payloads, device="cpu", out=None) -> dict``, ``combine_with_tokens(...) -> (dict, Σ n_i)``,
``tokens_of(payload)``, ``total_tokens(payloads)``, ``payload_nbytes()``, ``fp32_nbytes()``.
Any malformed payload raises ``PayloadError`` (a ``ValueError``) whose message names the problem.
Codecs are not thread-safe (they cache scratch buffers).

Modules
-------
``wire``
    the wire format (its byte layout is documented there): header, format version, layout
    digest, crc32, HMAC tag; writing a header, and checking untrusted bytes before any codec
    reads a body.
``manifest``
    ``TensorSpec`` and ``Manifest``: the tensors every worker sends and their canonical form.
``kernels``
    the sign codec's hot loops: sign test, bit packing and unpacking, chunk norms and the
    accumulation in ``combine``, as numpy kernels on a small thread pool on CPU or as torch ops on
    CUDA and other devices.
``base``
    what both codecs share (input checks, payload assembly and parsing, result views) and
    ``DecodedPayload``.
``sign``, ``dense``
    ``SignCodec`` (chunk layout, scales, zero rule, error feedback, combine rules) and
    ``DenseCodec``.
``sparse``, ``quant``
    ``SparseSignCodec`` (top-k, position code, error feedback) and ``QuantCodec`` (int8 / fp4).

Imports point one way, wire/manifest/kernels -> base -> sign/dense/sparse/quant -> this file, and from the rest
of geomesh the package imports only ``geomesh.errors`` (nothing higher), so every layer may use it.
Names with a leading underscore are shared between the package's modules, not exported.
"""

from __future__ import annotations

from ..errors import PayloadError
from .base import DecodedPayload
from .dense import DenseCodec
from .manifest import Manifest, TensorSpec
from .quant import QuantCodec
from .sign import SignCodec
from .sparse import SparseSignCodec
from .wire import FORMAT_VERSION, HEADER_NBYTES, MAGIC, MAX_TOKENS, TAG_NBYTES

__all__ = [
    "FORMAT_VERSION",
    "HEADER_NBYTES",
    "MAGIC",
    "MAX_TOKENS",
    "TAG_NBYTES",
    "DecodedPayload",
    "DenseCodec",
    "Manifest",
    "PayloadError",
    "QuantCodec",
    "SignCodec",
    "SparseSignCodec",
    "TensorSpec",
]
