"""The emulated runtime's worker processes (runtime/emulated/parallel.py): same results as in-process, bit for bit.

Every comparison runs the *current* scenario and method code twice (in-process, then in worker processes)
and compares the two runs; no number is hard-coded, so planner or scenario changes cannot break it."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from geomesh.cli import main
from geomesh.config import FaultConfig
from geomesh.methods import get_method
from geomesh.runtime.emulated import EmulatedRun, RunError, RunOptions
from geomesh.runtime.emulated.parallel import PoolError, WorkerPool, assign_owners, default_processes, worker_threads


def run(scenario, method, out, **opts):
    em = EmulatedRun(scenario, get_method(method), RunOptions(out_dir=out, progress=False, **opts))
    return em, em.run()


def assert_same(a_dir, b_dir, a_run, b_run):
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a_dir, b_dir))
    for s in (sa, sb):
        s.pop("wall_clock_s"), s.pop("setup_s")  # real seconds of this machine
    assert sa == sb
    assert (a_dir / "events.jsonl").read_bytes() == (b_dir / "events.jsonl").read_bytes()
    for name, want in a_run.cluster.global_model.state_dict().items():
        assert torch.equal(b_run.cluster.global_model.state_dict()[name], want), name
    for wa, wb in zip(a_run.cluster.workers, b_run.cluster.workers):  # state brought back from the processes
        for name, want in wa.model.state_dict().items():
            assert torch.equal(wb.model.state_dict()[name], want), (wa.name, name)
        assert wa.stream.state_dict() == wb.stream.state_dict()


FAULTS = [FaultConfig(1, "r0-h100", "slowdown", 2.0), FaultConfig(1, "r1-a100", "nan"), FaultConfig(1, "r2-t4", "leave"),
          FaultConfig(2, "r0-h100", "corrupt"), FaultConfig(2, "r2-t4", "join")]  # fmt: skip


def faulty(tiny_scenario):
    """The tiny scenario with every kind of fault in rounds 1-2 and GeoMesh's batches capped, so that a small
    budget holds enough rounds for all of them."""
    s = tiny_scenario(tokens=12000, zero_shot_items=0)
    s.faults = list(FAULTS)
    s.geomesh.max_batch = 16
    return s


@pytest.mark.parametrize("method", ["diloco", "geomesh", "ddp"])
@pytest.mark.filterwarnings("ignore:worker r")  # the injected NaN and corrupt rounds
def test_worker_processes_give_the_serial_run_bit_for_bit(tiny_scenario, tmp_path, method):
    """Faults included: a NaN worker (dropped, AdamW healed in its process; under DDP the step is skipped), a
    corrupted payload, a worker leaving and rejoining (fresh AdamW and residual, in its process), a slowdown
    the planner re-plans for. DDP's workers compute their gradients in their processes, summed here."""
    s = faulty(tiny_scenario)
    s.geomesh.error_feedback = method == "geomesh"  # a codec with state that must live in the worker's process
    serial, _ = run(s, method, tmp_path / "serial", workers_parallel=1)
    parallel, summary = run(s, method, tmp_path / "parallel", workers_parallel=2)
    assert parallel.workers_parallel == 2 and serial.workers_parallel == 1
    assert summary["rounds"] >= 3 and summary["dropped_updates"] == 1
    assert summary["rejected_payloads"] == (0 if method == "ddp" else 1)  # ddp has no payload to corrupt
    assert_same(tmp_path / "serial", tmp_path / "parallel", serial, parallel)


@pytest.mark.parametrize("method", ["geomesh", "ddp"])
@pytest.mark.filterwarnings("ignore:worker r")
def test_worker_processes_checkpoint_and_resume_exactly(tiny_scenario, tmp_path, monkeypatch, method):
    """Checkpoints written from worker processes hold each worker's state (fetched from its process); an
    interrupted parallel run resumed in parallel ends exactly where the uninterrupted serial run ends."""
    s = faulty(tiny_scenario)
    s.geomesh.error_feedback = True
    ref, _ = run(s, method, tmp_path / "ref", workers_parallel=1, checkpoint_every=1)

    class Interrupted(Exception):
        pass

    original = EmulatedRun._barrier_spans

    def barrier(self, compute, exchange_s):
        if self.rounds == 2:  # the third round, after the checkpoints of rounds 1 and 2
            raise Interrupted
        return original(self, compute, exchange_s)

    monkeypatch.setattr(EmulatedRun, "_barrier_spans", barrier)
    with pytest.raises(Interrupted):
        run(s, method, tmp_path / "run", workers_parallel=2, checkpoint_every=1)
    monkeypatch.undo()
    resumed = EmulatedRun(s, get_method(method), RunOptions(out_dir=tmp_path / "run", progress=False, resume=True,
                                                               checkpoint_every=1, workers_parallel=2))  # fmt: skip
    assert resumed.resumed_from == 2
    resumed.run()
    assert_same(tmp_path / "ref", tmp_path / "run", ref, resumed)


def test_owners_spread_skewed_work_and_defaults_follow_the_cores():
    assert assign_owners([3072, 1188, 390, 150], 2) == [0, 1, 1, 1]  # one fast GPU does most of the work
    assert assign_owners([200, 200, 200, 200], 2) == [0, 1, 0, 1]
    assert assign_owners([5, 1, 1], 3) == [0, 1, 2]
    assert default_processes(4, cores=1) == 1  # one core: in-process
    assert default_processes(4, cores=2) == 2
    assert default_processes(3, cores=16) == 3  # never more processes than workers
    assert default_processes(4, device="cuda", cores=16) == 1
    assert worker_threads(4, cores=2) == 1 and worker_threads(4, cores=16) == 4 and worker_threads(1, cores=1) == 1


def test_pool_runs_calls_in_the_owner_and_reports_failures():
    state = {"n": 0}

    def bump(i, x):  # runs in worker i's process: its own copy of ``state``
        state["n"] += x
        if x == 3:
            warnings.warn(f"worker {i} saw 3")
        return (i, state["n"])

    def boom(i, _):
        raise ValueError(f"worker {i} is broken")

    with WorkerPool({"bump": bump, "boom": boom}, owners=[0, 1, 0]) as pool:
        assert pool.map("bump", [(0, 1), (1, 10), (2, 100)]) == [(0, 1), (1, 10), (2, 101)]
        with pytest.warns(UserWarning, match="worker 1 saw 3"):
            assert pool.map("bump", [(1, 3)]) == [(1, 13)]
        with pytest.raises(PoolError, match="ValueError: worker 2 is broken"):
            pool.map("boom", [(2, None)])
        assert pool.map("bump", [(2, 0)]) == [(2, 101)]  # the pool survives a failed call
    assert state["n"] == 0  # the parent's copy never changed


def test_bad_workers_parallel_is_one_clear_error(tiny_scenario, tmp_path, capsys):
    s = tiny_scenario()
    with pytest.raises(RunError, match="--workers-parallel 0"):
        EmulatedRun(s, get_method("diloco"), RunOptions(workers_parallel=0))
    assert EmulatedRun(s, get_method("diloco"), RunOptions(workers_parallel=8)).workers_parallel == 3
    path = tmp_path / "tiny.yaml"
    code = main(["train", str(path), "--method", "diloco", "--out", str(tmp_path / "o"), "--workers-parallel", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --workers-parallel -1")
