"""Measure this device with the model the run will train: the scenario's ``model`` (a built-in preset or a
``transformers`` model), at its sequence length, in the precision the run uses (the region's when the profile
is named after one, else ``training.precision``: with ``auto`` bf16 autocast on a GPU that has it, fp16 on one
that does not, fp32 on a CPU), with the run's AdamW. Each micro-batch size is warmed up (allocator, kernels, optimizer state),
then forward + backward and the optimizer step are each timed ``repeats`` times (the median counts). On
CUDA the largest micro-batch that fits is probed with ``torch.cuda.max_memory_allocated``. The result is a
:class:`~geomesh.hardware.WorkerProfile` with ``source="measured"``, accepted by ``geomesh plan --profile``
and both runtimes in place of the cost model.

This file is long because measuring a device is one procedure in two settings (a standalone profile and the
calibration of a live worker), whose windows, monotonicity checks and bounds must stay the same.

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
from .worker import PRECISION_DTYPES, Worker, make_inner_optimizer, resolve_precision

WARMUP_STEPS = 2  # full steps per micro-batch before timing: kernels chosen, AdamW state allocated
CALIBRATION_STEP_LIMIT = 24  # warm-ups and timed samples the given candidates may take in all (start-up stays short)
DEFAULT_CANDIDATES = 3  # micro-batches a calibration measures by default (fewer, each timed more often)
DEFAULT_REPEATS = 4  # timed samples per candidate (the median and the robust line count)
MEMORY_HEADROOM = 0.9  # the share of the device's memory a micro-batch may fill (as the memory model counts)
# a timed sample lasts at least this long: the mean of the steps that fill it where one step is shorter. A process
# under a CPU quota (CFS bandwidth control: 100 ms periods in containers and batch systems) runs a short step
# unthrottled or waits out the rest of a period, so one short step's time is bimodal; a window of five periods
# averages that out (simulated quotas of 0.1-0.6 of a core, steps of 2-120 ms: every candidate's median within 8%
# of its sustained time, 6% in nine cases of ten; windows of three periods: 15%, 9%).
# Always this long: a quota is not always visible to the process (inside `ip netns exec`, which mounts a /sys of
# its own, a container, a neighbour's load), and a GPU's clocks announce nothing either
WINDOW_S = 0.5
# the first stage's warm-up keeps the device busy for at least this many windows before anything is timed: a
# quota's first unthrottled period, a GPU's boost before its power limit holds the clock, spent untimed
WARMUP_WINDOWS = 2
MAX_WINDOW_STEPS = 256  # at most this many steps in one timed sample (and warm-up passes in the first stage)
KNEE = 0.9  # the planner's knee (PlanConstraints.knee): larger micro-batches are measured while they still pay
# a larger micro-batch measured faster than a smaller one by more than this (relative) is a table that does not
# grow with the micro-batch: measured again (a dip within it is the timer's noise on a flat GPU curve)
MONOTONE_SLACK = 0.02
MAX_REMEASURES = 2  # times a table that does not grow with the micro-batch is measured again
# a stage after the first (a larger size, a measurement again) starts only when what it is estimated to take fits
# within this many seconds of the calibration's start
CALIBRATION_BUDGET_S = 10.0


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
    # the precision the region of this name trains at (else the run's): the plan reads this profile for it
    regions = [i for i, r in enumerate(scenario.regions) if r.name == name]
    asked = scenario.region_precision(regions[0]) if regions else getattr(scenario.training, "precision", "auto")
    precision = resolve_precision(asked, torch.device(device))
    dtype = PRECISION_DTYPES.get(precision)
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
               "precision_name": precision,
               "activation_checkpointing": activation_checkpointing, "repeats": repeats, "warmup": WARMUP_STEPS,
               "table_noise": timing_noise(samples)},
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
                     repeats: int = DEFAULT_REPEATS, window_s: float = WINDOW_S,
                     budget_s: float = CALIBRATION_BUDGET_S,
                     remeasures: int = MAX_REMEASURES) -> Calibration:  # fmt: skip
    """Measure ``worker``'s sustained step time in place, for the model it really trains, and leave it as it was.

    The candidates are micro-batches ``m`` (the region's micro-batch: a region of ``size`` ranks splits it over
    them; default :func:`default_micro_batches` of ``training.batch``). Those up to the reference batch
    (``training.batch``: the planning rule's round is made of it; at least the two smallest) are always
    measured, in the first stage; larger ones only while they still pay: after each stage
    :func:`next_micro_batch` says whether the next size up (twice the largest measured, or the next candidate
    given if nearer, up to the largest given) is worth measuring, i.e. whether the throughput of the largest
    measured is still below :data:`KNEE` of what the measured line promises. A plan uses micro-batches near the
    knee of its throughput, so a slow region is not held for minutes at the micro-batches a fast GPU's
    datasheet would use.

    **Sustained speed, not a burst.** A step is a full training step (forward + backward of ``m`` sequences from
    the worker's own stream in one pass per rank, ``accumulate_grad``, then the optimizer step, ``apply_step``).
    The first stage's warm-up runs passes over its candidates (one step of each) until the device has been busy
    for :data:`WARMUP_WINDOWS` × ``window_s`` (at least ``warmup_steps`` passes, at most
    :data:`MAX_WINDOW_STEPS`), so what a CPU quota's first period or a GPU's boost clock allows is spent before
    anything is timed; a larger size's stage warms it up for ``warmup_steps`` steps (the device is busy by
    then). Then ``repeats`` timed samples per candidate, each the mean of the ``n`` consecutive steps that fill
    ``window_s`` (default :data:`WINDOW_S`, five periods of a 100 ms CPU quota) at the warm-up's mean step
    time (its second half), then at the mean step of the candidate's last sample (at most
    :data:`MAX_WINDOW_STEPS`; 1 without warm-up or with ``window_s`` 0; the longest of the region's ranks'). The
    window does not depend on detecting a quota: a
    quota is not always visible to the process (inside ``ip netns exec``, in a container), and a GPU announces
    nothing of its clocks. The candidates of a stage are interleaved: each pass over them runs one sample of
    every candidate (ascending, then descending, and so on), so a busy spell of the host falls on all of them
    alike; a larger size is measured beside the smallest (``anchor``), scaled onto the first stage.

    **Step times grow with the micro-batch.** A table in which a larger micro-batch is faster than a smaller one
    by more than :data:`MONOTONE_SLACK` (:func:`step_times_grow`: a burst, a busy spell) is measured again,
    every candidate afresh, interleaved (at most ``remeasures`` times in all, :data:`MAX_REMEASURES` by default;
    ``extra["remeasured"]``,
    ``extra["monotone"]``): the first stage's table before any larger size is read against it, the table with
    the larger sizes while the budget allows; the profile's ``table`` is the robust line through every timed
    sample
    (:func:`linear_fit`: Theil-Sen, never falling with the micro-batch), the median optimizer step its
    ``step_overhead_s``, the medians per candidate kept as ``extra["measured_table"]`` and their uncertainty
    as ``extra["table_noise"]`` (:func:`timing_noise`).

    **The plan's sizes are measured.** ``max_micro_batch`` is the largest micro-batch measured (a larger batch
    the plan gives is made of measured micro-batches by accumulation, never read off the line far beyond its
    points), at most what memory allows: on CUDA the peak memory of each micro-batch
    (``torch.cuda.max_memory_allocated``, ``extra["peak_memory_bytes"]``) gives the micro-batch at which the line
    through the two largest candidates' peaks reaches 90% of the device (a candidate that runs out of memory is
    dropped with every larger one, and no larger one is grown to); on CPU the worker's own bound
    (``max_proxy_micro_batch`` per rank). That bound is kept as ``extra["memory_max_micro_batch"]``.

    **Bounded wall time.** The first stage takes its warm-up (about :data:`WARMUP_WINDOWS` × ``window_s``, or
    ``warmup_steps`` passes when they are longer) and ``repeats`` samples per candidate of max(``window_s``,
    one step) each: with the defaults and steps shorter than the window, 1 + 3 × 4 × 0.5 = 7 s (two
    candidates: 5 s), and as much again for each measurement again of it (at most ``remeasures``).
    Every later stage (a larger size: about 4 s, its samples beside the anchor's; a measurement again of the
    whole table) starts only when what it is estimated to take (from the steps measured) fits within
    ``budget_s`` (:data:`CALIBRATION_BUDGET_S`, 10 s) of the start. So a calibration takes at most about
    max(``budget_s``, its first stage with its measurements again: 7 s, 19 s at worst), plus saving and
    restoring the worker's state.

    Afterwards parameters, buffers, gradients, the optimizer's state and settings, the stream's position,
    the random generators' states and the micro-batch bound are restored exactly. The worker's declared
    ``slowdown`` (an injected fault) is not measured: the scenario applies it to the profile.

    In a region of several ranks every rank calls it with the same arguments (the steps run the region's
    gradient reduction, which is part of its step time; each rank measures its own device); its own
    communication is only what keeps the ranks' steps alike: the warm-up's passes, the window's steps and
    whether to grow or measure again are agreed (the largest over the region's ranks). At most
    :data:`CALIBRATION_STEP_LIMIT` warm-ups and samples for the candidates given (the sizes grown to between
    them come on top, one doubling each); bad arguments raise ValueError, a smallest candidate that does not fit
    in memory :class:`~geomesh.errors.RunError`.
    """
    started = time.perf_counter()
    device = next(worker.model.parameters()).device
    on_cuda = device.type == "cuda"
    size = int(getattr(worker, "size", 1))  # a RegionWorker's ranks share each micro-batch
    cpu_cap = worker.max_proxy_micro_batch * size
    candidates = _candidates(micro_batches, worker.cfg.batch, None if on_cuda else cpu_cap)
    counts = (("warmup_steps", warmup_steps, 0), ("repeats", repeats, 1), ("remeasures", remeasures, 0))
    for label, value, least in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{label}={value!r}: expected an integer >= {least}")
    for label, value in (("window_s", window_s), ("budget_s", budget_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{label}={value!r}: expected seconds >= 0")
    steps_needed = len(candidates) * (warmup_steps + repeats)
    if steps_needed > CALIBRATION_STEP_LIMIT:
        raise ValueError(f"calibration of {len(candidates)} micro-batches x {warmup_steps + repeats} steps = "
                         f"{steps_needed} steps; at most {CALIBRATION_STEP_LIMIT}: fewer candidates or repeats")  # fmt: skip

    saved = _save_training_state(worker, device)
    run = _Measurement(worker, device, size, worker.optimizer.param_groups[0]["lr"], warmup_steps, repeats,
                       float(window_s), started)  # fmt: skip
    remeasured = 0
    try:
        worker.model.train()
        base = torch.cuda.memory_allocated(device) if on_cuda else 0
        stage = [m for m in candidates if m <= worker.cfg.batch]
        stage = stage if len(stage) >= 2 else candidates[:2]  # (a line needs two)
        run.measure(stage, sustain_s=WARMUP_WINDOWS * float(window_s) if warmup_steps else 0.0)

        def measure_again(budgeted: bool) -> None:  # while the table does not grow with the micro-batch
            nonlocal remeasured
            while remeasured < remeasures and len(run.active) >= 2:
                again = not step_times_grow(run.medians()) and (not budgeted or run.fits(run.remeasure_s(), budget_s))
                if _agreed_max(worker, device, [float(again)])[0] <= 0:
                    break
                run.remeasure()
                remeasured += 1

        measure_again(budgeted=False)  # (the first stage's: what every larger size is read against)
        while run.active and run.active[-1] == stage[-1]:  # (the largest ran out of memory: no larger one)
            medians = run.medians()
            wanted = next_micro_batch(medians, candidates) is not None
            larger = _larger(max(medians), candidates)  # (the same on every rank: the same candidates measured)
            if larger is None:
                break
            anchor = run.active[0]  # a larger size is measured beside the smallest, on the first stage's scale
            fits = run.fits(run.growth_s(larger, anchor), budget_s)
            if _agreed_max(worker, device, [float(wanted and fits)])[0] <= 0:
                break
            stage = [larger]
            run.measure(stage, anchor)
        measure_again(budgeted=True)
    finally:
        _restore_training_state(worker, saved, device)
    samples = {m: ts for m, ts in run.samples.items() if m in run.active and ts}
    peaks = {m: b for m, b in run.peaks.items() if m in run.active}
    table = {m: statistics.median(ts) for m, ts in samples.items()}
    if on_cuda:
        usable = MEMORY_HEADROOM * torch.cuda.get_device_properties(device).total_memory
        cap = _memory_cap(peaks, base, usable, run.out_of_memory_at)
    else:
        cap = cpu_cap
    seconds = time.perf_counter() - started
    extra: dict[str, Any] = {
        "device": str(device), "seq_len": run.seq_len, "params": sum(p.numel() for p in worker.model.parameters()),
        "precision": str(worker.autocast_dtype or torch.float32), "warmup": warmup_steps, "repeats": repeats,
        "calibrated_in_place": True, "calibration_s": seconds, "calibration_steps": run.steps,
        "window_s": window_s, "window_steps": {str(m): n for m, n in run.window.items() if m in table},
        "timed_steps": {str(m): n for m, n in run.timed_steps.items()},
        "warmup_s": run.warmup_s, "warmup_passes": run.warmup_passes, "budget_s": budget_s,
        "stage_scale": {str(m): f for m, f in run.scale.items() if m in table},
        "remeasured": remeasured, "monotone": step_times_grow(table), "memory_max_micro_batch": cap,
    }  # fmt: skip
    if on_cuda:
        extra["peak_memory_bytes"] = {str(m): b for m, b in peaks.items()}
    extra["measured_table"] = {str(m): s for m, s in table.items()}
    extra["table_noise"] = timing_noise(samples)
    profile = WorkerProfile(name=worker.name, gpu=torch.cuda.get_device_name(device) if on_cuda else "cpu",
                            gpu_count=size, max_micro_batch=max(1, min(cap, max(table))), table=linear_fit(samples),
                            step_overhead_s=statistics.median(run.step_times), source="measured", extra=extra)  # fmt: skip
    return Calibration(profile=profile, seconds=seconds, steps=run.steps)


def step_times_grow(medians: Mapping[int, float], slack: float = MONOTONE_SLACK) -> bool:
    """Whether measured step times (micro-batch -> seconds) grow with the micro-batch: no micro-batch is faster
    than a smaller one by more than ``slack`` (relative). A table that does not (a burst, a busy spell during one
    candidate's samples) is measured again, never read as a free larger micro-batch."""
    top = 0.0
    for m in sorted(medians):
        t = medians[m]
        if t < top * (1.0 - slack):
            return False
        top = max(top, t)
    return True


class _Measurement:
    """What one calibration measured so far (its samples, peaks and steps); :meth:`measure` runs one stage."""

    def __init__(self, worker: Worker, device: torch.device, size: int, lr: float, warmup_steps: int, repeats: int,
                 window_s: float, started: float) -> None:  # fmt: skip
        self.worker, self.device, self.size, self.lr = worker, device, size, lr  # (any rate: the steps are undone)
        self.warmup_steps, self.repeats, self.window_s, self.started = warmup_steps, repeats, window_s, started
        self.samples: dict[int, list[float]] = {}  # timed forward + backward per candidate (a window's mean each)
        self.window: dict[int, int] = {}  # steps per timed sample
        self.timed_steps: dict[int, int] = {}  # steps per candidate in its timed samples (the anchor's included)
        self.scale: dict[int, float] = {}  # a grown size's samples: the factor onto the first stage's scale
        self.peaks: dict[int, int] = {}
        self.step_times: list[float] = []
        self.active: list[int] = []  # the candidates measured that fit in memory, ascending
        self.out_of_memory_at: int | None = None
        self.steps = 0
        self.seq_len = 0
        self.clock = 0.0  # seconds of every step run so far (the budget's clock where steps are simulated)
        self.warmup_s = 0.0  # the first stage's warm-up: seconds and passes
        self.warmup_passes = 0

    # ---- what the measurements say ---------------------------------------------------------------------
    def medians(self) -> dict[int, float]:
        return {m: statistics.median(self.samples[m]) for m in self.active if self.samples.get(m)}

    def elapsed(self) -> float:
        return max(time.perf_counter() - self.started, self.clock)

    def fits(self, seconds: float, budget_s: float) -> bool:
        """Whether a stage estimated at ``seconds`` ends within ``budget_s`` of the calibration's start."""
        return self.elapsed() + seconds <= budget_s

    def _sample_s(self, m: int) -> float:
        """One timed sample of ``m``, as measured: its window's steps at its median step."""
        return self.window.get(m, 1) * (statistics.median(self.samples[m]) + self._optimizer_s())

    def _optimizer_s(self) -> float:
        return statistics.median(self.step_times) if self.step_times else 0.0

    def growth_s(self, larger: int, anchor: int) -> float:
        """What measuring ``larger`` beside ``anchor`` is estimated to take: its step read off the line through
        the measured medians (the next size up: at most twice the largest), its warm-up and timed samples."""
        fit = linear_fit(self.medians())
        lo, hi = min(fit), max(fit)
        slope = (fit[hi] - fit[lo]) / (hi - lo) if hi > lo else fit[hi] / hi
        step = max(fit[hi] + slope * (larger - hi), 0.0) + self._optimizer_s()
        window = step * _window_steps(self.window_s, step) if self.window_s > 0 and self.warmup_steps else step
        return self.warmup_steps * step + self.repeats * (window + self._sample_s(anchor))

    def remeasure_s(self) -> float:
        """What measuring every active candidate again is estimated to take (its timed samples)."""
        return self.repeats * math.fsum(self._sample_s(m) for m in self.active)

    # ---- measuring ---------------------------------------------------------------------------------------
    def _run(self, m: int, n: int) -> tuple[float, float] | None:
        """``n`` consecutive training steps of ``m``: (forward + backward s, optimizer s), summed; None when ``m``
        ran out of memory (it and every larger candidate dropped)."""
        self.worker.max_proxy_micro_batch = -(-m // self.size)  # one forward/backward per rank
        fb_total = opt_total = 0.0
        on_cuda = self.device.type == "cuda"
        try:
            if on_cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            for _ in range(n):
                fb_s, opt_s, tokens = _timed_training_step(self.worker, m, self.lr, self.device)
                fb_total, opt_total = fb_total + fb_s, opt_total + opt_s
                self.clock += fb_s + opt_s
                self.steps += 1
            if on_cuda:
                self.peaks[m] = max(self.peaks.get(m, 0), int(torch.cuda.max_memory_allocated(self.device)))
        except torch.cuda.OutOfMemoryError:
            self.worker.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if m == self.active[0]:
                raise RunError(f"calibration of {self.worker.name}: a micro-batch of {m} does not fit in "
                               f"{torch.cuda.get_device_name(self.device)}'s memory; give smaller micro-batches") from None  # fmt: skip
            self.out_of_memory_at = m if self.out_of_memory_at is None else min(self.out_of_memory_at, m)
            self.active = [x for x in self.active if x < m]
            return None
        self.seq_len = tokens // m
        return fb_total, opt_total

    def measure(self, stage: list[int], anchor: int | None = None, *, sustain_s: float = 0.0,
                warm_up: bool = True) -> None:  # fmt: skip
        """Warm ``stage`` up (``warmup_steps`` passes over it, one step of each, and more while the passes took
        less than ``sustain_s`` in all), then ``repeats`` timed samples of every micro-batch of ``stage``,
        interleaved; with ``anchor`` (a micro-batch measured before), its timed samples too, interleaved with
        the stage's, and the stage's samples scaled by its median before over its median now: a busy spell of the
        host that lasts the stage (a larger size alone takes many seconds on a slow region) moves the anchor as
        much as the stage, and cancels, so every size is on the first stage's scale (``scale`` records the
        factors). ``warm_up`` False: no warm-up, the windows known (a measurement again)."""
        self.active = sorted({*self.active, *stage})
        k = 0  # passes so far: each runs the candidates ascending, the next descending
        first: dict[int, float] = {}
        later: dict[int, list[float]] = {}  # the warm-up's steps after its first pass
        warm_s = 0.0
        while warm_up and (k < self.warmup_steps or (sustain_s > 0 and k < MAX_WINDOW_STEPS and _agreed_max(
                self.worker, self.device, [float(warm_s < sustain_s)])[0] > 0)):  # fmt: skip
            for m in stage if k % 2 == 0 else stage[::-1]:
                if m not in self.active:  # (dropped in this pass: a smaller one ran out of memory)
                    continue
                took = self._run(m, 1)
                if took is None:
                    continue
                warm_s += sum(took)
                if k == 0:
                    first[m] = sum(took)
                else:
                    later.setdefault(m, []).append(sum(took))
            k += 1
        if sustain_s > 0:
            self.warmup_s, self.warmup_passes = warm_s, k
        ms = [m for m in stage if m in first]
        if ms and self.window_s > 0:  # the window's steps at the warm-up's mean step, agreed over the ranks
            # (the warm-up's second half: a burst at its start spent)
            mean = [statistics.fmean(later[m][len(later[m]) // 2 :]) if later.get(m) else first[m] for m in ms]
            longest = _agreed_max(self.worker, self.device, mean)
            self.window.update({m: _window_steps(self.window_s, t) for m, t in zip(ms, longest)})
        now: list[float] = []  # the anchor's samples in this stage
        for _ in range(self.repeats):
            order = [anchor, *stage] if anchor is not None else stage
            steps: dict[int, float] = {}  # this pass's mean full step per candidate: the next windows' unit
            for m in order if k % 2 == 0 else order[::-1]:
                if m not in self.active:
                    continue
                n = self.window.get(m, 1)
                took = self._run(m, n)
                if took is None:
                    continue
                self.timed_steps[m] = self.timed_steps.get(m, 0) + n
                steps[m] = sum(took) / n
                if m == anchor and m not in stage:
                    now.append(took[0] / n)
                    continue
                self.samples.setdefault(m, []).append(took[0] / n)
                self.step_times.append(took[1] / n)
            k += 1
            # a window follows the steps as sampled (a warm-up in a burst gave too short a step: its first window
            # was long), agreed over the ranks
            ms = [m for m in steps if m in self.window]
            if ms:
                longest = _agreed_max(self.worker, self.device, [steps[m] for m in ms])
                self.window.update({m: _window_steps(self.window_s, t) for m, t in zip(ms, longest)})
        if anchor is not None and now and anchor in self.samples:
            f = statistics.median(self.samples[anchor]) / statistics.median(now)
            for m in stage:
                if m in self.samples:
                    self.samples[m] = [t * f for t in self.samples[m]]
                    self.scale[m] = f

    def remeasure(self) -> None:
        """Every active candidate measured afresh, interleaved, its earlier samples dropped (a table that did not
        grow with the micro-batch: which of its samples a burst or a busy spell moved is not known)."""
        for m in self.active:
            self.samples[m] = []
            self.scale.pop(m, None)
        self.measure(list(self.active), warm_up=False)


def _window_steps(window_s: float, step_s: float) -> int:
    """The steps of one timed sample: as many as fill ``window_s`` at ``step_s`` each, 1 to MAX_WINDOW_STEPS."""
    if step_s <= 0:
        return MAX_WINDOW_STEPS
    return max(1, min(MAX_WINDOW_STEPS, math.ceil(window_s / step_s)))


def _agreed_max(worker: Worker, device: torch.device, values: list[float]) -> list[float]:
    """Each of ``values`` as the largest over the region's ranks (every rank of a region decides alike); as given in
    a region of one rank."""
    if int(getattr(worker, "size", 1)) <= 1 or not values:
        return values
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=getattr(worker, "group", None))
    return [float(v) for v in t.tolist()]


def next_micro_batch(medians: Mapping[int, float], candidates: Sequence[int], *, knee: float = KNEE) -> int | None:
    """The next micro-batch a calibration measures above those measured (``medians``: micro-batch -> its median
    forward + backward time), or None: larger micro-batches are not worth measuring. Up to ``max(candidates)``,
    the next size is twice the largest measured, or the next candidate above it when that is nearer.

    Worth it while the largest measured, m₁, is below the knee of the line through the measured medians
    (:func:`linear_fit`, t = a + c·m, what the planner will read): its throughput m/t(m) reaches ``knee`` of the
    line's best, 1/c, at m = knee/(1−knee)·a/c, and a plan uses micro-batches up to about there. A GPU's times
    barely grow at small micro-batches (c small, the knee far off): the sizes grow; a CPU's grow in proportion
    (a small, the knee passed): they stop. The robust line, not the last two points: one noisy median would
    otherwise move the knee by its whole error times knee/(1−knee)."""
    if len(medians) < 2:
        return None
    fit = linear_fit(medians)
    lo, hi = min(fit), max(fit)
    slope = (fit[hi] - fit[lo]) / (hi - lo)
    intercept = fit[lo] - slope * lo
    if intercept <= 0 or knee / (1.0 - knee) * intercept / slope <= hi:
        return None
    return _larger(hi, candidates)


def _larger(last: int, candidates: Sequence[int]) -> int | None:
    """The next size up from ``last``: twice it, or the next of ``candidates`` above it when nearer; None past them."""
    above = sorted(m for m in candidates if m > last)
    return min(2 * last, above[0]) if above else None


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


def timing_noise(samples: Mapping[int, Sequence[float]]) -> float:
    """How well a calibration knows its step times (relative): the uncertainty of a candidate's median, from the
    dispersion of its timed samples around it (1.4826 × the median absolute log-ratio, pooled over the
    candidates), × 1.2533/√n for the median of n samples. The planner takes it as the uncertainty of the table's
    times (``extra["table_noise"]``): regions whose tables differ by less than their noise can tell are planned
    alike (:mod:`geomesh.planner.settle`). Not one sample's dispersion: two regions compared at a micro-batch are
    compared by their medians there, and a sample is a window of many quota periods (``WINDOW_S``), not one short
    step; what the line misses between candidates, the plan's rounds measure and correct where the plan runs."""
    residuals, counts = [], []
    for ts in samples.values():
        ts = [t for t in ts if t > 0]
        if len(ts) < 2:
            continue
        mid = statistics.median(ts)
        residuals += [abs(math.log(t / mid)) for t in ts]
        counts.append(len(ts))
    if not residuals:
        return 0.0
    return 1.4826 * statistics.median(residuals) * 1.2533 / math.sqrt(statistics.median(counts))


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
        "precision": worker.precision_state(),  # (fp16: the loss scaler's scale and growth tracker)
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
    worker.load_precision_state(saved["precision"])
    worker.stream.load_state_dict(saved["stream"])
    worker.max_proxy_micro_batch = saved["max_proxy_micro_batch"]
    model.train(saved["training"])
    torch.set_rng_state(saved["cpu_rng"])
    if saved["cuda_rng"] is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"], device)
