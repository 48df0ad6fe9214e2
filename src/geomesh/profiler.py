"""Measure this device with the real model: step time at several micro-batches and, on CUDA, the largest
micro-batch that fits (probed with ``torch.cuda.max_memory_allocated``). The result is a
:class:`~geomesh.hardware.WorkerProfile` with ``source="measured"``, accepted by ``geomesh plan`` and the
runtimes in place of the cost model.
"""

from __future__ import annotations

import time

import torch

from .config import ScenarioConfig
from .hardware import WorkerProfile
from .model import build_model, model_config
from .worker import make_inner_optimizer


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return "cpu"


def profile_device(scenario: ScenarioConfig, device: str, batches: list[int], *, repeats: int = 3,
                   name: str = "local") -> WorkerProfile:  # fmt: skip
    if device == "cuda" and not torch.cuda.is_available():
        from .runtime.emulated import RunError

        raise RunError("--device cuda: no CUDA device is available on this machine")
    cfg = model_config(scenario.proxy.preset, vocab_size=scenario.data.vocab_size, seq_len=scenario.proxy.seq_len)
    model = build_model(cfg, seed=0).to(device)
    opt = make_inner_optimizer(model, scenario.training)
    gen = torch.Generator().manual_seed(0)

    def one_step(b: int) -> float:
        x = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, x)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    table: dict[int, float] = {}
    for b in batches:
        one_step(b)  # warm-up (allocator, kernels)
        table[b] = min(one_step(b) for _ in range(max(repeats, 1)))
    opt_t0 = time.perf_counter()
    opt.step()
    step_overhead = time.perf_counter() - opt_t0
    cap = _probe_max_micro_batch(model, cfg, device, batches[-1]) if device == "cuda" else max(batches)
    return WorkerProfile(
        name=name, gpu=_device_name(device), gpu_count=1, max_micro_batch=cap, table=table,
        step_overhead_s=step_overhead, source="measured",
        extra={"device": device, "preset": scenario.proxy.preset, "seq_len": cfg.seq_len},
    )  # fmt: skip


def _probe_max_micro_batch(model, cfg, device: str, start: int) -> int:
    """Double the micro-batch until peak memory would pass 90% of the device, then bisect."""
    total = torch.cuda.get_device_properties(0).total_memory

    def fits(b: int) -> bool:
        try:
            torch.cuda.reset_peak_memory_stats()
            x = torch.zeros((b, cfg.seq_len), dtype=torch.long, device=device)
            _, loss = model(x, x)
            loss.backward()
            model.zero_grad(set_to_none=True)
            ok = torch.cuda.max_memory_allocated() <= 0.9 * total
        except torch.cuda.OutOfMemoryError:
            ok = False
        torch.cuda.empty_cache()
        return ok

    lo, hi = 0, max(start, 1)
    while fits(hi) and hi < 1 << 16:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
