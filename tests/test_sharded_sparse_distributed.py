"""Sparse payloads through the sharded exchange over torch.distributed (runtime/distributed/sharded.py with
codec/sharded_sparse.py): 4 Gloo processes, then real 4-leader `geomesh launch` runs of geomesh-sparse.

Kept exact (float32 combined shards) it gives the all-gather's update bit for bit, in `sharded_round` and in
a whole launch; a damaged sparse slice drops only its sender for the round; re-sparsified (the default) every
leader applies the same update, the one the emulated runtime's in-process exchange forms, round after round
(the owners' residuals included)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from geomesh.codec import Manifest, SparseSignCodec

SHAPES = {"w": (64, 33), "b": (7,), "v": (1000,), "e": (300, 9)}
KEY = b"sharded-sparse-key-01"


def _payloads(codec, seed=0):
    out = []
    for r in range(4):
        g = torch.Generator().manual_seed(100 * seed + r)
        out.append(codec.encode({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}, tokens=100 + 50 * r))
    return out


def _flat(update):
    return torch.cat([v.reshape(-1) for v in update.values()])


def _worker(rank: int, store: str) -> None:
    from geomesh.codec.sharded_sparse import ShardedSparseExchange
    from geomesh.runtime.distributed import sharded as sd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        codec = SparseSignCodec(Manifest.from_shapes(SHAPES), chunk_size=128, k=16, block=4, key=KEY)
        p = _payloads(codec)
        exact = ShardedSparseExchange(codec, 4, bits=32)
        signed = dict(key=b"run-key", run_id="run-1", round_number=3)

        r = sd.sharded_round(p[rank], exact, **signed)  # 1. exact == the all-gather's combine, bit for bit
        assert r.accepted == [0, 1, 2, 3] and torch.equal(_flat(r.update), _flat(codec.combine(p))), rank
        assert r.tokens == sum(codec.tokens_of(x) for x in p)

        if rank == 2:  # 2. rank 2's sparse slice for shard 1 is damaged on the wire: only rank 2 is dropped
            real = exact.slices

            def damaged(payload):
                s = real(payload)
                s[1] = s[1][:60] + bytes([s[1][60] ^ 0xFF]) + s[1][61:]
                return s

            exact.slices = damaged
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = sd.sharded_round(p[rank], exact, **signed)
        if rank == 2:
            exact.slices = real
        assert r.accepted == [0, 1, 3] and list(r.rejected) == [2] and "slice of shard 1" in r.rejected[2], rank
        assert torch.equal(_flat(r.update), _flat(codec.combine([p[0], p[1], p[3]])))

        # 3. a sparse slice whose position code lies, well signed: its owner refuses it as it refuses a payload
        if rank == 0:
            real = exact.slices

            def lying(payload):
                s = real(payload)
                c = exact.codecs[3]
                tokens, body = c._parse(s[3])
                raw = bytearray(body)
                raw[-2] ^= 0xFF  # inside the unary fields: the wrong number of positions
                s[3] = c._assemble(tokens, [bytes(raw)])
                return s

            exact.slices = lying
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = sd.sharded_round(p[rank], exact, **signed)
        if rank == 0:
            exact.slices = real
        why = "position code of chunk" if rank == 3 else "its slice is malformed"  # (the owner names the defect)
        assert r.accepted == [1, 2, 3] and list(r.rejected) == [0] and why in r.rejected[0], (rank, r.rejected)

        # 4. re-sparsified with the owners' error feedback: every leader applies the same update, the one the
        # in-process exchange (the emulated runtime's) forms, over rounds
        sparse, here = ShardedSparseExchange(codec, 4, bits=8), ShardedSparseExchange(codec, 4, bits=8)
        for rnd in range(3):
            q = _payloads(codec, seed=rnd + 1)
            got = sd.sharded_round(q[rank], sparse, **{**signed, "round_number": 10 + rnd})
            flat = _flat(got.update)
            every = [torch.empty_like(flat) for _ in range(4)]
            dist.all_gather(every, flat)
            assert all(torch.equal(every[0], e) for e in every)
            assert torch.equal(flat, _flat(here.combine(q))), (rank, rnd)
        assert sparse.owners[rank].residual and not any(sparse.owners[k].residual for k in range(4) if k != rank)
    finally:
        dist.destroy_process_group()


def test_sparse_slices_through_the_sharded_exchange_over_gloo(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=4, join=True)


# ---- real `geomesh launch` runs of geomesh-sparse, 4 leaders ---------------------------------------------------

TOKENS = 10000
GPUS = ("H100", "A100", "T4", "V100")
CORRUPT = [{"at_round": 2, "region": "r2-t4", "kind": "corrupt"}]  # r2-t4's payload damaged on the wire


def _scenario(folder, corpus, geomesh, faults=None, wan=None):
    import yaml
    from conftest import FIXED_PLAN, tiny_scenario_dict

    data = tiny_scenario_dict(corpus, GPUS)
    data["wan"] = wan or data["wan"]
    data["geomesh"].update({**FIXED_PLAN, "max_batch": 16, **geomesh})
    data["compression"] = {"sparse_chunk_size": 256, "sparse_block_k": 24}
    if faults:
        data["faults"] = faults
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _launch(path, out, *extra, env=None, ok=True, tokens=TOKENS):
    from geomesh.cli import launch as cli_launch

    args = cli_launch.build_parser().parse_args(["launch", str(path), "--nproc", "4", "--method", "geomesh-sparse",
                                                 "--out", str(out), "--tokens", str(tokens), "--save-params",
                                                 "--quiet", "--timeout", "90", *extra])  # fmt: skip
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", **(env or {})})
    if ok:
        assert result.code == 0, result.message
    return result.summary if ok else result


@pytest.fixture(scope="module")
def sparse_runs(tmp_path_factory, small_corpus):
    """4 leaders of geomesh-sparse, the same scenario twice: the all-gather, and the sharded exchange kept exact
    (32 bits); in both, region r2-t4's payload is damaged on the wire in its third round."""
    folder = tmp_path_factory.mktemp("sharded-sparse")
    runs = {}
    for name, geomesh in (("all_gather", {"exchange": "all_gather"}),
                          ("sharded", {"exchange": "sharded", "shard_bits": 32})):  # fmt: skip
        out = folder / name
        runs[name] = (_launch(_scenario(folder / f"{name}-scenario", small_corpus, geomesh, CORRUPT), out), out)
    return runs


