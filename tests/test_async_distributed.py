"""The asynchronous baseline (``async-local-sgd``) under ``geomesh launch``: a parameter server on region 0's
leader, regions that never wait for each other. In the modeled order (``--async-order modeled``) the launch is the
emulated run bit for bit; in arrival order it trains, spends the budget and ends every region on the server's θ;
a forged push costs only its sender's update; what it cannot do is refused in one line before any rank starts."""

from __future__ import annotations

import pytest
import torch
from test_distributed import emulated_run, launch, write_scenario

from geomesh.telemetry import read_events

METHOD = "async-local-sgd"
TOKENS = 6000


def async_launch(path, out, nproc: int, *extra: str, env=None):
    return launch([str(path), "--nproc", str(nproc), "--method", METHOD, "--out", str(out), "--tokens", str(TOKENS),
                   "--save-params", "--quiet", "--wan", "none", "--timeout", "60", *extra], env=env)  # fmt: skip


@pytest.mark.parametrize("gpus", [("A100",), ("H100", "A100", "T4")], ids=["one-region", "three-regions"])
def test_modeled_order_equals_the_emulated_run(tmp_path, small_corpus, gpus):
    """The server applies the pushes in the emulated event queue's order: the same arrivals, the same θ and the
    same losses as `geomesh train`, bit for bit; every region ends on the server's θ."""
    path = write_scenario(tmp_path, small_corpus, gpus)
    expected, s = emulated_run(path, METHOD, TOKENS)
    out = tmp_path / "run"
    result = async_launch(path, out, len(gpus), "--async-order", "modeled")
    assert result.code == 0, result.message
    summary = result.summary
    assert summary["rounds"] == s["rounds"] >= 3 and summary["tokens"] == s["tokens"]
    assert summary["final_val_loss"] == s["final_val_loss"]
    assert summary["dyLU_inner_steps"] == s["dyLU_inner_steps"] and summary["plan"] == s["plan"]
    got = torch.load(out / "final_params.pt")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert len(set(summary["param_checksums"])) == 1
    # every evaluation on the same cadence (tokens) with the same loss; one round record per arrival
    assert [c[1:] for c in summary["curve"]] == [c[1:] for c in s["curve"]]
    rounds = [e for e in read_events(out / "events.jsonl") if e["type"] == "round"]
    assert [e["round"] for e in rounds] == list(range(1, s["rounds"] + 1))
