"""Shared fixtures: a session-wide data cache and a tiny, fast scenario on a slice of the default corpus."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and one thread does not slow down when the machine is busy."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def geomesh_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("geomesh-cache")
    os.environ["GEOMESH_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session", autouse=True)
def ranks_from_a_zygote():
    """Ranks that a launch in this process starts are forked from a process that imported torch once
    (tests/rank_zygote.py): the same command, without paying torch's import per rank. Session-wide, so the
    launches that module fixtures make are forked too (a function fixture would patch after them).
    ``GEOMESH_TEST_EXEC_RANKS=1`` starts every rank the product's way."""
    import rank_zygote

    if os.environ.get(rank_zygote.EXEC_RANKS_ENV) == "1":
        yield
        return

    from geomesh.cli import ranks

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ranks, "start_rank", rank_zygote.start_rank)
        yield


@pytest.fixture(autouse=True)
def exec_ranks_where_marked(request, monkeypatch):
    """A test that finds its ranks by their /proc environment (or that watches how they are started) is marked
    ``exec_ranks``: its ranks start the product's way."""
    if request.node.get_closest_marker("exec_ranks"):
        import rank_zygote

        from geomesh.cli import ranks

        monkeypatch.setattr(ranks, "start_rank", rank_zygote.product_start_rank)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> list[str]:
    """Two plays from the default corpus: enough text for a real (small) tokenizer and shards."""
    from geomesh.data import default_corpus_files

    files = [f for f in default_corpus_files() if f.name.startswith(("hamlet", "macbeth"))]
    assert len(files) == 2
    return [str(f) for f in files]


# A test that turns calibration on for what follows it (elastic runs, re-plans, the sharded exchange as users run
# it) measures with short windows: the default windows, long enough that a CPU quota's throttling is inside them,
# made calibration half of such a test's CPU. The tests of what calibration measures take the defaults
# (:func:`sustained_calibration`).
QUICK_CALIBRATION = {"calibration_window_s": 0.1, "calibration_budget_s": 2.0}


def sustained_calibration(data: dict) -> dict:
    """A scenario dict of :func:`tiny_scenario_dict` with the product's calibration windows."""
    for key in QUICK_CALIBRATION:
        data["geomesh"].pop(key, None)
    return data


def tiny_scenario_dict(paths: list[str], gpus=("H100", "A100", "T4"), **training) -> dict:
    regions = [{"name": f"r{i}-{g.lower()}", "gpu": g, "count": 1} for i, g in enumerate(gpus)]
    n = len(regions)
    return {
        "name": "tiny",
        "regions": regions,
        "wan": {"rtt": [[0 if i == j else 80 for j in range(n)] for i in range(n)], "bandwidth_gbps": 10.0},
        "timing_model": {"n_layers": 12, "hidden": 768, "seq_len": 1024, "vocab": 32000},
        "model": {"preset": "nano", "seq_len": 32},
        "data": {"paths": paths, "vocab_size": 512, "val_fraction": 0.05},
        "training": {"tokens": 24000, "batch": 4, "inner_steps": 5, "inner_lr": 0.003, "eval_sequences": 16,
                     "zero_shot_items": 40,
                     **training},
        # The sequence target (N·b·H per round) keeps rounds as small as the token budgets of these fast tests;
        # the planning rule (the default) is tested on its own (test_planning_rule.py) and on the presets.
        # calibrate: false: the distributed runtime plans from the datasheet model, as the emulated one (the
        # tiny model's step times on a shared machine are noise); tests of calibration turn it on
        "geomesh": {"min_batch": 1, "min_inner_steps": 1, "chunk_size": 256, "round_sequences_factor": 1.0,
                    "calibrate": False, **QUICK_CALIBRATION},
    }


@pytest.fixture
def tiny_scenario(tmp_path, small_corpus):
    """Write a tiny scenario YAML and return a function that loads it (with optional overrides)."""

    def make(gpus=("H100", "A100", "T4"), **training):
        from geomesh.config import load_scenario

        path = tmp_path / "tiny.yaml"
        path.write_text(yaml.safe_dump(tiny_scenario_dict(small_corpus, gpus, **training)))
        return load_scenario(path)

    return make


def bench_script(name: str):
    """The module of ``bench/<name>.py`` (the bench scripts are files, not a package)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


# A distributed run whose results a test compares bit for bit (with the emulated runtime, or with itself after a
# resume) keeps its plan: wall-clock measurements of a tiny model on a shared machine would re-plan it at
# rounds no two runs agree on. The tests of re-planning from measurement turn it back on.
FIXED_PLAN = {"replan": False, "calibrate": False}


def healed_in_place(events: list[dict]) -> list[tuple[int, str]]:
    """(round, region) of every region that fell behind and healed while still a member (its own exchange
    failed where the others' completed, e.g. a member killed between their parts of the collective): a
    ``leave`` with that reason and its ``join`` in the same round."""
    joins = {(e["round"], e["region"]) for e in events if e["type"] == "join"}
    return [(e["round"], e["region"]) for e in events if e["type"] == "leave"
            and e["reason"].startswith("restarted (or fell behind)") and (e["round"], e["region"]) in joins]


def pytest_collection_modifyitems(config, items):
    """The files that hold a test marked ``long`` or ``waits`` are collected first (the order inside each group
    kept): make test's workers take one file at a time, and a long file taken last keeps one worker busy while
    the others have nothing left to do."""
    long_files = {item.path for item in items if item.get_closest_marker("long") or item.get_closest_marker("waits")}
    items.sort(key=lambda item: item.path not in long_files)


def ranks_with_keys(path, out, method: str, tokens: int, keys: list[str], key_env: str = "GEOMESH_TEST_RUN_KEY"):
    """A static run started rank by rank (``python -m geomesh.run``, one process per region, as a deployment
    starts them, through :func:`geomesh.cli.ranks.start_rank`: forked from the rank zygote in a test), rank i with
    run key ``keys[i]`` in ``key_env``: (their exit codes, their output)."""
    import socket
    import sys
    import threading

    from geomesh.cli import ranks
    from geomesh.runtime.lifeline import LIFELINE_ENV, Lifeline

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = str(Path(__file__).resolve().parents[1] / "src")
    lifeline, procs = Lifeline(), []
    try:
        for rank, key in enumerate(keys):
            env = {**os.environ, "PYTHONPATH": src, "RANK": str(rank), "WORLD_SIZE": str(len(keys)),
                   "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", key_env: key, LIFELINE_ENV: str(lifeline.read_fd)}  # fmt: skip
            env.pop("GEOMESH_REGION", None)
            cmd = [sys.executable, "-m", "geomesh.run", str(path), "--method", method, "--out", str(out), "--tokens",
                   str(tokens), "--quiet", "--timeout", "60"]  # fmt: skip
            procs.append(ranks.start_rank(cmd, env, lifeline.read_fd, None))
        logs = [""] * len(procs)

        def read(i: int) -> None:  # (each pipe drained at once: a rank blocked on a full pipe would hold the others)
            logs[i] = procs[i].stdout.read()

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
        for t in readers:
            t.start()
        for p in procs:
            p.wait(timeout=240)
        for t in readers:
            t.join(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                ranks.kill(p)
        lifeline.close()
    return [p.returncode for p in procs], logs
