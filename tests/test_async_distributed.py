"""The asynchronous baseline (``async-local-sgd``) under ``geomesh launch``: a parameter server on region 0's
leader, regions that never wait for each other. In the modeled order (``--async-order modeled``) the launch is the
emulated run bit for bit; in arrival order it trains, spends the budget and ends every region on the server's θ;
a forged push costs only its sender's update; what it cannot do is refused in one line before any rank starts."""

from __future__ import annotations

import pytest
import torch
import yaml
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


def test_a_damaged_push_costs_only_its_sender(tmp_path, small_corpus, monkeypatch, capsys):
    """Three ranks, region 1 of two (DDP inside, θ shared by its leader), a run key, the pushes in the modeled
    order (so that which region's push comes when is the scenario's, not the machine's): region 1's first push is
    damaged on the wire (the scenario's corrupt fault); the server rejects it, drops that update only and sends θ
    back; region 1 goes on (its next push is the run's last: the budget is spent by then). Bytes: one frame each way per remote cycle. A checkpoint cadence is warned about in
    one line before the ranks start, and none is written."""
    key_env = "GEOMESH_TEST_ASYNC_KEY"
    monkeypatch.setenv(key_env, "k" * 32)
    path = write_scenario(tmp_path, small_corpus, ("H100", "A100"), counts=[1, 2])
    data = yaml.safe_load(path.read_text())
    data["reliability"] = {"hmac_key_env": key_env}
    data["faults"] = [{"at_round": 0, "region": "r1-a100", "kind": "corrupt"}]
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    result = async_launch(path, out, 3, "--checkpoint-every", "2", "--async-order", "modeled",
                          env={key_env: "k" * 32})  # fmt: skip
    assert result.code == 0, result.message
    warned = [line for line in capsys.readouterr().err.splitlines() if "no checkpoints are written" in line]
    assert len(warned) == 1 and not (out / "checkpoints").exists()
    summary = result.summary
    assert summary["rejected_payloads"] == 1 and summary["tokens_lost"] > 0
    events = read_events(out / "events.jsonl")
    warnings = [e for e in events if e["type"] == "warning"]
    assert [w["worker"] for w in warnings] == ["r1-a100"] and "rejected push" in warnings[0]["message"]
    cycles = summary["cycles"]
    assert cycles["r1-a100"] >= 2  # it went on after its rejected push
    assert summary["bytes_sent"] == 2 * summary["payload_bytes_per_worker"] * cycles["r1-a100"]
    assert len(set(summary["param_checksums"])) == 1


def test_arrival_order_trains_and_ends_every_rank_on_the_servers_theta(tmp_path, small_corpus):
    """Three ranks, region 1 of two, the pushes applied as they arrive (the default): the run spends the budget,
    its loss falls, every rank ends on the server's θ, and every arrival is one round record. (Which region
    arrives when is the machine's: nothing here depends on it.)"""
    path = write_scenario(tmp_path, small_corpus, ("H100", "A100"), counts=[1, 2])
    out = tmp_path / "run"
    result = async_launch(path, out, 3)
    assert result.code == 0, result.message
    summary = result.summary
    assert summary["async_order"] == "arrival" and summary["collective"] == "push_pull"
    assert summary["tokens"] >= TOKENS and summary["rounds"] >= 3
    curve = summary["curve"]
    assert curve[-1][2] < curve[0][2]  # the loss falls
    assert len(summary["param_checksums"]) == 3 and len(set(summary["param_checksums"])) == 1
    assert summary["rejected_payloads"] == 0 and summary["tokens_lost"] == 0
    assert summary["bytes_sent"] == 2 * summary["payload_bytes_per_worker"] * summary["cycles"]["r1-a100"]
    rounds = [e for e in read_events(out / "events.jsonl") if e["type"] == "round"]
    assert [e["round"] for e in rounds] == list(range(1, summary["rounds"] + 1))
    assert all(e["staleness"] >= 0 and len(e["members"]) == 1 for e in rounds)


@pytest.mark.parametrize(
    "extra, data, message",
    [
        (["--min-regions", "2", "--async-order", "modeled"], {}, "not with elastic regions"),
        (["--resume"], {}, "writes no checkpoints"),
        ([], {"faults": [{"at_round": 1, "region": "r1-a100", "kind": "nan"}]}, "injects only corrupt"),
        (["--time-budget", "30"], {}, "not with a time budget"),
        (["--async-order", "sorted"], {}, "--async-order 'sorted'"),
    ],
)
def test_what_it_cannot_do_is_refused_in_one_line(extra, data, message, tmp_path, small_corpus, capsys):
    from geomesh.cli import launch as cli_launch

    path = write_scenario(tmp_path, small_corpus, ("H100", "A100"))
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **data}))
    argv = ["launch", str(path), "--out", str(tmp_path / "run"), "--nproc", "2", "--method", METHOD, *extra]
    assert cli_launch.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "logs").exists()  # nothing started



def test_a_push_is_opened_only_as_the_push_it_claims_to_be():
    """What the server receives is data: a replayed push (another number), one in another region's place or from
    another sender, a forged one, tensors that are not θ's, or garbage is refused with a reason, never raised."""
    from geomesh.runtime.distributed.async_wire import PUSH, message_width, pack, unpack
    from geomesh.runtime.distributed.frames import Rejected, run_trust, set_run_trust

    before = run_trust()
    set_run_trust(b"k" * 32, "run-1")
    try:
        like = {"a": torch.zeros(3, 2), "b": torch.zeros(4)}
        width = message_width(like)
        delta = {"a": torch.ones(3, 2), "b": torch.full((4,), 0.5)}
        buf = pack(PUSH, {"delta": delta, "info": {"compute_s": 1.0}}, region=1, number=2, sender=3, width=width)
        good = unpack(PUSH, buf, region=1, number=2, sender=3, like=like)
        assert not isinstance(good, Rejected) and torch.equal(good["delta"]["a"], delta["a"])
        reasons = [unpack(PUSH, buf, region=1, number=1, sender=3, like=like),  # replayed
                   unpack(PUSH, buf, region=2, number=2, sender=3, like=like),  # another region's place
                   unpack(PUSH, buf, region=1, number=2, sender=4, like=like),  # another sender
                   unpack(PUSH, torch.zeros(width, dtype=torch.uint8), region=1, number=2, sender=3, like=like)]
        forged = buf.clone()
        forged[200] ^= 0x5A
        reasons.append(unpack(PUSH, forged, region=1, number=2, sender=3, like=like))
        odd = pack(PUSH, {"delta": {"a": torch.ones(2, 3), "b": torch.ones(4)}, "info": {}}, region=1, number=2,
                   sender=3, width=width)  # fmt: skip
        reasons.append(unpack(PUSH, odd, region=1, number=2, sender=3, like=like))
        nan = pack(PUSH, {"delta": {"a": torch.full((3, 2), float("nan")), "b": torch.ones(4)}, "info": {}},
                   region=1, number=2, sender=3, width=width)  # fmt: skip
        reasons.append(unpack(PUSH, nan, region=1, number=2, sender=3, like=like))
        assert all(isinstance(r, Rejected) for r in reasons), reasons
        assert ["replayed" in reasons[0].reason, "sender" in reasons[2].reason, "HMAC" in reasons[4].reason,
                "shapes" in reasons[5].reason, "non-finite" in reasons[6].reason] == [True] * 5
    finally:
        set_run_trust(before.key, before.run_id)
