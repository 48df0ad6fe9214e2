"""The sign codec's hot loops: the sign test, bit packing and unpacking, chunk norms, and the
accumulation of payloads in ``combine``, on CPU and on any torch device.

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
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

_F32 = torch.float32

# Sign test: bit = x > thr[k % 2] with thr = (0, -2**-126): zeros get the parity of their index.
_ROW = 4096  # row width over which the periodic threshold is broadcast (even)
_SIGN_BLOCK = 1 << 20  # encode: elements per sign-test block on CPU (bool scratch fits in L2)
_ZERO_THRESHOLD = -(2.0**-126)
_THR_NP = np.tile(np.array([0.0, _ZERO_THRESHOLD], dtype=np.float32), _ROW // 2 + 1)


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


def _combine_accumulator_torch(acc: torch.Tensor, blocks, majority: bool):
    """``accumulate(packed, weight, first)`` adding one payload's bits into ``acc``, with torch ops
    on any device (few, large blocks on GPUs); ``blocks`` are :meth:`SignCodec._blocks`'s."""
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


def _combine_accumulator_cpu(acc: torch.Tensor, blocks, majority: bool):
    """``accumulate(packed, weight, first)`` adding one payload's bits into ``acc`` on CPU: numpy
    kernels on cache-sized blocks handed out to a small thread pool (robust when the cores are
    shared, unlike many short OpenMP regions)."""
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


def _finish_combine_cpu(
    acc: torch.Tensor, blocks, corr: torch.Tensor, scale: float, majority: bool, total: int
) -> None:
    """Final pass of ``combine`` on CPU: (acc − corr)·scale, or sign(acc − N/2)·corr, block by block."""
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
