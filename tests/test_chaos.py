"""The fast subset of the fault-injection matrix (bench/chaos.py): one fault at one point of a round, real
``geomesh launch`` runs of 3 elastic regions with GeoMesh's plan loop on.

Each cell is checked by the bench's own checks (:func:`check` there): the launch exits 0, the surviving regions'
ranks exit 0, the fault fired, the survivors end with one checksum, and the records say what happened. What
depends on timing (whether a kill after the vote also rolls the next round back, which round a re-plan lands on)
is not asserted. The whole matrix: ``python bench/chaos.py`` (docs/reliability.md).
"""

from __future__ import annotations

import pytest
from conftest import bench_script

chaos = bench_script("chaos")


def run(cell, tmp_path, small_corpus) -> dict:
    result = chaos.run_cell(cell, tmp_path / "cell", small_corpus, timeout=240)
    assert result["ok"], (result["label"], result["problems"], result["evidence"])
    return result


@pytest.mark.waits
def test_a_region_killed_between_the_vote_and_its_outer_step_leaves_without_forking_theta(tmp_path, small_corpus):
    """r1-a100 dies at the outer step of round 2, its vote cast: it is not in a later quorum, and the two others
    end on one θ (whether their vote on round 2 completed before its connections closed is a race, not asserted:
    either they applied round 2 or rolled it back, alike)."""
    seen = run(chaos.Cell("geomesh", "step", 2), tmp_path, small_corpus)["seen"]
    assert [region for _, region in seen["leaves"]] == ["r1-a100"] and seen["leaves"][0][0] >= 2


@pytest.mark.waits
def test_a_lost_exchange_in_the_sharded_exchange_rolls_the_round_back_on_every_region(tmp_path, small_corpus):
    """r1-a100's leader loses round 2's sharded exchange after everything arrived: it votes no, every region rolls
    the round back (the owners' residuals too) and all three train it again and finish."""
    seen = run(chaos.Cell("sharded", "arrived", 2), tmp_path, small_corpus)["seen"]
    assert seen["regions_at_end"] == list(chaos.NAMES) and not seen["leaves"]


@pytest.mark.waits
def test_a_lost_streaming_exchange_rolls_back_every_regions_fragments_to_theta(tmp_path, small_corpus):
    """Streaming DiLoCo's regions keep their unsynced fragments from round to round; r1-a100's leader loses round
    2's exchange after every fragment payload arrived: every region rolls the round back (its local fragments to
    θ) and trains it again with the same fragment, and all three finish on one θ."""
    seen = run(chaos.Cell("streaming", "arrived", 2), tmp_path, small_corpus)["seen"]
    assert seen["regions_at_end"] == list(chaos.NAMES) and [r for r, _ in seen["rollbacks"]].count(2) >= 1


@pytest.mark.waits
def test_a_region_killed_before_its_checkpoint_beside_a_region_of_two_fsdp_ranks(tmp_path, small_corpus):
    """Every region checkpoints every round, r0-h100 of two ranks with FSDP: r1-a100 dies before writing its
    checkpoint of round 2; both ranks of r0-h100 and r2-t4 finish on one θ."""
    result = run(chaos.Cell("fsdp", "checkpoint", 2), tmp_path, small_corpus)
    assert result["seen"]["ranks"]["rank0 r0-h100"] == result["seen"]["ranks"]["rank1 r0-h100"] == "exit code 0"


def test_the_matrix_tries_every_point_with_a_kill_and_with_a_hang():
    """``--actions kill,hang``: every point of every configuration twice, the second time region 1 hung there (it
    is taken out of the run like a killed one, and its cell gets a short round deadline); a seed drawn without
    hangs draws what it drew before hangs existed, so earlier failures replay."""
    configs = ["geomesh", "sharded"]
    cells = chaos.matrix(configs, list(chaos.POINTS), 2, ("kill", "hang"))
    kills = [c for c in cells if c.act != "hang"]
    hangs = [c for c in cells if c.act == "hang"]
    assert len(kills) == len(hangs) == len(chaos.points_of("geomesh")) + len(chaos.points_of("sharded"))
    assert {c.fault()["action"] for c in hangs} == {"hang"} and {c.stops for c in hangs} == {"r1-a100"}
    assert chaos.Cell("geomesh", "arrived").stops is None  # a lost exchange takes no region out
    assert chaos.draw(7, 12, configs) == chaos.draw(7, 12, configs, ("kill",))
    assert all(c.act != "hang" for c in chaos.draw(7, 12, configs))
    assert any(c.act == "hang" for c in chaos.draw(7, 12, configs, ("kill", "hang")))
    results = [{"cell": {"config": c.config, "point": c.point, "action": c.action}, "ok": True, "problems": [],
                "wall_s": 1.0} for c in cells]  # fmt: skip
    rows = chaos.table(results, configs, list(chaos.POINTS), ("kill", "hang")).splitlines()
    assert "| send (hang) | pass (1 s) | pass (1 s) |" in rows and "| arrived (lose) | pass (1 s) | pass (1 s) |" in rows
    assert "| slices (hang) | - | pass (1 s) |" in rows
