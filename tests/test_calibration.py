"""Calibration in place (geomesh.profiler.calibrate_worker): a live region worker's measured profile, and
training afterwards bit-identical to training without it."""

from __future__ import annotations

import math

import pytest
import torch

from geomesh.hardware import WorkerProfile
from geomesh.methods import get_method
from geomesh.planner.settle import table_noise
from geomesh.profiler import (CALIBRATION_STEP_LIMIT, DEFAULT_REPEATS, Calibration, calibrate_worker,
                              default_micro_batches, linear_fit)
from geomesh.profiler import timing_noise
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


@pytest.mark.parametrize("trained_before", [0, 2], ids=["before round 0", "mid-training"])
def test_calibration_leaves_training_bit_identical(tiny_scenario, trained_before):
    sc = tiny_scenario()
    plain, calibrated = region_worker(sc), region_worker(sc)
    train(plain, trained_before), train(calibrated, trained_before)
    result = calibrate_worker(calibrated)
    # 1 warm-up + DEFAULT_REPEATS timed per candidate
    assert result.steps == len(default_micro_batches(sc.training.batch)) * (1 + DEFAULT_REPEATS)
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
    result = calibrate_worker(worker, [1, 2, 4], warmup_steps=1, repeats=2)
    assert isinstance(result, Calibration) and result.seconds > 0 and result.steps == 9
    profile = result.profile
    assert isinstance(profile, WorkerProfile) and profile.source == "measured"
    assert (profile.name, profile.gpu, profile.gpu_count) == (sc.regions[1].name, "cpu", 1)
    assert sorted(profile.table) == [1, 2, 4]
    assert all(math.isfinite(t) and t > 0 for t in profile.table.values()) and profile.step_overhead_s > 0
    assert profile.max_micro_batch == worker.max_proxy_micro_batch  # on CPU the worker's own bound
    assert profile.extra["seq_len"] == sc.model.seq_len and profile.extra["calibration_s"] == result.seconds
    assert "peak_memory_bytes" not in profile.extra  # CUDA only
    # how far one timed step is from the line: the planner's measure of what the table can tell apart
    assert 0 <= profile.extra["table_noise"] < 1 and table_noise(profile) == profile.extra["table_noise"]
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


def test_the_table_noise_is_one_steps_dispersion_around_the_table():
    line = {1: 0.01, 16: 0.04}
    assert timing_noise({1: [0.01, 0.01], 16: [0.04, 0.04]}, line) == 0.0
    noisy = {1: [0.01 * 1.05, 0.01 / 1.05], 16: [0.04 * 1.05, 0.04 / 1.05]}
    assert timing_noise(noisy, line) == pytest.approx(1.4826 * math.log(1.05))


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
    result = calibrate_worker(region_worker(tiny_scenario()), [1, 2, 4], warmup_steps=1, repeats=2)
    assert order == [1, 2, 4, 4, 2, 1, 1, 2, 4] and result.steps == 9
    assert sorted(result.profile.extra["measured_table"]) == ["1", "2", "4"]
