"""Elastic runs resume exactly and equal static ones: every region SIGKILLed then resumed ends bit-identical
to the uninterrupted run; without faults an elastic run is the static one (a file of its own, so make test's
two workers share the elastic tests)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
import torch
import yaml
from test_elastic import argv, processes, scenario, start

from geomesh.cli import launch as cli_launch
from geomesh.telemetry import read_events


@pytest.mark.long
# (one rank per region, each from its own folder: the hosts test bed, tests/test_hosts.py)
@pytest.mark.parametrize("strategy,ranks", [("fsdp", "2,1,1")])
def test_sigkill_every_region_then_resume_is_bit_identical(tmp_path, small_corpus, strategy, ranks):
    """Elastic regions checkpoint too (each region into DIR/checkpoints/<region>, with DCP): every process
    killed after the second of four rounds, the same command with --resume ends as the uninterrupted run (also
    with every region sharding θ, one of them over 2 ranks). The uninterrupted run is the static one: without
    faults membership through torchft changes nothing (the elastic run is the static run, bit for bit), so one
    reference proves both (a test of its own for the dense all-reduce below)."""
    path = scenario(tmp_path, small_corpus, strategy=strategy)
    ref = tmp_path / "ref"
    done = cli_launch.launch(cli_launch.build_parser().parse_args([*argv(path, ref, 7680, ranks=ranks),
                                                                   "--min-regions", "0"]),
                             extra_env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.code == 0, done.message
    assert "elastic" not in done.summary
    out, tag = tmp_path / "run", uuid.uuid4().hex
    cmd = [*argv(path, out, 7680, ranks=ranks), "--checkpoint-every", "1"]
    proc = start(cmd, tag, out, forked=True)
    try:
        deadline = time.monotonic() + 240
        while not all((out / "checkpoints" / r / "round-000002").is_dir() for r in ("r0-h100", "r1-a100", "r2-t4")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint of round 2 appeared"
            time.sleep(0.01)
    finally:
        for pid in processes(tag):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert not (out / "summary.json").exists()
    # the same command with --resume (in this process: only the killed run's processes had to be the product's own,
    # to be found and SIGKILLed)
    resumed = cli_launch.launch(cli_launch.build_parser().parse_args([*cmd, "--resume"]),
                                extra_env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert resumed.code == 0, resumed.message
    summary = json.loads((out / "summary.json").read_text())
    assert "elastic" in summary  # killed, resumed and elastic throughout: the static run's bits
    assert summary["final_val_loss"] == done.summary["final_val_loss"]
    a, b = torch.load(ref / "final_params.pt"), torch.load(out / "final_params.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rounds = [e["round"] for e in read_events(out / "events.jsonl") if e["type"] == "round"]
    assert rounds == [1, 2, 3, 4]


@pytest.mark.parametrize("method,strategy,ranks", [("diloco", "ddp", "1")])
def test_elastic_run_without_faults_equals_the_static_one(tmp_path, small_corpus, method, strategy, ranks):
    """Membership through torchft changes nothing when no region is lost: the same bits as the static run,
    here for the fp32 all-reduce (the all-gather of payloads, with regions that keep θ whole or shard it, is
    proved by the resume test above: its resumed elastic run ends as the static one). One region is 6x slower
    (its steps padded with sleep, which changes no bit): both runs book the others' wait for it as
    straggler_wait (the static barrier; the elastic exchange's first part), not as WAN time."""
    path = scenario(tmp_path, small_corpus, strategy=strategy)
    data = yaml.safe_load(path.read_text())
    data["regions"][2]["slowdown"] = 6.0
    path.write_text(yaml.safe_dump(data))
    runs = {}
    for name, extra in (("elastic", []), ("static", ["--min-regions", "0"])):
        args = cli_launch.build_parser().parse_args([*argv(path, tmp_path / name, 3840, method=method, ranks=ranks),
                                                     *extra])  # fmt: skip
        result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1"})
        assert result.code == 0, result.message
        runs[name] = result.summary
        events = read_events(tmp_path / name / "events.jsonl")
        rounds = [e for e in events if e["type"] == "round"]
        # every region's spans reach the run's end in the writer's records (a region's last exchange is recorded
        # by every leader, not only by its own)
        assert {e["worker"] for e in events if e["type"] == "span" and e["round"] == len(rounds)} == {
            "r0-h100", "r1-a100", "r2-t4"}, name  # fmt: skip
        waited = {region: sum(e["end"] - e["start"] for e in events if e["type"] == "span" and e["worker"] == region
                              and e["kind"] == "straggler_wait") for region in ("r0-h100", "r1-a100", "r2-t4")}
        behind = {region: sum(max(e["compute_s"]) - e["compute_s"][e["members"].index(region)] for e in rounds)
                  for region in ("r0-h100", "r1-a100")}  # fmt: skip
        # the slowest region waits for nobody; the others wait for it (elastic regions start their rounds as
        # torchft's quorum returns to each, up to a quorum tick apart, so their wait is looser than the barrier's)
        assert waited["r2-t4"] < 0.5 * min(waited["r0-h100"], waited["r1-a100"]), (name, waited)
        for region, seconds in behind.items():
            assert seconds > 0 and waited[region] >= (0.5 if name == "static" else 0.2) * seconds, (name, waited, behind)
    assert "elastic" in runs["elastic"] and "elastic" not in runs["static"]
    assert runs["elastic"]["final_val_loss"] == runs["static"]["final_val_loss"]
    a, b = torch.load(tmp_path / "elastic" / "final_params.pt"), torch.load(tmp_path / "static" / "final_params.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