def test_exact_sharded_sparse_launch_equals_the_all_gather_bit_for_bit(sparse_runs):
    from test_sharded_distributed import assert_same_run

    (ag, _), (sh, _) = sparse_runs["all_gather"], sparse_runs["sharded"]
    assert ag["method"] == sh["method"] == "geomesh-sparse"
    assert_same_run(sparse_runs)
    assert sh["tokens_lost"] == ag["tokens_lost"] > 0
    # bytes on the wire per leader: the ring all-gather's N−1 slots; the sharded exchange's slices and
    # float32 shards to each other leader (and its agreements)
    assert ag["bytes_sent"] == ag["rounds"] * 4 * 3 * (ag["proxy_payload_bytes"] + 9)
    assert sh["bytes_per_round"] == sh["bytes_sent"] / sh["rounds"] > ag["bytes_per_round"]


def test_a_damaged_sparse_payload_drops_only_its_sender(sparse_runs):
    """r2-t4's damaged payload goes out as damaged slices: their owners refuse them, every region drops its
    update that round (one warning naming it), and the others' updates are applied."""
    from geomesh.telemetry import read_events

    (ag, ag_out), (sh, sh_out) = sparse_runs["all_gather"], sparse_runs["sharded"]
    assert sh["rejected_payloads"] == ag["rejected_payloads"] == 1
    warned = [e for e in read_events(sh_out / "events.jsonl") if e["type"] == "warning"]
    assert [(w["worker"], w["round"]) for w in warned] == [("r2-t4", 3)]
    assert "payload rejected" in warned[0]["message"] and "slice of shard" in warned[0]["message"]


