"""The distributed runtime: real rank processes over Gloo on loopback, against the emulated runtime.

Every launch here starts real processes (``geomesh launch`` machinery), so the file runs a handful of them:
3 ranks of GeoMesh (identical parameters on every rank, equal to the emulated runtime, the documented
summary), 2 regions x 2 ranks with DDP inside each region, a rank that dies, and network namespaces with
kernel rate limits (skipped where namespaces cannot be made).
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FIXED_PLAN, bench_script, tiny_scenario_dict

from geomesh.cli import launch as cli_launch
from geomesh.checkpoint import fingerprint_hash
from geomesh.config import ConfigError, load_scenario
from geomesh.methods import get_method
from geomesh.network import WanModel
from geomesh.runtime.distributed import params_checksum, parse_ranks_per_region, rank_layout
from geomesh.runtime.checkpoint_state import run_fingerprint
from geomesh.runtime.emulated import EmulatedRun, RunOptions
from geomesh.runtime.distributed.transport import ABSENT, SLOT_HEADER_NBYTES, split_gathered
from geomesh.runtime.distributed.wan_shaper import WanShaper
from geomesh.testbed.netns import netns_unavailable_reason
from geomesh.telemetry import read_events

SUMMARY_FIELDS = ("method", "scenario", "runtime", "seed", "tokens", "rounds", "modeled_time_s", "final_val_loss",
                  "target_val_loss", "time_to_target_s", "straggler_idle_frac", "wan_idle_frac", "utilization",
                  "bytes_sent", "bytes_per_round", "proxy_bytes_sent", "dropped_updates", "proxy_params",
                  "timing_params", "plan", "per_worker", "curve", "modeled", "wall_clock_s",
                  "payload_bytes_per_worker", "exchange_s_per_round", "collective", "world_size",
                  "ranks_per_region", "param_checksums", "model", "model_params")  # fmt: skip
# one thread per rank, as the emulated runtime in this process (conftest): the same float results
RANK_ENV = {"OMP_NUM_THREADS": "1"}
TOKENS = 6000


def write_scenario(folder: Path, paths: list[str], gpus, counts=None, geomesh=None, **training) -> Path:
    data = tiny_scenario_dict(paths, gpus, **training)
    data["geomesh"].update(FIXED_PLAN)
    for region, count in zip(data["regions"], counts or [1] * len(gpus)):
        region["count"] = count
    data["geomesh"].update(geomesh or {})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def launch(argv: list[str], env: dict[str, str] | None = None) -> cli_launch.LaunchResult:
    args = cli_launch.build_parser().parse_args(["launch", *argv])
    return cli_launch.launch(args, extra_env={**RANK_ENV, **(env or {})})


def emulated_run(scenario_path: Path, method: str, tokens: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The emulated runtime's final parameters and summary for the same scenario, method and tokens."""
    run = EmulatedRun(load_scenario(scenario_path), get_method(method), RunOptions(tokens=tokens, progress=False))
    summary = run.run()
    return run.cluster.global_model.state_dict(), summary


def emulated_params(scenario_path: Path, method: str, tokens: int) -> dict[str, torch.Tensor]:
    return emulated_run(scenario_path, method, tokens)[0]


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], **tol, msg=lambda m, name=name: f"{name}: {m}")


# ---- pieces that need no processes ------------------------------------------------------------------


def test_ranks_fill_regions_in_order(tiny_scenario):
    s = tiny_scenario(gpus=("H100", "A100", "T4"))
    assert rank_layout(s, 3).counts == (1, 1, 1)
    layout = rank_layout(s, 5, [2, 1, 2])
    assert [layout.region_of(r) for r in range(5)] == [0, 0, 1, 2, 2]
    assert layout.leaders == [0, 2, 3]
    assert parse_ranks_per_region("2", 3) == [2, 2, 2]
    for bad in ("0", "1,x", "1,2"):
        with pytest.raises(ConfigError, match="ranks-per-region"):
            parse_ranks_per_region(bad, 3)
    with pytest.raises(ConfigError, match="does not fit"):
        rank_layout(s, 4)
    with pytest.raises(ConfigError, match="add up to"):
        rank_layout(s, 4, [1, 1, 1])


def test_gathered_payloads_keep_rank_order_and_absent_slots():
    slots = [b"GMSH" + bytes([i]) * 4 for i in range(3)]
    slots[1] = ABSENT + bytes(4)
    gathered = torch.frombuffer(bytearray(b"".join(slots)), dtype=torch.uint8)
    assert split_gathered(gathered, 8) == [slots[0], None, slots[2]]


