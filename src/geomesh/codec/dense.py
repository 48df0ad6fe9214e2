"""The dense codec, the uncompressed baseline (DiLoCo): the tensors' values in the wire dtype
(float32 by default, lossless). ``combine`` is exactly an average, with equal or token weights."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..errors import PayloadError
from .base import DecodedPayload, _Codec
from .combine import weighted_combine
from .manifest import Manifest, _dtype_name
from .wire import (
    FLAG_HMAC,
    HEADER_NBYTES,
    KIND_DENSE,
    _DENSE_DTYPES,
    _DENSE_DTYPE_SHIFT,
    _check_tokens_arg,
    _frombuffer,
)

_F32 = torch.float32


class DenseCodec(_Codec):
    """Uncompressed baseline: raw little-endian values of the flattened tensors + header.

    Args:
        manifest: the tensors every worker sends.
        weighting: ``"equal"`` (combine = plain mean, DiLoCo) or ``"tokens"`` (Σ n_i x_i / Σ n_i).
        dtype: wire dtype, float32 (default; lossless) or bfloat16/float16.
        key: optional HMAC-SHA256 key.
    """

    _kind = KIND_DENSE

    def __init__(
        self,
        manifest: Manifest,
        *,
        weighting: str = "equal",
        dtype: torch.dtype = torch.float32,
        key: bytes | None = None,
    ):
        super().__init__(manifest, key)
        if weighting not in ("equal", "tokens"):
            raise ValueError(f"weighting must be 'equal' or 'tokens', got {weighting!r}")
        if dtype not in _DENSE_DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.weighting = weighting
        self.dtype = dtype
        self._flags = _DENSE_DTYPES[dtype] << _DENSE_DTYPE_SHIFT
        self._elem = torch.empty(0, dtype=dtype).element_size()
        self._body_len = self._elem * self._numel
        self._digest = self._digest_bytes(f"dtype={_dtype_name(dtype)}")

    def __repr__(self) -> str:
        return (
            f"DenseCodec({self.manifest!r}, weighting={self.weighting!r}, "
            f"dtype={_dtype_name(self.dtype)}, hmac={self.key is not None})"
        )

    def _flag_text(self, flags: int) -> str:
        code = (flags >> _DENSE_DTYPE_SHIFT) & 0x3
        names = {v: _dtype_name(k) for k, v in _DENSE_DTYPES.items()}
        return f"dtype={names.get(code, f'unknown({code})')}, hmac={bool(flags & FLAG_HMAC)}" + (
            f", reserved bits 0x{flags & 0xE3:02x}" if flags & 0xE3 else ""
        )

    def encode(self, tensors: Mapping[str, torch.Tensor], tokens: int) -> bytes:
        """Serialise ``tensors`` in the wire dtype; refuses NaN/Inf (and values the dtype cannot hold)."""
        tokens = _check_tokens_arg(tokens)
        xs, _ = self._inputs(tensors)
        # the values are written straight into the payload buffer (one host copy, no temporaries)
        buf = bytearray(self.payload_nbytes())
        flat = (
            torch.frombuffer(buf, dtype=self.dtype, count=self._numel, offset=HEADER_NBYTES)
            if self._numel
            else torch.empty(0, dtype=self.dtype)
        )
        for spec, off, x in zip(self.manifest, self.manifest.offsets, xs):
            flat[off : off + spec.numel].copy_(x)
        if self._numel and not bool(torch.isfinite(flat).all()):
            for spec, x in zip(self.manifest, xs):
                if not bool(torch.isfinite(x).all()):
                    raise ValueError(f"tensor {spec.name!r} contains NaN or Inf; refusing to encode it")
            bad = int((~torch.isfinite(flat)).nonzero()[0])
            raise ValueError(
                f"tensor {self._tensor_of_element(bad)!r} has values out of range for the "
                f"{_dtype_name(self.dtype)} wire dtype"
            )
        del flat  # release the export of buf before it is read
        self._write_header(buf, tokens)
        return bytes(buf)

    def _values(self, body: memoryview) -> torch.Tensor:
        if self.dtype == _F32:
            vals = _frombuffer(body, _F32, self._numel)
        else:
            vals = _frombuffer(body, torch.int16, self._numel).view(self.dtype)
        if self._numel and not bool(torch.isfinite(vals).all()):
            bad = int((~torch.isfinite(vals)).nonzero()[0])
            raise PayloadError(f"non-finite value {float(vals[bad])!r} in tensor {self._tensor_of_element(bad)!r}")
        return vals

    def decode(self, payload: bytes, *, device: torch.device | str = "cpu") -> DecodedPayload:
        """Check ``payload`` and return its token count and float32 tensors on ``device``."""
        tokens, body = self._parse(payload)
        vals = self._values(body)
        out = vals.to(device=torch.device(device), dtype=_F32, copy=True)
        return DecodedPayload(tokens, self._split(out))

    # ---- the all-reduce form: contributions that a sum combines ----------------------------------------
    def reduce_weight(self, tokens: int) -> float:
        """A payload's weight in the summed form: its tokens (in units of 2^20, so the sum stays well inside
        float32) under token weighting, else 1."""
        return tokens / 2**20 if self.weighting == "tokens" else 1.0

    def reducible(self, payload: bytes | None, *, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[w·Δ, w]`` (float32, numel + 1) of a checked payload: summing these over workers (an all-reduce)
        and dividing by the last element (:meth:`reduced_update`) is the weighted average. ``None``: zeros,
        a worker that sends no update."""
        flat = torch.zeros(self._numel + 1, dtype=_F32, device=torch.device(device))
        if payload is not None:
            decoded = self.decode(payload, device=device)
            w = self.reduce_weight(decoded.tokens)
            torch.cat([t.reshape(-1) for t in decoded.tensors.values()], out=flat[: self._numel])
            flat[: self._numel].mul_(w)
            flat[self._numel] = w
        return flat

    def reduced_update(self, summed: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The update in a sum of :meth:`reducible` forms (views into ``summed``); None when nothing was sent."""
        if float(summed[self._numel]) <= 0:
            return None
        return self._split(summed[: self._numel].div(summed[self._numel]))

    def combine_with_tokens(
        self,
        payloads: Iterable[bytes],
        *,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Average of the payloads: equal weights or token weights; returns (update, Σ tokens).

        Streams over any iterable; ``out`` is an optional float32 accumulator as in SignCodec.
        """
        device = torch.device(device)
        acc = self._accumulator(out, device)

        def add(body: memoryview, w: float) -> None:
            acc.add_(self._values(body).to(device), alpha=w)

        return weighted_combine(self, payloads, acc, self.weighting, add)
