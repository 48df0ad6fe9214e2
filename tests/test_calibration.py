"""Calibration in place (geomesh.profiler.calibrate_worker): a live region worker's measured profile, and
training afterwards bit-identical to training without it."""

from __future__ import annotations

import math

import pytest
import torch

from geomesh.hardware import WorkerProfile
from geomesh.methods import get_method
from geomesh.planner.settle import table_noise
from geomesh.profiler import (CALIBRATION_BUDGET_S, CALIBRATION_STEP_LIMIT, DEFAULT_REPEATS, MAX_REMEASURES,
                              MAX_WINDOW_STEPS, WARMUP_WINDOWS, WINDOW_S, Calibration, calibrate_worker,
                              default_micro_batches, linear_fit, next_micro_batch, step_times_grow, timing_noise)
from geomesh.runtime.distributed.region import RegionWorker, build_training

STEPS = 4


def region_worker(sc, region: int = 0) -> RegionWorker:
    """Region ``region``'s worker on this (CPU) rank, built as the distributed runtime builds it."""
    training = build_training(sc, region, seed=0, device=torch.device("cpu"))
    return RegionWorker(sc.regions[region].name, training.replica, training.stream, sc.training,
                        device=torch.device("cpu"))  # fmt: skip


def train(worker: RegionWorker, steps: int) -> None:
    worker.train(steps, worker.cfg.batch, lambda k: worker.cfg.inner_lr * (1 + k) / steps)


def assert_same_training_state(a: RegionWorker, b: RegionWorker) -> None:
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), f"parameter {name} differs"
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for field, value in sa["state"][k].items():
            assert torch.equal(value, sb["state"][k][field]), f"optimizer state {k}.{field} differs"
    assert a.stream.state_dict() == b.stream.state_dict()


@pytest.mark.parametrize("trained_before, window_s", [(0, WINDOW_S), (2, 0.05)], ids=["before round 0", "mid-training"])
def test_calibration_leaves_training_bit_identical(tiny_scenario, trained_before, window_s):
    sc = tiny_scenario()
    plain, calibrated = region_worker(sc), region_worker(sc)
    train(plain, trained_before), train(calibrated, trained_before)
    result = calibrate_worker(calibrated, window_s=window_s)
    # a sustained warm-up (WARMUP_WINDOWS windows, or MAX_WINDOW_STEPS passes), then DEFAULT_REPEATS timed samples
    # per candidate, each a window of steps (and, where the table did not grow, all of them again)
    extra = result.profile.extra
    windows = extra["window_steps"]
    assert sorted(int(m) for m in windows) == default_micro_batches(sc.training.batch)
    assert extra["window_s"] == window_s and extra["calibration_steps"] == result.steps
    assert extra["warmup_s"] >= WARMUP_WINDOWS * window_s or extra["warmup_passes"] == MAX_WINDOW_STEPS
    assert result.steps == len(windows) * extra["warmup_passes"] + sum(extra["timed_steps"].values())
    assert all(n >= DEFAULT_REPEATS * (1 + extra["remeasured"]) for n in extra["timed_steps"].values())
    assert calibrated.max_proxy_micro_batch == plain.max_proxy_micro_batch
    assert_same_training_state(plain, calibrated)
    torch.manual_seed(123)  # the same random state for both from here: calibration restored the generator too
    train(plain, STEPS)
    torch.manual_seed(123)
    train(calibrated, STEPS)
    assert_same_training_state(plain, calibrated)


