"""The quantised codec: every value in 8 bits (int8) or 4 bits (FP4 E2M1), one float32 scale per chunk, and
the token count. The compressed baselines of the field: torchft and INTELLECT-1 exchange DiLoCo's outer
gradients in 8 bits, Streaming DiLoCo in 4-bit floats.

Formats (``fmt``)
-----------------
- ``"int8"``: s = max|x|/127 per chunk; q = round(x/s) in [−127, 127] (−128 is never written and refused).
- ``"fp4"``: E2M1, the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} and a sign bit; s = max|x|/6 per chunk, each
  value rounded to the nearest grid point of x/s. Two values per byte, the lower element index in the low
  nibble (bit 3 of a nibble is the sign, bits 0-2 the grid index).

Rounding is to nearest (deterministic), so a chunk's largest value is exact and no value moves by more than
half a grid step. ``combine``: the plain mean (``weighting="equal"``, DiLoCo) or token weights.

Body (after the 48-byte header of :mod:`geomesh.codec.wire`, kind 4; flags bit 1: fp4, else int8):
M float32 scales, then the d codes (int8: one byte each; fp4: ⌈d/2⌉ bytes, a zero high nibble when d is
odd). Chunks never cross tensors. A decoder refuses non-finite or negative scales, the int8 code −128 and a
non-zero padding nibble.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from ..errors import PayloadError
from .base import DecodedPayload, _Codec
from .combine import weighted_combine
from .manifest import Manifest
from .wire import FLAG_HMAC, KIND_QUANT, _check_tokens_arg, _frombuffer

_F32 = torch.float32
FLAG_FP4 = 0x02
_FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=_F32)
_FP4_EDGES = (_FP4_GRID[1:] + _FP4_GRID[:-1]) / 2  # nearest grid point = number of midpoints below
_QMAX = {"int8": 127.0, "fp4": 6.0}


class QuantCodec(_Codec):
    """Per-chunk absmax quantisation to int8 or FP4 (E2M1) with one float32 scale per chunk.

    Args:
        manifest: the tensors every worker sends.
        fmt: ``"int8"`` or ``"fp4"``.
        chunk_size: elements per scale (default 256).
        weighting: ``"equal"`` (the plain mean, DiLoCo) or ``"tokens"``.
        key: optional HMAC-SHA256 key.
    """

    _kind = KIND_QUANT

    def __init__(self, manifest: Manifest, *, fmt: str = "int8", chunk_size: int = 256, weighting: str = "equal",
                 key: bytes | None = None):  # fmt: skip
        super().__init__(manifest, key)
        if fmt not in _QMAX:
            raise ValueError(f"fmt must be 'int8' or 'fp4', got {fmt!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size < 2**32:
            raise ValueError(f"chunk_size must be an int in [1, 2**32), got {chunk_size!r}")
        if weighting not in ("equal", "tokens"):
            raise ValueError(f"weighting must be 'equal' or 'tokens', got {weighting!r}")
        self.fmt, self.chunk_size, self.weighting = fmt, chunk_size, weighting
        self._chunk_field = chunk_size
        self._flags = FLAG_FP4 if fmt == "fp4" else 0
        self._digest = self._digest_bytes(f"quant;fmt={fmt}")
        # (global start, rows, width, first scale) per tensor's full chunks and its tail chunk
        self._runs: list[tuple[int, int, int, int]] = []
        m = 0
        for spec, off in zip(manifest, manifest.offsets):
            full, tail = divmod(spec.numel, chunk_size)
            if full:
                self._runs.append((off, full, chunk_size, m))
                m += full
            if tail:
                self._runs.append((off + full * chunk_size, 1, tail, m))
                m += 1
        self._n_scales = m
        self._code_nbytes = self._numel if fmt == "int8" else (self._numel + 1) // 2
        self._body_len = 4 * m + self._code_nbytes

    def __repr__(self) -> str:
        return (f"QuantCodec({self.manifest!r}, fmt={self.fmt!r}, chunk_size={self.chunk_size}, "
                f"weighting={self.weighting!r}, hmac={self.key is not None})")  # fmt: skip

    def _flag_text(self, flags: int) -> str:
        return f"fmt={'fp4' if flags & FLAG_FP4 else 'int8'}, hmac={bool(flags & FLAG_HMAC)}" + (
            f", reserved bits 0x{flags & ~0x06:02x}" if flags & ~0x06 else "")  # fmt: skip

    def bits_per_parameter(self) -> float:
        return 8 * self.payload_nbytes() / max(1, self._numel)

    def encode(self, tensors: Mapping[str, torch.Tensor], tokens: int) -> bytes:
        """Quantise ``tensors``; refuses NaN/Inf (naming the tensor), a bad token count or a manifest mismatch."""
        tokens = _check_tokens_arg(tokens)
        xs, _ = self._inputs(tensors)
        x = torch.empty(self._numel, dtype=_F32)
        for spec, off, t in zip(self.manifest, self.manifest.offsets, xs):
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"tensor {spec.name!r} contains NaN or Inf; refusing to encode it")
            x[off : off + spec.numel].copy_(t)
        scales = torch.empty(self._n_scales, dtype=_F32)
        q = torch.empty(self._numel, dtype=torch.int8 if self.fmt == "int8" else torch.uint8)
        qmax = _QMAX[self.fmt]
        for start, rows, width, m0 in self._runs:
            v = x[start : start + rows * width].view(rows, width)
            s = v.abs().amax(dim=1) / qmax
            scales[m0 : m0 + rows] = s
            y = v / torch.where(s > 0, s, 1.0).unsqueeze(1)
            if self.fmt == "int8":
                q[start : start + rows * width] = y.round().clamp_(-127, 127).to(torch.int8).reshape(-1)
            else:
                code = torch.bucketize(y.abs(), _FP4_EDGES).to(torch.uint8) | ((y < 0).to(torch.uint8) << 3)
                q[start : start + rows * width] = code.reshape(-1)
        if self.fmt == "int8":
            codes = q.view(torch.uint8).numpy()
        else:
            nib = q.numpy()
            if nib.size % 2:
                nib = np.append(nib, np.uint8(0))
            codes = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
        return self._assemble(tokens, [scales.numpy(), codes])

    def _values(self, body: memoryview) -> torch.Tensor:
        scales = _frombuffer(body[: 4 * self._n_scales], _F32, self._n_scales)
        if scales.numel() and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            bad = int((~(torch.isfinite(scales) & (scales >= 0))).nonzero()[0])
            raise PayloadError(f"bad scale {float(scales[bad])!r} of chunk {bad} (must be finite and >= 0)")
        raw = np.frombuffer(body[4 * self._n_scales :], dtype=np.uint8)
        if self.fmt == "int8":
            codes = raw.view(np.int8)
            if (codes == -128).any():
                raise PayloadError(f"int8 code -128 at element {int(np.flatnonzero(codes == -128)[0])} "
                                   f"(codes are in [-127, 127])")  # fmt: skip
            vals = torch.from_numpy(codes.astype(np.float32))
        else:
            nib = np.empty(2 * raw.size, dtype=np.uint8)
            nib[0::2], nib[1::2] = raw & 0x0F, raw >> 4
            if nib.size > self._numel and nib[self._numel :].any():
                raise PayloadError("non-zero padding nibble after the last fp4 code")
            nib = torch.from_numpy(nib[: self._numel].astype(np.int64))
            vals = _FP4_GRID[nib & 7] * torch.where(nib >= 8, -1.0, 1.0)
        for start, rows, width, m0 in self._runs:
            vals[start : start + rows * width].view(rows, width).mul_(scales[m0 : m0 + rows].unsqueeze(1))
        if vals.numel() and not bool(torch.isfinite(vals).all()):
            raise PayloadError("scales too large: a decoded value overflows float32")
        return vals

    def decode(self, payload: bytes, *, device: torch.device | str = "cpu") -> DecodedPayload:
        tokens, body = self._parse(payload)
        return DecodedPayload(tokens, self._split(self._values(body).to(torch.device(device))))

    def combine_with_tokens(
        self,
        payloads: Iterable[bytes],
        *,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Average of the dequantised payloads (equal or token weights); returns (update, Σ tokens)."""
        device = torch.device(device)
        acc = self._accumulator(out, device)

        def add(body: memoryview, w: float) -> None:
            acc.add_(self._values(body).to(device), alpha=w)
            if acc.numel() and not bool(torch.isfinite(acc).all()):
                raise PayloadError("scales too large: the combined update overflows float32")

        return weighted_combine(self, payloads, acc, self.weighting, add)
