"""Paper-scale comparison on one GPU: DDP, DiLoCo and GeoMesh on the `default` cluster with a ~125M proxy.

The emulated runtime (modeled GPU and WAN time, real training) with the ``paper_scale`` preset: the proxy is
``llama-125m`` (124M parameters at vocabulary 32000) on 512-token sequences, 4M tokens per method, trained
on the GPU in bf16 autocast (fp32 parameters, pseudo-gradients and outer step). Sized to finish within about
8 minutes on one H200-class GPU. Writes what ``geomesh bench`` writes (``results.json``, ``table.md``, loss and
idle plots, per-worker timelines, one run folder per method) plus ``paper_scale.json`` (device, versions,
each method's wall time and real tokens/s, the whole run's wall time):

    python bench/paper_scale.py --device cuda --out runs/paper-scale
    python bench/paper_scale.py --smoke --out runs/paper-scale-smoke      # CPU, a few minutes at most

``--smoke`` runs the same script, scenario and methods with a tiny proxy (``nano``, 64-token sequences,
vocabulary 512, 16k tokens) so that the whole path (GPU-less) is checked quickly; it is what the test suite
runs. ``--set FIELD=VALUE`` overrides any scenario field (after ``--smoke``'s), ``--tokens`` the budget.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from geomesh.compare import run_comparison
from geomesh.config import ConfigError, load_scenario, parse_overrides
from geomesh.errors import USER_ERRORS

PRESET = "paper_scale"
METHODS = ["ddp", "diloco", "geomesh"]
SMOKE = {  # the same scenario, shrunk until the whole path runs on a CPU in well under a minute
    "model.preset": "nano",
    "model.seq_len": 64,
    "data.vocab_size": 512,
    "training.tokens": 16_000,
    "training.batch": 2,
    "training.inner_steps": 4,
    "training.inner_lr": 0.003,
    "training.eval_sequences": 8,
    "training.zero_shot_items": 16,
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/paper-scale", help="output folder (results.json, table.md, plots)")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when there is one, else cpu)")
    ap.add_argument("--smoke", action="store_true", help="tiny proxy and budget: checks the whole path on a CPU")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (default: ddp,diloco,geomesh)")
    ap.add_argument("--tokens", type=int, default=None, help="token budget per method (default: the preset's)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a scenario field")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def environment(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
                            "cuda": torch.version.cuda, "cpu_threads": torch.get_num_threads()}  # fmt: skip
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    bf16=torch.cuda.is_bf16_supported())  # fmt: skip
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and not device.startswith("cuda"):
        raise ConfigError(f"--device {device}: the paper-scale run trains a 124M-parameter proxy and is sized for "
                          f"one GPU; give --device cuda on a machine with one, or --smoke to check it on a CPU")  # fmt: skip
    overrides = {**(SMOKE if args.smoke else {}), **parse_overrides(args.set)}
    scenario = load_scenario(PRESET, overrides)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    out = Path(args.out)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast (evaluation) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    started = time.perf_counter()
    results = run_comparison(scenario, methods, out, tokens=args.tokens, seed=args.seed, progress=not args.quiet,
                             log=log, device=device, workers_parallel=1 if device.startswith("cuda") else None)  # fmt: skip
    wall = time.perf_counter() - started
    per_method = {s["method"]: {"wall_clock_s": round(s["wall_clock_s"], 1), "setup_s": round(s["setup_s"], 1),
                                "tokens": s["tokens"], "proxy_params": s["proxy_params"],
                                "real_tokens_per_s": round(s["tokens"] / max(s["wall_clock_s"] - s["setup_s"], 1e-9))}
                  for s in results["summaries"]}  # fmt: skip
    meta = {"preset": PRESET, "smoke": args.smoke, "methods": methods, "wall_clock_s": round(wall, 1),
            "overrides": overrides, "environment": environment(device), "per_method": per_method,
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device.startswith("cuda") and torch.cuda.is_available() else None,
            "scenario": scenario.to_dict()}  # fmt: skip
    (out / "paper_scale.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    results["paper_scale"] = meta
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        results = run(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = results["paper_scale"]
    params = next(iter(meta["per_method"].values()))["proxy_params"] if meta["per_method"] else 0
    print(f"Scenario: {PRESET}{' (smoke)' if args.smoke else ''} on {meta['environment']['device']}"
          f"{' (' + meta['environment']['gpu'] + ')' if 'gpu' in meta['environment'] else ''}: proxy "
          f"{params / 1e6:.1f}M parameters; target loss = DiLoCo's final loss ({results['target_val_loss']})")  # fmt: skip
    print(results["table"])
    print(f"\nwall time {meta['wall_clock_s']:.0f} s; results in {args.out}/results.json, {args.out}/paper_scale.json; "
          f"plots in {args.out}/")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
