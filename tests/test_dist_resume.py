"""Checkpoints and exact resume in the distributed runtime (``torch.distributed.checkpoint``).

A real ``geomesh launch`` of 3 ranks writes a checkpoint every round; every one of its processes (the launcher
and each rank) is SIGKILLed once about half of the rounds are done; the same command with ``--resume`` ends
with the parameters and ``final_val_loss`` of the run that was never interrupted, bit for bit (CPU/Gloo).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FIXED_PLAN, tiny_scenario_dict
from rank_zygote import EXEC_RANKS_ENV

from geomesh.cli import launch as cli_launch
from geomesh.runtime.distributed import checkpoints as dist_checkpoint

SRC = str(Path(__file__).resolve().parents[1] / "src")
TOKENS = 7680  # 4 rounds: 3 regions x 5 inner steps x 4 sequences x 32 tokens each
TAG_ENV = "GEOMESH_TEST_TAG"


def scenario(folder: Path, paths: list[str]) -> Path:
    data = tiny_scenario_dict(paths, ("H100", "A100", "T4"))
    data["geomesh"].update(FIXED_PLAN)
    data["geomesh"]["error_feedback"] = True  # the residuals must come back too
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def argv(path: Path, out: Path, *extra: str) -> list[str]:
    """The sign codec with error feedback, on DiLoCo's plan (b=4, H=5 everywhere: the same rounds whatever the
    planner's tuning)."""
    return ["launch", str(path), "--nproc", "3", "--method", "geomesh-sign-only", "--out", str(out),
            "--tokens", str(TOKENS), "--save-params", "--quiet", "--wan", "none", "--timeout", "90", *extra]  # fmt: skip


