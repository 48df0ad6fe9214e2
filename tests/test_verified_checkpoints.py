"""Verified checkpoints: nothing in a checkpoint runs code, every file is checked against its marker before it
is read, and a damaged newest checkpoint falls back to the previous intact one.

The distributed runtime's checkpoint (a DCP folder) is doctored the two ways an outsider with access to a
shared run folder would: a ``.metadata`` pickle that runs code (with the marker's hash rewritten to match, as
anyone without the run key can), and one flipped byte in θ. ``geomesh launch --resume`` runs no code, warns,
resumes from the intact checkpoint before them and ends bit-identical to the run that was never interrupted;
with nothing intact it is one error line.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from test_dist_resume import TOKENS, argv, scenario

from geomesh import checkpoint as ckpt
from geomesh.cli import launch as cli_launch
from geomesh.errors import CheckpointError
from geomesh.runtime.distributed import checkpoints as dist_checkpoint
from geomesh.runtime.distributed import resume as dist_resume


class RunsCode:
    """A pickle that, when loaded by a plain unpickler, writes ``path`` (proof that code ran)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def doctor_metadata(folder: Path, sentinel: Path) -> None:
    """Replace DCP's ``.metadata`` by a pickle that runs code, and rewrite the marker's hash to match."""
    blob = pickle.dumps(RunsCode(sentinel))
    (folder / ".metadata").write_bytes(blob)
    marker = json.loads((folder / "geomesh.json").read_text())
    marker["files"][".metadata"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (folder / "geomesh.json").write_text(json.dumps(marker))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_doctored_checkpoints_run_no_code_and_fall_back_bit_identical(tmp_path, small_corpus, capsys, monkeypatch,
                                                                      recwarn):  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = scenario(tmp_path, small_corpus)
    ref = tmp_path / "ref"
    assert cli_launch.main(argv(path, ref)) == 0
    out = tmp_path / "run"
    monkeypatch.setenv("GEOMESH_TEST_EXIT_AFTER_ROUND", "1:3")  # rank 1 dies after round 3
    assert cli_launch.main(argv(path, out, "--checkpoint-every", "1", "--keep", "4")) != 0
    monkeypatch.delenv("GEOMESH_TEST_EXIT_AFTER_ROUND")
    folders = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in folders] == ["round-000001", "round-000002", "round-000003"]
    sentinel = tmp_path / "code-ran"
    doctor_metadata(folders[2], sentinel)  # round 3: a pickle that runs code, its hash "fixed" in the marker
    flip_byte(folders[1] / "__0_0.distcp")  # round 2: one flipped byte in θ
    capsys.readouterr()
    recwarn.clear()

    code = cli_launch.main([*argv(path, out, "--checkpoint-every", "1", "--keep", "4"), "--resume"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert not sentinel.exists()  # no code ran, on the launcher or any rank
    warned = [str(w.message) for w in recwarn if "checkpoint" in str(w.message)]  # the launcher's warnings
    assert any("round-000003" in w and ".metadata is refused" in w and "exec" in w for w in warned), warned
    assert any("round-000002" in w and "__0_0.distcp does not match its SHA-256" in w for w in warned), warned
    assert all("previous intact checkpoint (round 1)" in w for w in warned if "round-00000" in w)
    summary = json.loads((out / "summary.json").read_text())
    want, got = torch.load(ref / "final_params.pt"), torch.load(out / "final_params.pt")
    assert summary["final_val_loss"] == json.loads((ref / "summary.json").read_text())["final_val_loss"]
    for name in want:
        assert torch.equal(want[name], got[name]), name
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["type"] == "round"] == [1, 2, 3, 4]

    # rounds 2 and 3 were written again over the doctored ones; now damage every checkpoint: one error line
    for folder in sorted((out / "checkpoints").iterdir()):
        flip_byte(folder / ".metadata")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and "logs" not in p.parts}
    code = cli_launch.main([*argv(path, out), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --resume"), err
    assert "no intact checkpoint" in err[0] and "round-000004" in err[0] and "round-000001" in err[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and "logs" not in p.parts} == before


# ---- one process, no launch: the pieces -----------------------------------------------------------------


def small_state() -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, opt),
            "loop": json.dumps({"rounds": 3}), "rng": {"torch": torch.get_rng_state(), "numpy": [1, 2.5, "x"]}}  # fmt: skip


def write_one(directory: Path, round_index: int, key: bytes | None = None, state: dict | None = None) -> Path:
    return dist_checkpoint.save(directory, round_index, state or small_state(), keep=5, coordinator=True,
                                marker={"fingerprint": {}}, key=key)  # fmt: skip