def test_re_sparsified_sharded_launch_equals_emulated(tmp_path, small_corpus):
    """Re-sparsified combined shards (the owners' error feedback; what the plan picks for geomesh-sparse
    where an all-gather's bytes set its time, forced here where the tiny cluster's latency favours the all-gather): the emulated runtime runs the same exchange in one process, so θ is the emulated runtime's, to the float
    tolerance of tests/test_distributed.py (the ranks' inner steps run in their own processes)."""
    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.runtime.emulated import EmulatedRun, RunOptions

    path = _scenario(tmp_path / "s", small_corpus, {"exchange": "sharded"})
    s = _launch(path, tmp_path / "run")
    assert s["exchange"] == "sharded" and s["shard_bits"] == 8
    emulated = EmulatedRun(load_scenario(path), get_method("geomesh-sparse"), RunOptions(tokens=TOKENS, progress=False))
    e = emulated.run()
    assert e["exchange"] == "sharded" and e["rounds"] == s["rounds"] >= 3 and e["tokens"] == s["tokens"]
    assert s["final_val_loss"] == pytest.approx(e["final_val_loss"], rel=1e-5)
    expected, got = emulated.cluster.global_model.state_dict(), torch.load(tmp_path / "run" / "final_params.pt")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.long
def test_re_sparsified_sharded_launch_resumes_bit_identical(tmp_path, small_corpus):
    """The owners' residuals are in each leader's checkpoint: a run whose rank exits after round 2 resumes from
    its checkpoint and ends with the uninterrupted run's θ bit for bit (without them, the owners start empty and
    the combined shards of round 3 differ)."""
    from geomesh.runtime.distributed import checkpoints as dist_checkpoint

    path = _scenario(tmp_path / "s", small_corpus, {"exchange": "sharded"})
    ref = _launch(path, tmp_path / "ref", "--wan", "none", "--checkpoint-every", "1")
    assert ref["exchange"] == "sharded" and ref["shard_bits"] == 8 and ref["rounds"] >= 3
    cut = _launch(path, tmp_path / "run", "--wan", "none", "--checkpoint-every", "1",
                  env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "1:2"}, ok=False)  # fmt: skip
    assert cut.code != 0 and not (tmp_path / "run" / "summary.json").exists()
    keys = dist_checkpoint.stored_keys(tmp_path / "run" / "checkpoints" / "round-000002")
    assert {k.split(".owners.")[0] for k in keys if ".owners." in k} == {f"region.{g}" for g in
                                                                          ("r0-h100", "r1-a100", "r2-t4", "r3-v100")}
    resumed = _launch(path, tmp_path / "run", "--wan", "none", "--checkpoint-every", "1", "--resume")
    assert resumed["rounds"] == ref["rounds"] and resumed["final_val_loss"] == ref["final_val_loss"]
    want, got = torch.load(tmp_path / "ref" / "final_params.pt"), torch.load(tmp_path / "run" / "final_params.pt")
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_a_re_sparsified_launch_plans_rounds_of_half_the_sequences(tmp_path, small_corpus):
    """The method as users run it (calibration and re-planning on, the method's own sequences per round), its
    payloads through the re-sparsified sharded exchange: every plan of the launch, the first and each re-plan,
    targets a quarter of N·b·H sequences (half the method's half), as the emulated runtime plans it (a round held
    on the way to a far re-plan is a round of a time)."""
    from geomesh.config import load_scenario
    from geomesh.methods import get_method

    path = _scenario(tmp_path / "s", small_corpus, {"exchange": "sharded", "replan": True, "calibrate": True,
                                                    "round_sequences_factor": None})  # fmt: skip
    s = _launch(path, tmp_path / "run")
    assert s["exchange"] == "sharded" and s["rounds"] >= 3
    sc = load_scenario(path)
    quarter = round(len(sc.regions) * sc.training.batch * sc.training.inner_steps / 4)
    assert get_method("geomesh-sparse").constraints(sc, len(sc.regions)).target_sequences == quarter
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    plans = [e["plan"] for e in events if e.get("type") == "plan"]
    # (a re-plan whose round would be far longer or shorter than the round in force is held to a step of it on
    # the way, a round of a time, not of a target: planner/online.py, ROUND_STEP)
    targets = [p["target_sequences"] for p in plans if not p["rule"].startswith("the round held to")]
    assert plans[0]["target_sequences"] == quarter and set(targets) == {quarter}, [p["rule"] for p in plans]