def tagged_pids(tag: str) -> list[int]:
    """Every process on this machine whose environment carries ``tag`` (the launcher and its ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if f"{TAG_ENV}={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.long
def test_sigkill_every_process_then_resume_is_bit_identical(tmp_path, small_corpus):
    path = scenario(tmp_path, small_corpus)
    ref = tmp_path / "ref"
    args = cli_launch.build_parser().parse_args(argv(path, ref))
    done = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1"})
    assert done.code == 0, done.message
    assert done.summary["rounds"] == 4

    out = tmp_path / "run"
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", TAG_ENV: tag}
    # (its ranks forked from a zygote, tests/zygote_launch.py: their /proc environment is the zygote's, tagged too)
    cmd = [sys.executable, str(Path(__file__).with_name("zygote_launch.py")),
           *argv(path, out, "--checkpoint-every", "1", "--keep", "2")]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while not (out / "checkpoints" / "round-000002").is_dir():
            assert proc.poll() is None, "the run ended before its second checkpoint"
            assert time.monotonic() < deadline, "no checkpoint of round 2 appeared"
            time.sleep(0.01)
    finally:
        pids = tagged_pids(tag)
        for pid in pids:  # SIGKILL: no handler, no flush, no cleanup, in the launcher or any rank
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
    forked = os.environ.get(EXEC_RANKS_ENV) != "1"  # (the launcher, the zygote that forked its ranks, 3 ranks)
    assert proc.returncode == -9 and len(pids) == 4 + forked
    assert not (out / "summary.json").exists()  # it really was interrupted
    for _ in range(100):  # the kernel reaps the orphaned ranks
        if not tagged_pids(tag):
            break
        time.sleep(0.1)

    # the same command with --resume (in this process: the killed run's processes are the ones that had to be
    # the product's own, to be found and SIGKILLed)
    resumed = cli_launch.launch(cli_launch.build_parser().parse_args([*argv(path, out, "--checkpoint-every", "1",
                                                                           "--keep", "2"), "--resume"]),
                                extra_env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert resumed.code == 0, resumed.message
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["tokens"] == done.summary["tokens"]
    assert summary["final_val_loss"] == done.summary["final_val_loss"]
    want, got = torch.load(ref / "final_params.pt"), torch.load(out / "final_params.pt")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert len(set(summary["param_checksums"])) == 1
    # the events of the resumed run are those of one run: one run record, one round record per round
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events].count("run") == 1
    assert [e["round"] for e in events if e["type"] == "round"] == [1, 2, 3, 4]
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert left == ["round-000003", "round-000004"]  # the newest 2, no temporary folder
    keys = dist_checkpoint.stored_keys(out / "checkpoints" / "round-000004")
    for part in ("global.params.", "global.outer.buf.", ".optim.state.", ".codec.", ".stream", "rank.2", "run.loop"):
        assert any(part in k for k in keys), part  # θ, momentum, AdamW moments, residuals, data, RNG, plan


def test_resume_of_another_run_is_one_error_and_touches_nothing(tmp_path, small_corpus, capsys):
    path = scenario(tmp_path, small_corpus)
    out = tmp_path / "run"
    args = cli_launch.build_parser().parse_args(argv(path, out, "--checkpoint-every", "2", "--tokens", "3840"))
    assert cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1"}).code == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and "logs" not in p.parts}
    capsys.readouterr()
    for extra, says in ((["--method", "diloco"], 'method ("geomesh-sign-only" then, "diloco" now)'),
                        (["--set", "training.outer_lr=0.5"], "scenario.training.outer_lr (0.7 then, 0.5 now)")):  # fmt: skip
        code = cli_launch.main([*argv(path, out, "--tokens", "3840"), *extra, "--resume"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: --resume"), err
        assert "belongs to another run" in err[0] and says in err[0], err[0]
    code = cli_launch.main([*argv(path, tmp_path / "empty"), "--resume"])
    assert code == 2 and "no checkpoint in" in capsys.readouterr().err
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and "logs" not in p.parts}
    assert after == before


def test_only_complete_checkpoints_count(tmp_path):
    """A folder still being written (``.tmp-``), or one without its marker, is never used; pruning keeps K."""
    d = tmp_path / "checkpoints"
    for r in (1, 2, 3):
        (d / f"round-{r:06d}").mkdir(parents=True)
        (d / f"round-{r:06d}" / ".metadata").write_bytes(b"x")
        (d / f"round-{r:06d}" / "geomesh.json").write_text(json.dumps({"round": r}))
    (d / ".tmp-round-000004").mkdir()
    (d / "round-000005").mkdir()  # no marker: a crash between the rename and ... cannot happen, but is ignored
    assert [r for r, _, _ in dist_checkpoint.list_complete(d)] == [1, 2, 3]
    dist_checkpoint.prune(d, 2)
    assert [r for r, _, _ in dist_checkpoint.list_complete(d)] == [2, 3]
    with pytest.raises(dist_checkpoint.DistCheckpointError, match="no checkpoint in"):
        dist_checkpoint.newest(tmp_path / "nothing")


def test_the_ddp_baseline_resumes_bit_identical(tmp_path, small_corpus):
    """``--method ddp`` checkpoints every N steps too: a rank that exits after step 5 leaves the checkpoint of
    step 3, and ``--resume`` ends with the uninterrupted run's parameters, loss and step records."""
    path = scenario(tmp_path, small_corpus)
    tokens = 10 * 3 * 4 * 32  # 10 steps: 3 regions x training.batch x seq_len each

    def ddp(out: Path, *extra: str, env: dict[str, str] | None = None):
        args = cli_launch.build_parser().parse_args(
            ["launch", str(path), "--nproc", "3", "--method", "ddp", "--out", str(out), "--tokens", str(tokens),
             "--save-params", "--quiet", "--wan", "none", "--timeout", "90", *extra])  # fmt: skip
        return cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", **(env or {})})

    ref = ddp(tmp_path / "ref")
    assert ref.code == 0, ref.message
    cut = ddp(tmp_path / "run", "--checkpoint-every", "3", env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "1:5"})
    assert cut.code != 0 and not (tmp_path / "run" / "summary.json").exists()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["round-000003"]
    resumed = ddp(tmp_path / "run", "--checkpoint-every", "3", "--resume")
    assert resumed.code == 0, resumed.message
    assert resumed.summary["rounds"] == ref.summary["rounds"] == 10
    assert resumed.summary["final_val_loss"] == ref.summary["final_val_loss"]
    want, got = torch.load(tmp_path / "ref" / "final_params.pt"), torch.load(tmp_path / "run" / "final_params.pt")
    for name in want:
        assert torch.equal(want[name], got[name]), name
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["type"] == "round"] == list(range(1, 11))
    keys = dist_checkpoint.stored_keys(tmp_path / "run" / "checkpoints" / "round-000009")
    assert any(".optim.state." in k for k in keys) and not any(k.startswith("global.outer") for k in keys)