def test_the_measured_profile_plans_the_region(tiny_scenario):
    sc = tiny_scenario()
    worker = region_worker(sc, region=1)
    # (one-step samples: no measurement again of a table they may leave uneven, the steps counted exactly)
    result = calibrate_worker(worker, [1, 2, 4], warmup_steps=1, repeats=2, window_s=0, remeasures=0)
    assert isinstance(result, Calibration) and result.seconds > 0 and result.steps == 9
    profile = result.profile
    assert isinstance(profile, WorkerProfile) and profile.source == "measured"
    assert (profile.name, profile.gpu, profile.gpu_count) == (sc.regions[1].name, "cpu", 1)
    assert sorted(profile.table) == [1, 2, 4]
    assert all(math.isfinite(t) and t > 0 for t in profile.table.values()) and profile.step_overhead_s > 0
    # the plan's micro-batches are measured ones: at most the largest measured (on CPU the worker's own bound
    # is what memory allows)
    assert profile.max_micro_batch == 4
    assert profile.extra["memory_max_micro_batch"] == worker.max_proxy_micro_batch
    assert profile.extra["seq_len"] == sc.model.seq_len and profile.extra["calibration_s"] == result.seconds
    assert "peak_memory_bytes" not in profile.extra  # CUDA only
    # how well the medians are known: the planner's measure of what the table can tell apart (its size is the
    # machine's: one-step samples on a busy one scatter by more than 2x)
    noise = profile.extra["table_noise"]
    assert math.isfinite(noise) and noise >= 0 and table_noise(profile) == noise
    # as a `geomesh profile` file would be: it round-trips and plans the region in place of the cost model
    assert WorkerProfile.from_json(profile.to_json()).table == profile.table
    profiles = sc.worker_profiles({sc.regions[1].name: profile})
    assert profiles[1] is profile and profiles[0].source == "model"
    plan = get_method("geomesh").plan(sc, profiles)
    assert plan.worker(sc.regions[1].name).compute_s > 0


def test_default_candidates_and_bad_arguments(tiny_scenario):
    assert default_micro_batches(4) == [1, 2, 4]
    assert default_micro_batches(6) == [1, 4, 6]
    assert default_micro_batches(64) == [1, 32, 64]
    assert default_micro_batches(64, cap=8) == [1, 4, 8]
    # the reference batch (training.batch) measured too, where the plan's micro-batches go beyond it
    assert default_micro_batches(47, 64, reference=4) == [1, 4, 47]
    assert default_micro_batches(60, 64, reference=32) == [1, 32, 60]
    assert default_micro_batches(4, 64, reference=4) == [1, 2, 4] and default_micro_batches(64, 8, 16) == [1, 4, 8]
    worker = region_worker(tiny_scenario())
    with pytest.raises(ValueError, match="positive integers"):
        calibrate_worker(worker, [0, 2])
    with pytest.raises(ValueError, match="at most 64 sequences"):
        calibrate_worker(worker, [128])
    with pytest.raises(ValueError, match=f"at most {CALIBRATION_STEP_LIMIT}"):
        calibrate_worker(worker, [1, 2, 4, 8, 16], repeats=4)
    with pytest.raises(ValueError, match="repeats=0"):
        calibrate_worker(worker, [1], repeats=0)
    with pytest.raises(ValueError, match="remeasures=-1"):
        calibrate_worker(worker, [1], remeasures=-1)
    with pytest.raises(ValueError, match="window_s=-1"):
        calibrate_worker(worker, [1], window_s=-1)
    with pytest.raises(ValueError, match="budget_s=nan"):
        calibrate_worker(worker, [1], budget_s=float("nan"))


def test_the_planner_sees_the_measured_times_as_a_line():
    """A noisy dip (32 sequences measured as fast as 16) must not make a micro-batch look free: the profile
    keeps the median (Theil-Sen) line through every point, growing with the batch; the raw times are kept too."""
    noisy = {1: 0.010, 16: 0.035, 32: 0.035, 47: 0.060}
    fit = linear_fit(noisy)
    assert sorted(fit) == sorted(noisy)
    assert fit[1] < fit[16] < fit[32] < fit[47]
    slope = (fit[47] - fit[1]) / 46
    assert abs(fit[16] - (fit[1] + 15 * slope)) < 1e-12  # a line
    flat = linear_fit({1: 0.02, 8: 0.02})  # no growth measured at all: still a positive cost per sequence
    assert flat[8] > flat[1] > 0
    assert linear_fit({4: 0.5}) == {4: 0.5}


