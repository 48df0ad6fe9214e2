"""Run several methods side by side on one scenario, token budget and seed; tabulate and plot them.

Used by ``geomesh demo`` and ``geomesh bench``. The target loss is the loss the reference method (DiLoCo)
reaches at the end of the budget unless one is given; time-to-target is then read off every method's
loss curve, so all methods are judged against the same target in the same run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import ScenarioConfig
from .methods import get_method
from .methods.budget import budget_rule
from .report import (apply_target, comparison_rows, format_table, plot_idle_bars, plot_loss_vs_time,
                     plot_timeline)  # fmt: skip
from .runtime.emulated import EmulatedRun, RunError, RunOptions, prepare_run_dir
from .telemetry import write_json_atomic

REFERENCE = "diloco"


def run_comparison(
    scenario: ScenarioConfig,
    methods: list[str],
    out_dir: Path,
    *,
    tokens: int | None = None,
    seed: int | None = None,
    target_val_loss: float | None = None,
    progress: bool = True,
    log=print,
    **options: Any,
) -> dict[str, Any]:
    """Train every method in ``methods``; write ``results.json``, ``table.md`` and PNG plots to ``out_dir``.

    ``options`` are further :class:`RunOptions` fields for every run (``workers_parallel``, ``device``, ...)."""
    for name in methods:
        get_method(name)  # fail fast on a typo, before hours of training
    prepare_run_dir(out_dir)
    summaries = []
    for name in methods:
        log(f"[{len(summaries) + 1}/{len(methods)}] {name}")
        opts = RunOptions(out_dir=out_dir / name, tokens=tokens, seed=seed, progress=progress, **options)
        summaries.append(EmulatedRun(scenario, get_method(name), opts).run())
    target = target_val_loss if target_val_loss is not None else scenario.training.target_val_loss
    rule = budget_rule(scenario) if tokens is None else f"token budget: {tokens:,} proxy tokens per method"
    return _tabulate(scenario.name, summaries, out_dir, target, rule)


def tabulate(out_dir: Path, methods: list[str], target_val_loss: float | None = None) -> dict[str, Any]:
    """The table, ``results.json`` and plots of finished runs in ``out_dir/<method>/`` (e.g. methods of one
    study trained by separate commands, at once), exactly as :func:`run_comparison` writes them."""
    out_dir = Path(out_dir)
    summaries = []
    for name in methods:
        path = out_dir / name / "summary.json"
        try:
            summaries.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise RunError(f"{path}: no finished run to tabulate ({exc})") from None
    names = {s["scenario"] for s in summaries}
    if len(names) > 1:
        raise RunError(f"{out_dir}: the runs belong to different scenarios ({', '.join(sorted(names))})")
    return _tabulate(names.pop(), summaries, out_dir, target_val_loss)


def _tabulate(scenario: str, summaries: list[dict[str, Any]], out_dir: Path, target: float | None,
              rule: str | None = None) -> dict[str, Any]:  # fmt: skip
    if target is None:
        ref = next((s for s in summaries if s["method"] == REFERENCE), None)
        target = ref["final_val_loss"] if ref is not None else None
    apply_target(summaries, target)
    for s in summaries:
        write_json_atomic(out_dir / s["method"] / "summary.json", s)
    rows = comparison_rows(summaries, REFERENCE)
    table = format_table(rows)
    results = {"scenario": scenario, "target_val_loss": target, "reference": REFERENCE, "stopping_rule": rule,
               "rows": rows, "summaries": summaries}  # fmt: skip
    write_json_atomic(out_dir / "results.json", results)
    (out_dir / "table.md").write_text((f"Stopping rule: {rule}.\n\n" if rule else "") + table + "\n")
    plot_loss_vs_time(summaries, out_dir / "loss_vs_time.png", target)
    plot_idle_bars(summaries, out_dir / "idle.png")
    for s in summaries:
        plot_timeline(out_dir / s["method"] / "events.jsonl", out_dir / f"timeline_{s['method']}.png",
                      f"{s['method']}: per-worker timeline (first rounds)")  # fmt: skip
    results["table"] = table
    return results
