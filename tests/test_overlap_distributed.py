"""Overlapped rounds in the distributed runtime: the collective runs under the next round's inner steps, and
the run ends where the emulated runtime's does (a file of its own, so make test's two workers share the
overlap tests)."""

from __future__ import annotations

import pytest
import torch
from test_overlap import TOKENS, run, write

from geomesh.telemetry import read_events



def test_distributed_overlap_equals_emulated_and_every_rank_agrees(tmp_path, small_corpus):
    """3 ranks, one per region, over the WAN shaper: the collective runs asynchronously under the next
    round's inner steps, the update is applied at the plan's apply step, and the run ends where the emulated
    runtime ends (same plan, same apply steps, same operations)."""
    from test_distributed import launch

    path = write(tmp_path, small_corpus, max_batch=16)
    out = tmp_path / "run"
    result = launch([str(path), "--nproc", "3", "--method", "geomesh-overlap", "--out", str(out), "--tokens",
                     str(TOKENS), "--save-params", "--quiet", "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    summary = result.summary
    assert summary["overlap"] is True and summary["rounds"] >= 3
    assert len(set(summary["param_checksums"])) == 1  # every rank holds the same θ (checked every round too)
    emulated, params = run(path, "geomesh-overlap", tmp_path / "emulated")
    final = torch.load(out / "final_params.pt")
    for k, v in params.items():
        torch.testing.assert_close(final[k], v, rtol=1e-5, atol=1e-6)
    assert summary["plan"] == emulated["plan"] and summary["tokens"] == emulated["tokens"]
    assert summary["final_val_loss"] == pytest.approx(emulated["final_val_loss"], rel=1e-5)
    events = read_events(out / "events.jsonl")
    flights = [e for e in events if e["type"] == "exchange"]
    assert all(e["end"] >= e["start"] for e in flights)
    # one exchange per round, the last one in the fragments the emulated runtime split it into
    emulated_flights = [e for e in read_events(out.parent / "emulated" / "events.jsonl") if e["type"] == "exchange"]
    assert [(e["round"], e.get("fragment")) for e in flights] == [(e["round"], e.get("fragment"))
                                                                 for e in emulated_flights]  # fmt: skip
    assert max(e.get("fragment", 0) for e in flights) >= 1
    assert sum(e["type"] == "eval" for e in events) == summary["rounds"] + 1  # θ_0, then each update


@pytest.mark.long
def test_distributed_overlap_checkpoints_equal_emulated_and_resume_exactly(tmp_path, small_corpus):
    """--checkpoint-every 2 with overlap: the exchange before each checkpoint is waited for as in the emulated
    runtime (same parameters), and a run whose rank exits after round 3 resumes from round 2 bit for bit."""
    from test_distributed import launch

    path = write(tmp_path, small_corpus)
    tokens = 5 * 19360
    argv = [str(path), "--nproc", "3", "--method", "geomesh-overlap", "--tokens", str(tokens), "--save-params",
            "--quiet", "--timeout", "60", "--wan", "none", "--checkpoint-every", "2"]  # fmt: skip
    ref = launch([*argv, "--out", str(tmp_path / "ref")])
    assert ref.code == 0, ref.message
    _, params = run(path, "geomesh-overlap", tmp_path / "emulated", tokens=tokens, checkpoint_every=2)
    final = torch.load(tmp_path / "ref" / "final_params.pt")
    for k, v in params.items():
        torch.testing.assert_close(final[k], v, rtol=1e-5, atol=1e-6)
    cut = launch([*argv, "--out", str(tmp_path / "cut")], env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "1:3"})
    assert cut.code != 0 and not (tmp_path / "cut" / "summary.json").exists()
    resumed = launch([*argv, "--out", str(tmp_path / "cut"), "--resume"])
    assert resumed.code == 0, resumed.message
    assert resumed.summary["final_val_loss"] == ref.summary["final_val_loss"]
    got = torch.load(tmp_path / "cut" / "final_params.pt")
    for k, v in final.items():
        assert torch.equal(got[k], v), k


def test_regions_of_two_ranks_share_the_overlapped_update(tmp_path, small_corpus):
    """The leader completes the exchange at the apply step and broadcasts it inside its region (the last one
    fragment by fragment); DDP keeps running in between: every rank ends with the same θ."""
    from test_distributed import launch, write_scenario

    path = write_scenario(tmp_path, small_corpus, ("A100", "T4"), counts=[2, 2],
                          geomesh={"overlap": True, "overlap_tail_fragments": 3})  # the last exchange in fragments
    result = launch([str(path), "--nproc", "4", "--method", "geomesh", "--out", str(tmp_path / "run"), "--tokens",
                     "20000", "--quiet", "--timeout", "60", "--wan", "none"])  # fmt: skip
    assert result.code == 0, result.message
    s = result.summary
    assert s["overlap"] is True and s["rounds"] >= 2 and s["intra_region_bytes"] > 0
    assert len(s["param_checksums"]) == 4 and len(set(s["param_checksums"])) == 1