def test_the_table_noise_is_the_uncertainty_of_the_medians():
    """The samples' dispersion around each candidate's own median (not around a line that may not fit the
    curve: that misfit is no noise), over √n for the median of n samples."""
    assert timing_noise({1: [0.01, 0.01], 16: [0.04, 0.04]}) == 0.0
    noisy = {1: [0.01 * 1.05, 0.01 / 1.05], 16: [0.04 * 1.05, 0.04 / 1.05]}
    assert timing_noise(noisy) == pytest.approx(1.4826 * math.log(1.05) * 1.2533 / math.sqrt(2))
    # a curve the line through it misses is known as well as its samples say: a straight line is no noise
    curved = {1: [0.010] * 4, 8: [0.030] * 4, 16: [0.090] * 4}
    assert timing_noise(curved) == 0.0
    # four times the samples: half the uncertainty
    four = {m: [t * 1.05, t / 1.05] * 4 for m, t in ((1, 0.01), (16, 0.04))}
    assert timing_noise(four) == pytest.approx(timing_noise(noisy) / 2)
    assert timing_noise({1: [0.01]}) == 0.0  # (one sample tells nothing of its noise)


def test_the_line_ignores_a_slow_step():
    """Every timed step counts (a micro-batch -> its times): one step slowed 5x by a busy host moves the
    median line by nothing, where a least-squares line would tilt, and the medians per candidate are kept
    in the profile as measured (the calibration's extra)."""
    clean = {1: [0.010, 0.010, 0.010], 16: [0.040, 0.040, 0.040], 32: [0.072, 0.072, 0.072]}
    slowed = {**clean, 16: [0.040, 0.200, 0.040]}
    assert linear_fit(slowed) == pytest.approx(linear_fit(clean), rel=1e-9)
    fit = linear_fit(clean)
    assert fit[1] < fit[16] < fit[32]


def test_calibration_interleaves_the_candidates(tiny_scenario, monkeypatch):
    """Each pass over the candidates runs one step of every one (ascending, then descending), so a busy spell
    of the host falls on all of them alike; the warm-up pass is not timed."""
    import geomesh.profiler as profiler

    order = []
    real = profiler._timed_training_step

    def spy(worker, m, lr, device):
        order.append(m)
        return real(worker, m, lr, device)

    monkeypatch.setattr(profiler, "_timed_training_step", spy)
    result = calibrate_worker(region_worker(tiny_scenario()), [1, 2, 4], warmup_steps=1, repeats=2, window_s=0,
                              remeasures=0)  # fmt: skip
    assert order == [1, 2, 4, 4, 2, 1, 1, 2, 4] and result.steps == 9
    assert sorted(result.profile.extra["measured_table"]) == ["1", "2", "4"]


def simulated(monkeypatch, step_s, run: bool = True):
    """Calibration's clock replaced: each training step really runs (and is undone; with ``run`` False none runs),
    but takes ``step_s(m, k)`` seconds (forward + backward; the optimizer step a tenth of a millisecond), k
    counting every step of m."""
    import geomesh.profiler as profiler

    real, counts, order = profiler._timed_training_step, {}, []

    def fake(worker, m, lr, device):
        _, _, tokens = real(worker, m, lr, device) if run else (0, 0, 16 * m)
        k = counts[m] = counts.get(m, -1) + 1
        order.append(m)
        return step_s(m, k), 1e-4, tokens

    monkeypatch.setattr(profiler, "_timed_training_step", fake)
    return order


class Quota:
    """A CPU quota simulated (CFS bandwidth control): ``share`` of a core in every ``period`` s, after ``burst_s``
    seconds of CPU run unthrottled (a burst that ends). :meth:`run` is the wall time ``cpu_s`` of CPU takes from
    now on the process's clock."""

    def __init__(self, share: float, period: float = 0.1, burst_s: float = 0.0):
        self.share, self.period, self.burst = share, period, burst_s
        self.now = self.used = self.start = 0.0

    def run(self, cpu_s: float) -> float:
        began, left = self.now, cpu_s
        free = min(self.burst, left)
        self.burst, left, self.now = self.burst - free, left - free, self.now + free
        while left > 1e-12:
            start = math.floor(self.now / self.period + 1e-9) * self.period
            if start != self.start:
                self.start, self.used = start, 0.0
            room = min(self.share * self.period - self.used, left, start + self.period - self.now)
            if room <= 1e-12:  # the period's quota is spent: throttled until the next period
                self.now = start + self.period
                continue
            self.used, left, self.now = self.used + room, left - room, self.now + room
        return self.now - began


