"""Streaming DiLoCo under ``geomesh launch``: the same rounds as the emulated runtime, bit for bit, static and
elastic; each round's slots are its fragment's size; a region of two FSDP ranks keeps its fragments' local state
through a checkpoint. (Faults at every point of an elastic streaming round: ``bench/chaos.py --configs
streaming``, docs/reliability.md.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from test_distributed import assert_same_params, emulated_run, launch, write_scenario

from geomesh.config import load_scenario
from geomesh.methods import get_method
from geomesh.methods.base import proxy_manifest
from geomesh.runtime.distributed.transport import SLOT_HEADER_NBYTES

METHOD = "streaming-diloco"
H = 4  # a multiple of the method's 2 fragments: one fragment syncs every H/2 = 2 inner steps
TOKENS = 6000


def fragment_sizes(path: Path) -> list[int]:
    scenario = load_scenario(path)
    return get_method(METHOD).make_codec(proxy_manifest(scenario), scenario).fragment_nbytes()


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_streaming_launch_equals_the_emulated_run(tmp_path, small_corpus, elastic):
    """Fragments synchronised in turn, each with its own outer step, the others training on locally: the launch
    ends on the emulated run's θ and loss exactly. Each round's all-gather carries slots of the fragment that
    round syncs (fragment 0 and fragment 1 are of different sizes), and nothing else."""
    path = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"), inner_steps=H)
    expected, s = emulated_run(path, METHOD, TOKENS)
    out = tmp_path / "run"
    result = launch([str(path), "--nproc", "3", "--method", METHOD, "--out", str(out), "--tokens", str(TOKENS),
                     "--save-params", "--quiet", "--wan", "none", "--timeout", "60",
                     *(["--min-regions", "2"] if elastic else [])])  # fmt: skip
    assert result.code == 0, result.message
    summary = result.summary
    assert ("elastic" in summary) == elastic
    assert summary["rounds"] == s["rounds"] >= 4 and summary["tokens"] == s["tokens"]
    assert summary["final_val_loss"] == s["final_val_loss"]
    got = torch.load(out / "final_params.pt")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert len(set(summary["param_checksums"] if not elastic else summary["param_checksums"].values())) == 1
    sizes = fragment_sizes(path)
    assert sizes[0] != sizes[1]
    sent = [sizes[r % 2] for r in range(summary["rounds"])]
    assert summary["proxy_bytes_sent"] == 3 * sum(sent)  # every region's payload, every round
    if not elastic:  # the ring all-gather: each leader sends its slot and forwards one other (docs/formats.md)
        assert summary["bytes_sent"] == sum(3 * 2 * (n + SLOT_HEADER_NBYTES) for n in sent)


def test_streaming_with_a_region_of_two_fsdp_ranks_resumes_bit_identical(tmp_path, small_corpus):
    """Region 0 of two ranks shards θ and its replica (FSDP); a rank exits after round 3 and ``--resume`` from the
    checkpoint of round 2 ends as the uninterrupted run, bit for bit: the fragment that did not sync in round 2
    trains on from each region's own local values, which the checkpoint holds. The run itself is the emulated
    one up to float summation order inside the two-rank region."""
    path = write_scenario(tmp_path, small_corpus, ("A100", "T4"), counts=[2, 1], inner_steps=H)
    data = yaml.safe_load(path.read_text())
    data["regions"][0]["strategy"] = data["regions"][1]["strategy"] = "fsdp"
    path.write_text(yaml.safe_dump(data))

    def run(out: Path, *extra: str, env: dict[str, str] | None = None):
        return launch([str(path), "--nproc", "3", "--method", METHOD, "--out", str(out), "--tokens", str(TOKENS),
                       "--save-params", "--quiet", "--wan", "none", "--timeout", "60", *extra], env=env)  # fmt: skip

    ref = run(tmp_path / "ref")
    assert ref.code == 0, ref.message
    cut = run(tmp_path / "run", "--checkpoint-every", "2", env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "1:3"})
    assert cut.code != 0 and not (tmp_path / "run" / "summary.json").exists(), cut.message
    resumed = run(tmp_path / "run", "--checkpoint-every", "2", "--resume")
    assert resumed.code == 0, resumed.message
    assert resumed.summary["rounds"] == ref.summary["rounds"] >= 6
    assert resumed.summary["final_val_loss"] == ref.summary["final_val_loss"]
    want, got = torch.load(tmp_path / "ref" / "final_params.pt"), torch.load(tmp_path / "run" / "final_params.pt")
    assert all(torch.equal(want[k], got[k]) for k in want)
    expected, _ = emulated_run(path, METHOD, TOKENS)
    assert_same_params(want, expected, rtol=0.0, atol=1e-2)


def test_a_round_screens_out_a_payload_of_another_fragment(tiny_scenario):
    """Round r's codec is fragment r mod F's: a payload of the other fragment (well signed, from a region off the
    schedule or replaying) is rejected by the screen and costs only its sender's update; the region's own schedule
    moves to the agreed round whatever rounds it missed."""
    from geomesh.runtime.payloads import screen_slots

    s = tiny_scenario(inner_steps=H)
    method, m = get_method(METHOD), proxy_manifest(s)
    key = b"k" * 32
    sender, receiver = method.make_codec(m, s, key=key), method.make_codec(m, s, key=key)
    delta = {spec.name: torch.randn(spec.shape) for spec in m}
    method.round_codec(sender, 6)
    on_schedule = sender.encode(delta, 100)
    method.round_codec(sender, 3)
    off_schedule = sender.encode(delta, 100)
    assert sender.current == 1 and method.round_codec(sender, 6) is sender.codecs[0]
    passed, rejected, dropped = screen_slots(method.round_codec(receiver, 6), {0: on_schedule, 1: off_schedule,
                                                                                2: None})  # fmt: skip
    assert list(passed) == [0] and dropped == [2]
    assert [r for r, _ in rejected] == [1] and "mismatch" in rejected[0][1]