def test_non_tensor_state_is_json_and_comes_back_in_shape(tmp_path):
    state = small_state()
    folder = write_one(tmp_path, 1, state=state)
    plain = json.loads((folder / "rank-0.json").read_text())["state"]
    assert plain["loop"] == state["loop"] and plain["o"]["param_groups"][0]["betas"] == [0.9, 0.999]
    marker = json.loads((folder / "geomesh.json").read_text())
    assert set(marker["files"]) == {p.name for p in folder.iterdir()} - {"geomesh.json"}
    dist_checkpoint.verify(folder, marker, None)
    template = small_state()
    template["m"], template["o"] = {k: torch.zeros_like(v) for k, v in state["m"].items()}, json.loads(json.dumps(
        {"param_groups": state["o"]["param_groups"]}))  # fmt: skip
    template["o"]["param_groups"][0]["betas"] = (0.0, 0.0)
    template["o"]["state"] = {n: {k: torch.zeros_like(v) for k, v in s.items()} for n, s in state["o"]["state"].items()}
    for t in (template["m"]["weight"], template["o"]["state"]["weight"]["exp_avg"]):
        t.zero_()
    template["loop"] = ""
    got = dist_checkpoint.load(folder, template)
    assert torch.equal(got["m"]["weight"], state["m"]["weight"])
    assert torch.equal(got["o"]["state"]["weight"]["exp_avg"], state["o"]["state"]["weight"]["exp_avg"])
    assert got["o"]["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple again, as AdamW made it
    assert got["loop"] == state["loop"] and got["rng"]["numpy"] == [1, 2.5, "x"]


def test_a_metadata_pickle_that_runs_code_is_refused_before_it_runs(tmp_path):
    folder = write_one(tmp_path, 1)
    sentinel = tmp_path / "code-ran"
    doctor_metadata(folder, sentinel)
    marker = json.loads((folder / "geomesh.json").read_text())
    with pytest.raises(dist_checkpoint.DistCheckpointError, match=r"\.metadata is refused: it names builtins\.exec"):
        dist_checkpoint.verify(folder, marker, None)
    with pytest.raises(dist_checkpoint.DistCheckpointError):
        dist_checkpoint.load(folder, small_state())
    assert not sentinel.exists()


def test_the_run_key_signs_the_marker(tmp_path):
    key, other = b"k" * 32, b"o" * 32
    write_one(tmp_path, 1, key)
    folder = write_one(tmp_path, 2, key)
    marker = json.loads((folder / "geomesh.json").read_text())
    dist_checkpoint.verify(folder, marker, key)
    with pytest.raises(dist_checkpoint.DistCheckpointError, match="does not match the run key"):
        dist_checkpoint.verify(folder, marker, other)
    # whoever rewrites a file and its hash in the marker, without the key, is found out
    flip_byte(folder / "rank-0.json")
    marker["files"]["rank-0.json"] = ckpt.file_digest(folder / "rank-0.json")
    (folder / "geomesh.json").write_text(json.dumps(marker))
    with pytest.warns(UserWarning, match=r"round-000002.*tag does not match.*previous intact checkpoint \(round 1\)"):
        round_index, _, _ = dist_resume.check_resume(tmp_path, {}, tmp_path, key=key)
    assert round_index == 1
    assert dist_resume.check_resume(tmp_path, {}, tmp_path)[0] == 2  # without the key: the hashes match


def test_a_truncated_file_is_skipped_and_none_intact_is_one_error(tmp_path):
    write_one(tmp_path, 1)
    folder = write_one(tmp_path, 2)
    distcp = next(folder.glob("*.distcp"))
    distcp.write_bytes(distcp.read_bytes()[:10])
    with pytest.warns(UserWarning, match="has 10 bytes, its marker says"):
        assert dist_resume.check_resume(tmp_path, {}, tmp_path)[0] == 1
    (tmp_path / "round-000001" / "rank-0.json").unlink()
    with pytest.raises(dist_checkpoint.DistCheckpointError, match="no intact checkpoint.*rank-0.json is missing"):
        dist_resume.check_resume(tmp_path, {}, tmp_path)


def test_an_older_unhashed_checkpoint_is_refused(tmp_path):
    folder = write_one(tmp_path, 1)
    marker = json.loads((folder / "geomesh.json").read_text())
    marker["format"] = 1
    with pytest.raises(dist_checkpoint.DistCheckpointError, match="format 1"):
        dist_checkpoint.verify(folder, marker, None)


def test_the_emulated_checkpoint_marker_is_signed_too(tmp_path):
    key = b"k" * 32
    ckpt.write_checkpoint(tmp_path, 1, {"x": torch.ones(2)}, keep=2, key=key)
    marker, state = ckpt.load_latest(tmp_path, key=key)
    assert marker["tag"] and torch.equal(state["x"], torch.ones(2))
    with pytest.raises(CheckpointError, match="no usable checkpoint"), pytest.warns(UserWarning, match="run key"):
        ckpt.load_latest(tmp_path, key=b"o" * 32)