def under_quota(monkeypatch, quota: Quota, cpu_s=lambda m: 0.005 * m, optimizer_s: float = 2e-4):
    """Calibration's steps replaced by ``quota``'s clock: each takes the wall time its CPU (``cpu_s(m)`` forward +
    backward, then the optimizer's) takes under the quota (no step runs: hundreds of them fill the windows)."""
    import geomesh.profiler as profiler

    def fake(worker, m, lr, device):
        return quota.run(cpu_s(m)), quota.run(optimizer_s), m * 16  # (tokens: 16 a sequence)

    monkeypatch.setattr(profiler, "_timed_training_step", fake)


def test_a_timed_sample_is_a_window_that_measures_the_sustained_speed_under_a_quota(tiny_scenario, monkeypatch):
    """A region held to a quarter of a core (100 ms periods) whose steps take 5-20 ms of CPU: a short step runs
    unthrottled, or waits out the rest of the period, so one step's time says little of the region's speed
    (the bed: 0.049 s at 1, 0.096 s at 4 and 0.102 s at 7 sequences, and the plan gave the slowest region the most
    work). Each timed sample is the mean of the steps that fill WINDOW_S (five periods), after a warm-up that
    kept the device busy for WARMUP_WINDOWS windows: the table is the sustained time, CPU / 0.25, within a few
    percent, and grows with the micro-batch; one step per sample reads the unthrottled bursts instead. Nothing
    detects the quota: the window is the same with or without one."""
    worker = region_worker(tiny_scenario())
    sustained = {m: 0.005 * m / 0.25 for m in (1, 2, 4)}
    under_quota(monkeypatch, Quota(0.25))
    extra = calibrate_worker(worker, [1, 2, 4]).profile.extra
    assert extra["window_s"] == WINDOW_S and extra["warmup_s"] >= WARMUP_WINDOWS * WINDOW_S
    assert all(n * sustained[int(m)] >= 0.8 * WINDOW_S for m, n in extra["window_steps"].items())
    measured = {int(m): t for m, t in extra["measured_table"].items()}
    assert measured == pytest.approx(sustained, rel=0.1) and step_times_grow(measured)
    under_quota(monkeypatch, Quota(0.25))
    single = calibrate_worker(worker, [1, 2, 4], window_s=0, remeasures=0).profile.extra["measured_table"]
    assert single["1"] < 0.5 * sustained[1]  # (a burst's speed, four times too fast)
    # a burst that ends (the first 0.5 s of CPU unthrottled: a cgroup's burst, a GPU's boost) is spent in the warm-up
    under_quota(monkeypatch, Quota(0.25, burst_s=0.5))
    burst = calibrate_worker(worker, [1, 2, 4]).profile.extra["measured_table"]
    assert {int(m): t for m, t in burst.items()} == pytest.approx(sustained, rel=0.1)
    # a window is never more than MAX_WINDOW_STEPS steps
    simulated(monkeypatch, lambda m, k: 1e-6)
    windows = calibrate_worker(worker, [1, 2], window_s=1.0).profile.extra["window_steps"]
    assert set(windows.values()) == {MAX_WINDOW_STEPS}


