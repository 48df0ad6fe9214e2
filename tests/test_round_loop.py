"""The one distributed round loop: what one mode of it supports, every mode does (faults in static runs,
payload screening everywhere, the ddp baseline's refusal of faults), on real rank processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FIXED_PLAN, tiny_scenario_dict

from geomesh.cli import launch as cli_launch
from geomesh.telemetry import read_events

RANK_ENV = {"OMP_NUM_THREADS": "1"}
ONE_ROUND = 4 * 5 * 32  # b=4, H=5, 32 tokens per sequence (the tiny scenario, uniform plan)


def write(tmp_path, small_corpus, faults=None, **reliability):
    data = tiny_scenario_dict(small_corpus, ("H100", "A100", "T4"))
    data["geomesh"].update(FIXED_PLAN)
    data["faults"] = faults or []
    if reliability:
        data["reliability"] = reliability
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def launch(argv, env=None):
    args = cli_launch.build_parser().parse_args(["launch", *argv])
    return cli_launch.launch(args, extra_env={**RANK_ENV, **(env or {})})


@pytest.mark.parametrize("method", ["geomesh", "diloco"])
def test_a_static_run_honours_slowdown_and_corrupt_faults(tmp_path, small_corpus, capsys, method):
    """Without elastic regions: a slowdown (re-planned at once) and a corrupted payload (screened out by every
    receiver, or by its sender for a summed dense exchange) on real processes; the run goes to its end."""
    faults = [{"at_round": 1, "region": "r0-h100", "kind": "slowdown", "factor": 2.0},
              {"at_round": 2, "region": "r2-t4", "kind": "corrupt"}]  # fmt: skip
    path = write(tmp_path, small_corpus, faults)
    out = tmp_path / "run"
    result = launch([str(path), "--nproc", "3", "--method", method, "--out", str(out), "--tokens", "8000",
                     "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    s = result.summary
    assert [(f["kind"], f["region"], f["round"]) for f in s["faults"]] == [("slowdown", "r0-h100", 1),
                                                                          ("corrupt", "r2-t4", 2)]  # fmt: skip
    assert s["rejected_payloads"] == 1
    corrupt = s["faults"][1]
    assert corrupt["tokens_lost"] > 0 and s["tokens_lost"] == corrupt["tokens_lost"]
    events = read_events(out / "events.jsonl")
    warnings = [e for e in events if e["type"] == "warning"]
    assert [(w["worker"], w["round"]) for w in warnings] == [("r2-t4", 3)]
    assert "payload rejected" in warnings[0]["message"]
    assert [e["round"] for e in events if e["type"] == "plan"] == [0, 1]  # the slowdown is planned at once
    assert len(set(s["param_checksums"])) == 1
    err = capsys.readouterr()
    assert "region r2-t4: payload rejected" in err.out + err.err


def test_ddp_refuses_scenario_faults_in_one_line(tmp_path, small_corpus, capsys):
    path = write(tmp_path, small_corpus, [{"at_round": 1, "region": "r0-h100", "kind": "slowdown", "factor": 2.0}])
    code = cli_launch.main(["launch", str(path), "--nproc", "3", "--method", "ddp", "--out", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--method ddp: the scenario has faults (slowdown)" in err and err.count("\n") == 1
    assert not (tmp_path / "r" / "logs").exists()


def test_a_static_run_refuses_membership_faults_in_one_line(tmp_path, small_corpus, capsys):
    path = write(tmp_path, small_corpus, [{"at_round": 1, "region": "r1-a100", "kind": "leave"}])
    code = cli_launch.main(["launch", str(path), "--nproc", "3", "--method", "geomesh", "--out", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert "leave/join faults need elastic regions" in err and err.count("\n") == 1


def test_a_region_with_another_key_is_rejected_each_round_and_the_others_finish(tmp_path, small_corpus):
    """A static run signed with a run key, one region started with another key (as a mis-deployed region
    would be): every round the others reject its payload (the slot's tag fails), name it and finish; it cannot
    authenticate them, so it stands aside (it applies nothing) and ends with one error naming the key."""
    from conftest import ranks_with_keys

    path = write(tmp_path, small_corpus, hmac_key_env="GEOMESH_TEST_RUN_KEY")
    out = tmp_path / "run"
    good, wrong = "the-run-key-of-32-bytes-for-tests", "a-wrong-key-of-32-bytes-for-tests"
    codes, errs = ranks_with_keys(path, out, "geomesh", 8000, [good, good, wrong])
    assert codes == [0, 0, 2], errs
    odd = [ln for ln in errs[2].splitlines() if ln.startswith("error:")]
    assert len(odd) == 1 and "r2-t4" in odd[0] and "another run key" in odd[0], errs[2]
    summary = yaml.safe_load((out / "summary.json").read_text())
    rounds = summary["rounds"]
    assert rounds >= 3 and summary["rejected_payloads"] == rounds
    warnings = [e for e in read_events(out / "events.jsonl") if e["type"] == "warning"]
    assert [w["round"] for w in warnings] == list(range(1, rounds + 1))
    assert all(w["worker"] == "r2-t4" and "HMAC" in w["message"] for w in warnings)
    assert summary["param_checksums"][0] == summary["param_checksums"][1] != summary["param_checksums"][2]


def _checksum_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from geomesh.runtime.distributed import region

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    try:
        gen = torch.Generator().manual_seed(0)  # every rank builds the same whole θ
        whole = {"emb": torch.randn(7, 5, generator=gen), "norm": torch.randn(4, generator=gen),
                 "big": torch.randn(2000, 3, generator=gen), "one_row": torch.randn(1, 9, generator=gen)}  # fmt: skip
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) for k, v in whole.items()}
        gathers = []
        real = torch.distributed.tensor.DTensor.full_tensor
        torch.distributed.tensor.DTensor.full_tensor = lambda self, *a, **k: gathers.append(1) or real(self, *a, **k)
        try:
            got = region.params_checksum(sharded, samples=64)
        finally:
            torch.distributed.tensor.DTensor.full_tensor = real
        Path(out, f"crc{rank}.json").write_text(json.dumps(
            {"sharded": got, "whole": region.params_checksum(whole, samples=64), "gathers": len(gathers)}))
    finally:
        dist.destroy_process_group()


def test_a_sharded_theta_checksums_like_the_whole_one_without_gathering_it(tmp_path):
    """Only samples cross the region: uneven shards (7 rows on 3 ranks, a one-row tensor) included."""
    import torch.multiprocessing as mp

    mp.spawn(_checksum_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=3, join=True)
    results = [json.loads((tmp_path / f"crc{r}.json").read_text()) for r in range(3)]
    assert all(r["sharded"] == r["whole"] == results[0]["whole"] for r in results)
    assert all(r["gathers"] == 0 for r in results)


def _gathered_dtype_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from geomesh.models import build_model, model_config
    from geomesh.runtime.distributed import region

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        seen = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", None)):
            model = build_model(model_config("nano", vocab_size=64, seq_len=16), seed=0)
            region.shard_region(model, region.region_mesh(dist.group.WORLD, torch.device("cpu")), dtype)
            block = region.transformer_blocks(model)[0]
            weights = []
            block.register_forward_pre_hook(lambda m, i: weights.append(str(next(m.parameters()).dtype)))
            loss = model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
            loss = loss[1] if isinstance(loss, tuple) else loss
            loss.backward()
            seen[name] = {"gathered": weights[0], "grad": str(next(model.parameters()).grad.dtype),
                          "shard": str(next(model.parameters()).dtype)}  # fmt: skip
        Path(out, f"dtypes{rank}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


def test_fsdp_regions_gather_what_the_memory_model_counts(tmp_path):
    """bf16 training: FSDP2 gathers bf16 weights and keeps fp32 shards and gradients; fp32 stays fp32."""
    import torch.multiprocessing as mp

    mp.spawn(_gathered_dtype_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    seen = json.loads((tmp_path / "dtypes0.json").read_text())
    assert seen["bf16"] == {"gathered": "torch.bfloat16", "grad": "torch.float32", "shard": "torch.float32"}
    assert seen["fp32"] == {"gathered": "torch.float32", "grad": "torch.float32", "shard": "torch.float32"}
