"""Payload codecs: scaled-sign compression of pseudo-gradients, and the fp32 baseline.

Every worker forms a pseudo-gradient Δ_i (name -> tensor, θ_global − θ_local) and sends one
*payload*; every worker then combines all payloads into the same update

    Δ = Σ_i (n_i / Σ_j n_j) · s_i ⊙ sign(Δ_i)

where n_i is worker i's token count and s_i its magnitudes (one float per chunk). This module is
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
Both: ``encode(tensors, tokens) -> bytes``, ``decode(payload, device="cpu") -> DecodedPayload``,
``combine(payloads, device="cpu", out=None) -> dict``, ``combine_with_tokens(...) -> (dict, Σ n_i)``,
``tokens_of(payload)``, ``total_tokens(payloads)``, ``payload_nbytes()``, ``fp32_nbytes()``.
Any malformed payload raises ``PayloadError`` (a ``ValueError``) whose message names the problem.

Wire format (all integers little-endian)
----------------------------------------
====== ====== =============== ==========================================================
offset bytes  field           meaning
====== ====== =============== ==========================================================
0      4      magic           ``b"GMSH"``
4      2      version (u16)   wire-format version, currently 1; others are refused
6      1      kind (u8)       1 = sign codec, 2 = dense codec
7      1      flags (u8)      bit 0: error feedback was on (sign); bit 1: scale is l1
                              (else l2) (sign); bit 2: an HMAC tag follows the body;
                              bits 3-4: dense wire dtype (0 = float32, 1 = bfloat16,
                              2 = float16); bits 5-7: reserved, zero. A payload's flags
                              must equal the receiving codec's (all workers run one config).
8      4      chunk (u32)     elements per magnitude; 0 = one magnitude per tensor (dense: 0)
12     16     layout digest   first 16 bytes of sha256 over the kind, chunk, dense dtype and
                              the manifest (ordered names, shapes, dtypes)
28     8      tokens (u64)    the worker's token count n_i, 1 <= n_i <= 2**53
36     8      body length     bytes of body; must equal what the manifest implies
44     4      crc32 (u32)     zlib.crc32 over bytes [0, 44) followed by the body
48     B      body            sign: M float32 magnitudes, then ceil(d/8) sign bytes;
                              dense: d values of the wire dtype
48+B   32     HMAC tag        only with flag bit 2: HMAC-SHA256(key, bytes [0, 48+B))
====== ====== =============== ==========================================================

``d`` is the total element count of the manifest, ``M`` the number of chunks. Tensors are
concatenated in manifest order, each flattened in row-major (C) order; element k of this
concatenation (the *global index*) is bit ``k % 8`` of sign byte ``k // 8`` (little-endian bit
order within a byte, ``numpy.packbits(..., bitorder="little")``). Bit 1 means +1, bit 0 means −1.
The unused high bits of the last sign byte must be zero. Chunks never cross tensors: each tensor is
cut into chunks of ``chunk`` elements from its own start, the last one may be shorter; magnitude j
belongs to the j-th chunk in this order. An empty tensor has no chunks and no bits; a 0-d tensor
has one element. ``payload_nbytes() = 48 + 4·M + ceil(d/8) (+ 32 with a key)``.

Decoding untrusted bytes checks, in this order, size >= header, magic, version, kind, flags,
chunk, layout digest, body length, total size (refusing truncated and oversized payloads before
touching the body, so nothing larger than the manifest justifies is ever allocated), the HMAC tag
when the codec has a key, the crc32, the token count, then the body itself (finite, non-negative
magnitudes; zero padding bits; finite dense values).

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

Devices and speed
-----------------
``encode`` works on the tensors' own device (CUDA included); ``decode``/``combine`` put results on
``device`` (default cpu). Everything is vectorised; Python loops run over tensors, runs of
equal-width chunks or cache-sized blocks, never over elements. On CPU the hot loops are numpy
kernels on cache-sized blocks (the sign test + ``packbits``, chunk norms, and in ``combine``
``unpackbits`` + multiply-add into the accumulator) handed out dynamically to a small pool of
``torch.get_num_threads()`` threads: numpy's comparison and bit-packing kernels beat torch's bool
ones ~2x, and the pool keeps going when the cores are shared, where many short OpenMP regions
stall (measured 4-8x slower on the 2-core dev VM under load). On other devices the same steps are
torch ops (a 256-row table gather unpacks the bits). ``combine`` accumulates Σ_i b_i·2w_i·s_i from
the 0/1 bits and subtracts Σ_i w_i·s_i per chunk once at the end, never materialising d floats
per payload. It returns views into one contiguous float32 buffer; pass ``out=`` (a float32 buffer
of d elements) to reuse one across rounds and skip first-touch page faults of a fresh result.
Codecs are not thread-safe (they cache scratch buffers).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import hmac
import itertools
import json
import math
import os
import struct
import sys
import threading
import warnings
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .errors import PayloadError

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
    "SignCodec",
    "TensorSpec",
]

MAGIC = b"GMSH"
FORMAT_VERSION = 1
KIND_SIGN = 1
KIND_DENSE = 2
_KIND_NAMES = {KIND_SIGN: "sign", KIND_DENSE: "dense"}

# magic, version, kind, flags, chunk, layout digest, tokens, body length, crc32
_HEADER = struct.Struct("<4sHBBI16sQQI")
HEADER_NBYTES = _HEADER.size  # 48
_CRC_OFFSET = HEADER_NBYTES - 4
TAG_NBYTES = 32  # HMAC-SHA256
MAX_TOKENS = 2**53  # token counts stay exact as float64

FLAG_ERROR_FEEDBACK = 0x01
FLAG_SCALE_L1 = 0x02
FLAG_HMAC = 0x04
_DENSE_DTYPE_SHIFT = 3
_DENSE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F32 = torch.float32

# Sign test: bit = x > thr[k % 2] with thr = (0, -2**-126): zeros get the parity of their index.
_ROW = 4096  # row width over which the periodic threshold is broadcast (even)
# combine unpacks sign bits block by block: a cache-resident scratch on CPU, few launches on GPUs
_BLOCK_CPU = 1 << 18
_BLOCK_ACCEL = 1 << 24
_SIGN_BLOCK = 1 << 20  # encode: elements per sign-test block on CPU (bool scratch fits in L2)
_NORM_PIECE = 1 << 18  # encode: elements per chunk-norm task on CPU
_NP_NORM_MAX_WIDTH = 1 << 16  # wider chunks get torch's cascade-summed norm (more accurate)
_ZERO_THRESHOLD = -(2.0**-126)
_THR_NP = np.tile(np.array([0.0, _ZERO_THRESHOLD], dtype=np.float32), _ROW // 2 + 1)

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("geomesh.codec needs a little-endian host (the wire format is little-endian)")


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a manifest: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class Manifest:
    """The ordered list of tensors (name, shape, dtype) that all workers agree on.

    Build it with :meth:`from_tensors` (order = the mapping's iteration order) or
    :meth:`from_shapes`. Its :meth:`digest` enters every payload header, so a payload made for
    another model is refused.
    """

    def __init__(self, specs: Iterable[TensorSpec]):
        specs = tuple(specs)
        seen: set[str] = set()
        for spec in specs:
            if not isinstance(spec, TensorSpec):
                raise TypeError(f"Manifest entries must be TensorSpec, got {type(spec).__name__}")
            if not isinstance(spec.name, str):
                raise TypeError(f"tensor names must be str, got {spec.name!r}")
            if spec.name in seen:
                raise ValueError(f"duplicate tensor name {spec.name!r} in manifest")
            seen.add(spec.name)
            if any((not isinstance(s, int)) or s < 0 for s in spec.shape):
                raise ValueError(f"tensor {spec.name!r}: bad shape {spec.shape!r}")
            if spec.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"tensor {spec.name!r}: dtype {spec.dtype} is not supported (allowed: float32, bfloat16, float16)"
                )
        self._specs = specs
        offsets, total = [], 0
        for spec in specs:
            offsets.append(total)
            total += spec.numel
        self._offsets = tuple(offsets)
        self._numel = total
        self._canonical = json.dumps(
            [[s.name, list(s.shape), _dtype_name(s.dtype)] for s in specs],
            separators=(",", ":"),
            ensure_ascii=True,
        ).encode()

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """Manifest of a name -> tensor mapping (or (name, tensor) pairs), in iteration order."""
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        specs = []
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
            specs.append(TensorSpec(name, tuple(int(s) for s in t.shape), t.dtype))
        return cls(specs)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Iterable[int]], dtype: torch.dtype = torch.float32) -> Manifest:
        """Manifest of a name -> shape mapping, all of one dtype."""
        return cls(TensorSpec(n, tuple(int(s) for s in shape), dtype) for n, shape in shapes.items())

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return self._specs

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._specs)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Global element offset of each tensor in the concatenation."""
        return self._offsets

    @property
    def numel(self) -> int:
        """Total number of elements d."""
        return self._numel

    def canonical(self) -> bytes:
        """Canonical byte form (JSON of [name, shape, dtype] triples) used for the digest."""
        return self._canonical

    def digest(self) -> str:
        """sha256 hex digest of :meth:`canonical`."""
        return hashlib.sha256(self._canonical).hexdigest()

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self):
        return iter(self._specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Manifest) and self._canonical == other._canonical

    def __hash__(self) -> int:
        return hash(self._canonical)

    def __repr__(self) -> str:
        return f"Manifest({len(self)} tensors, {self._numel} elements)"


