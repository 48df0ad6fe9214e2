"""Emulated-runtime overhead: real CPU training throughput of the runtime beside a bare PyTorch loop.

Both train the same proxy model on the same corpus, same batch size and same number of tokens, in this one
process, alternating repeats so that machine noise hits both alike. The runtime's extra work (replicas,
pseudo-gradients, encoding, combining, outer steps, spans and events) shows up as the ratio
``runtime_tokens_per_s / bare_tokens_per_s`` (target: at least 0.9). Evaluation is not training, so the
runtime evaluates only at the start and the end here and skips the zero-shot task.

    python bench/engine.py [--scenario default] [--methods diloco] [--tokens 200000] [--repeats 2]

Only methods that train at ``training.batch`` on every worker compare like for like with the bare loop
(DiLoCo, DDP); GeoMesh's planned batches are larger, so its throughput is not the engine's overhead.

Prints one JSON object per method.

With ``--parallel`` it compares instead the runtime's two ways of running the workers of a round, side by side,
alternating within each repeat: in-process as before (every worker phase on all the cores' intra-op threads,
what the runtime did before worker processes), in-process with one thread per worker phase (the reference
the worker processes reproduce bit for bit), and worker processes (``workers_parallel``, one per core). It
reports tokens/s of each, the speed-up of worker processes over the in-process runtime, and whether their
summary equals the reference's exactly:

    python bench/engine.py --parallel [--methods diloco,geomesh] [--tokens 120000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from geomesh.config import load_scenario
from geomesh.data import BatchStream, Corpus, CorpusSpec
from geomesh.methods import get_method
from geomesh.models import build_model, model_config
from geomesh.runtime.emulated import EmulatedRun, RunOptions
from geomesh.worker import inner_lr, make_inner_optimizer


def bare_loop(scenario, tokens: int) -> float:
    """Plain AdamW on one model: the fastest this machine trains the proxy. Returns tokens per second."""
    d, tr, seq = scenario.data, scenario.training, scenario.model.seq_len
    corpus = Corpus.load(CorpusSpec(paths=d.paths, vocab_size=d.vocab_size, val_fraction=d.val_fraction))
    model = build_model(model_config(scenario.model.preset, vocab_size=corpus.vocab_size, seq_len=seq), tr.seed)
    opt = make_inner_optimizer(model, tr)
    stream = BatchStream(corpus.train_tokens, seq, seed=tr.seed)
    steps = tokens // (tr.batch * seq)
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = stream.next_batch(tr.batch)
        for g in opt.param_groups:
            g["lr"] = inner_lr(step * tr.batch * seq, tokens, tr)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        opt.step()
    return steps * tr.batch * seq / (time.perf_counter() - t0)


def runtime_loop(scenario, method: str, tokens: int) -> float:
    """The emulated runtime's real (not modeled) training throughput: the run's wall clock less its set-up
    (loading the corpus, building the replicas), which the bare loop does not time either."""
    summary = EmulatedRun(scenario, get_method(method), RunOptions(tokens=tokens, progress=False)).run()
    return summary["tokens"] / (summary["wall_clock_s"] - summary["setup_s"])


def parallel_variants(scenario, method: str, tokens: int, processes: int | None) -> dict[str, tuple[float, dict]]:
    """One run of each way of running the workers; (tokens/s, summary without real seconds) by variant."""
    cores = torch.get_num_threads()
    variants = {
        "in_process": {"workers_parallel": 1, "worker_threads": cores},  # the runtime before worker processes
        "in_process_1_thread": {"workers_parallel": 1, "worker_threads": 1},
        "worker_processes": {"workers_parallel": processes},  # None: the default, one per core
    }
    out = {}
    for name, opts in variants.items():
        summary = EmulatedRun(scenario, get_method(method), RunOptions(tokens=tokens, progress=False, **opts)).run()
        rate = summary["tokens"] / (summary.pop("wall_clock_s") - summary.pop("setup_s"))
        out[name] = (rate, summary)
    return out


def compare_parallel(scenario, method: str, tokens: int, repeats: int, processes: int | None) -> dict:
    rates: dict[str, list[float]] = {}
    identical = True
    load = [os.getloadavg()[0]]
    for r in range(repeats):
        got = parallel_variants(scenario, method, tokens, processes)
        identical &= got["worker_processes"][1] == got["in_process_1_thread"][1]
        for name, (rate, _) in got.items():
            rates.setdefault(name, []).append(rate)
        load.append(os.getloadavg()[0])
    best = {k: max(v) for k, v in rates.items()}
    med = {k: statistics.median(v) for k, v in rates.items()}
    probe = EmulatedRun(scenario, get_method(method), RunOptions(tokens=tokens, progress=False, workers_parallel=processes))
    return {"scenario": scenario.name, "method": method, "tokens": tokens, "repeats": repeats,
            "cores": torch.get_num_threads(), "processes": probe.workers_parallel,
            **{f"{k}_tokens_per_s": round(v) for k, v in best.items()},
            "speedup_vs_in_process": round(best["worker_processes"] / best["in_process"], 3),
            "speedup_vs_in_process_median": round(med["worker_processes"] / med["in_process"], 3),
            "speedup_vs_1_thread": round(best["worker_processes"] / best["in_process_1_thread"], 3),
            "identical_to_1_thread_summary": identical, "loadavg_1min": [round(x, 2) for x in load],
            "all_tokens_per_s": {k: [round(x) for x in v] for k, v in rates.items()}}  # fmt: skip


def without_evaluation(scenario):
    scenario.training.eval_every_rounds = 10**9
    scenario.training.zero_shot_items = 0
    return scenario


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="default")
    ap.add_argument("--methods", default="diloco", help="methods whose plan uses training.batch for every step")
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parallel", action="store_true", help="in-process runtime vs worker processes, side by side")
    ap.add_argument("--processes", type=int, default=None, help="worker processes (default: one per core)")
    args = ap.parse_args()
    scenario = without_evaluation(load_scenario(args.scenario))
    if args.parallel:
        for method in args.methods.split(","):
            print(json.dumps(compare_parallel(scenario, method, args.tokens, args.repeats, args.processes)), flush=True)
        return
    for method in args.methods.split(","):
        bare, emulated = [], []
        for _ in range(args.repeats):
            bare.append(bare_loop(scenario, args.tokens))
            emulated.append(runtime_loop(scenario, method, args.tokens))
        b, e = max(bare), max(emulated)
        print(json.dumps({"scenario": args.scenario, "method": method, "tokens": args.tokens,
                          "bare_tokens_per_s": round(b), "runtime_tokens_per_s": round(e),
                          "ratio": round(e / b, 3), "threads": torch.get_num_threads()}))  # fmt: skip


if __name__ == "__main__":
    main()
