"""GPU check: does GeoMesh's GPU path work on this machine, and what does it give? A few minutes on one GPU.

Usage:  PYTHONPATH=src python bench/gpu_check.py --out runs/gpu-check            # CUDA, every GPU here
        PYTHONPATH=src python bench/gpu_check.py --out runs/gpu-check --smoke    # CPU size (what the tests run)

Three checks, one JSON file (``OUT/gpu_check.json``) and a table on stdout:

1. ``train``: the distributed runtime (``geomesh launch``: one rank per GPU, NCCL) trains the built-in
   ``llama-125m`` preset (Llama-shaped, ~102M parameters at the corpus's 4096-token vocabulary, sequence 512)
   as one region of this machine's GPUs, DiLoCo rounds, twice: with the region's ``strategy: fsdp``
   (FSDP2 ``fully_shard``, also over a single GPU), ``training.precision: bf16`` (autocast, fp32 master
   weights) and activation checkpointing; then ``strategy: ddp`` in fp32 with no checkpointing; on a GPU also
   ``strategy: fsdp`` in ``fp16`` (autocast with dynamic loss scaling by FSDP2's ``ShardedGradScaler``: what a
   V100 or T4 region trains in). Reported: tokens/s, peak GPU memory of rank 0, validation loss before and
   after, every rank's parameter checksum, and for fp16 the steps the loss scaler skipped and its final scale.
2. ``codec``: ``SignCodec`` encode and combine on the device (bench/codec.py's measurement) at 10M and 100M
   parameters, against a plain device copy; the wire ratio (~31.7x fewer bytes than fp32).
3. ``profile``: ``geomesh profile --device cuda`` with the same model (step time per micro-batch, the memory
   cap), the file ``geomesh plan --profile REGION=FILE`` reads.

``--smoke`` (or ``--device cpu``) runs the same checks at a CPU size: the ``nano`` preset on two plays of the
default corpus, two Gloo ranks sharing one region (FSDP over two ranks), a 100k-parameter codec, two
micro-batch sizes; the test suite runs it, so the script stays importable and working without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

BENCH = Path(__file__).resolve().parent
if str(BENCH.parent / "src") not in sys.path:
    sys.path.insert(0, str(BENCH.parent / "src"))


def _catalog_gpu(device: str) -> str:
    """The catalog's name for this machine's GPU (the plan's memory check uses it); H100 when unknown."""
    from geomesh.hardware import GPU_CATALOG

    if device != "cuda":
        return "H100"
    import torch

    name = torch.cuda.get_device_name(0).upper()
    for known in sorted(GPU_CATALOG, key=len, reverse=True):  # longest first: "H100" before "H10"
        if known.upper() in name:
            return known
    return "H100"


def sizes(device: str, smoke: bool) -> dict[str, Any]:
    """What each check runs at: a GPU size, or the CPU size of ``--smoke``."""
    if smoke:
        from geomesh.data import default_corpus_files

        plays = [str(f) for f in default_corpus_files() if f.name.startswith(("hamlet", "macbeth"))]
        return {"ranks": 2, "preset": "nano", "seq_len": 32, "vocab": 512, "paths": plays, "batch": 4,
                "inner_steps": 5, "tokens": 2000, "codec_params": [100_000], "profile_batches": "1,2",
                "timeout": 120}  # fmt: skip
    import torch

    return {"ranks": max(1, min(8, torch.cuda.device_count())), "preset": "llama-125m", "seq_len": 512,
            "vocab": 4096, "paths": None, "batch": 16, "inner_steps": 10, "tokens": 1_000_000,
            "codec_params": [10_000_000, 100_000_000], "profile_batches": "1,2,4,8,16", "timeout": 600}  # fmt: skip


def write_scenario(path: Path, device: str, s: dict[str, Any], *, strategy: str, precision: str,
                   checkpointing: bool) -> Path:  # fmt: skip
    """One region of this machine's devices, training ``s["preset"]``; the timing model is the same model."""
    from geomesh.models import MODEL_PRESETS

    shape = MODEL_PRESETS[s["preset"]]
    scenario = {
        "name": "gpu-check",
        "description": "one region of this machine's devices (bench/gpu_check.py)",
        "regions": [{"name": "this-machine", "gpu": _catalog_gpu(device), "count": s["ranks"], "strategy": strategy,
                     "activation_checkpointing": checkpointing}],  # fmt: skip
        "wan": {"rtt": [[0]], "bandwidth_gbps": 100.0},
        "timing_model": {"n_layers": shape["n_layers"], "hidden": shape["d_model"], "seq_len": s["seq_len"],
                         "vocab": s["vocab"]},  # fmt: skip
        "model": {"preset": s["preset"], "seq_len": s["seq_len"]},
        "data": {"paths": s["paths"], "vocab_size": s["vocab"]},
        "training": {"tokens": s["tokens"], "batch": s["batch"], "inner_steps": s["inner_steps"],
                     "precision": precision, "eval_sequences": 16, "zero_shot_items": 0,
                     "warmup_frac": 0.05},  # fmt: skip
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return path


TRAIN_RUNS = [("fsdp-bf16-ckpt", "fsdp", "bf16", True), ("ddp-fp32", "ddp", "fp32", False)]
GPU_ONLY_RUNS = [("fsdp-fp16", "fsdp", "fp16", False)]  # loss scaling (tests/test_precision.py: such a region on CPU)


def train_check(out: Path, device: str, s: dict[str, Any], quiet: bool = True) -> list[dict[str, Any]]:
    """The distributed runtime on one region: FSDP + bf16 + activation checkpointing, then DDP in fp32; on a GPU
    also FSDP in fp16 with dynamic loss scaling."""
    from geomesh.cli import launch as cli_launch

    rows = []
    for label, strategy, precision, checkpointing in TRAIN_RUNS + (GPU_ONLY_RUNS if device == "cuda" else []):
        folder = out / label
        scenario = write_scenario(folder / "scenario.yaml", device, s, strategy=strategy, precision=precision,
                                  checkpointing=checkpointing)  # fmt: skip
        argv = ["launch", str(scenario), "--nproc", str(s["ranks"]), "--method", "diloco", "--out",
                str(folder / "run"), "--wan", "none", "--timeout", str(s["timeout"]),
                "--backend", "nccl" if device == "cuda" else "gloo"]  # fmt: skip
        if quiet:
            argv.append("--quiet")
        args = cli_launch.build_parser().parse_args(argv)
        started = time.perf_counter()
        result = cli_launch.launch(args)
        if result.code != 0:
            raise RuntimeError(f"{label}: geomesh launch failed: {result.message}")
        summary = result.summary
        scaler = (summary.get("precision") or {}).get("this-machine") or {}
        rows.append({
            "run": label, "strategy": strategy, "precision": precision, "activation_checkpointing": checkpointing,
            "ranks": s["ranks"], "backend": summary["backend"], "model": summary["model"],
            "model_params": summary["model_params"], "tokens": summary["tokens"], "rounds": summary["rounds"],
            "train_s": summary["modeled_time_s"], "tokens_per_s": summary["tokens"] / summary["modeled_time_s"],
            "peak_gpu_memory_gib": summary.get("peak_gpu_memory_gib"),
            # θ + outer momentum on rank 0: 1/ranks of 8·P with fsdp, 8·P with ddp
            "outer_state_gib": summary["outer_state_bytes_per_rank"][0] / 2**30,
            "val_loss_start": summary["curve"][0][2], "val_loss_end": summary["final_val_loss"],
            "checksums_agree": len(set(summary["param_checksums"])) == 1,
            "launch_s": time.perf_counter() - started,
            # what the region really trained in, and in fp16 the steps its loss scaler skipped and its last scale
            "trained_precision": scaler.get("precision"), "skipped_steps": scaler.get("skipped_steps"),
            "loss_scale": scaler.get("loss_scale"),
        })  # fmt: skip
    return rows


def codec_check(device: str, s: dict[str, Any]) -> list[dict[str, Any]]:
    """SignCodec on the device, with bench/codec.py's measurement (encode, combine, a plain copy)."""
    import torch

    spec = importlib.util.spec_from_file_location("geomesh_bench_codec", BENCH / "codec.py")
    codec_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec_bench)
    repeats = 1 if device == "cpu" else 5
    return [codec_bench.bench_size(int(p), torch.device(device), 4, repeats, 8) for p in s["codec_params"]]


def profile_check(out: Path, device: str, s: dict[str, Any]) -> dict[str, Any]:
    """``geomesh profile --device DEVICE`` with the check's model (in this process, through the CLI)."""
    from geomesh.cli import main as cli_main

    scenario = write_scenario(out / "profile" / "scenario.yaml", device, s, strategy="ddp", precision="auto",
                              checkpointing=False)  # fmt: skip
    path = out / "profile" / f"{device}.json"
    code = cli_main(["profile", "--device", device, "--out", str(path), "--scenario", str(scenario),
                     "--batches", s["profile_batches"], "--repeats", "1" if device == "cpu" else "3"])  # fmt: skip
    if code not in (0, None):
        raise RuntimeError(f"geomesh profile --device {device} exited {code}")
    return json.loads(path.read_text())


def run_checks(out: Path, device: str, smoke: bool, quiet: bool = True) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    s = sizes(device, smoke)
    results: dict[str, Any] = {"device": device, "smoke": smoke, "sizes": {k: v for k, v in s.items() if k != "paths"}}
    if device == "cuda":
        import torch

        results["gpu"] = torch.cuda.get_device_name(0)
        results["gpus"] = torch.cuda.device_count()
        results["bf16_supported"] = torch.cuda.is_bf16_supported()
    results["train"] = train_check(out, device, s, quiet)
    results["codec"] = codec_check(device, s)
    results["profile"] = profile_check(out, device, s)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| run | model | ranks | tokens/s | peak GiB (rank 0) | θ + momentum GiB (rank 0) | val loss start -> end "
             "| checksums agree | skipped steps (loss scale) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["train"]:
        peak = f"{r['peak_gpu_memory_gib']:.2f}" if r["peak_gpu_memory_gib"] is not None else "-"
        scaled = f"{r['skipped_steps']} ({r['loss_scale']:g})" if r.get("loss_scale") is not None else "-"
        lines.append(f"| {r['run']} | {r['model']}, {r['model_params'] / 1e6:.1f}M | {r['ranks']} ({r['backend']}) | "
                     f"{r['tokens_per_s']:,.0f} | {peak} | {r['outer_state_gib']:.3f} | "
                     f"{r['val_loss_start']:.3f} -> {r['val_loss_end']:.3f} | {r['checksums_agree']} | "
                     f"{scaled} |")  # fmt: skip
    lines += ["", "| codec params | wire ratio | encode GB/s | combine GB/s | copy GB/s |", "|---|---|---|---|---|"]
    for c in results["codec"]:
        lines.append(f"| {c['params']:,} | {c['wire_ratio']} | {c['encode_gbps']} | {c['combine_gbps']} | "
                     f"{c['copy_gbps']} |")  # fmt: skip
    p = results["profile"]
    steps = ", ".join(f"b={b}: {t * 1000:.1f} ms" for b, t in sorted(((int(b), t) for b, t in p["table"].items())))
    lines += ["", f"profile ({results['device']}): max micro-batch {p['max_micro_batch']}; {steps}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the runs and gpu_check.json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda, or cpu with --smoke")
    ap.add_argument("--smoke", action="store_true", help="CPU size (seconds; what the test suite runs)")
    ap.add_argument("--verbose", action="store_true", help="show the ranks' output")
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.smoke else "cuda")
    smoke = args.smoke or device == "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda: CUDA is not available here (run with --smoke for the CPU size)", file=sys.stderr)
            return 2
    results = run_checks(Path(args.out), device, smoke, quiet=not args.verbose)
    print(table(results))
    print(f"\nwrote {Path(args.out) / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