@dataclasses.dataclass
class DecodedPayload:
    """One decoded payload: the worker's token count and its float32 tensors (s ⊙ sign)."""

    tokens: int
    tensors: dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _check_tokens_arg(tokens: Any) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)):
        raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
    tokens = int(tokens)
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be in [1, 2**53], got {tokens}")
    return tokens


def _frombuffer(buf: memoryview, dtype: torch.dtype, count: int) -> torch.Tensor:
    """Zero-copy read-only CPU tensor over ``buf`` (never written to)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": we only read it
        return torch.frombuffer(buf, dtype=dtype, count=count)


def _as_bytes_view(payload: Any) -> memoryview:
    if isinstance(payload, str) or not isinstance(payload, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes-like, got {type(payload).__name__}")
    mv = memoryview(payload)
    if not mv.c_contiguous:
        raise PayloadError("payload buffer is not contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _to_numpy_bytes(t: torch.Tensor) -> np.ndarray:
    """Raw bytes of a contiguous tensor as a uint8 numpy array (copied to host if needed)."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.view(torch.uint8).numpy() if t.numel() else np.empty(0, dtype=np.uint8)


def _pack_bits_torch(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor whose length is a multiple of 8 (little-endian bit order) to uint8.

    Works on any device: 8 bools are one little-endian uint64 whose byte j is 0/1; multiplying by
    0x0102040810204080 gathers byte j's bit into bit 56+j without carries, so the top byte is the
    packed value. Equal to ``numpy.packbits(bits, bitorder="little")``.
    """
    lanes = bits.view(torch.uint8).view(torch.int64)
    packed = torch.mul(lanes, 0x0102040810204080)
    return packed.view(torch.uint8).view(-1, 8)[:, 7].contiguous()


_LUT_CACHE: dict[torch.device, torch.Tensor] = {}


def _bits_lut(device: torch.device) -> torch.Tensor:
    """(256, 8) float32 table: row v, column j = bit j of v (0 or 1)."""
    lut = _LUT_CACHE.get(device)
    if lut is None:
        v = torch.arange(256).unsqueeze(1)
        lut = ((v >> torch.arange(8)) & 1).to(_F32).contiguous().to(device)
        _LUT_CACHE[device] = lut
    return lut


def _unpack01(packed: torch.Tensor, out: torch.Tensor, numpy_on_cpu: bool = True) -> torch.Tensor:
    """Unpack sign bytes (little-endian bit order) into 0/1 float32 ``out`` (8 per byte).

    On CPU: ``numpy.unpackbits`` then one uint8 -> float32 conversion (~2x faster than a table
    lookup there); elsewhere a gather from the 256-row table.
    """
    n = packed.numel()
    if n == 0:
        return out
    if packed.device.type == "cpu" and numpy_on_cpu:
        out[: 8 * n].copy_(torch.from_numpy(np.unpackbits(packed.numpy(), bitorder="little")))
    else:
        torch.index_select(_bits_lut(packed.device), 0, packed.to(torch.int32), out=out[: 8 * n].view(n, 8))
    return out


def _sign_test_np(xn: np.ndarray, parity: int, out: np.ndarray) -> None:
    """out[j] = xn[j] > thr[(parity + j) % 2], thr = (0, -2**-126): sign bits with the zero rule."""
    n = xn.size
    rows = n // _ROW
    cut = rows * _ROW
    thr = _THR_NP[parity : parity + _ROW]
    if rows:
        np.greater(xn[:cut].reshape(rows, _ROW), thr, out=out[:cut].reshape(rows, _ROW))
    if n > cut:
        np.greater(xn[cut:], thr[: n - cut], out=out[cut:n])


_THR_CACHE: dict[tuple[torch.device, int], torch.Tensor] = {}


def _sign_test_torch(x: torch.Tensor, parity: int, out: torch.Tensor) -> None:
    """Same as :func:`_sign_test_np` with torch ops on any device (``out`` a bool view)."""
    n = x.numel()
    rows = n // _ROW
    cut = rows * _ROW
    key = (x.device, parity)
    thr = _THR_CACHE.get(key)
    if thr is None:
        thr = _THR_CACHE[key] = torch.from_numpy(_THR_NP[parity : parity + _ROW].copy()).to(x.device)
    if rows:
        torch.gt(x[:cut].view(rows, _ROW), thr, out=out[:cut].view(rows, _ROW))
    if n > cut:
        torch.gt(x[cut:], thr[: n - cut], out=out[cut:n])


_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_PID = 0
_TLS = threading.local()


def _run_tasks(fn, ntasks: int, workers: int) -> None:
    """Run fn(0..ntasks-1) on the calling thread plus ``workers - 1`` pool threads.

    Tasks are pulled from a shared counter (dynamic hand-out: a descheduled thread does not stall
    the others on a shared machine, and there is no per-task future overhead); numpy releases
    the GIL inside its loops, so the threads really run in parallel.
    """
    global _POOL, _POOL_SIZE, _POOL_PID
    workers = min(workers, ntasks)
    if workers <= 1:
        for t in range(ntasks):
            fn(t)
        return
    helpers = workers - 1
    if _POOL is None or _POOL_SIZE < helpers or _POOL_PID != os.getpid():  # a forked child needs its own
        _POOL = ThreadPoolExecutor(max_workers=helpers, thread_name_prefix="geomesh-codec")
        _POOL_SIZE, _POOL_PID = helpers, os.getpid()
    counter = itertools.count()

    def loop() -> None:
        for t in iter(counter.__next__, None):
            if t >= ntasks:
                return
            fn(t)

    futures = [_POOL.submit(loop) for _ in range(helpers)]
    try:
        loop()
    finally:
        for f in futures:
            f.result()


def _bool_scratch(n: int) -> np.ndarray:
    """A per-thread bool scratch of at least n elements."""
    buf = getattr(_TLS, "bools", None)
    if buf is None or buf.size < n:
        buf = _TLS.bools = np.empty(n, dtype=bool)
    return buf


def _f32_scratch(n: int) -> np.ndarray:
    """A per-thread float32 scratch of at least n elements."""
    buf = getattr(_TLS, "floats", None)
    if buf is None or buf.size < n:
        buf = _TLS.floats = np.empty(n, dtype=np.float32)
    return buf


def _row_norms_np(v: np.ndarray, ord_: int, out: np.ndarray) -> None:
    """out[r] = ‖v[r]‖_ord for a (rows, width) float32 array (ord 1 or 2)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow and NaN are handled by the caller
        if ord_ == 2:
            np.einsum("ij,ij->i", v, v, out=out)
            np.sqrt(out, out=out)
        else:
            a = np.abs(v, out=_f32_scratch(v.size)[: v.size].reshape(v.shape))
            np.add.reduce(a, axis=1, out=out)


def _signs_packed_cpu(sources: list[tuple[torch.Tensor, int]], d: int, extra: list | None = None) -> np.ndarray:
    """Sign bits of CPU float32 ``sources`` ((flat tensor, global offset), in order), packed.

    Works in blocks of ``_SIGN_BLOCK`` elements (a multiple of 8) so the bool scratch stays in
    cache, handed out to ``torch.get_num_threads()`` threads together with the ``extra``
    callables (the chunk-norm tasks), so one pool round does all of an encode's passes.
    """
    extra = extra or []
    packed = np.empty((d + 7) // 8, dtype=np.uint8)
    arrays = [(x.numpy(), off) for x, off in sources if x.numel()]
    workers = min(torch.get_num_threads(), 8)
    if not arrays:
        _run_tasks(lambda i: extra[i](), len(extra), workers)
        return packed
    starts = [off for _, off in arrays]
    # at least one block per worker for mid-sized inputs; blocks are multiples of 8 elements
    block = min(_SIGN_BLOCK, max(1 << 16, -(-d // (8 * workers)) * 8))
    nblocks = -(-d // block)

    def work(task: int) -> None:
        if task < len(extra):
            extra[task]()
            return
        blk = task - len(extra)
        scratch = _bool_scratch(min(block, d))
        a = blk * block
        b = min(a + block, d)
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(arrays) and arrays[i][1] < b:
            xn, off = arrays[i]
            lo, hi = max(a, off), min(b, off + xn.size)
            if hi > lo:
                _sign_test_np(xn[lo - off : hi - off], lo & 1, scratch[lo - a : hi - a])
            i += 1
        packed[a // 8 : (b + 7) // 8] = np.packbits(scratch[: b - a], bitorder="little")

    _run_tasks(work, len(extra) + nblocks, workers)
    return packed


def _signs_packed_torch(sources: list[tuple[torch.Tensor, int]], d: int, bits: torch.Tensor) -> torch.Tensor:
    """Device-generic version of :func:`_signs_packed_cpu`; ``bits`` is a bool scratch of
    8·ceil(d/8) elements whose tail past d is zero. Returns packed uint8 on the device."""
    for x, off in sources:
        if x.numel():
            _sign_test_torch(x, off & 1, bits[off : off + x.numel()])
    return _pack_bits_torch(bits)


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


# --------------------------------------------------------------------------------------------
# shared codec machinery
# --------------------------------------------------------------------------------------------


class _Codec:
    """Header, validation and bookkeeping shared by :class:`SignCodec` and :class:`DenseCodec`."""

    _kind: int

    def __init__(self, manifest: Manifest, key: bytes | None):
        if not isinstance(manifest, Manifest):
            raise TypeError(f"manifest must be a Manifest, got {type(manifest).__name__}")
        if key is not None:
            if not isinstance(key, (bytes, bytearray)) or len(key) == 0:
                raise ValueError("key must be non-empty bytes (or None for no HMAC tag)")
            key = bytes(key)
        self.manifest = manifest
        self.key = key
        self._numel = manifest.numel
        self._flags = 0
        self._chunk_field = 0
        self._body_len = 0

    # ---- layout -------------------------------------------------------------------------
    def _digest_bytes(self, extra: str) -> bytes:
        h = hashlib.sha256()
        h.update(b"geomesh-codec\0")
        h.update(f"{_KIND_NAMES[self._kind]};chunk={self._chunk_field};{extra}\0".encode())
        h.update(self.manifest.canonical())
        return h.digest()[:16]

    def payload_nbytes(self) -> int:
        """Exact size in bytes of one payload (header + body + optional HMAC tag)."""
        return HEADER_NBYTES + self._body_len + (TAG_NBYTES if self.key else 0)

    def fp32_nbytes(self) -> int:
        """Size of the same tensors as raw float32 (4 bytes per element)."""
        return 4 * self._numel

    # ---- encode side --------------------------------------------------------------------
    def _inputs(self, tensors: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], torch.device]:
        """Validate ``tensors`` against the manifest; return flat contiguous views and the device."""
        if not isinstance(tensors, Mapping):
            raise TypeError(f"tensors must be a mapping name -> tensor, got {type(tensors).__name__}")
        names = self.manifest.names
        if len(tensors) != len(names) or any(n not in tensors for n in names):
            missing = [n for n in names if n not in tensors]
            known = set(names)
            extra = [k for k in tensors if k not in known]
            raise ValueError(f"tensors do not match the manifest: missing {missing}, unexpected {extra}")
        flat: list[torch.Tensor] = []
        device: torch.device | None = None
        for spec in self.manifest:
            t = tensors[spec.name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {spec.name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"tensor {spec.name!r} has shape {tuple(t.shape)}, the manifest says {spec.shape}")
            if t.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"tensor {spec.name!r} has dtype {t.dtype}; allowed: float32, bfloat16, float16")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"tensor {spec.name!r} is on {t.device} but earlier tensors are on {device}")
            flat.append(t.detach().reshape(-1).contiguous())
        return flat, device if device is not None else torch.device("cpu")

    def _assemble(self, tokens: int, parts: list[np.ndarray | bytes]) -> bytes:
        total = self.payload_nbytes()
        buf = bytearray(total)
        pos = HEADER_NBYTES
        for part in parts:
            n = part.nbytes if isinstance(part, np.ndarray) else len(part)
            buf[pos : pos + n] = memoryview(part).cast("B") if n else b""
            pos += n
        if pos != HEADER_NBYTES + self._body_len:  # pragma: no cover - internal invariant
            raise AssertionError("body length does not match the layout")
        self._write_header(buf, tokens)
        return bytes(buf)

    def _write_header(self, buf: bytearray, tokens: int) -> None:
        flags = self._flags | (FLAG_HMAC if self.key else 0)
        _HEADER.pack_into(
            buf,
            0,
            MAGIC,
            FORMAT_VERSION,
            self._kind,
            flags,
            self._chunk_field,
            self._digest,
            tokens,
            self._body_len,
            0,
        )
        mv = memoryview(buf)
        end = HEADER_NBYTES + self._body_len
        crc = zlib.crc32(mv[HEADER_NBYTES:end], zlib.crc32(mv[:_CRC_OFFSET]))
        struct.pack_into("<I", buf, _CRC_OFFSET, crc)
        if self.key:
            buf[end : end + TAG_NBYTES] = hmac.new(self.key, mv[:end], hashlib.sha256).digest()

    # ---- decode side --------------------------------------------------------------------
    def _flag_text(self, flags: int) -> str:  # overridden for readable messages
        return f"0x{flags:02x}"

    def _parse(self, payload: Any) -> tuple[int, memoryview]:
        """Validate everything but the body's contents; return (tokens, body view)."""
        mv = _as_bytes_view(payload)
        n = len(mv)
        if n < HEADER_NBYTES:
            raise PayloadError(f"truncated payload: {n} bytes, shorter than the {HEADER_NBYTES}-byte header")
        magic, version, kind, flags, chunk, digest, tokens, body_len, crc = _HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise PayloadError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a GeoMesh payload")
        if version != FORMAT_VERSION:
            raise PayloadError(f"unsupported wire-format version {version} (this codec reads version {FORMAT_VERSION})")
        if kind != self._kind:
            got = _KIND_NAMES.get(kind, f"unknown kind {kind}")
            raise PayloadError(f"wrong codec kind: payload is {got}, this codec decodes {_KIND_NAMES[self._kind]}")
        want_flags = self._flags | (FLAG_HMAC if self.key else 0)
        if flags != want_flags:
            if (flags ^ want_flags) & FLAG_HMAC:
                if self.key:
                    raise PayloadError("missing HMAC tag: this codec has a key but the payload is unsigned")
                raise PayloadError("payload carries an HMAC tag but this codec has no key to check it")
            raise PayloadError(
                f"flags mismatch: payload has {self._flag_text(flags)}, "
                f"this codec expects {self._flag_text(want_flags)}"
            )
        if chunk != self._chunk_field:
            raise PayloadError(f"chunk size mismatch: payload has {chunk}, this codec uses {self._chunk_field}")
        if digest != self._digest:
            raise PayloadError(
                f"manifest mismatch: layout digest {digest.hex()} != expected {self._digest.hex()} "
                f"(other tensor names/shapes/dtypes, or a corrupted header)"
            )
        if body_len != self._body_len:
            raise PayloadError(
                f"body length mismatch: header says {body_len} bytes, the manifest implies {self._body_len}"
            )
        expected = self.payload_nbytes()
        if n < expected:
            raise PayloadError(f"truncated payload: {n} bytes, expected {expected}")
        if n > expected:
            raise PayloadError(f"oversized payload: {n} bytes, expected {expected} ({n - expected} extra)")
        end = HEADER_NBYTES + body_len
        if self.key:
            tag = hmac.new(self.key, mv[:end], hashlib.sha256).digest()
            if not hmac.compare_digest(tag, bytes(mv[end:])):
                raise PayloadError("HMAC tag mismatch: wrong key or tampered payload")
        body = mv[HEADER_NBYTES:end]
        got_crc = zlib.crc32(body, zlib.crc32(mv[:_CRC_OFFSET]))
        if got_crc != crc:
            raise PayloadError(f"checksum mismatch: crc32 {got_crc:08x} != header {crc:08x} (corrupted payload)")
        if not 1 <= tokens <= MAX_TOKENS:
            raise PayloadError(f"bad token count {tokens}: must be in [1, 2**53]")
        return tokens, body

    def tokens_of(self, payload: bytes) -> int:
        """Token count of a payload, after checking its header, size, tag and checksum."""
        return self._parse(payload)[0]

    def total_tokens(self, payloads: Iterable[bytes]) -> int:
        """Σ n_i over payloads (each checked as in :meth:`tokens_of`)."""
        return sum(self.tokens_of(p) for p in payloads)

    def _tensor_of_element(self, k: int) -> str:
        i = bisect.bisect_right(self.manifest.offsets, k) - 1
        return self.manifest.specs[max(i, 0)].name

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            spec.name: flat[off : off + spec.numel].view(spec.shape)
            for spec, off in zip(self.manifest, self.manifest.offsets)
        }

    def combine(
        self,
        payloads: Iterable[bytes],
        *,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Combined update of all payloads (streaming over any iterable); see the module docstring."""
        return self.combine_with_tokens(payloads, device=device, out=out)[0]

    def combine_with_tokens(
        self,
        payloads: Iterable[bytes],
        *,
        device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _accumulator(self, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """``out`` checked (a flat float32 buffer of d elements on ``device``), or a new one."""
        d = self._numel
        if out is None:
            return torch.empty(d, dtype=_F32, device=device)
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != _F32
            or out.device != device
            or out.dim() != 1
            or out.numel() != d
            or not out.is_contiguous()
        ):
            raise ValueError(f"out must be a contiguous 1-D float32 tensor of {d} elements on {device}")
        return out


# --------------------------------------------------------------------------------------------
# Sign codec
# --------------------------------------------------------------------------------------------


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

    def _accumulate_torch(self, acc: torch.Tensor, blocks, majority: bool):
        """Per-payload accumulation with torch ops on any device (few, large blocks on GPUs)."""
        max_bytes = max((nb for _, nb, _ in blocks), default=0)
        scratch = torch.empty(max_bytes * 8, dtype=_F32, device=acc.device)

        def accumulate(packed: torch.Tensor, weight, first: bool) -> None:
            packed = packed.to(acc.device)
            for b0, nb, pieces in blocks:
                _unpack01(packed[b0 : b0 + nb], scratch, False)
                base = b0 * 8
                for start, rows, width, m0 in pieces:
                    n = rows * width
                    dst = acc[start : start + n].view(rows, width)
                    src = scratch[start - base : start - base + n].view(rows, width)
                    wcol = weight if majority else weight[m0 : m0 + rows].unsqueeze(1)
                    if first:
                        torch.mul(src, wcol, out=dst)
                    elif majority:
                        dst.add_(src, alpha=weight)
                    else:
                        dst.addcmul_(src, wcol)

        return accumulate

    def _accumulate_cpu(self, acc: torch.Tensor, blocks, majority: bool):
        """Per-payload accumulation on CPU: numpy kernels on cache-sized blocks handed out to a
        small thread pool (robust when the cores are shared, unlike many short OpenMP regions)."""
        accn = acc.numpy()
        workers = min(torch.get_num_threads(), 8)
        max_bytes = max((nb for _, nb, _ in blocks), default=0)
        state: dict[str, Any] = {}

        def task(i: int) -> None:
            b0, nb, pieces = blocks[i]
            bits = _f32_scratch(8 * max_bytes)
            np.copyto(bits[: 8 * nb], np.unpackbits(state["packed"][b0 : b0 + nb], bitorder="little"), casting="unsafe")
            base = b0 * 8
            weight, first = state["weight"], state["first"]
            for start, rows, width, m0 in pieces:
                n = rows * width
                src = bits[start - base : start - base + n].reshape(rows, width)
                dst = accn[start : start + n].reshape(rows, width)
                wcol = weight if majority else weight[m0 : m0 + rows, None]
                if first:
                    np.multiply(src, wcol, out=dst)
                else:
                    np.multiply(src, wcol, out=src)
                    np.add(dst, src, out=dst)

        def accumulate(packed: torch.Tensor, weight, first: bool) -> None:
            state["packed"] = packed.numpy()
            state["weight"] = weight if majority else weight.numpy()
            state["first"] = first
            _run_tasks(task, len(blocks), workers)

        return accumulate

    def _finish_cpu(
        self, acc: torch.Tensor, blocks, corr: torch.Tensor, scale: float, majority: bool, total: int
    ) -> None:
        """Final pass on CPU: (acc − corr)·scale, or sign(acc − N/2)·corr, block by block."""
        accn, corrn = acc.numpy(), corr.numpy()
        half = np.float32(total / 2)
        sc = np.float32(scale)

        def task(i: int) -> None:
            for start, rows, width, m0 in blocks[i][2]:
                v = accn[start : start + rows * width].reshape(rows, width)
                c = corrn[m0 : m0 + rows, None]
                if majority:
                    np.subtract(v, half, out=v)
                    np.sign(v, out=v)
                    np.multiply(v, c, out=v)
                else:
                    np.multiply(v, sc, out=v)
                    np.subtract(v, c, out=v)

        _run_tasks(task, len(blocks), min(torch.get_num_threads(), 8))

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
            accumulate = self._accumulate_cpu(acc, blocks, majority)
        else:
            accumulate = self._accumulate_torch(acc, blocks, majority)
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
            self._finish_cpu(acc, blocks, corr, scale, majority, total)
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


# --------------------------------------------------------------------------------------------
# Dense codec (fp32 baseline)
# --------------------------------------------------------------------------------------------


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
        total, count, first = 0, 0, 0
        for payload in payloads:
            tokens, body = self._parse(payload)
            vals = self._values(body)
            if count == 0:
                first = tokens
            total += tokens
            count += 1
            w = 1.0 if self.weighting == "equal" else tokens / first
            if count == 1:
                torch.mul(vals.to(device), w, out=acc)
            else:
                acc.add_(vals.to(device), alpha=w)
        if count == 0:
            raise ValueError("combine needs at least one payload")
        acc.mul_(1.0 / count if self.weighting == "equal" else first / total)
        return self._split(acc), total
