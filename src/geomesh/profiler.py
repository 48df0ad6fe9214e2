"""Measure this device with the model the run will train: the scenario's ``model`` (a built-in preset or a
``transformers`` model), at its sequence length, in the precision the run uses (bf16 autocast on a GPU that
has it), with the run's AdamW. Each micro-batch size is warmed up (allocator, kernels, optimizer state),
then forward + backward and the optimizer step are each timed ``repeats`` times (the median counts). On
CUDA the largest micro-batch that fits is probed with ``torch.cuda.max_memory_allocated``. The result is a
:class:`~geomesh.hardware.WorkerProfile` with ``source="measured"``, accepted by ``geomesh plan --profile``
and both runtimes in place of the cost model.

:func:`calibrate_worker` makes the same measurement in place, on a live worker (a region's
:class:`~geomesh.worker.Worker` or :class:`~geomesh.runtime.distributed.region.RegionWorker`) before it
trains: its own model, optimizer and data stream, a few steps per candidate micro-batch, all of them undone
afterwards (parameters, buffers, gradients, optimizer state, stream position, random state), so what the
worker then trains is bit for bit what it would have trained without the calibration.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import ScenarioConfig
from .errors import RunError
from .hardware import WorkerProfile
from .models import build_proxy_model, enable_activation_checkpointing, model_name
from .worker import Worker, autocast_dtype, make_inner_optimizer

WARMUP_STEPS = 2  # full steps per micro-batch before timing: kernels chosen, AdamW state allocated
CALIBRATION_STEP_LIMIT = 24  # training steps one calibration may run in all, so that start-up stays short
DEFAULT_CANDIDATES = 3  # micro-batches a calibration measures by default (fewer, each timed more often)
DEFAULT_REPEATS = 4  # timed steps per candidate (the median and the robust line count)
MEMORY_HEADROOM = 0.9  # the share of the device's memory a micro-batch may fill (as the memory model counts)


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
        raise RunError("--device cuda: no CUDA device is available on this machine")
    vocab = scenario.data.vocab_size
    seq = scenario.model.seq_len
    model = build_proxy_model(scenario.model, vocab, seed=0)
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
    samples: dict[int, list[float]] = {}
    opt_times: list[float] = []
    for b in batches:
        for _ in range(WARMUP_STEPS):
            timed_step(b)
        runs = [timed_step(b) for _ in range(max(repeats, 1))]
        samples[b] = [r[0] for r in runs]
        table[b] = statistics.median(samples[b])
        opt_times += [r[1] for r in runs]
    cap = _probe_max_micro_batch(forward_backward, vocab, seq, device, batches[-1]) if device == "cuda" else max(batches)
    return WorkerProfile(
        name=name, gpu=_device_name(device), gpu_count=1, max_micro_batch=cap, table=table,
        step_overhead_s=statistics.median(opt_times), source="measured",
        extra={"device": device, "model": model_name(scenario.model, model), "seq_len": seq,
               "params": sum(p.numel() for p in model.parameters()), "precision": str(dtype or torch.float32),
               "activation_checkpointing": activation_checkpointing, "repeats": repeats, "warmup": WARMUP_STEPS,
               "table_noise": timing_noise(samples, table)},
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


# ---- calibration in place: a live worker's step time, measured before it trains ---------------------------


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate_worker` measured, and what measuring cost."""

    profile: WorkerProfile  # source="measured"; the region's name, its micro-batch -> seconds table
    seconds: float  # wall time of the whole calibration, saving and restoring the worker's state included
    steps: int  # training steps it ran (every one of them undone)


def default_micro_batches(batch: int, cap: int | None = None, reference: int | None = None) -> list[int]:
    """The micro-batches a calibration measures: powers of two up to ``batch`` (the reference batch
    ``training.batch``, the batch DiLoCo's plan uses, or the largest micro-batch a plan may give; and at most
    ``cap``), that batch itself, at most :data:`DEFAULT_CANDIDATES`: 1 and the largest (the plan interpolates
    between them and extrapolates from the last two). ``reference`` (``training.batch`` when ``batch`` is
    larger) is measured too, in place of the next-to-largest: the planning rule's round is made of steps of
    it and the slowest region runs it, so its time is measured, not read off a line."""
    top = max(1, min(batch, cap) if cap is not None else batch)
    points = sorted({1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top})
    chosen = points if len(points) <= DEFAULT_CANDIDATES else [points[0], *points[1 - DEFAULT_CANDIDATES :]]
    if reference is not None and 1 <= reference <= top and reference not in chosen:
        chosen = sorted({*chosen[: DEFAULT_CANDIDATES - 2], reference, chosen[-1]})
    return chosen


