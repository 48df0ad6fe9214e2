"""Each region at its own precision: bf16 autocast, fp16 autocast with dynamic loss scaling, or fp32.

On CPU, fp16 autocast and ``torch.amp.GradScaler`` stand in for a GPU without bf16 (V100, T4): the loss scale
grows after clean steps and halves on an overflow, an overflowed step is skipped, counted and trains no tokens,
clipping sees unscaled gradients, the scaler's state survives a state_dict and a checkpoint. A 3-region
distributed run with one fp16 region (sharded by FSDP2: the sharded scaler) and two bf16 regions trains,
checkpoints, resumes bit-identically and records each region's precision and skipped steps.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FIXED_PLAN, tiny_scenario_dict

from geomesh.cli import launch as cli_launch
from geomesh.cli import main
from geomesh.config import ConfigError, TrainingConfig, load_scenario
from geomesh.data import BatchStream
from geomesh.hardware import GPU_CATALOG, TimingModel, model_profile, planned_precision
from geomesh.models import build_model, model_config
from geomesh.runtime.distributed import checkpoints as dist_checkpoint
from geomesh.worker import Worker, autocast_dtype, resolve_precision

TOKENS = torch.randint(0, 512, (20000,), generator=torch.Generator().manual_seed(0))
BATCH, SEQ = 4, 32


def fp16_worker(**training) -> Worker:
    model = build_model(model_config("nano", vocab_size=512, seq_len=SEQ), seed=0)
    return Worker("w", model, BatchStream(TOKENS, SEQ, seed=1), TrainingConfig(precision="fp16", **training))


def overflow_at(worker: Worker, steps: set[int]) -> None:
    """The worker's gradients overflow (an inf in one of them) at its inner steps ``steps`` (0-based, counted
    from now), as fp16 gradients do when the loss scale is too large."""
    original, calls = worker.accumulate_grad, [0]

    def accumulate_grad(*args, **kwargs):
        out = original(*args, **kwargs)
        if calls[0] in steps:
            next(worker.model.parameters()).grad.view(-1)[0] = float("inf")
        calls[0] += 1
        return out

    worker.accumulate_grad = accumulate_grad


def params(worker: Worker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.named_parameters()}


def lr(k: int) -> float:
    return 1e-3


# ---- the worker ------------------------------------------------------------------------------------------


def test_precision_resolves_per_device_and_fp16_autocasts_with_fp32_masters():
    cpu = torch.device("cpu")
    assert [resolve_precision(p, cpu) for p in ("auto", "bf16", "fp16", "fp32")] == ["fp32", "bf16", "fp16", "fp32"]
    assert autocast_dtype("fp16", cpu) == torch.float16 and autocast_dtype("auto", cpu) is None
    w = fp16_worker()
    assert w.precision == "fp16" and isinstance(w.scaler, torch.amp.GradScaler) and w.loss_scale == 2.0**16
    with w.autocast():
        logits, _ = w.model(TOKENS[:SEQ].view(1, SEQ))
    assert logits.dtype == torch.float16
    result = w.train(2, BATCH, lr)
    assert result.finite and result.skipped == 0 and result.tokens == 2 * BATCH * SEQ
    assert all(p.dtype == torch.float32 for p in w.model.parameters())  # parameters and AdamW stay fp32
    assert all(v.dtype == torch.float32 for st in w.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.is_floating_point())  # fmt: skip
    assert Worker("w", w.model, w.stream, TrainingConfig(precision="fp16"), precision="bf16").scaler is None


def test_the_loss_scale_grows_after_clean_steps_and_halves_on_an_overflow():
    w = fp16_worker()
    w.scaler.set_growth_interval(3)
    w.train(3, BATCH, lr)
    assert w.loss_scale == 2.0**17 and w.skipped_steps == 0  # 3 clean steps: doubled
    overflow_at(w, {1})
    result = w.train(3, BATCH, lr)
    assert w.loss_scale == 2.0**16 and w.skipped_steps == 1  # halved on the overflow; the growth count restarts
    assert result.steps == 3 and result.skipped == 1 and result.finite
    w.train(2, BATCH, lr)
    assert w.loss_scale == 2.0**17  # 3 clean steps since the overflow


def test_an_overflowed_step_is_skipped_counted_and_trains_no_tokens():
    w = fp16_worker()
    w.train(1, BATCH, lr)
    before, moments = params(w), {id(p): st["exp_avg"].clone() for p, st in w.optimizer.state.items()}
    overflow_at(w, {0})
    loss, tokens = w.inner_step(BATCH, 1e-3)
    assert tokens == 0 and not w.last_step_applied and w.skipped_steps == 1 and loss == loss
    assert all(torch.equal(before[k], v) for k, v in params(w).items())  # the step changed nothing
    assert all(torch.equal(moments[id(p)], st["exp_avg"]) for p, st in w.optimizer.state.items())
    overflow_at(w, {1})
    result = w.train(3, BATCH, lr)
    assert (result.steps, result.skipped, result.tokens) == (3, 1, 2 * BATCH * SEQ)  # the applied steps' tokens
    assert w.skipped_steps == 2 and result.finite
    overflow_at(w, {0, 1})
    everything = w.train(2, BATCH, lr)  # nothing applied: no update to send this round
    assert everything.tokens == 0 and everything.skipped == 2 and everything.finite


def test_clipping_sees_the_unscaled_gradients():
    w = fp16_worker(grad_clip=0.01)
    w.optimizer.zero_grad(set_to_none=True)
    w.accumulate_grad(BATCH)
    scaled = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in w.model.parameters()]))
    assert scaled > 1000  # the gradients hold the 2**16 loss scale
    assert w.apply_step(1e-3)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in w.model.parameters()]))
    assert norm == pytest.approx(0.01, rel=1e-3)  # unscaled first, then clipped to grad_clip


def test_the_scaler_state_round_trips_through_state_dict_as_plain_values():
    a = fp16_worker()
    a.scaler.set_growth_interval(2)
    overflow_at(a, {1})
    a.train(3, BATCH, lr)  # clean, overflow (halved), clean: one clean step towards the next growth
    state = copy.deepcopy(a.state_dict())  # (the optimizer's state dict holds its live tensors)
    plain = state["precision"]
    assert json.loads(json.dumps(plain)) == plain  # JSON, no tensors, nothing pickled
    assert plain["precision"] == "fp16" and plain["skipped_steps"] == 1 and plain["scaler"]["scale"] == 2.0**15
    b = fp16_worker()
    b.load_state_dict(state)
    assert (b.loss_scale, b.skipped_steps, b.scaler.get_growth_interval()) == (2.0**15, 1, 2)
    assert b.scaler._get_growth_tracker() == a.scaler._get_growth_tracker() == 1
    for w in (a, b):
        overflow_at(w, {1})
        w.train(3, BATCH, lr)  # clean (grown: the tracker came back), overflow (halved), clean
    assert (a.loss_scale, a.skipped_steps) == (b.loss_scale, b.skipped_steps) == (2.0**15, 2)
    assert all(torch.equal(v, params(b)[k]) for k, v in params(a).items())  # bit for bit the same training


def test_a_fresh_adamw_brings_a_fresh_scaler():
    """A rejoined or healed region starts with a fresh AdamW and a fresh loss scaler, whether the loop resets
    the worker or clears AdamW's state directly."""
    w = fp16_worker()
    overflow_at(w, {0})
    w.train(2, BATCH, lr)
    assert w.loss_scale == 2.0**15
    w.optimizer.state.clear()  # what a loop that heals does
    w.train(1, BATCH, lr)
    assert w.loss_scale == 2.0**16
    overflow_at(w, {0})
    w.train(1, BATCH, lr)
    w.reset_inner_state()
    assert w.loss_scale == 2.0**16 and not w.optimizer.state


