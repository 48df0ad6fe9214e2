"""Measure this device with the model the run will train: the scenario's ``model`` (a built-in preset or a
``transformers`` model), at its sequence length, in the precision the run uses (bf16 autocast on a GPU that
has it), with the run's AdamW. Each micro-batch size is warmed up (allocator, kernels, optimizer state),
then forward + backward and the optimizer step are each timed ``repeats`` times (the median counts). On
CUDA the largest micro-batch that fits is probed with ``torch.cuda.max_memory_allocated``. The result is a
:class:`~geomesh.hardware.WorkerProfile` with ``source="measured"``, accepted by ``geomesh plan --profile``
and both runtimes in place of the cost model.
"""

from __future__ import annotations

import statistics
import time

import torch

from .config import ScenarioConfig
from .hardware import WorkerProfile
from .models import build_proxy_model, enable_activation_checkpointing, model_name
from .worker import autocast_dtype, make_inner_optimizer

WARMUP_STEPS = 2  # full steps per micro-batch before timing: kernels chosen, AdamW state allocated


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return "cpu"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def profile_device(scenario: ScenarioConfig, device: str, batches: list[int], *, repeats: int = 3,
                   name: str = "local", activation_checkpointing: bool = False) -> WorkerProfile:  # fmt: skip
    if device == "cuda" and not torch.cuda.is_available():
        from .errors import RunError

        raise RunError("--device cuda: no CUDA device is available on this machine")
    vocab = scenario.data.vocab_size
    seq = scenario.proxy.seq_len
    model = build_proxy_model(scenario.proxy, vocab, seed=0)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    model = model.to(device)
    opt = make_inner_optimizer(model, scenario.training)
    dtype = autocast_dtype(getattr(scenario.training, "precision", "auto"), torch.device(device))
    gen = torch.Generator().manual_seed(0)

    def forward_backward(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        if dtype is None:
            _, loss = model(x, x)
        else:
            with torch.autocast(torch.device(device).type, dtype=dtype):
                _, loss = model(x, x)
        loss.backward()

    def timed_step(b: int) -> tuple[float, float]:
        x = torch.randint(0, vocab, (b, seq), generator=gen).to(device)
        _sync(device)
        t0 = time.perf_counter()
        forward_backward(x)
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    table: dict[int, float] = {}
    opt_times: list[float] = []
    for b in batches:
        for _ in range(WARMUP_STEPS):
            timed_step(b)
        runs = [timed_step(b) for _ in range(max(repeats, 1))]
        table[b] = statistics.median(r[0] for r in runs)
        opt_times += [r[1] for r in runs]
    cap = _probe_max_micro_batch(forward_backward, vocab, seq, device, batches[-1]) if device == "cuda" else max(batches)
    return WorkerProfile(
        name=name, gpu=_device_name(device), gpu_count=1, max_micro_batch=cap, table=table,
        step_overhead_s=statistics.median(opt_times), source="measured",
        extra={"device": device, "model": model_name(scenario.proxy, model), "seq_len": seq,
               "params": sum(p.numel() for p in model.parameters()), "precision": str(dtype or torch.float32),
               "activation_checkpointing": activation_checkpointing, "repeats": repeats, "warmup": WARMUP_STEPS},
    )  # fmt: skip


def _probe_max_micro_batch(forward_backward, vocab: int, seq: int, device: str, start: int) -> int:
    """Double the micro-batch until peak memory would pass 90% of the device, then bisect."""
    total = torch.cuda.get_device_properties(0).total_memory

    def fits(b: int) -> bool:
        try:
            torch.cuda.reset_peak_memory_stats()
            forward_backward(torch.zeros((b, seq), dtype=torch.long, device=device))
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