def test_a_table_that_does_not_grow_with_the_micro_batch_is_measured_again(tiny_scenario, monkeypatch):
    """The first stage's samples of 4 sequences fall in a burst (measured faster than 2): the table does not grow
    with the micro-batch, so every candidate is measured again, afresh; the second measurement grows and is the
    profile. A table that never grows is measured again MAX_REMEASURES times, then kept as the monotone line
    through its samples, never read beyond its largest micro-batch; the first stage's table is measured again
    whatever the budget (every larger size is read against it)."""
    worker = region_worker(tiny_scenario())
    first_stage = 1 + DEFAULT_REPEATS  # steps of each candidate before a measurement again (window_s 0)
    simulated(monkeypatch, lambda m, k: 0.002 if m == 4 and k < first_stage else 0.001 + 0.002 * m, run=False)
    profile = calibrate_worker(worker, [1, 2, 4], window_s=0).profile
    assert profile.extra["remeasured"] == 1 and profile.extra["monotone"]
    measured = {int(m): t for m, t in profile.extra["measured_table"].items()}
    assert measured == pytest.approx({1: 0.003, 2: 0.005, 4: 0.009})
    assert not step_times_grow({1: 0.003, 2: 0.005, 4: 0.002}) and step_times_grow({1: 0.003, 2: 0.00499, 4: 0.009})
    order = simulated(monkeypatch, lambda m, k: 0.010 if m == 4 else 0.001 + 0.01 * m, run=False)
    profile = calibrate_worker(worker, [1, 2, 4], window_s=0).profile
    extra = profile.extra
    assert extra["remeasured"] == MAX_REMEASURES and not extra["monotone"]
    assert len(order) == 3 * first_stage + MAX_REMEASURES * 3 * DEFAULT_REPEATS
    assert profile.max_micro_batch == 4 and profile.table[1] < profile.table[2] < profile.table[4]
    simulated(monkeypatch, lambda m, k: 0.010 if m == 4 else 0.001 + 0.01 * m, run=False)
    extra = calibrate_worker(worker, [1, 2, 4], window_s=0, budget_s=0).profile.extra
    assert extra["remeasured"] == MAX_REMEASURES


def test_calibration_time_is_bounded(tiny_scenario, monkeypatch):
    """A GPU's curve (time barely grows: larger sizes pay) would grow to the largest candidate; each larger size is
    measured only when what it is estimated to take fits within budget_s of the start (the simulated steps are
    the clock here; CALIBRATION_BUDGET_S by default): with 60 s, every size; with 12 s, the sizes that fit; with
    none left after the first stage, no larger one."""
    worker = region_worker(tiny_scenario())
    gpu = lambda m, k: 0.5 + 0.001 * m  # noqa: E731  (half a second a step: far above the real steps' time)
    simulated(monkeypatch, gpu, run=False)
    table = calibrate_worker(worker, [1, 4, 64], window_s=0, budget_s=60).profile.table
    assert sorted(table) == [1, 4, 8, 16, 32, 64] and CALIBRATION_BUDGET_S < 60
    simulated(monkeypatch, gpu, run=False)
    # the first stage: 2 x 5 steps = 5 s; 8 beside 1: 9 steps, 4.5 s, fits in 12; 16 would end at 14 s
    extra = calibrate_worker(worker, [1, 4, 64], window_s=0, budget_s=12).profile.extra
    assert sorted(int(m) for m in extra["measured_table"]) == [1, 4, 8] and extra["budget_s"] == 12
    assert extra["calibration_steps"] == 19
    simulated(monkeypatch, gpu, run=False)
    profile = calibrate_worker(worker, [1, 4, 64], window_s=0, budget_s=0).profile
    assert sorted(profile.table) == [1, 4] and profile.max_micro_batch == 4


