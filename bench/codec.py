"""Benchmark the sign codec against a plain fp32 tensor copy, side by side in one process.

Usage:  PYTHONPATH=src python bench/codec.py [--sizes 1e6,1e7,1e8] [--device cpu|cuda]
        [--payloads 4] [--repeats 7] [--tensors 8] [--threads N]

For each size it builds a pseudo-gradient of ``params`` float32 elements split into ``--tensors``
tensors of uneven sizes (so partial chunks and unaligned bit offsets are exercised), then times,
best of ``--repeats``:

* ``encode``: ``SignCodec.encode`` of the whole dict (sign test, magnitudes, packing, crc32);
* ``combine``: ``SignCodec.combine`` of ``--payloads`` payloads (validation, crc32, unpacking,
  token-weighted accumulation), reported per payload, accumulating into a reused ``out=`` buffer
  (like the copy's preallocated ``dst``); ``combine_fresh`` is the same without ``out=``, so it
  also pays for first-touching a freshly allocated result (page faults: ~3 µs per 4 KiB page on
  the dev VM, i.e. ~0.3 s for a 400 MB result), amortised over the payloads;
* ``copy``: ``dst.copy_(src)`` of one fp32 buffer of the same size into a preallocated ``dst``.

Throughputs are GB/s of fp32 input processed (4·params bytes / seconds). One JSON object per line
per size: params, tensors, wire_bytes, fp32_bytes, wire_ratio, encode_gbps, combine_gbps,
combine_fresh_gbps, copy_gbps, encode_vs_copy, combine_vs_copy (ratios of times in this run), the
raw seconds, payloads, device, threads (torch intra-op threads, also the codec's CPU pool size)
and loadavg_1m (other load on the machine skews every number).

Targets: wire_ratio >= 31 at 10M parameters; encode and combine each >= 1/3 of copy_gbps.

RESULTS (2-core dev VM, torch 2.13 CPU, default --tensors 8 --payloads 4; the VM is shared with
other sessions, so loadavg_1m is reported: 1.4-2.0 during these runs, i.e. ~one core busy elsewhere)

    threads  params  wire_ratio  encode GB/s  combine GB/s  copy GB/s  encode/copy  combine/copy
    2        1M      31.74       3.68         3.39          21.6       0.17         0.16
    2        10M     31.75       3.97         3.69           9.6       0.41         0.38
    2        100M    31.75       3.92         2.95           7.1       0.55         0.41
    1        1M      31.74       3.07         3.33          10.9       0.28         0.30
    1        10M     31.75       2.42         2.10           5.3       0.46         0.40
    1        100M    31.75       3.16         3.21           6.6       0.48         0.49

(combine_fresh, i.e. without ``out=``: 2.7 / 2.6 GB/s at 10M / 100M with 2 threads.)

wire_ratio is met everywhere (31.75 at 10M). encode/combine >= 1/3 of copy is met at 10M and
100M, and missed at 1M: by about 2x with 2 threads (0.17 / 0.16) and by 10-15% with 1 thread.
Why: at 1M the 4 MB buffer sits in cache, where ``dst.copy_(src)`` runs at 21 GB/s (0.19 ms), while
one encode or combine of 8 tensors has ~0.3-0.5 ms of fixed cost (per-tensor checks and views, the
thread hand-off, crc32 and payload assembly, the final correction pass) on top of 3-4 passes of
real work (sign test, norms, packing; or unpack, convert, multiply-add). At 10M and 100M the work
dominates and the ratio is 0.4-0.55. Numbers move by 2x between runs on this shared VM; with two
threads torch's own OpenMP kernels were far slower under load (combine 0.04-0.2 of copy), which is
why the CPU hot loops use numpy kernels on a small dynamically fed thread pool (see codec.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from geomesh.codec import Manifest, SignCodec


def _sizes(text: str) -> list[int]:
    return [int(float(s)) for s in text.split(",") if s.strip()]


def _split_sizes(params: int, n: int) -> list[int]:
    """Uneven split of ``params`` into ``n`` tensor sizes (weights ~ 1..n, odd remainders)."""
    n = max(1, min(n, params))
    weights = list(range(1, n + 1))
    total = sum(weights)
    sizes = [max(1, params * w // total) for w in weights]
    sizes[-1] += params - sum(sizes)
    return sizes


def _best(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_size(params: int, device: torch.device, n_payloads: int, repeats: int, n_tensors: int) -> dict:
    gen = torch.Generator().manual_seed(params)
    sizes = _split_sizes(params, n_tensors)
    tensors = {f"t{i}": (torch.randn(s, generator=gen) * 1e-3).to(device) for i, s in enumerate(sizes)}
    codec = SignCodec(Manifest.from_tensors(tensors))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    payloads = [codec.encode(tensors, tokens=1000 * (i + 1)) for i in range(n_payloads)]
    t_encode = _best(lambda: codec.encode(tensors, tokens=1000), repeats, sync)
    acc = torch.empty(params, device=device)
    t_combine = _best(lambda: codec.combine(payloads, device=device, out=acc), repeats, sync) / n_payloads
    t_fresh = _best(lambda: codec.combine(payloads, device=device), max(1, repeats // 2), sync) / n_payloads

    src = torch.randn(params, generator=gen).to(device)
    dst = torch.empty_like(src)
    t_copy = _best(lambda: dst.copy_(src), repeats, sync)

    fp32 = codec.fp32_nbytes()

    def gbps(t: float) -> float:
        return fp32 / t / 1e9

    return {
        "params": params,
        "tensors": len(sizes),
        "wire_bytes": codec.payload_nbytes(),
        "fp32_bytes": fp32,
        "wire_ratio": round(fp32 / codec.payload_nbytes(), 3),
        "encode_gbps": round(gbps(t_encode), 3),
        "combine_gbps": round(gbps(t_combine), 3),
        "combine_fresh_gbps": round(gbps(t_fresh), 3),
        "copy_gbps": round(gbps(t_copy), 3),
        "encode_vs_copy": round(t_copy / t_encode, 3),
        "combine_vs_copy": round(t_copy / t_combine, 3),
        "encode_s": t_encode,
        "combine_s_per_payload": t_combine,
        "copy_s": t_copy,
        "payloads": n_payloads,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=_sizes, default=_sizes("1e6,1e7,1e8"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--payloads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--tensors", type=int, default=8)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    for params in args.sizes:
        print(json.dumps(bench_size(params, device, args.payloads, args.repeats, args.tensors)), flush=True)


if __name__ == "__main__":
    main()
