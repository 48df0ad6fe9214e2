"""Side-by-side tables and plots of finished runs (reads summaries and ``events.jsonl``; trains nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .telemetry import read_events, time_to_target

SPAN_COLORS = {"compute": "#2a9d8f", "straggler_wait": "#e76f51", "comm_wait": "#457b9d", "other": "#bbbbbb"}


def loss_at_time(curve: list[list[float]], t: float) -> float | None:
    """The validation loss of the last evaluation at or before modeled time ``t``."""
    best = None
    for time_s, _tokens, loss in curve:
        if time_s <= t + 1e-9:
            best = loss
    return best


def apply_target(summaries: list[dict[str, Any]], target: float | None) -> None:
    """Set ``target_val_loss`` and recompute ``time_to_target_s`` from each run's loss curve."""
    for s in summaries:
        s["target_val_loss"] = target
        evals = [{"time": t, "val_loss": loss} for t, _, loss in s["curve"]]
        s["time_to_target_s"] = time_to_target(evals, target)


def comparison_rows(summaries: list[dict[str, Any]], reference: str = "diloco") -> list[dict[str, Any]]:
    """One row per method with the side-by-side metrics and ratios against ``reference``."""
    ref = next((s for s in summaries if s["method"] == reference), None)
    equal_time = min(s["modeled_time_s"] for s in summaries)
    rows = []
    for s in summaries:
        row = {
            "method": s["method"],
            "time_to_target_s": s["time_to_target_s"],
            "modeled_time_s": s["modeled_time_s"],
            "straggler_idle_pct": 100 * s["straggler_idle_frac"],
            "wan_idle_pct": 100 * s["wan_idle_frac"],
            "utilization_pct": 100 * s["utilization"],
            "bytes_per_round": s["bytes_per_round"],
            "rounds": s["rounds"],
            "final_val_loss": s["final_val_loss"],
            "val_loss_at_equal_time": loss_at_time(s["curve"], equal_time),
            "zero_shot_acc": s.get("zero_shot", {}).get("acc") if s.get("zero_shot") else None,
        }
        if ref is not None and ref is not s:
            row["ttt_reduction_vs_ref"] = _reduction(s["time_to_target_s"], ref["time_to_target_s"])
            row["straggler_idle_ratio_vs_ref"] = _ratio(ref["straggler_idle_frac"], s["straggler_idle_frac"])
            row["wan_idle_ratio_vs_ref"] = _ratio(ref["wan_idle_frac"], s["wan_idle_frac"])
        rows.append(row)
    return rows


def _reduction(x: float | None, ref: float | None) -> float | None:
    return None if x is None or not ref else 1 - x / ref


def _ratio(ref: float, x: float) -> float | None:
    return None if x <= 0 else ref / x


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table for the terminal and for docs/benchmarks.md (Markdown-compatible)."""
    cols = [
        ("method", "method", "{}"),
        ("time-to-target", "time_to_target_s", "{:,.0f} s"),
        ("Δ vs DiLoCo", "ttt_reduction_vs_ref", "{:+.1%}"),
        ("straggler idle", "straggler_idle_pct", "{:.1f}%"),
        ("WAN idle", "wan_idle_pct", "{:.1f}%"),
        ("util", "utilization_pct", "{:.1f}%"),
        ("bytes/round", "bytes_per_round", "{}"),
        ("rounds", "rounds", "{}"),
        ("final val loss", "final_val_loss", "{:.4f}"),
        ("loss @ equal time", "val_loss_at_equal_time", "{:.4f}"),
        ("zero-shot acc", "zero_shot_acc", "{:.3f}"),
    ]
    cols = [c for c in cols if any(r.get(c[1]) is not None for r in rows) or c[1] == "time_to_target_s"]

    def cell(row: dict, key: str, fmt: str) -> str:
        v = row.get(key)
        if v is None:
            return "—" if key != "ttt_reduction_vs_ref" or row["method"] != "diloco" else "ref"
        if key == "bytes_per_round":
            return human_bytes(v)
        if key == "ttt_reduction_vs_ref":
            return f"{-v:+.1%}"
        return fmt.format(v)

    header = [c[0] for c in cols]
    body = [[cell(r, key, fmt) for _, key, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    line = lambda items: "| " + " | ".join(x.ljust(w) for x, w in zip(items, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(b) for b in body)])


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n} B"


# ---- plots --------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_vs_time(summaries: list[dict[str, Any]], path: Path, target: float | None = None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summaries:
        curve = [c for c in s["curve"] if c[0] > 0]  # the log axis starts at the first exchange
        ax.plot([c[0] / 3600 for c in curve], [c[2] for c in curve], label=s["method"], lw=1.6, marker=".", ms=3)
    if target is not None:
        ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("modeled time (hours, log scale)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"Validation loss vs modeled time — {summaries[0]['scenario']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_idle_bars(summaries: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [s["method"] for s in summaries]
    bottom = [0.0] * len(names)
    for key, label, kind in (("utilization", "compute", "compute"), ("straggler_idle_frac", "straggler wait",
                             "straggler_wait"), ("wan_idle_frac", "WAN wait", "comm_wait")):  # fmt: skip
        vals = [100 * s[key] for s in summaries]
        ax.bar(names, vals, bottom=bottom, label=label, color=SPAN_COLORS[kind])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("% of worker time")
    ax.set_title("Where worker time goes")
    ax.legend(loc="upper right", fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


EXCHANGE_COLOR = "#1d3557"  # an exchange in flight while the worker computes (overlapped rounds)


def plot_timeline(events_path: Path, path: Path, title: str, max_rounds: int = 3) -> None:
    """Per-worker spans of the first ``max_rounds`` rounds (or steps, for DDP). With overlapped rounds
    (docs/overlap.md) each exchange in flight is drawn as a thin hatched bar under the worker's spans: it runs
    concurrently with the next round's compute."""
    plt = _pyplot()
    events = read_events(events_path)
    spans = [e for e in events if e["type"] == "span" and e["round"] < max_rounds]
    flights = [e for e in events if e["type"] == "exchange" and e["round"] < max_rounds]
    workers = list(dict.fromkeys(e["worker"] for e in spans))
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.5 * len(workers)))
    for i, w in enumerate(workers):
        for kind, color in SPAN_COLORS.items():
            bars = [(e["start"], e["end"] - e["start"]) for e in spans if e["worker"] == w and e["kind"] == kind]
            if bars:
                ax.broken_barh(bars, (i - 0.35, 0.5), color=color, label=kind if i == 0 else None)
        bars = [(e["start"], e["end"] - e["start"]) for e in flights if w in e["workers"]]
        if bars:
            ax.broken_barh(bars, (i + 0.18, 0.17), facecolor="white", edgecolor=EXCHANGE_COLOR, hatch="////",
                           linewidth=0.6)  # fmt: skip
    ax.set_yticks(range(len(workers)), workers)
    ax.invert_yaxis()
    ax.set_xlabel("modeled time (s)")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in SPAN_COLORS.values()][:3]
    labels = list(SPAN_COLORS)[:3]
    if flights:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor=EXCHANGE_COLOR, hatch="////"))
        labels.append("exchange in flight (overlapped)")
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(labels), fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
