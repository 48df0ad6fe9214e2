"""The compressed methods side by side, from finished ``geomesh bench`` folders (issue 25's rows).

Usage:  PYTHONPATH=src python bench/compressed.py runs/i25-default [runs/i25-fast-wan ...]

``geomesh bench`` trains the methods and writes ``OUT/results.json``; this reads it (nothing is trained) and
prints, per folder, one Markdown table with the rows a reader comparing compressed methods asks for:
bits per parameter per round (one worker's payload, header and tag included, over the model's parameters:
the proxy's bytes, which scale to the timing model unchanged), inner steps per round, time-to-target, the
loss at equal tokens (each method's last evaluation at or before the fewest tokens any method trained) and
at equal time (the same at the shortest modeled run), zero-shot accuracy, and the stopping rule the bench
used. Under a token budget "equal tokens" is every method's final loss; under a time budget, "equal time" is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from geomesh.config import load_scenario
from geomesh.methods import get_method
from geomesh.methods.base import proxy_manifest
from geomesh.report import loss_at_time


def loss_at_tokens(curve: list[list[float]], tokens: float) -> float | None:
    """The validation loss of the last evaluation at or before ``tokens`` trained."""
    return next((loss for _time, done, loss in reversed(curve) if done <= tokens + 1e-9), None)


def table(folder: Path) -> str:
    results = json.loads((folder / "results.json").read_text())
    summaries = results["summaries"]
    scenario = load_scenario(results["scenario"])
    numel = proxy_manifest(scenario).numel
    # a token budget ends every run within one inner step per worker of it, not exactly on it: 1% of slack
    equal_tokens = min(s["tokens"] for s in summaries) * 1.01
    equal_time = min(s["modeled_time_s"] for s in summaries)
    lines = [f"`{results['scenario']}`; stopping rule: {results.get('stopping_rule')}; target loss "
             f"{results['target_val_loss']:.4f} (DiLoCo's final); equal tokens = {equal_tokens / 1.01:,.0f} (+1%), equal time = "
             f"{equal_time:,.0f} modeled s", "",
             "| method | bits/param/round | inner steps/round | rounds | time-to-target | loss @ equal tokens "
             "| loss @ equal time | zero-shot acc |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in summaries:
        method = get_method(s["method"])
        bits = 8 * s["proxy_payload_bytes"] / numel if s.get("proxy_payload_bytes") else 32.0
        steps = ",".join(str(w["inner_steps"]) for w in (s.get("plan") or {}).get("workers", [])) or "?"
        ttt = s.get("time_to_target_s")
        zs = (s.get("zero_shot") or {}).get("acc")
        lt, le = loss_at_tokens(s["curve"], equal_tokens), loss_at_time(s["curve"], equal_time)
        lines.append(f"| {method.name} | {bits:.3f} | {steps} | {s['rounds']} | "
                     f"{'—' if ttt is None else f'{ttt:,.0f} s'} | {'—' if lt is None else f'{lt:.4f}'} | "
                     f"{'—' if le is None else f'{le:.4f}'} | {'—' if zs is None else f'{zs:.3f}'} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    for folder in argv:
        path = Path(folder)
        if not (path / "results.json").is_file():
            print(f"error: {path}/results.json not found (run `geomesh bench ... --out {path}` first)", file=sys.stderr)
            return 2
        print(table(path) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
