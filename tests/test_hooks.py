"""The fault hooks (runtime/hooks.py): one object, named points, read from the environment in one place."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from geomesh.runtime.hooks import HOOKS_ENV, LEGACY, FaultHooks, HooksError

SRC = Path(__file__).resolve().parents[1] / "src" / "geomesh"


def test_a_fault_fires_once_at_its_point_round_and_region():
    hooks = FaultHooks.from_env({HOOKS_ENV: json.dumps([{"point": "arrived", "region": "r1", "round": 3,
                                                         "action": "lose"}])})  # fmt: skip
    assert not hooks.at("arrived", "r1", 2) and not hooks.at("arrived", "r0", 3) and not hooks.at("send", "r1", 3)
    assert hooks.pending("arrived", "r1", 3)
    assert hooks.at("arrived", "r1", 3) is True
    assert not hooks.at("arrived", "r1", 3) and not hooks.pending("arrived", "r1", 3)  # (once)


def test_the_one_fault_variables_are_read_as_faults_of_the_same_form():
    hooks = FaultHooks.from_env({LEGACY["kill"]: "r2:4:hang", LEGACY["lose"]: "r0:2", LEGACY["slow"]: "r1:2:3.5",
                                 LEGACY["slices"]: "r1:5", LEGACY["exit"]: "1:6", LEGACY["wan"]: "2:3:8",
                                 LEGACY["compute"]: "1"})  # fmt: skip
    got = {(f.point, f.region, f.round, f.action, f.rank) for f in hooks.faults}
    assert got == {("send", "r2", 4, "hang", None), ("arrived", "r0", 2, "lose", None), ("send", "r1", 3, "slow", None),
                   ("slices", "r1", 5, "kill", None), ("done", None, 6, "exit", 1)}  # fmt: skip
    # a slowdown from the round after the one named, on that region only
    assert [hooks.slowdown("r1", k) for k in (1, 2, 3, 9)] == [1.0, 1.0, 3.5, 3.5] and hooks.slowdown("r0", 9) == 1.0
    assert [hooks.wan_factor(k) for k in (0, 3, 4)] == [2.0, 2.0, 8.0] and hooks.compute_as_planned


def test_a_restarted_region_is_not_killed_again_by_its_old_process_s_fault():
    hooks = FaultHooks.from_env({LEGACY["kill"]: "r2:4"})
    hooks.forget("r2")
    assert hooks.at("send", "r2", 4) is False  # (a kill would have ended this test's process)


@pytest.mark.parametrize("spec, why", [
    ("not json", "not JSON"), ('{"point": "send"}', "a JSON list"),
    ('[{"point": "nowhere", "region": "r0", "round": 1, "action": "kill"}]', "fault point 'nowhere'"),
    ('[{"point": "send", "region": "r0", "round": 1, "action": "explode"}]', "fault action 'explode'"),
    ('[{"point": "send", "region": "r0", "round": -1, "action": "kill"}]', "fault round -1"),
    ('[{"point": "send", "round": 1, "action": "kill"}]', "names its region"),
])  # fmt: skip
def test_a_malformed_fault_is_one_clear_error(spec, why):
    with pytest.raises(HooksError, match=re.escape(why)):
        FaultHooks.from_env({HOOKS_ENV: spec})


def test_only_the_hooks_module_reads_the_fault_variables():
    readers = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if re.search(r"environ[^\n]*GEOMESH_TEST|GEOMESH_TEST_[A-Z_]+\"\)", p.read_text())
                     or re.search(r"os\.environ\.get\((TEST_\w+|HOOKS_ENV)", p.read_text()))  # fmt: skip
    assert readers == ["runtime/hooks.py"], readers