def test_shaper_holds_to_the_wan_model():
    wan = WanModel(rtt_s=((0, 0.1), (0.1, 0)), bandwidth_Bps=((1e9, 1e6), (1e6, 1e9)))
    assert WanShaper(wan, "shaper").allgather_s(10**6) == pytest.approx(0.05 + 1.0)
    assert WanShaper(wan, "latency").allgather_s(10**6) == pytest.approx(0.05)
    assert WanShaper(wan, "none").allreduce_s(10**6) == 0.0
    assert WanShaper(wan, "shaper").allreduce_s(10**6) == pytest.approx(2 * (0.05 + 0.5))


def test_an_exchange_without_a_barrier_books_the_wait_for_the_slowest():
    from geomesh.runtime.distributed.exchange import wait_for_slowest_s

    infos = [{"region": 0, "compute_s": 1.0}, {"region": 1, "compute_s": 2.5}, {"region": 2, "compute_s": None},
             {"region": 3, "compute_s": float("nan")}]  # fmt: skip
    assert wait_for_slowest_s(infos, 1.0) == pytest.approx(1.5)
    assert wait_for_slowest_s(infos, 2.5) == 0.0  # the slowest waits for nobody
    assert wait_for_slowest_s([], 1.0) == 0.0


def test_two_launches_at_once_never_hand_out_the_same_port(monkeypatch, tmp_path):
    """A picked port is reserved on this machine for PORT_RESERVED_S (its ranks bind it seconds later on a busy
    machine): 200 picks over a range of 400 ports are 200 different ports (random picks alone would almost surely
    repeat one), a port claimed once is refused to the next claim, and a claim older than the window is taken
    over."""
    from geomesh.runtime.distributed import transport

    monkeypatch.setattr(transport, "PORT_RESERVATIONS", tmp_path / "ports")
    monkeypatch.setattr(transport, "LOWEST_PICKED_PORT", 20000)
    monkeypatch.setattr(transport, "ephemeral_ports", lambda: (20400, 60999))  # 400 ports: repeats are likely
    picks = [transport.free_port() for _ in range(200)]
    assert len(set(picks)) == len(picks) and all(20000 <= p < 20400 for p in picks)
    now = time.time()
    assert transport.reserve_port(40001, now) and not transport.reserve_port(40001, now + 1)
    assert transport.reserve_port(40001, now + transport.PORT_RESERVED_S + 1)