# ---- configuration and planning --------------------------------------------------------------------------


def test_a_bad_precision_is_one_clear_error(tmp_path, small_corpus, capsys):
    data = tiny_scenario_dict(small_corpus)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as bad:
        load_scenario(path, {"training.precision": "fp8"})
    assert str(bad.value) == "training.precision: 'fp8' is not allowed; expected one of auto, bf16, fp16, fp32"
    with pytest.raises(ConfigError, match=r"regions\[1\]\.precision: 'half' is not allowed; expected one of auto, "
                                          r"bf16, fp16, fp32, or null \(training\.precision\)"):  # fmt: skip
        load_scenario(path, {"regions": [*data["regions"][:1], {**data["regions"][1], "precision": "half"},
                                         *data["regions"][2:]]})  # fmt: skip
    assert main(["plan", str(path), "--set", "training.precision=fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: training.precision: 'fp8'") and "Traceback" not in err[0]


def test_the_ddp_baseline_refuses_an_fp16_region(tiny_scenario):
    """Loss scaling is each region's own; the ddp baseline all-reduces raw gradients across regions every step."""
    from geomesh.methods import get_method
    from geomesh.runtime.distributed.core import check_distributed_support

    s = tiny_scenario()
    s.regions[2] = dataclasses.replace(s.regions[2], precision="fp16")
    with pytest.raises(ConfigError, match=r"^--method ddp: regions r2-t4 train in fp16, whose loss scaling"):
        check_distributed_support(s, get_method("ddp"))
    check_distributed_support(s, get_method("geomesh"))  # a round-based method takes it


def test_regions_override_the_precision_and_the_plan_follows_it(tmp_path, small_corpus, capsys):
    data = tiny_scenario_dict(small_corpus, ("H100", "A100", "T4"))
    data["regions"][1]["precision"] = "fp32"
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    s = load_scenario(path)
    assert [s.region_precision(i) for i in range(3)] == ["auto", "fp32", "auto"]
    assert [s.planned_precision(i) for i in range(3)] == ["bf16", "fp32", "fp16"]  # T4: no bf16, so fp16
    assert [g for g, spec in GPU_CATALOG.items() if not spec.bf16] == ["V100", "V100-16GB", "T4"]
    t4, a100 = GPU_CATALOG["T4"], GPU_CATALOG["A100"]
    assert planned_precision("auto", t4) == "fp16" and planned_precision("auto", a100) == "bf16"
    tm = TimingModel(n_layers=12, hidden=768, seq_len=1024)
    fast, slow = model_profile("t", "T4", 1, tm), model_profile("t", "T4", 1, tm, precision="fp32")
    # the T4's compute per sequence in fp32 against fp16 (65 vs 8.1 TFLOP/s), less its fixed overheads
    assert (slow.table[4] - t4.micro_overhead_s) / (fast.table[4] - t4.micro_overhead_s) == pytest.approx(65 / 8.1)
    assert slow.max_micro_batch < fast.max_micro_batch  # fp32 activations take twice the memory
    assert s.region_profile(s.regions[1]).table[1] > model_profile("a", "A100", 1, s.timing()).table[1] * 5
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "prec" in out and all(f"{r['name']:<16}{r['gpu']:<10}{p:<6}" in out
                                 for r, p in zip(data["regions"], ("bf16", "fp32", "fp16")))  # fmt: skip
    assert main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == {"r0-h100": "bf16", "r1-a100": "fp32", "r2-t4": "fp16"}


def test_the_emulated_runtime_trains_each_region_at_its_precision(tiny_scenario):
    from geomesh.methods import get_method
    from geomesh.runtime.emulated import EmulatedRun, RunOptions

    s = tiny_scenario(tokens=4000, zero_shot_items=0)
    s.training.precision = "bf16"
    s.regions[2] = dataclasses.replace(s.regions[2], precision="fp16")
    em = EmulatedRun(s, get_method("geomesh"), RunOptions(progress=False))
    summary = em.run()
    assert [w.precision for w in em.cluster.workers] == ["bf16", "bf16", "fp16"]
    assert summary["precision"]["r2-t4"] == {"precision": "fp16", "skipped_steps": 0, "loss_scale": 2.0**16}
    assert summary["precision"]["r0-h100"]["loss_scale"] is None
    assert summary["final_val_loss"] < summary["curve"][0][2]


# ---- the distributed runtime: one fp16 region, two bf16 ----------------------------------------------------

RUN_TOKENS = 7680  # 4 rounds of N·b·H = 3 x 4 x 5 sequences of 32 tokens


def mixed_scenario(folder: Path, paths: list[str]) -> Path:
    """Regions in bf16 (the training's precision) but the T4, which trains in fp16 and is sharded by FSDP2 (over
    its one rank: the sharded scaler); its gradients are poisoned in its second round, so its scaler skips every step
    there."""
    data = tiny_scenario_dict(paths, ("H100", "A100", "T4"), precision="bf16", zero_shot_items=0)
    data["geomesh"].update(FIXED_PLAN)
    data["regions"][2].update(precision="fp16", strategy="fsdp")
    data["faults"] = [{"at_round": 1, "region": "r2-t4", "kind": "nan"}]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def launch(path: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> cli_launch.LaunchResult:
    args = cli_launch.build_parser().parse_args([
        "launch", str(path), "--nproc", "3", "--method", "geomesh", "--out", str(out), "--tokens", str(RUN_TOKENS),
        "--save-params", "--quiet", "--wan", "none", "--timeout", "90", "--checkpoint-every", "1", *extra])  # fmt: skip
    return cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.long
def test_one_fp16_region_beside_two_bf16_trains_checkpoints_and_resumes_bit_identical(tmp_path, small_corpus, capsys):
    path = mixed_scenario(tmp_path, small_corpus)
    ref = launch(path, tmp_path / "ref")
    assert ref.code == 0, ref.message
    s = ref.summary
    assert s["rounds"] == 4 and len(set(s["param_checksums"])) == 1
    assert s["final_val_loss"] < s["curve"][0][2]  # it trained
    t4 = s["precision"]["r2-t4"]  # its round-1 steps were all skipped (poisoned): its update is dropped there
    assert t4["precision"] == "fp16" and t4["skipped_steps"] >= 1 and t4["loss_scale"] < 2.0**16
    assert t4["loss_scale"] == 2.0**16 / 2 ** t4["skipped_steps"]  # halved once per skipped step, never grown
    assert {k: v["precision"] for k, v in s["precision"].items()} == {"r0-h100": "bf16", "r1-a100": "bf16",
                                                                      "r2-t4": "fp16"}  # fmt: skip
    assert s["precision"]["r0-h100"]["skipped_steps"] == 0 and s["precision"]["r0-h100"]["loss_scale"] is None
    assert s["dropped_updates"] >= 1  # the T4's all-skipped round sent nothing
    events = [json.loads(line) for line in (tmp_path / "ref" / "events.jsonl").read_text().splitlines()]
    (run,) = [e for e in events if e["type"] == "run"]
    assert run["precision"] == {"r0-h100": "bf16", "r1-a100": "bf16", "r2-t4": "fp16"}
    keys = dist_checkpoint.stored_keys(tmp_path / "ref" / "checkpoints" / "round-000004")
    assert {"region.r2-t4.precision", "region.r0-h100.precision"} <= keys

    cut = tmp_path / "cut"  # the fp16 region's rank dies after round 2 (checkpointed); --resume goes on from there
    first = launch(path, cut, env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "2:2"})
    assert first.code != 0 and not (cut / "summary.json").exists(), first.message
    resumed = launch(path, cut, "--resume")
    assert resumed.code == 0, resumed.message
    r = resumed.summary
    assert r["rounds"] == s["rounds"] and r["final_val_loss"] == s["final_val_loss"]
    assert r["precision"] == s["precision"]  # the same skipped steps and loss scale: the scaler came back
    want, got = torch.load(tmp_path / "ref" / "final_params.pt"), torch.load(cut / "final_params.pt")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    capsys.readouterr()
    assert main(["plan", str(cut)]) == 0  # the run's plans and each region's precision, from its records
    out = capsys.readouterr().out
    assert f"r2-t4 fp16 ({t4['skipped_steps']} steps skipped by its loss scaler)" in out and "r0-h100 bf16" in out