def calibrate_worker(worker: Worker, micro_batches: Sequence[int] | None = None, *, warmup_steps: int = 1,
                     repeats: int = DEFAULT_REPEATS) -> Calibration:  # fmt: skip
    """Measure ``worker``'s step time in place, for the model it really trains, and leave it as it was.

    For each candidate micro-batch ``m`` (the region's micro-batch: a region of ``size`` ranks splits it
    over them; default :func:`default_micro_batches` of ``training.batch``), ``warmup_steps`` then
    ``repeats`` full training steps: forward + backward of ``m`` sequences from the worker's own stream in
    one pass per rank (``accumulate_grad``), then the optimizer step (``apply_step``). The candidates are
    interleaved: each pass over them runs one step of every candidate (ascending, then descending, and so on),
    so a busy spell of the host (other processes, a neighbour's job) falls on all of them alike instead of
    skewing one candidate against the others; the first ``warmup_steps`` passes are not timed. The profile's
    ``table`` is the robust line through every timed forward + backward (:func:`linear_fit`: Theil-Sen,
    monotone in the micro-batch), the median optimizer step its ``step_overhead_s``; the medians per
    candidate are kept (``extra["measured_table"]``). On CUDA the peak memory of each micro-batch
    (``torch.cuda.max_memory_allocated``) is recorded (``extra["peak_memory_bytes"]``) and bounds
    ``max_micro_batch``: the micro-batch at which the line through the two largest candidates' peaks reaches
    90% of the device (a candidate that runs out of memory is dropped with every larger one); on CPU it is the
    worker's own bound (``max_proxy_micro_batch`` per rank).

    Afterwards parameters, buffers, gradients, the optimizer's state and settings, the stream's position,
    the random generators' states and the micro-batch bound are restored exactly. The worker's declared
    ``slowdown`` (an injected fault) is not measured: the scenario applies it to the profile.

    No communication of its own: in a region of several ranks every rank calls it with the same arguments
    (the steps run the region's gradient reduction, which is part of its step time; each rank measures its
    own device). At most :data:`CALIBRATION_STEP_LIMIT` steps in all; bad arguments raise ValueError, a
    smallest candidate that does not fit in memory :class:`~geomesh.errors.RunError`.
    """
    started = time.perf_counter()
    device = next(worker.model.parameters()).device
    on_cuda = device.type == "cuda"
    size = int(getattr(worker, "size", 1))  # a RegionWorker's ranks share each micro-batch
    cpu_cap = worker.max_proxy_micro_batch * size
    candidates = _candidates(micro_batches, worker.cfg.batch, None if on_cuda else cpu_cap)
    for label, value, least in (("warmup_steps", warmup_steps, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{label}={value!r}: expected an integer >= {least}")
    steps_needed = len(candidates) * (warmup_steps + repeats)
    if steps_needed > CALIBRATION_STEP_LIMIT:
        raise ValueError(f"calibration of {len(candidates)} micro-batches x {warmup_steps + repeats} steps = "
                         f"{steps_needed} steps; at most {CALIBRATION_STEP_LIMIT}: fewer candidates or repeats")  # fmt: skip

    saved = _save_training_state(worker, device)
    lr = worker.optimizer.param_groups[0]["lr"]  # any rate runs the same kernels; the step is undone
    samples: dict[int, list[float]] = {m: [] for m in candidates}  # timed forward + backward per candidate
    peaks: dict[int, int] = {}
    step_times: list[float] = []
    active = list(candidates)
    out_of_memory_at: int | None = None
    steps = 0
    seq_len = 0
    try:
        worker.model.train()
        base = torch.cuda.memory_allocated(device) if on_cuda else 0
        for k in range(warmup_steps + repeats):
            for m in list(active if k % 2 == 0 else active[::-1]):
                if m not in active:  # (dropped in this pass: a smaller one ran out of memory)
                    continue
                worker.max_proxy_micro_batch = -(-m // size)  # one forward/backward per rank: the micro-batch
                try:
                    if on_cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    forward_backward_s, optimizer_s, tokens = _timed_training_step(worker, m, lr, device)
                    steps += 1
                    if on_cuda:
                        peaks[m] = max(peaks.get(m, 0), int(torch.cuda.max_memory_allocated(device)))
                except torch.cuda.OutOfMemoryError:
                    worker.optimizer.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                    if m == active[0]:
                        raise RunError(f"calibration of {worker.name}: a micro-batch of {m} does not fit in "
                                       f"{torch.cuda.get_device_name(device)}'s memory; give smaller micro-batches") from None  # fmt: skip
                    out_of_memory_at = m if out_of_memory_at is None else min(out_of_memory_at, m)
                    active = [x for x in active if x < m]
                    continue
                seq_len = tokens // m
                if k >= warmup_steps:
                    samples[m].append(forward_backward_s)
                    step_times.append(optimizer_s)
    finally:
        _restore_training_state(worker, saved, device)
    samples = {m: ts for m, ts in samples.items() if m in active and ts}
    peaks = {m: b for m, b in peaks.items() if m in active}
    table = {m: statistics.median(ts) for m, ts in samples.items()}
    if on_cuda:
        usable = MEMORY_HEADROOM * torch.cuda.get_device_properties(device).total_memory
        cap = _memory_cap(peaks, base, usable, out_of_memory_at)
    else:
        cap = cpu_cap
    seconds = time.perf_counter() - started
    extra: dict[str, Any] = {
        "device": str(device), "seq_len": seq_len, "params": sum(p.numel() for p in worker.model.parameters()),
        "precision": str(worker.autocast_dtype or torch.float32), "warmup": warmup_steps, "repeats": repeats,
        "calibrated_in_place": True, "calibration_s": seconds, "calibration_steps": steps,
    }  # fmt: skip
    if on_cuda:
        extra["peak_memory_bytes"] = {str(m): b for m, b in peaks.items()}
    extra["measured_table"] = {str(m): s for m, s in table.items()}
    fitted = linear_fit(samples)
    extra["table_noise"] = timing_noise(samples, fitted)
    profile = WorkerProfile(name=worker.name, gpu=torch.cuda.get_device_name(device) if on_cuda else "cpu",
                            gpu_count=size, max_micro_batch=cap, table=fitted,
                            step_overhead_s=statistics.median(step_times), source="measured", extra=extra)  # fmt: skip
    return Calibration(profile=profile, seconds=seconds, steps=steps)


def linear_fit(table: Mapping[int, float | Sequence[float]]) -> dict[int, float]:
    """The measured micro-batch times as a line, t(m) = a + b·m (a >= 0, b > 0), at the measured
    micro-batches. ``table`` maps a micro-batch to its time, or to every time measured at it.

    The line is Theil-Sen's: the slope is the median of the slopes between every two measurements at
    different micro-batches, the intercept the median of t − b·m over all of them. A few timed steps are
    noisy where steps are short (a busy host, a small model), and the planner picks the micro-batch whose time
    looks cheapest: a raw table with a dip, or a least-squares line pulled by one slow step, makes it chase
    the noise, round after round. The median line ignores up to about a third of the measurements however far
    off they are, and keeps the shape the planner may rely on: a fixed cost per pass plus a cost per sequence,
    never falling with the micro-batch."""
    points = [(m, float(t)) for m, ts in table.items() for t in (ts if isinstance(ts, Sequence) else [ts])]
    xs = sorted({m for m, _ in points})
    if len(xs) < 2:
        return {m: statistics.median(t for x, t in points if x == m) for m in xs}
    slopes = [(t1 - t0) / (m1 - m0) for i, (m0, t0) in enumerate(points) for m1, t1 in points[i + 1 :] if m1 != m0]
    my = statistics.fmean(t for _, t in points)
    b = max(statistics.median(slopes), 1e-3 * my / max(xs))  # a time that does not grow is noise, not a free batch
    a = max(statistics.median(t - b * m for m, t in points), 0.0)
    return {m: a + b * m for m in xs}


def timing_noise(samples: Mapping[int, Sequence[float]], table: Mapping[int, float]) -> float:
    """How far one timed step may be from the profile's ``table`` (relative): the robust dispersion (1.4826 ×
    the median absolute log-ratio) of every timed step around the table's time at its micro-batch. The
    planner takes it as the uncertainty of the table's times (``extra["table_noise"]``): regions whose
    tables differ by less than their noise can tell are planned alike (:mod:`geomesh.planner.settle`). One
    step's dispersion rather than that of a median of several: a line through two or three candidates is
    known at the micro-batches between them no better than that."""
    residuals = [abs(math.log(t / table[m])) for m, ts in samples.items() if m in table for t in ts if t > 0]
    return 1.4826 * statistics.median(residuals) if residuals else 0.0


def _candidates(given: Sequence[int] | None, batch: int, cap: int | None) -> list[int]:
    if given is None:
        return default_micro_batches(batch, cap)
    values = list(given)
    if not values or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in values):
        raise ValueError(f"micro_batches={values!r}: expected positive integers")
    if cap is not None and max(values) > cap:
        raise ValueError(f"micro_batches={values!r}: this worker runs at most {cap} sequences per micro-batch")
    return sorted(set(values))


def _timed_training_step(worker: Worker, micro_batch: int, lr: float, device: torch.device) -> tuple[float, float, int]:
    """One training step of ``micro_batch`` sequences: (forward + backward s, optimizer step s, tokens)."""
    worker.optimizer.zero_grad(set_to_none=True)
    _synchronize(device)
    t0 = time.perf_counter()
    _, tokens = worker.accumulate_grad(micro_batch)
    _synchronize(device)
    t1 = time.perf_counter()
    worker.apply_step(lr)
    _synchronize(device)
    return t1 - t0, time.perf_counter() - t1, tokens


def _memory_cap(peaks: dict[int, int], base: int, usable: float, out_of_memory_at: int | None) -> int:
    """The largest micro-batch whose peak memory stays within ``usable`` bytes: on the line through the two
    largest measured peaks (through ``base``, the memory before the first step, when only one was measured),
    never below a measured micro-batch that stayed within it, below one that ran out of memory."""
    xs = sorted(peaks)
    if len(xs) >= 2:
        (m0, p0), (m1, p1) = (xs[-2], peaks[xs[-2]]), (xs[-1], peaks[xs[-1]])
    else:
        (m0, p0), (m1, p1) = (0, base), (xs[-1], peaks[xs[-1]])
    slope = (p1 - p0) / (m1 - m0)
    fitted = math.floor((usable - (p1 - slope * m1)) / slope) if slope > 0 else xs[-1]
    fitting = [m for m in xs if peaks[m] <= usable]
    cap = max([fitted, *fitting])
    if out_of_memory_at is not None:
        cap = min(cap, out_of_memory_at - 1)
    return max(cap, 1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cloned(obj: Any) -> Any:
    """A copy of a (nested) state dict whose tensors are copies too: a later step cannot change it."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return copy.deepcopy(obj)


def _save_training_state(worker: Worker, device: torch.device) -> dict[str, Any]:
    model = worker.model
    return {
        "tensors": {n: t.detach().clone() for n, t in itertools.chain(model.named_parameters(), model.named_buffers())},
        "grads": {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()},
        # Optimizer.state_dict() hands out the live state tensors, which the next step changes in place
        "optimizer": _cloned(worker.optimizer.state_dict()),
        "stream": copy.deepcopy(worker.stream.state_dict()),
        "max_proxy_micro_batch": worker.max_proxy_micro_batch,
        "training": model.training,
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }  # fmt: skip


def _restore_training_state(worker: Worker, saved: dict[str, Any], device: torch.device) -> None:
    model = worker.model
    live = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    with torch.no_grad():
        for name, value in saved["tensors"].items():
            live[name].copy_(value)
    for name, p in model.named_parameters():
        p.grad = saved["grads"][name]
    worker.optimizer.load_state_dict(saved["optimizer"])
    worker.stream.load_state_dict(saved["stream"])
    worker.max_proxy_micro_batch = saved["max_proxy_micro_batch"]
    model.train(saved["training"])
    torch.set_rng_state(saved["cpu_rng"])
    if saved["cuda_rng"] is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"], device)