def test_a_local_launch_port_is_free_and_below_the_ephemeral_range(monkeypatch, tmp_path):
    """The rendezvous port of a local launch is one no outgoing connection can take as its source port before the
    rank binds it (a busy machine's Gloo connections took an ephemeral one: EADDRINUSE): below the kernel's
    range, bindable; where the range leaves no room below it, an ephemeral port still."""
    import socket

    from geomesh.runtime.distributed import transport

    low, _ = transport.ephemeral_ports()
    ports = {transport.free_port() for _ in range(20)}
    assert all(transport.LOWEST_PICKED_PORT <= p < low for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
    squeezed = tmp_path / "range"
    squeezed.write_text(f"{transport.LOWEST_PICKED_PORT}\t60999\n")
    monkeypatch.setattr(transport, "EPHEMERAL_RANGE_FILE", str(squeezed))
    assert transport.ephemeral_ports() == (transport.LOWEST_PICKED_PORT, 60999)
    assert transport.free_port() >= transport.LOWEST_PICKED_PORT  # the kernel's pick
    squeezed.write_text("not a range")
    assert transport.ephemeral_ports() == (32768, 60999)


def test_checksum_sees_any_sampled_change():
    params = {"a": torch.arange(10_000, dtype=torch.float32), "b": torch.ones(3)}
    before = params_checksum(params)
    assert params_checksum({k: v.clone() for k, v in params.items()}) == before
    params["a"][0] += 1e-6
    assert params_checksum(params) != before


# ---- 3 ranks of GeoMesh ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def geomesh_run(tmp_path_factory, small_corpus):
    """3 ranks, one per region (H100, A100, T4), planned b_i and H_i all different, over the shaper."""
    folder = tmp_path_factory.mktemp("dist-geomesh")
    scenario = write_scenario(folder, small_corpus, ("H100", "A100", "T4"), geomesh={"max_batch": 16})
    out = folder / "run"
    result = launch([str(scenario), "--nproc", "3", "--method", "geomesh", "--out", str(out), "--tokens",
                     str(TOKENS), "--save-params", "--quiet", "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    return scenario, out, result.summary


def test_three_ranks_with_different_plans_end_identical(geomesh_run):
    summary = geomesh_run[2]
    plan = [(w["batch"], w["inner_steps"]) for w in summary["plan"]["workers"]]
    assert len({b for b, _ in plan}) == 3 and len({h for _, h in plan}) == 3, plan
    assert summary["rounds"] >= 2
    checksums = summary["param_checksums"]  # every rank's θ at the end (and checked after every round)
    assert len(checksums) == 3 and len(set(checksums)) == 1


def test_distributed_equals_emulated(geomesh_run):
    scenario, out, summary = geomesh_run
    expected, s = emulated_run(scenario, "geomesh", TOKENS)
    assert_same_params(torch.load(out / "final_params.pt"), expected, rtol=1e-5, atol=1e-6)
    assert summary["tokens"] == s["tokens"] and summary["rounds"] == s["rounds"]
    assert summary["final_val_loss"] == pytest.approx(s["final_val_loss"], rel=1e-5)
    assert summary["plan"] == s["plan"]


def test_summary_and_events_follow_the_formats(geomesh_run):
    _, out, summary = geomesh_run
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    for field in SUMMARY_FIELDS:
        assert field in summary, field
    assert summary["runtime"] == "distributed" and summary["wan"] == "shaper" and summary["world_size"] == 3
    # bytes on the wire: the ring all-gather sends each leader's slot and forwards N−2 others, N−1 = 2 slots
    # per leader per round (docs/formats.md)
    payload = summary["proxy_payload_bytes"]
    assert summary["collective"] == "all_gather"
    # (each slot carries its head: a payload or "no update", and the round it belongs to)
    assert summary["bytes_sent"] == summary["rounds"] * 3 * 2 * (payload + SLOT_HEADER_NBYTES)
    assert summary["proxy_bytes_sent"] == summary["rounds"] * 3 * payload
    events = read_events(out / "events.jsonl")
    assert events[0]["type"] == "run" and events[0]["runtime"] == "distributed"
    assert sum(e["type"] == "round" for e in events) == summary["rounds"]
    spans = [e for e in events if e["type"] == "span"]
    assert {e["kind"] for e in spans} >= {"compute", "straggler_wait", "comm_wait"}
    for worker, totals in summary["per_worker"].items():
        mine = sorted((e for e in spans if e["worker"] == worker), key=lambda e: e["start"])
        assert mine[0]["start"] == 0.0
        for a, b in itertools.pairwise(mine):  # the spans tile the worker's timeline
            assert b["start"] == pytest.approx(a["end"], abs=1e-9)
        parts = totals["compute"] + totals["straggler_wait"] + totals["comm_wait"] + totals["other"]
        assert parts == pytest.approx(totals["wall"])
        # the shaper holds every exchange at least as long as the WAN model says
        assert totals["comm_wait"] >= summary["rounds"] * summary["shaper_s_per_round"] * 0.999


# ---- DDP inside regions -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["diloco", "geomesh"])
def test_two_regions_of_two_ranks_train_with_ddp(method, tmp_path, small_corpus, capsys, monkeypatch):
    """`geomesh launch` end to end: 4 ranks, regions of 2 ranks each, DDP inside, the summary printed."""
    scenario = write_scenario(tmp_path, small_corpus, ("A100", "T4"), counts=[2, 2])
    out = tmp_path / "run"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = cli_launch.main(["launch", str(scenario), "--nproc", "4", "--method", method, "--out", str(out),
                            "--tokens", "5000", "--save-params", "--quiet", "--wan", "none", "--timeout", "60"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "runtime: distributed" in captured.out and "world_size: 4" in captured.out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks_per_region"] == {"r0-a100": 2, "r1-t4": 2}
    assert len(set(summary["param_checksums"])) == 1
    assert summary["intra_region_bytes"] > 0  # the leaders broadcast the reduced update inside their region
    # the region's ranks split its batch, so the region computes the emulated worker's gradient (up to float
    # summation order; with 1-bit payloads that can flip the sign of a few near-zero elements of Δ)
    tol = {"rtol": 1e-4, "atol": 1e-5} if method == "diloco" else {"rtol": 0.0, "atol": 1e-2}
    assert_same_params(torch.load(out / "final_params.pt"), emulated_params(scenario, method, 5000), **tol)


# ---- failures -------------------------------------------------------------------------------------------


def test_a_dead_rank_stops_the_others_with_a_clear_error(tmp_path, small_corpus):
    scenario = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"))
    timeout = 30
    result = launch([str(scenario), "--nproc", "3", "--method", "geomesh", "--out", str(tmp_path / "run"),
                     "--tokens", "20000", "--quiet", "--timeout", str(timeout)],
                    env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "1:1"})  # fmt: skip
    assert result.code == 1
    assert result.message.startswith("rank 1 (region r1-a100) died (exit code 17")
    dead = result.ranks[1]
    for k in (0, 2):
        rank = result.ranks[k]
        assert rank.code == 1 and not rank.killed
        assert rank.at - dead.at < timeout  # stopped by the error, not by the launcher
        assert f"error: rank {k} (region" in rank.error_line() and "a rank died or hung" in rank.error_line()
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "0"], "--nproc 0"),
        (["--nproc", "4"], "does not fit"),
        (["--nproc", "3", "--wan", "carrier-pigeon"], "--wan 'carrier-pigeon'"),
        (["--nproc", "3", "--method", "async-local-sgd", "--min-regions", "2", "--async-order", "modeled"],
         "not with elastic regions"),
        (["--nproc", "3", "--method", "sgd9000"], "unknown method 'sgd9000'"),
        (["--nproc", "3", "--ranks-per-region", "1,x"], "--ranks-per-region"),
        (["--nproc", "3", "--set", "training.tokens=-1"], "training.tokens"),
        (["--nproc", "3", "--backend", "mpi"], "--backend 'mpi'"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, message, tmp_path, small_corpus, capsys):
    scenario = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"))
    method = [] if "--method" in argv else ["--method", "geomesh"]
    full = ["launch", str(scenario), "--out", str(tmp_path / "run"), *method, *argv]
    assert cli_launch.main(full) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "logs").exists()  # nothing started


def test_a_rank_outside_a_launch_says_how_to_start(monkeypatch, capsys, tmp_path, small_corpus):
    from geomesh.cli import rank as run

    scenario = write_scenario(tmp_path, small_corpus, ("H100",))
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = run.build_parser().parse_args([str(scenario), "--method", "geomesh", "--out", str(tmp_path / "r")])
    assert run._main(args) == 2
    err = capsys.readouterr().err
    assert "$RANK is not set" in err and err.count("\n") == 1


# ---- network namespaces ---------------------------------------------------------------------------------


def test_netns_wan_puts_real_bytes_on_a_slow_link(tmp_path, small_corpus):
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    rate_gbps, rtt_ms = 0.01, 60  # 10 Mbit/s, 30 ms each way
    scenario = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"))
    data = yaml.safe_load(scenario.read_text())
    data["wan"] = {"rtt": [[0 if i == j else rtt_ms for j in range(3)] for i in range(3)], "bandwidth_gbps": rate_gbps}
    scenario.write_text(yaml.safe_dump(data))
    result = launch([str(scenario), "--nproc", "3", "--method", "geomesh", "--out", str(tmp_path / "run"),
                     "--tokens", "4000", "--quiet", "--wan", "netns", "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    s = result.summary
    payload = s["proxy_payload_bytes"]
    rounds = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["type"] == "round"]
    assert len(rounds) == s["rounds"] >= 2
    for r in rounds:
        # every leader puts its payload on the wire to each of the 2 others (ring or direct), plus TCP/IP headers
        assert r["wire_bytes"] >= 3 * 2 * payload
        # the exchange took at least the ring's latency (2 steps of 30 ms) plus one payload at 10 Mbit/s
        assert r["exchange_s"] >= 2 * rtt_ms / 2 / 1000 + payload * 8 / (rate_gbps * 1e9)
    assert s["wire_bytes_sent"] == sum(r["wire_bytes"] for r in rounds)
    assert s["wire_bytes_sent"] < 4 * s["rounds"] * 3 * 2 * payload  # headers, barrier and acks: not much more
    assert result.netns["rate"] == "htb"


# ---- any model, any data: as the emulated runtime builds them ------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip


def test_a_transformers_llama_on_token_shards_trains_as_in_the_emulated_runtime(tmp_path, small_corpus):
    pytest.importorskip("transformers")
    import numpy as np

    from geomesh.data import write_token_file

    rng = np.random.default_rng(0)
    for k in range(2):  # two shard files, memory-mapped as one token array
        write_token_file(tmp_path / "shards" / f"part{k}.bin", np.tile(rng.integers(0, 500, 499), 30))
    scenario = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"))
    data = yaml.safe_load(scenario.read_text())
    data["model"] = {"seq_len": 32, "hf_config": LLAMA}
    data["data"] = {"tokens_file": str(tmp_path / "shards"), "vocab_size": 512}
    data["logging"] = {"tensorboard": True}
    scenario.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    result = launch([str(scenario), "--nproc", "3", "--method", "geomesh", "--out", str(out), "--tokens",
                     str(TOKENS), "--save-params", "--quiet", "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    s = result.summary
    emulated = EmulatedRun(load_scenario(scenario), get_method("geomesh"),
                           RunOptions(out_dir=tmp_path / "emulated", tokens=TOKENS, progress=False))  # fmt: skip
    expected = emulated.run()
    assert s["model"] == expected["model"] == "llama (transformers)"  # both runtimes name what trained
    assert s["model_params"] == expected["proxy_params"] == emulated.cluster.global_model.num_params()
    assert len(set(s["param_checksums"])) == 1
    assert s["tokens"] == expected["tokens"] and s["final_val_loss"] == pytest.approx(expected["final_val_loss"])
    assert s["zero_shot"] == pytest.approx(expected["zero_shot"])  # scored at the end, as the emulated runtime does
    assert any((out / "tensorboard").iterdir())  # the scenario's logging section is honoured on rank 0
    assert_same_params(torch.load(out / "final_params.pt"), emulated.cluster.global_model.state_dict(),
                       rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.exec_ranks  # it watches the launcher's Popen
def test_ddp_all_reduces_every_step_across_regions(tmp_path, small_corpus, capsys, monkeypatch):
    """`--method ddp`: 2 regions (2 ranks + 1), a gradient all-reduce per step held by the WAN shaper; the same
    parameters as the emulated runtime's DDP; every rank's environment and log lines name its region."""
    scenario = write_scenario(tmp_path, small_corpus, ("A100", "T4"), counts=[2, 1])
    envs: dict[int, str] = {}
    real_popen = cli_launch.subprocess.Popen

    def popen(cmd, env=None, **kw):  # what the launcher hands each rank
        envs[int(env["RANK"])] = env["GEOMESH_REGION"]
        return real_popen(cmd, env=env, **kw)

    monkeypatch.setattr(cli_launch.subprocess, "Popen", popen)
    out = tmp_path / "run"
    tokens = 2000
    result = launch([str(scenario), "--nproc", "3", "--method", "ddp", "--out", str(out), "--tokens", str(tokens),
                     "--save-params", "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    assert envs == {0: "r0-a100", 1: "r0-a100", 2: "r1-t4"}
    err = capsys.readouterr().err
    assert "[rank 0 region r0-a100] [ddp] round 0" in err
    s = result.summary
    step_tokens = 2 * 4 * 32  # regions x training.batch x seq_len
    assert s["method"] == "ddp" and s["collective"] == "all_reduce"
    assert s["rounds"] == -(-tokens // step_tokens) and s["tokens"] == s["rounds"] * step_tokens
    grad_bytes = 4 * s["model_params"]
    assert s["payload_bytes_per_worker"] == grad_bytes
    assert s["bytes_sent"] == s["rounds"] * 2 * grad_bytes  # each of the 2 leaders, every step
    assert len(set(s["param_checksums"])) == 1 and len(s["param_checksums"]) == 3
    for totals in s["per_worker"].values():  # every step's all-reduce is held to the WAN model
        assert totals["comm_wait"] >= s["rounds"] * s["shaper_s_per_round"] * 0.999
    assert sum(e["type"] == "round" for e in read_events(out / "events.jsonl")) == s["rounds"]
    emulated = EmulatedRun(load_scenario(scenario), get_method("ddp"), RunOptions(tokens=tokens, progress=False))
    e = emulated.run()
    assert e["rounds"] == s["rounds"]
    assert_same_params(torch.load(out / "final_params.pt"), emulated.cluster.global_model.state_dict(),
                       rtol=1e-4, atol=1e-5)  # fmt: skip


def test_fsdp_inside_a_region_trains_as_ddp(tmp_path, small_corpus):
    """One region of 2 ranks: FSDP2 (fully_shard over Gloo) ends with DDP's global parameters. (FSDP with bf16
    and activation checkpointing: test_gpu_check_script_runs_at_cpu_size.)"""
    finals = {}
    for name, region in [("ddp", {"strategy": "ddp"}), ("fsdp", {"strategy": "fsdp"})]:
        scenario = write_scenario(tmp_path / name, small_corpus, ("A100",), counts=[2])
        data = yaml.safe_load(scenario.read_text())
        data["regions"][0].update(region)
        scenario.write_text(yaml.safe_dump(data))
        result = launch([str(scenario), "--nproc", "2", "--method", "diloco", "--out", str(tmp_path / name / "run"),
                         "--tokens", "3000", "--save-params", "--quiet", "--wan", "none", "--timeout", "60"])  # fmt: skip
        assert result.code == 0, result.message
        assert len(set(result.summary["param_checksums"])) == 1
        finals[name] = (torch.load(tmp_path / name / "run" / "final_params.pt"), result.summary)
    assert_same_params(finals["fsdp"][0], finals["ddp"][0], rtol=1e-4, atol=1e-5)


def strategy_runs(tmp_path: Path, small_corpus, method: str, tokens: int, *extra: str,
                  env: dict[str, str] | None = None, strategies=("ddp", "fsdp"), region1: str = "ddp") -> dict:  # fmt: skip
    """The same 3-rank launch with region 0 (2 ranks) under each strategy, region 1 one rank (``region1``)."""
    runs = {}
    for strategy in strategies:
        scenario = write_scenario(tmp_path / strategy, small_corpus, ("A100", "T4"), counts=[2, 1])
        data = yaml.safe_load(scenario.read_text())
        data["regions"][0]["strategy"] = strategy
        data["regions"][1]["strategy"] = region1
        scenario.write_text(yaml.safe_dump(data))
        out = tmp_path / strategy / "run"
        result = launch([str(scenario), "--nproc", "3", "--method", method, "--out", str(out), "--tokens",
                         str(tokens), "--save-params", "--quiet", "--wan", "none", "--timeout", "60", *extra],
                        env=env)  # fmt: skip
        runs[strategy] = (result, out, scenario)
    return runs


FSDP_TOKENS = 5000


@pytest.fixture(scope="module")
def fsdp_region_runs(tmp_path_factory, small_corpus) -> dict:
    """GeoMesh with region 0 (2 ranks) under ddp and under fsdp, region 1 ddp: shared by the test that compares
    the two and the one that resumes the fsdp run (its uninterrupted reference)."""
    return strategy_runs(tmp_path_factory.mktemp("fsdp-region"), small_corpus, "geomesh", FSDP_TOKENS)


@pytest.mark.parametrize("method", ["geomesh", "geomesh-overlap"])
def test_an_fsdp_region_holds_its_shard_of_theta_and_trains_as_ddp(tmp_path, small_corpus, method, request):
    """θ and the outer momentum of an fsdp region are sharded like its replica (what the planner's memory model
    counts): each of its 2 ranks holds half of them, the region's ranks evaluate θ together, and the run ends
    where the same run with a ddp region ends (1-bit exchange, plain and overlapped: eager starts, rebase, the
    last exchange in 3 fragments taken from the sharded replica)."""
    if method == "geomesh":
        runs = request.getfixturevalue("fsdp_region_runs")
    else:
        runs = strategy_runs(tmp_path, small_corpus, method, 4000, "--set", "geomesh.overlap_tail_fragments=3")
    for result, _, _ in runs.values():
        assert result.code == 0, result.message
        assert len(set(result.summary["param_checksums"])) == 1
    ddp, fsdp = runs["ddp"][0].summary, runs["fsdp"][0].summary
    whole = ddp["outer_state_bytes_per_rank"]
    assert whole[0] == whole[1] == whole[2] == 2 * 4 * ddp["model_params"]  # θ and momentum, fp32, on every rank
    sharded = fsdp["outer_state_bytes_per_rank"]
    assert sharded[0] + sharded[1] == whole[0] and max(sharded[:2]) < 0.6 * whole[0] and sharded[2] == whole[2]
    assert ddp["rounds"] == fsdp["rounds"] >= 2
    assert [c[1] for c in fsdp["curve"]] == [c[1] for c in ddp["curve"]]  # an evaluation after every round
    assert [c[2] for c in fsdp["curve"]] == pytest.approx([c[2] for c in ddp["curve"]], abs=1e-4)
    assert_same_params(torch.load(runs["fsdp"][1] / "final_params.pt"), torch.load(runs["ddp"][1] / "final_params.pt"),
                       rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("region1", ["ddp", "fsdp"])
def test_an_fsdp_region_resumes_its_sharded_theta_exactly(tmp_path, small_corpus, region1, request):
    """A rank of the fsdp region exits after round 2; ``--resume`` reads the sharded θ, momentum and AdamW state
    back from the round-2 checkpoint (written whole by the ddp region, or as shards when every region shards)
    and ends bit-identical to the run that was not interrupted."""
    if region1 == "ddp":  # the uninterrupted run is the fsdp run of the shared pair
        ref = request.getfixturevalue("fsdp_region_runs")
    else:
        ref = strategy_runs(tmp_path / "ref", small_corpus, "geomesh", FSDP_TOKENS, strategies=("fsdp",),
                            region1=region1)  # fmt: skip
    assert ref["fsdp"][0].code == 0, ref["fsdp"][0].message
    cut = strategy_runs(tmp_path / "cut", small_corpus, "geomesh", FSDP_TOKENS, "--checkpoint-every", "1",
                        region1=region1, env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "1:2"}, strategies=("fsdp",))["fsdp"]  # fmt: skip
    ref = ref["fsdp"]
    assert cut[0].code != 0 and not (cut[1] / "summary.json").exists(), cut[0].message
    resumed = launch([str(cut[2]), "--nproc", "3", "--method", "geomesh", "--out", str(cut[1]), "--tokens",
                      str(FSDP_TOKENS), "--save-params", "--quiet", "--wan", "none", "--timeout", "60", "--resume"])  # fmt: skip
    assert resumed.code == 0, resumed.message
    assert resumed.summary["rounds"] == ref[0].summary["rounds"] >= 3
    assert resumed.summary["final_val_loss"] == ref[0].summary["final_val_loss"]
    want, got = torch.load(ref[1] / "final_params.pt"), torch.load(cut[1] / "final_params.pt")
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_ddp_method_refuses_sharded_regions(tmp_path, small_corpus, capsys):
    scenario = write_scenario(tmp_path, small_corpus, ("A100", "T4"), counts=[2, 1])
    data = yaml.safe_load(scenario.read_text())
    data["regions"][0]["strategy"] = "fsdp"
    scenario.write_text(yaml.safe_dump(data))
    assert cli_launch.main(["launch", str(scenario), "--nproc", "3", "--method", "ddp", "--out",
                            str(tmp_path / "run")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "strategy fsdp" in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_rank_whose_region_env_disagrees_with_the_layout_is_refused(monkeypatch, capsys, tmp_path, small_corpus):
    from geomesh.cli import rank as run

    scenario = write_scenario(tmp_path, small_corpus, ("H100", "A100"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("GEOMESH_REGION", "r0-h100")  # e.g. a region's torchrun started with the wrong node rank
    args = run.build_parser().parse_args([str(scenario), "--method", "geomesh", "--out", str(tmp_path / "r")])
    assert run._main(args) == 2
    err = capsys.readouterr().err
    assert "$GEOMESH_REGION='r0-h100', but rank 1 is in region 'r1-a100'" in err and err.count("\n") == 1


def test_model_section_is_the_preferred_name_of_proxy(tmp_path, small_corpus):
    scenario = write_scenario(tmp_path, small_corpus, ("H100", "A100"))
    data = yaml.safe_load(scenario.read_text())
    as_model = load_scenario(scenario)
    data["proxy"] = data.pop("model")  # a scenario file written before the rename
    scenario.write_text(yaml.safe_dump(data))
    old = load_scenario(scenario)
    assert old.model == as_model.model and old.to_dict() == as_model.to_dict()
    assert fingerprint_hash(run_fingerprint(old, "geomesh", 0, 10)) == fingerprint_hash(
        run_fingerprint(as_model, "geomesh", 0, 10))  # fmt: skip
    assert load_scenario(scenario, {"model.seq_len": 64}).model.seq_len == 64
    assert load_scenario(scenario, {"proxy.seq_len": 48}).model.seq_len == 48  # old override names still work
    with pytest.raises(ConfigError, match=r"model\.preset: 'huge' is not allowed"):
        load_scenario(scenario, {"model.preset": "huge"})
    data["model"] = dict(data["proxy"])
    scenario.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="both `model:` and `proxy:`"):
        load_scenario(scenario)


def test_gpu_presets_have_their_sizes():
    from geomesh.models import GPT, model_config

    for preset, low, high in [("llama-125m", 110e6, 140e6), ("llama-350m", 300e6, 400e6), ("llama-1b", 0.9e9, 1.2e9)]:
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = GPT(model_config(preset, vocab_size=32000))
        assert low <= model.num_params() <= high, (preset, model.num_params())


def test_gpu_check_script_runs_at_cpu_size(tmp_path):
    """bench/gpu_check.py --smoke: FSDP + bf16 + activation checkpointing inside a region of 2 Gloo ranks beside
    DDP in fp32, the codec, and `geomesh profile`, all at a CPU size (on a GPU the same checks run at 125M)."""
    gpu_check = bench_script("gpu_check")
    assert gpu_check.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    fsdp, ddp = results["train"]
    assert (fsdp["strategy"], fsdp["precision"], ddp["strategy"], ddp["precision"]) == ("fsdp", "bf16", "ddp", "fp32")
    assert fsdp["outer_state_gib"] == pytest.approx(ddp["outer_state_gib"] / 2, rel=1e-3)  # θ, momentum sharded
    for run in (fsdp, ddp):
        assert run["model"] == "nano (built-in)" and run["ranks"] == 2 and run["checksums_agree"]
        assert run["val_loss_end"] < run["val_loss_start"] and run["tokens_per_s"] > 0
    assert results["codec"][0]["wire_ratio"] > 30
    assert results["profile"]["max_micro_batch"] >= 1 and results["profile"]["table"]


def test_fsdp_over_a_single_rank_region_trains_as_the_emulated_worker(tmp_path, small_corpus):
    """A region of one GPU may shard too (what a single-GPU check runs): FSDP2 over a group of one rank."""
    scenario = write_scenario(tmp_path, small_corpus, ("A100", "T4"))
    data = yaml.safe_load(scenario.read_text())
    data["regions"][0]["strategy"] = "fsdp"
    scenario.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    result = launch([str(scenario), "--nproc", "2", "--method", "diloco", "--out", str(out), "--tokens", "3000",
                     "--save-params", "--quiet", "--wan", "none", "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    assert result.summary["intra_region_bytes"] == 0  # nothing to broadcast inside one-rank regions
    assert_same_params(torch.load(out / "final_params.pt"), emulated_params(scenario, "diloco", 3000),
                       rtol=1e-5, atol=1e-6)  # fmt: skip


def test_a_hf_dataset_is_tokenised_once_and_trains_as_in_the_emulated_runtime(tmp_path, small_corpus):
    """data.format hf (a local JSONL through `datasets`): rank 0 fills a fresh token cache, the others read it."""
    pytest.importorskip("datasets")
    lines = [json.dumps({"text": p}) for p in Path(small_corpus[0]).read_text().split("\n\n") if p.strip()]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    scenario = write_scenario(tmp_path, small_corpus, ("H100", "T4"))
    data = yaml.safe_load(scenario.read_text())
    data["data"] = {"format": "hf", "hf_dataset": "json", "paths": [str(tmp_path / "docs.jsonl")], "vocab_size": 512}
    data["training"]["zero_shot_items"] = 0
    scenario.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    result = launch([str(scenario), "--nproc", "2", "--method", "diloco", "--out", str(out), "--tokens", "3000",
                     "--save-params", "--quiet", "--wan", "none", "--timeout", "120"],
                    env={"GEOMESH_CACHE": str(tmp_path / "fresh-cache")})  # fmt: skip
    assert result.code == 0, result.message
    assert any((tmp_path / "fresh-cache").rglob("*")) and len(set(result.summary["param_checksums"])) == 1
    assert_same_params(torch.load(out / "final_params.pt"), emulated_params(scenario, "diloco", 3000),
                       rtol=1e-5, atol=1e-6)  # fmt: skip


def test_a_rank_under_plain_torchrun_sets_its_region_env(monkeypatch, tmp_path, small_corpus):
    """Without the launcher (torchrun sets only RANK, WORLD_SIZE, ...), geomesh.cli.rank puts the region in os.environ."""
    import os

    from geomesh.cli import rank as run
    from geomesh.runtime.distributed.transport import free_port

    scenario = write_scenario(tmp_path, small_corpus, ("H100",), zero_shot_items=0)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "GEOMESH_LAUNCHER": "1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    # set, then deleted: monkeypatch records the original (absent) value and restores it, so the region that
    # run._main puts into os.environ does not leak into later tests (and their subprocesses)
    monkeypatch.setenv("GEOMESH_REGION", "unset")
    monkeypatch.delenv("GEOMESH_REGION")
    args = run.build_parser().parse_args([str(scenario), "--method", "diloco", "--out", str(tmp_path / "r"),
                                          "--tokens", "600", "--quiet", "--backend", "gloo"])  # fmt: skip
    assert run._main(args) == 0
    assert os.environ["GEOMESH_REGION"] == "r0-h100"
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["model"] == "nano (built-in)"


def test_precision_bf16_autocasts_the_forward_and_keeps_fp32_master_weights(tiny_scenario):
    """training.precision is honoured by the Worker itself, so by both runtimes (here on CPU)."""
    import dataclasses

    from geomesh.data import BatchStream
    from geomesh.models import build_model, model_config
    from geomesh.worker import Worker

    s = tiny_scenario()
    tokens = torch.randint(0, 512, (4000,), generator=torch.Generator().manual_seed(0))
    after = {}
    for precision in ("fp32", "bf16"):
        model = build_model(model_config("nano", vocab_size=512, seq_len=32), seed=0)
        cfg = dataclasses.replace(s.training, precision=precision)
        worker = Worker("w", model, BatchStream(tokens, 32, seed=1), cfg)
        with worker.autocast():
            logits, _ = model(tokens[:32].view(1, 32))
        assert logits.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        loss, _ = worker.inner_step(4, 1e-3)
        assert loss == loss and all(p.dtype == torch.float32 for p in model.parameters())  # finite, fp32 masters
        after[precision] = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(after["fp32"][k], after["bf16"][k]) for k in after["fp32"])