def test_larger_micro_batches_are_measured_only_while_they_pay(tiny_scenario, monkeypatch):
    """The candidates up to the reference batch (the tiny scenario's 4) are measured; larger ones, doubling up to
    the largest given, only while the line through the two largest measured still has its knee above them. A CPU
    (time in proportion to the batch) stops at the reference: a slow region is not held at the micro-batches a
    fast GPU's datasheet plan would use; a GPU (time nearly flat) grows to the top. (No step really runs: the
    simulated times are the clock, so a busy machine's slower real steps do not spend the calibration's budget.)"""
    worker = region_worker(tiny_scenario())
    cpu = simulated(monkeypatch, lambda m, k: 0.001 + 0.010 * m, run=False)
    profile = calibrate_worker(worker, [1, 4, 64], window_s=0).profile
    assert sorted(profile.table) == [1, 4] and set(cpu) == {1, 4}
    gpu = simulated(monkeypatch, lambda m, k: 0.010 + 0.0001 * m, run=False)
    profile = calibrate_worker(worker, [1, 4, 64], window_s=0).profile
    assert sorted(profile.table) == [1, 4, 8, 16, 32, 64]
    assert gpu[: 2 * (1 + DEFAULT_REPEATS)] == [1, 4, 4, 1, 1, 4, 4, 1, 1, 4]  # the first stage interleaved
    # a knee between: a fixed part a = 0.02 s, c = 0.01 s per sequence: the knee at 9a/c = 18 sequences, so 32 is
    # measured (16 is below the knee) and 64 is not
    simulated(monkeypatch, lambda m, k: 0.02 + 0.01 * m, run=False)
    assert sorted(calibrate_worker(worker, [1, 4, 64], window_s=0).profile.table) == [1, 4, 8, 16, 32]
    simulated(monkeypatch, lambda m, k: 0.05 + 0.01 * m, run=False)  # the knee at 45: up to the largest given, 40
    assert sorted(calibrate_worker(worker, [1, 4, 40], window_s=0).profile.table) == [1, 4, 8, 16, 32, 40]


def test_a_larger_size_is_measured_beside_the_smallest_so_a_busy_spell_cancels(tiny_scenario, monkeypatch):
    """A grown size is measured alone after the first stage (seconds, on a slow region): a busy spell of the host
    that lasts it (here every step three times slower from the growth stage on) would make it look 3x slower,
    the line through it wrong at every size (on the bed: a 0.15-core region's 16 measured at 3.0 s against 0.86 s
    at 8). Measured beside the smallest size, interleaved, and scaled onto the first stage by that one's
    medians, it is what it is."""
    import geomesh.profiler as profiler

    real, count = profiler._timed_training_step, [0]

    def fake(worker, m, lr, device):
        _, _, tokens = real(worker, m, lr, device)
        count[0] += 1
        spell = 3.0 if count[0] > 2 * (1 + DEFAULT_REPEATS) else 1.0  # from the second stage on
        return spell * (0.05 + 0.01 * m), 1e-4, tokens

    monkeypatch.setattr(profiler, "_timed_training_step", fake)
    extra = calibrate_worker(region_worker(tiny_scenario()), [1, 4, 8], window_s=0).profile.extra
    assert extra["measured_table"] == pytest.approx({"1": 0.06, "4": 0.09, "8": 0.13})
    assert extra["stage_scale"] == pytest.approx({"8": 1 / 3})
    assert count[0] == 2 * (1 + DEFAULT_REPEATS) + (1 + 2 * DEFAULT_REPEATS)  # the anchor: timed samples only


def test_next_micro_batch():
    cpu = {1: 0.2, 8: 0.92}  # the bed's slowest region: a = 0.097, c = 0.103, knee at 8.5
    assert next_micro_batch(cpu, [1, 8, 64]) == 16
    assert next_micro_batch({**cpu, 16: 1.95}, [1, 8, 64]) is None  # the robust line's knee, 6, is passed
    # one median 10% high: the last two points alone would put the knee at 17 (and measure 32: 23 s at 0.15 of a
    # core on the bed); the line through all three keeps it at 10
    assert next_micro_batch({1: 0.249, 8: 1.105, 16: 2.002}, [1, 8, 64]) is None
    assert next_micro_batch({1: 0.010, 8: 0.011}, [1, 8, 64]) == 16  # a GPU: barely grows
    assert next_micro_batch({1: 0.010, 8: 0.010}, [1, 8, 64]) == 16  # no growth at all: grow past it
    assert next_micro_batch({1: 0.010, 8: 0.011}, [1, 8, 12, 64]) == 12  # a candidate given nearer than 2x
    assert next_micro_batch({1: 0.010, 32: 0.011}, [1, 32, 48]) == 48  # never past the largest given
    assert next_micro_batch({1: 0.010, 48: 0.011}, [1, 32, 48]) is None
    assert next_micro_batch({8: 0.9}, [1, 8, 64]) is None  # one point: no line
