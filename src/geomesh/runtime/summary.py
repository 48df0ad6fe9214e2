"""The run summary (``summary.json``), built the same way by both runtimes (docs/formats.md).

:func:`build_summary` lays out the fields every runtime reports, in one order: what ran, how far it got,
the clock (modeled or wall), idle fractions, bytes, dropped updates, the model, the last plan, per-worker
spans, the loss curve and what was modeled. A runtime passes what only it knows (``reliability``:
fault records; ``model``: its model fields; ``tail``: its own fields, such as the device or the world
size) and the loop's ``extra`` fields, which come last and win over any field of the same name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import ScenarioConfig
    from ..planner import Plan
    from ..telemetry import Telemetry


def build_summary(*, method: str, scenario: ScenarioConfig, runtime: str, status: str | None, seed: int,
                  tokens: int, rounds: int, time_s: float, target: float | None, telemetry: Telemetry,
                  bytes_sent: float, proxy_bytes_sent: float, reliability: dict[str, Any], model: dict[str, Any],
                  plans: list[Plan], modeled: list[str], wall_s: float, tail: dict[str, Any],
                  extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One run's summary; ``status`` None leaves the field out (the loop's ``extra`` may set it)."""
    evals = telemetry.evals
    final = evals[-1]["val_loss"] if evals else None
    head: dict[str, Any] = {"method": method, "scenario": scenario.name, "runtime": runtime}
    if status is not None:
        head["status"] = status
    return {
        **head,
        "seed": seed,
        "tokens": tokens,
        "rounds": rounds,
        "modeled_time_s": time_s,
        "final_val_loss": final,
        "target_val_loss": target,
        "time_to_target_s": telemetry.time_to_target(target),
        **telemetry.idle_fractions(),
        "bytes_sent": bytes_sent,
        "bytes_per_round": bytes_sent / max(rounds, 1),
        "proxy_bytes_sent": proxy_bytes_sent,
        "dropped_updates": int(telemetry.counters.get("dropped_updates", 0)),
        **reliability,
        **model,
        "timing_params": scenario.timing().params,
        "plan": plans[-1].to_json() if plans else None,
        "per_worker": telemetry.per_worker(),
        "curve": [[e["time"], e["tokens"], e["val_loss"]] for e in evals],
        "modeled": modeled,
        "wall_clock_s": wall_s,
        **tail,
        **extra,
    }
