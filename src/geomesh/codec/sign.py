"""The scaled-sign codec: 1 bit per element plus one float32 magnitude per chunk, and the token count.

Δ_i is sent as s_i ⊙ sign(Δ_i); ``combine`` forms Δ = Σ_i (n_i / Σ_j n_j) · s_i ⊙ sign(Δ_i) by
default. This module holds the chunk layout, the scales, error feedback and the combine rules; the
bit-level loops are in :mod:`geomesh.codec.kernels`, the header in :mod:`geomesh.codec.wire`.

sign(0)
-------
A zero element carries no direction but one bit must still be sent. Zeros are sent by the parity
of their global index: +1 at odd k, −1 at even k. Decoding is unchanged, so across any run of
zeros the decoded values alternate ±s and their expected (and, in pairs, exact) contribution is 0;
with error feedback the residual keeps the ±s error and sends it back later. (-0.0 is a zero;
negative values of magnitude below 2**-126, far under any magnitude, are treated as zeros too,
which lets the sign test be one vectorised comparison against a periodic threshold.)

Scale (default ``"l2"``)
------------------------
``"l1"``: s = ‖x‖₁/d per chunk, the least-squares optimum min_s ‖x − s·sign(x)‖², which shrinks
the norm (×0.80 for Gaussian x). ``"l2"``: s = ‖x‖₂/√d per chunk, which preserves each chunk's
norm exactly (the decoded chunk has norm s·√d = ‖x‖₂); 1-bit Adam uses it.
Measured on a toy of the real loop: teacher-student MLP classification, 4 workers with batch
8/16/32/64 doing H=20 AdamW steps (lr 1e-3) per round, 30 rounds, token-weighted combine, outer
Nesterov SGD (momentum 0.9) at outer lr 0.4/0.7/1.0, chunk 4096; eval loss, mean of 3 seeds
(seed spread about ±0.02)::

    model           outer lr  dense fp32   l1     l1+EF   l2     l2+EF
    32-128-128-10   0.4       0.755        0.834  0.942   0.797  0.825
                    0.7       0.714        0.788  0.902   0.773  0.780
                    1.0       0.717        0.782  0.938   0.785  0.785
    32-512-512-10   0.4       0.646        0.639  0.721   0.653  0.663
                    0.7       0.748        0.702  0.771   0.765  0.756
                    1.0       0.810        0.805  0.870   0.878  0.815

At each scale's best outer lr the two are within noise (0.773 l2 vs 0.782 l1; 0.639 l1 vs 0.653
l2). The deciding difference: l2's best outer lr is dense fp32's best outer lr in both models (0.7
and 0.4), while l1's is not in the small model (1.0 vs 0.7), because l1 silently rescales the step
by ‖x‖₁/(√d‖x‖₂) (0.8 for Gaussian x, less for heavy tails). With l2 the outer lr tuned for fp32 DiLoCo carries over
and GeoMesh-vs-DiLoCo runs at the same outer lr are a fair comparison, so l2 is the default. Error
feedback never clearly helped and cost 0.07-0.15 with l1 (its residual compounds with outer
momentum), so it is opt-in.

Chunk size (default 4096)
-------------------------
Each magnitude costs 32 bits, so the wire ratio is about 32 / (1 + 32/chunk): 31.75 at 4096,
31.5 at 2048, 31.0 at 1024 (then below 31 with the header and per-tensor partial chunks). In the
same toy at outer lr 0.7 the chunk size hardly mattered: l2 256 / 4096 / per tensor = 0.773 /
0.773 / 0.774 (small MLP); l2 1024 / 4096 / 65536 / per tensor = 0.772 / 0.778 / 0.780 / 0.778
and l1 0.712 / 0.716 / 0.715 / 0.716 (wide MLP, 2 seeds). So 4096 is the smallest power of two
that keeps the wire ratio >= 31 with margin (31.75 at 10M parameters). ``chunk_size=None`` sends
one magnitude per tensor.

Combine rules
-------------
``"weighted"`` (default): Δ = Σ_i (n_i/N) s_i ⊙ sign_i, N = Σ n_i; accumulated in float32 with
relative weights n_i/n_1 (n_1: the first payload's count, since N is only known at the end of the
stream) and rescaled by n_1/N once at the end. ``"majority"``: token-weighted signSGD vote
Δ = sign(Σ_i n_i·sign_i) ⊙ m with m = Σ_i (n_i/N)·s_i per chunk (the token-weighted mean
magnitude); a tied vote gives 0. The vote is accumulated in float32, exact while N < 2**24.
``combine`` streams: it validates and accumulates one payload at a time (memory O(d)), and accepts
any iterable, e.g. a generator reading payloads off the network.

Error feedback
--------------
With ``error_feedback=True`` the codec keeps a float32 residual e per tensor on the input's device:
p = x + e; send C(p); e <- p − C(p). So Σ decoded + e_final == Σ inputs (telescoping).
``codec.residual`` exposes it (views into one flat buffer); ``state_dict()``/``load_state_dict()``
let a checkpoint save it. A failed ``encode`` (e.g. NaN input) leaves the residual unchanged.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import PayloadError
from .base import DecodedPayload, _Codec
from .kernels import (
    _combine_accumulator_cpu,
    _combine_accumulator_torch,
    _finish_combine_cpu,
    _row_norms_np,
    _signs_packed_cpu,
    _signs_packed_torch,
    _to_numpy_bytes,
    _unpack01,
)
from .manifest import Manifest
from .wire import (
    FLAG_ERROR_FEEDBACK,
    FLAG_HMAC,
    FLAG_SCALE_L1,
    FORMAT_VERSION,
    KIND_SIGN,
    _check_tokens_arg,
    _frombuffer,
)

_F32 = torch.float32

# combine unpacks sign bits block by block: a cache-resident scratch on CPU, few launches on GPUs
_BLOCK_CPU = 1 << 18
_BLOCK_ACCEL = 1 << 24
_NORM_PIECE = 1 << 18  # encode: elements per chunk-norm task on CPU
_NP_NORM_MAX_WIDTH = 1 << 16  # wider chunks get torch's cascade-summed norm (more accurate)

# A run is a maximal stretch of equal-width chunks that are contiguous in memory:
# (element start, rows, width, first magnitude index).
_Run = tuple[int, int, int, int]


def _merge_runs(runs: list[_Run]) -> list[_Run]:
    merged: list[_Run] = []
    for start, rows, width, m0 in runs:
        if merged:
            ps, pr, pw, pm = merged[-1]
            if pw == width and ps + pr * pw == start and pm + pr == m0:
                merged[-1] = (ps, pr + rows, pw, pm)
                continue
        merged.append((start, rows, width, m0))
    return merged


class SignCodec(_Codec):
    """Scaled-sign codec: 1 bit per element + one float32 magnitude per chunk + token count.

    Args:
        manifest: the tensors every worker sends (see :class:`Manifest`).
        chunk_size: elements per magnitude (default 4096); ``None`` = one magnitude per tensor.
        scale: ``"l2"`` (s = ‖x‖₂/√d, preserves the norm; default) or ``"l1"`` (s = ‖x‖₁/d,
            least-squares optimum).
        error_feedback: keep a residual e and send C(x + e) (EF-SignSGD).
        combine_rule: ``"weighted"`` (token-weighted average of s·sign) or ``"majority"``
            (token-weighted sign vote times the token-weighted mean magnitude).
        key: optional HMAC-SHA256 key; payloads then carry a 32-byte tag that decode checks.
    """

    _kind = KIND_SIGN
    #: CPU encode uses numpy for the sign test and bit packing (faster there than torch's bool
    #: kernels); tests turn this off to run the device-generic torch path on CPU.
    _numpy_on_cpu = True

    def __init__(
        self,
        manifest: Manifest,
        *,
        chunk_size: int | None = 4096,
        scale: str = "l2",
        error_feedback: bool = False,
        combine_rule: str = "weighted",
        key: bytes | None = None,
    ):
        super().__init__(manifest, key)
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size < 2**32
        ):
            raise ValueError(f"chunk_size must be an int in [1, 2**32) or None, got {chunk_size!r}")
        if scale not in ("l1", "l2"):
            raise ValueError(f"scale must be 'l1' or 'l2', got {scale!r}")
        if combine_rule not in ("weighted", "majority"):
            raise ValueError(f"combine_rule must be 'weighted' or 'majority', got {combine_rule!r}")
        self.chunk_size = chunk_size
        self.scale = scale
        self.error_feedback = bool(error_feedback)
        self.combine_rule = combine_rule
        self._chunk_field = chunk_size or 0
        self._flags = (FLAG_ERROR_FEEDBACK if self.error_feedback else 0) | (FLAG_SCALE_L1 if scale == "l1" else 0)
        self._digest = self._digest_bytes("sign")

        # Chunk layout: per tensor, full chunks then one partial tail chunk.
        tensor_runs: list[list[_Run]] = []  # local element offsets
        global_runs: list[_Run] = []
        mag_starts: list[int] = []
        widths: list[int] = []
        m = 0
        for spec, off in zip(manifest, manifest.offsets):
            n = spec.numel
            mag_starts.append(m)
            runs: list[_Run] = []
            if n:
                c = chunk_size if chunk_size is not None else n
                full, tail = divmod(n, c)
                if full:
                    runs.append((0, full, c, m))
                    widths += [c] * full
                    m += full
                if tail:
                    runs.append((full * c, 1, tail, m))
                    widths.append(tail)
                    m += 1
            tensor_runs.append(runs)
            global_runs += [(off + s, r, w, m0) for s, r, w, m0 in runs]
        self._tensor_runs = tensor_runs
        self._runs = _merge_runs(global_runs)
        self._mag_starts = mag_starts
        self._n_mags = m
        self._n_sign_bytes = (self._numel + 7) // 8
        self._body_len = 4 * m + self._n_sign_bytes
        inv = [1.0 / w if scale == "l1" else 1.0 / math.sqrt(w) for w in widths]
        self._inv_len_cpu = torch.tensor(inv, dtype=torch.float64).to(_F32)
        self._ord = 1 if scale == "l1" else 2
        self._cache: dict[tuple[str, torch.device], Any] = {}
        self._residual_flat: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"SignCodec({self.manifest!r}, chunk_size={self.chunk_size}, scale={self.scale!r}, "
            f"error_feedback={self.error_feedback}, combine_rule={self.combine_rule!r}, "
            f"hmac={self.key is not None})"
        )

    def _flag_text(self, flags: int) -> str:
        return (
            f"error_feedback={bool(flags & FLAG_ERROR_FEEDBACK)}, "
            f"scale={'l1' if flags & FLAG_SCALE_L1 else 'l2'}, hmac={bool(flags & FLAG_HMAC)}"
            + (f", reserved bits 0x{flags & ~0x07:02x}" if flags & ~0x07 else "")
        )

    @property
    def num_chunks(self) -> int:
        """Number of magnitudes M per payload."""
        return self._n_mags

    def _inv_len(self, device: torch.device) -> torch.Tensor:
        key = ("inv_len", device)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = self._inv_len_cpu.to(device)
        return t

    def _bits_buffer(self, device: torch.device) -> torch.Tensor:
        """Scratch bool buffer of 8·ceil(d/8) elements (zero tail) for the device-generic path."""
        key = ("bits", device)
        buf = self._cache.get(key)
        if buf is None:
            buf = self._cache[key] = torch.zeros(self._n_sign_bytes * 8, dtype=torch.bool, device=device)
        return buf

    # ---- error-feedback state -----------------------------------------------------------
    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """Error-feedback residual per tensor (float32 views into one buffer; empty if none yet)."""
        if self._residual_flat is None:
            return {}
        return self._split(self._residual_flat)

    def reset_residual(self) -> None:
        """Forget the error-feedback residual."""
        self._residual_flat = None

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: the error-feedback residual (cloned)."""
        return {
            "format": FORMAT_VERSION,
            "residual": {k: v.clone() for k, v in self.residual.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (names and shapes must match the manifest)."""
        residual = state.get("residual", {}) if isinstance(state, Mapping) else None
        if not isinstance(residual, Mapping):
            raise TypeError("state must be a mapping with a 'residual' mapping")
        if not residual:
            self._residual_flat = None
            return
        if not self.error_feedback:
            raise ValueError("state has a residual but this codec has error_feedback=False")
        flat, device = self._inputs(residual)
        buf = torch.empty(self._numel, dtype=_F32, device=device)
        for spec, off, x in zip(self.manifest, self.manifest.offsets, flat):
            buf[off : off + spec.numel].copy_(x)
        if not bool(torch.isfinite(buf).all()):
            raise ValueError("residual in state contains NaN or Inf")
        self._residual_flat = buf

    # ---- encode -------------------------------------------------------------------------
    def encode(self, tensors: Mapping[str, torch.Tensor], tokens: int) -> bytes:
        """Compress ``tensors`` (names/shapes of the manifest; fp32, bf16 or fp16; one device).

        Raises ValueError (naming the tensor) for NaN/Inf input, a bad token count, or tensors
        that do not match the manifest.
        """
        tokens = _check_tokens_arg(tokens)
        xs, device = self._inputs(tensors)
        d = self._numel
        offsets = self.manifest.offsets

        if self.error_feedback:
            e = self._residual_flat
            if e is None:
                e = torch.zeros(d, dtype=_F32, device=device)
            elif e.device != device:
                e = e.to(device)
            p = torch.empty(d, dtype=_F32, device=device)
            for spec, off, x in zip(self.manifest, offsets, xs):
                torch.add(x, e[off : off + spec.numel], out=p[off : off + spec.numel])
            sources = [(p, self._runs)]
            data = [p[off : off + spec.numel] for spec, off in zip(self.manifest, offsets)]
            sign_sources = [(p, 0)]
        else:
            data = [x if x.dtype == _F32 else x.to(_F32) for x in xs]
            sources = list(zip(data, self._tensor_runs))
            sign_sources = list(zip(data, offsets))

        if device.type == "cpu" and self._numpy_on_cpu:
            # One pool round: chunk norms (numpy, for chunks up to _NP_NORM_MAX_WIDTH wide) and
            # sign bits with the zero rule, packed 8 per byte.
            mags_np = np.empty(self._n_mags, dtype=np.float32)
            mags = torch.from_numpy(mags_np)
            arrays = [src.numpy() for src, _ in sources]
            tasks, wide = [], []
            for i, (src, runs) in enumerate(sources):
                for start, rows, width, m0 in runs:
                    if width > _NP_NORM_MAX_WIDTH:
                        wide.append((src, start, rows, width, m0))
                        continue
                    per = max(1, _NORM_PIECE // width)
                    for r0 in range(0, rows, per):
                        nr = min(per, rows - r0)
                        a0 = start + r0 * width
                        v = arrays[i][a0 : a0 + nr * width].reshape(nr, width)
                        out = mags_np[m0 + r0 : m0 + r0 + nr]
                        tasks.append(lambda v=v, out=out: _row_norms_np(v, self._ord, out))
            packed = _signs_packed_cpu(sign_sources, d, tasks)
            packed_t = torch.from_numpy(packed)
        else:
            wide = [(src, start, rows, width, m0) for src, runs in sources for start, rows, width, m0 in runs]
            mags = torch.empty(self._n_mags, dtype=_F32, device=device)
            packed_t = _signs_packed_torch(sign_sources, d, self._bits_buffer(device))
            packed = _to_numpy_bytes(packed_t)
        # torch norms (cascade summation) for the remaining runs, e.g. whole large tensors
        for src, start, rows, width, m0 in wide:
            torch.linalg.vector_norm(
                src[start : start + rows * width].view(rows, width), self._ord, dim=1, out=mags[m0 : m0 + rows]
            )
        mags.mul_(self._inv_len(device))
        if self._n_mags and not bool(torch.isfinite(mags).all()):
            self._repair_magnitudes(mags, xs, data)

        if self.error_feedback:
            # e <- p - C(p), in place in p (with the signs exactly as sent); committed only now
            # that nothing can fail any more.
            bits = _unpack01(
                packed_t, torch.empty(self._n_sign_bytes * 8, dtype=_F32, device=device), self._numpy_on_cpu
            )
            pm1 = bits.mul_(2).sub_(1)
            for start, rows, width, m0 in self._runs:
                sl = slice(start, start + rows * width)
                p[sl].view(rows, width).addcmul_(pm1[sl].view(rows, width), mags[m0 : m0 + rows].unsqueeze(1), value=-1)
            self._residual_flat = p

        return self._assemble(tokens, [_to_numpy_bytes(mags), packed])

    def _tensor_of_chunk(self, j: int) -> int:
        """Index of the tensor that owns magnitude j (empty tensors own none)."""
        return bisect.bisect_right(self._mag_starts, j) - 1

    def _repair_magnitudes(self, mags: torch.Tensor, xs: list[torch.Tensor], data: list[torch.Tensor]) -> None:
        """Non-finite magnitudes: NaN/Inf input (refused), or norm overflow (recomputed scaled)."""
        bad = (~torch.isfinite(mags)).nonzero().flatten().tolist()
        inv = self._inv_len(mags.device)
        for i in sorted({self._tensor_of_chunk(j) for j in bad}):
            spec = self.manifest.specs[i]
            if not bool(torch.isfinite(xs[i]).all()):
                raise ValueError(f"tensor {spec.name!r} contains NaN or Inf; refusing to encode it")
            for start, rows, width, m0 in self._tensor_runs[i]:
                v = data[i][start : start + rows * width].view(rows, width)
                amax = v.abs().amax(dim=1, keepdim=True)
                amax = torch.where(amax > 0, amax, torch.ones_like(amax))
                s = torch.linalg.vector_norm(v / amax, self._ord, dim=1) * inv[m0 : m0 + rows]
                mags[m0 : m0 + rows] = s * amax.squeeze(1)  # scale last: s·amax <= amax is finite
                if not bool(torch.isfinite(mags[m0 : m0 + rows]).all()):
                    raise ValueError(
                        f"tensor {spec.name!r}: values overflow float32 (input plus error-feedback residual)"
                    )

    # ---- decode / combine ---------------------------------------------------------------
    def _body(self, body: memoryview) -> tuple[torch.Tensor, torch.Tensor]:
        m = self._n_mags
        mags = _frombuffer(body[: 4 * m], _F32, m)
        packed = _frombuffer(body[4 * m :], torch.uint8, self._n_sign_bytes)
        if m:
            ok = torch.isfinite(mags) & (mags >= 0)
            if not bool(ok.all()):
                j = int((~ok).nonzero()[0])
                i = self._tensor_of_chunk(j)
                raise PayloadError(
                    f"bad magnitude {float(mags[j])!r} (chunk {j}, tensor "
                    f"{self.manifest.specs[i].name!r}): magnitudes must be finite and >= 0"
                )
        rem = self._numel % 8
        if rem and int(packed[-1]) >> rem:
            raise PayloadError("nonzero padding bits in the last sign byte")
        return mags, packed

    def _new_bits_f32(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self._n_sign_bytes * 8, dtype=_F32, device=device)

    def decode(self, payload: bytes, *, device: torch.device | str = "cpu") -> DecodedPayload:
        """Check ``payload`` and return its token count and float32 tensors s ⊙ sign on ``device``."""
        tokens, body = self._parse(payload)
        mags, packed = self._body(body)
        device = torch.device(device)
        mags = mags.to(device)
        out = _unpack01(packed.to(device), self._new_bits_f32(device), self._numpy_on_cpu)
        for start, rows, width, m0 in self._runs:
            out[start : start + rows * width].view(rows, width).mul_(2).sub_(1).mul_(mags[m0 : m0 + rows].unsqueeze(1))
        return DecodedPayload(tokens, self._split(out[: self._numel]))

    def _blocks(self, block: int) -> list[tuple[int, int, list[_Run]]]:
        """Cut the runs into pieces grouped in blocks of <= ``block`` elements (cached).

        Returns (first sign byte, sign bytes, pieces) per block; every piece lies inside its
        block, so a block's bits are unpacked once into a small cache-resident scratch.
        """
        key = ("blocks", block)
        blocks = self._cache.get(key)
        if blocks is not None:
            return blocks
        pieces: list[_Run] = []
        for start, rows, width, m0 in self._runs:
            if width > block:  # very wide chunks: split each row into column pieces
                for r in range(rows):
                    row0 = start + r * width
                    for c0 in range(0, width, block):
                        pieces.append((row0 + c0, 1, min(block, width - c0), m0 + r))
            else:
                per = max(1, block // width)
                for r0 in range(0, rows, per):
                    nr = min(per, rows - r0)
                    pieces.append((start + r0 * width, nr, width, m0 + r0))
        blocks = []
        cur: list[_Run] = []
        a = 0
        for piece in pieces:
            start, rows, width, _ = piece
            if cur and start + rows * width - a > block:
                blocks.append(self._close_block(a, cur))
                cur = []
            if not cur:
                a = start
            cur.append(piece)
        if cur:
            blocks.append(self._close_block(a, cur))
        self._cache[key] = blocks
        return blocks

    @staticmethod
    def _close_block(a: int, pieces: list[_Run]) -> tuple[int, int, list[_Run]]:
        last = pieces[-1]
        end = last[0] + last[1] * last[2]
        b0 = a // 8
        return (b0, (end + 7) // 8 - b0, pieces)

    def combine_with_tokens(
        self,
        payloads: Iterable[bytes],
        *,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Combine payloads (see ``combine_rule``); returns (update, Σ tokens).

        Streams: each payload is checked, then its bits are unpacked block by block into a small
        scratch and accumulated, so memory is the float32 accumulator plus an O(block) scratch,
        whatever the number of payloads. ``out``: an optional float32 buffer of
        ``manifest.numel`` elements on ``device`` to accumulate into (overwritten; the returned
        tensors are views of it), which saves allocating and first-touching a fresh one.
        """
        device = torch.device(device)
        acc = self._accumulator(out, device)
        majority = self.combine_rule == "majority"
        cpu = device.type == "cpu" and self._numpy_on_cpu
        blocks = self._blocks(_BLOCK_CPU if cpu else _BLOCK_ACCEL)
        # weighted: acc accumulates Σ_i b_i·2w_i·s_i with b the 0/1 bits, and corr Σ_i w_i·s_i per
        # chunk, so that at the end Σ_i w_i·s_i·(2b_i − 1) = acc − corr.
        # majority: acc accumulates the vote Σ_i n_i·b_i (exact for integer sums < 2**24), and
        # corr the magnitudes Σ_i w_i·s_i; sign(Σ n_i (2b_i − 1)) = sign(acc − N/2).
        corr = torch.zeros(self._n_mags, dtype=_F32, device=device)
        if cpu:
            accumulate = _combine_accumulator_cpu(acc, blocks, majority)
        else:
            accumulate = _combine_accumulator_torch(acc, blocks, majority)
        total, count, first = 0, 0, 0
        for payload in payloads:
            tokens, body = self._parse(payload)
            mags, packed = self._body(body)
            if count == 0:
                first = tokens
            total += tokens
            w = tokens / first
            mags = mags.to(device)
            corr.add_(mags, alpha=w)
            # every partial sum of acc is bounded by 2·corr: one check on M numbers rules out overflow
            if self._n_mags and not bool(torch.isfinite(corr * 2).all()):
                raise PayloadError("magnitudes too large: the combined update would overflow float32")
            weight = float(tokens) if majority else mags * (2 * w)
            accumulate(packed, weight, count == 0)
            count += 1
        if count == 0:
            raise ValueError("combine needs at least one payload")
        scale = first / total
        corr.mul_(scale)
        if cpu:
            _finish_combine_cpu(acc, blocks, corr, scale, majority, total)
        else:
            if majority:
                acc.sub_(total / 2).sign_()
            for start, rows, width, m0 in self._runs:
                v = acc[start : start + rows * width].view(rows, width)
                c = corr[m0 : m0 + rows].unsqueeze(1)
                if majority:
                    v.mul_(c)
                else:
                    torch.add(-c, v, alpha=scale, out=v)  # (acc − corr)·n_1/N in one pass
        return self._split(acc), total
