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
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from .config import ScenarioConfig
from .errors import RunError
from .hardware import WorkerProfile
from .models import build_proxy_model, enable_activation_checkpointing, model_name
from .worker import Worker, autocast_dtype, make_inner_optimizer

WARMUP_STEPS = 2  # full steps per micro-batch before timing: kernels chosen, AdamW state allocated
CALIBRATION_STEP_LIMIT = 24  # warm-ups and timed samples the given candidates may take in all (start-up stays short)
DEFAULT_CANDIDATES = 3  # micro-batches a calibration measures by default (fewer, each timed more often)
DEFAULT_REPEATS = 4  # timed samples per candidate (the median and the robust line count)
MEMORY_HEADROOM = 0.9  # the share of the device's memory a micro-batch may fill (as the memory model counts)
# a timed sample lasts at least this long: the mean of several steps where one step is shorter. A process under a
# CPU quota (CFS bandwidth control, 10-100 ms periods) runs a short step unthrottled or waits out the rest of a
# period, so one short step's time is bimodal; a window of many periods averages that out
WINDOW_S = 0.25
# without a quota over the process a step's time is not bimodal: a sample only evens out step-to-step jitter (the
# timer, the allocator, Python), which a few steps do; a window of quota periods there only makes start-up longer
UNTHROTTLED_WINDOW_S = 0.05
MAX_WINDOW_STEPS = 16  # at most this many steps in one timed sample
KNEE = 0.9  # the planner's knee (PlanConstraints.knee): larger micro-batches are measured while they still pay


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
                     repeats: int = DEFAULT_REPEATS, window_s: float | None = None) -> Calibration:  # fmt: skip
    """Measure ``worker``'s step time in place, for the model it really trains, and leave it as it was.

    The candidates are micro-batches ``m`` (the region's micro-batch: a region of ``size`` ranks splits it over
    them; default :func:`default_micro_batches` of ``training.batch``). Those up to the reference batch
    (``training.batch``: the planning rule's round is made of it; at least the two smallest) are always
    measured; larger ones only while they still pay: after each stage :func:`next_micro_batch` says whether the
    next size up (twice the largest measured, or the next candidate given if nearer, up to the largest given)
    is worth measuring, i.e. whether the throughput of the largest measured is still below :data:`KNEE` of what
    the measured line promises. A plan uses micro-batches near the knee of its throughput, so a slow region is
    not held for minutes at the micro-batches a fast GPU's datasheet would use. Each candidate runs
    ``warmup_steps`` untimed steps, then ``repeats`` timed samples, each the mean of ``n`` consecutive full
    training steps (forward + backward of ``m`` sequences from the worker's own stream in one pass per rank,
    ``accumulate_grad``, then the optimizer step, ``apply_step``), ``n`` the steps that fill ``window_s`` by the
    first warm-up step (at most :data:`MAX_WINDOW_STEPS`; 1 without warm-up or with ``window_s`` 0; by default
    :data:`WINDOW_S` where the process runs under a CPU quota, :func:`cpu_quota_period_s`, else
    :data:`UNTHROTTLED_WINDOW_S`; the longest of the region's ranks'). The
    candidates of a stage are interleaved: each pass over them runs one sample of every candidate (ascending,
    then descending, and so on), so a busy spell of the host falls on all of them alike. The profile's ``table``
    is the robust line through every timed sample (:func:`linear_fit`: Theil-Sen, monotone in the micro-batch),
    the median optimizer step its ``step_overhead_s``, the medians per candidate kept as
    ``extra["measured_table"]`` and their uncertainty as ``extra["table_noise"]`` (:func:`timing_noise`). On
    CUDA the peak memory of each micro-batch (``torch.cuda.max_memory_allocated``) is recorded
    (``extra["peak_memory_bytes"]``) and bounds ``max_micro_batch``: the micro-batch at which the line through
    the two largest candidates' peaks reaches 90% of the device (a candidate that runs out of memory is dropped
    with every larger one, and no larger one is grown to); on CPU it is the worker's own bound
    (``max_proxy_micro_batch`` per rank).

    Afterwards parameters, buffers, gradients, the optimizer's state and settings, the stream's position,
    the random generators' states and the micro-batch bound are restored exactly. The worker's declared
    ``slowdown`` (an injected fault) is not measured: the scenario applies it to the profile.

    In a region of several ranks every rank calls it with the same arguments (the steps run the region's
    gradient reduction, which is part of its step time; each rank measures its own device); its own
    communication is only what keeps the ranks' steps alike: the window's steps and whether to grow are agreed
    (the largest over the region's ranks). At most :data:`CALIBRATION_STEP_LIMIT` warm-ups and samples for the
    candidates given (the sizes grown to between them come on top, one doubling each); bad arguments raise
    ValueError, a smallest candidate that does not fit in memory :class:`~geomesh.errors.RunError`.
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
    if window_s is None:
        window_s = WINDOW_S if cpu_quota_period_s() is not None else UNTHROTTLED_WINDOW_S
    elif isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not 0 <= window_s < math.inf:
        raise ValueError(f"window_s={window_s!r}: expected seconds >= 0")
    steps_needed = len(candidates) * (warmup_steps + repeats)
    if steps_needed > CALIBRATION_STEP_LIMIT:
        raise ValueError(f"calibration of {len(candidates)} micro-batches x {warmup_steps + repeats} steps = "
                         f"{steps_needed} steps; at most {CALIBRATION_STEP_LIMIT}: fewer candidates or repeats")  # fmt: skip

    saved = _save_training_state(worker, device)
    run = _Measurement(worker, device, size, worker.optimizer.param_groups[0]["lr"], warmup_steps, repeats, window_s)
    try:
        worker.model.train()
        base = torch.cuda.memory_allocated(device) if on_cuda else 0
        stage = [m for m in candidates if m <= worker.cfg.batch]
        stage = stage if len(stage) >= 2 else candidates[:2]  # (a line needs two)
        anchor = None
        while stage:
            run.measure(stage, anchor)
            if not run.active or run.active[-1] != stage[-1]:  # (the largest ran out of memory: no larger one)
                break
            anchor = run.active[0]  # a larger size is measured beside the smallest, on the first stage's scale
            medians = {m: statistics.median(run.samples[m]) for m in run.active}
            wanted = next_micro_batch(medians, candidates) is not None
            larger = _larger(max(medians), candidates)  # (the same on every rank: the same candidates measured)
            stage = [larger] if larger is not None and _agreed_max(worker, device, [float(wanted)])[0] > 0 else []
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
        "stage_scale": {str(m): f for m, f in run.scale.items() if m in table},
    }  # fmt: skip
    if on_cuda:
        extra["peak_memory_bytes"] = {str(m): b for m, b in peaks.items()}
    extra["measured_table"] = {str(m): s for m, s in table.items()}
    extra["table_noise"] = timing_noise(samples)
    profile = WorkerProfile(name=worker.name, gpu=torch.cuda.get_device_name(device) if on_cuda else "cpu",
                            gpu_count=size, max_micro_batch=cap, table=linear_fit(samples),
                            step_overhead_s=statistics.median(run.step_times), source="measured", extra=extra)  # fmt: skip
    return Calibration(profile=profile, seconds=seconds, steps=run.steps)


class _Measurement:
    """What one calibration measured so far (its samples, peaks and steps); :meth:`measure` runs one stage."""

    def __init__(self, worker: Worker, device: torch.device, size: int, lr: float, warmup_steps: int, repeats: int,
                 window_s: float) -> None:  # fmt: skip
        self.worker, self.device, self.size, self.lr = worker, device, size, lr  # (any rate: the steps are undone)
        self.warmup_steps, self.repeats, self.window_s = warmup_steps, repeats, window_s
        self.samples: dict[int, list[float]] = {}  # timed forward + backward per candidate (a window's mean each)
        self.window: dict[int, int] = {}  # steps per timed sample
        self.scale: dict[int, float] = {}  # a grown size's samples: the factor onto the first stage's scale
        self.peaks: dict[int, int] = {}
        self.step_times: list[float] = []
        self.active: list[int] = []  # the candidates measured that fit in memory, ascending
        self.out_of_memory_at: int | None = None
        self.steps = 0
        self.seq_len = 0

    def measure(self, stage: list[int], anchor: int | None = None) -> None:
        """``warmup_steps`` then ``repeats`` timed samples of every micro-batch of ``stage``, interleaved; with
        ``anchor`` (a micro-batch measured before), its timed samples too, interleaved with the stage's, and the
        stage's samples scaled by its median before over its median now: a busy spell of the host that lasts
        the stage (a larger size alone takes many seconds on a slow region) moves the anchor as much as the
        stage, and cancels, so every size is on the first stage's scale (``scale`` records the factors)."""
        on_cuda = self.device.type == "cuda"
        self.active = sorted({*self.active, *stage})
        first: dict[int, float] = {}
        now: list[float] = []  # the anchor's samples in this stage
        for k in range(self.warmup_steps + self.repeats):
            if k == 1 and first and self.window_s > 0:  # after the first warm-up pass: the window's steps, agreed
                firsts = [first.get(m, 0.0) for m in stage]
                window_s, *longest = _agreed_max(self.worker, self.device, [self.window_s, *firsts])
                self.window = {**self.window, **{m: _window_steps(window_s, t) for m, t in zip(stage, longest)}}
            timed = k >= self.warmup_steps
            order = [anchor, *stage] if anchor is not None and timed else stage
            for m in order if k % 2 == 0 else order[::-1]:
                if m not in self.active:  # (dropped in this pass: a smaller one ran out of memory)
                    continue
                n = self.window.get(m, 1) if timed else 1
                self.worker.max_proxy_micro_batch = -(-m // self.size)  # one forward/backward per rank
                fb_total = opt_total = 0.0
                try:
                    if on_cuda:
                        torch.cuda.reset_peak_memory_stats(self.device)
                    for _ in range(n):
                        fb_s, opt_s, tokens = _timed_training_step(self.worker, m, self.lr, self.device)
                        fb_total, opt_total = fb_total + fb_s, opt_total + opt_s
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
                    continue
                self.seq_len = tokens // m
                if not timed:
                    first.setdefault(m, fb_total + opt_total)
                    continue
                if m == anchor and m not in stage:
                    now.append(fb_total / n)
                    continue
                self.samples.setdefault(m, []).append(fb_total / n)
                self.step_times.append(opt_total / n)
        if anchor is not None and now and anchor in self.samples:
            f = statistics.median(self.samples[anchor]) / statistics.median(now)
            for m in stage:
                if m in self.samples:
                    self.samples[m] = [t * f for t in self.samples[m]]
                    self.scale[m] = f


def cpu_quota_period_s(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The longest CFS period of a CPU quota over this process (its control group's, or an ancestor's: cgroup v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, cgroup v2's ``cpu.max``), in seconds; None under no quota, or
    where control groups cannot be read. A container's ``--cpus``, a batch system's CPU limit and the hosts test
    bed's ``--cpu`` are such quotas."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    periods: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        v2 = controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        mounts = [Path(root)] if v2 else [Path(root) / "cpu", Path(root) / controllers]
        mount = next((m for m in mounts if m.is_dir()), None)
        if mount is None:
            continue
        group = PurePosixPath(path if path.startswith("/") else "/" + path)
        for ancestor in [group, *group.parents]:
            where = mount / str(ancestor).lstrip("/")
            try:
                if v2:
                    quota, period = (where / "cpu.max").read_text().split()[:2]
                else:
                    quota, period = (where / "cpu.cfs_quota_us").read_text(), (where / "cpu.cfs_period_us").read_text()
                if quota.strip() not in ("max", "-1"):
                    periods.append(int(period) / 1e6)
            except (OSError, ValueError):
                continue
    return max(periods) if periods else None


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
