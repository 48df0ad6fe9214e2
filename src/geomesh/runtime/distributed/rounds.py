"""The round loop of the distributed runtime for round-based methods (diloco, geomesh and its ablations, with
or without overlap), on one rank: the region's inner steps, the leaders' straggler barrier and exchange
(all-gather of payloads or all-reduce of the weighted fp32 pseudo-gradient), the broadcast inside a region,
the outer step on every rank, the checksum of θ, records and checkpoints (see
:mod:`geomesh.runtime.distributed`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ...codec import Manifest
from ...errors import RunError
from ...methods.base import OuterLoopMethod, budget_steps, payload_key
from ...methods.overlap import fold_remainder, round_compute_s
from ...outer import OuterNesterov
from ...planner import Plan
from ...worker import inner_lr
from .checkpoints import RunCheckpointer
from .core import STATIC_FAULTS, RankRun, params_checksum
from ..payloads import CombineOn
from .region import lay_out_like
from .transport import WanShaper, split_gathered, tx_bytes


def run_rounds(run: RankRun) -> dict[str, Any]:
    """The round loop of a round-based method on this rank of ``run`` (set up); returns the summary's method
    fields."""
    method: OuterLoopMethod = run.method  # type: ignore[assignment]
    sc, tr = run.scenario, run.scenario.training
    if sc.faults:
        raise RunError(STATIC_FAULTS)
    model = run.global_model
    params = {k: p.detach() for k, p in model.named_parameters()}
    manifest = Manifest.from_tensors(params)
    key = payload_key(sc)  # the shared secret that signs payloads, when the scenario names one
    codec = method.make_codec(manifest, sc, key=key)
    combiner = method.make_codec(manifest, sc, key=key)
    outer = OuterNesterov(params, lr=tr.outer_lr, momentum=tr.outer_momentum)
    wan = sc.wan_model()
    shaper = WanShaper(wan, run.options.wan)
    proxy_payload = combiner.payload_nbytes()
    modeled_payload = method.modeled_payload_bytes(sc, manifest)
    exchange_s, _ = method.exchange(wan, modeled_payload)

    def make_plan() -> dict:
        return method.plan(sc, run._profiles(), exchange_bytes=modeled_payload, exchange_s=exchange_s).to_json()

    plan = Plan.from_json(run._on_rank0("planning", make_plan))
    run.plans.append(plan)
    n = len(sc.regions)
    d = manifest.numel
    dense = method.collective == "all_reduce"
    # what one leader hands to the cross-region collective, and what the shaper holds it for
    wan_nbytes = 4 * (d + 1) if dense else proxy_payload
    shaper_s = shaper.allreduce_s(wan_nbytes) if dense else shaper.allgather_s(wan_nbytes)
    names = [r.name for r in sc.regions]
    seq = sc.proxy.seq_len
    lay_out = lambda whole: lay_out_like(whole, params)  # noqa: E731 - updates land as θ is held (sharded or whole)
    overlap = None  # the overlapped round (runtime/distributed/overlap.py, docs/overlap.md)
    if method.overlapped(sc):
        from .overlap import RankOverlap

        overlap = RankOverlap(run, method, combiner, outer, params, manifest, shaper, shaper_s, dense,
                              proxy_payload)  # fmt: skip
    run._start_records(plan)
    run._start_clock()
    every, keep = run._checkpoint_cadence()
    saver = None
    if every > 0 or run._resume_from is not None:
        saver = RunCheckpointer(run, params, outer, codec, run._checkpoint_fingerprint(), overlap=overlap)
    if run._resume_from is not None:
        saver.restore(Path(run._resume_from))
        plan = run.plans[-1]
        run._t0 = time.perf_counter() - run._cursor  # the clock goes on from the checkpoint's time
        run._say(f"[{method.name}] resumed from the checkpoint of round {run.rounds} ({run._resume_from})")
    while run.tokens_done < run.budget:
        remaining = run.budget - run.tokens_done
        steps = budget_steps([w.inner_steps for w in plan.workers], [w.batch for w in plan.workers], seq,
                             remaining)  # as the emulated runtime
        if overlap is not None:  # a remainder too short to hide the exchange joins this round (as emulated)
            steps = fold_remainder(steps, [w.batch for w in plan.workers], seq, remaining,
                                   plan.sequences_per_round * seq, plan.compute_s, plan.exchange_s)  # fmt: skip
        round_tokens = sum(w.batch * h for w, h in zip(plan.workers, steps)) * seq
        run._mark("other")
        round_start = run._cursor
        wp, h, start = plan.workers[run.region], steps[run.region], run.tokens_done
        run.worker.follow_plan(wp)

        def lr_at(k: int, h: int = h, start: int = start, total: int = round_tokens) -> float:
            return inner_lr(start + k / h * total, run.budget, tr)

        checkpoint_due = saver is not None and every > 0 and (run.rounds + 1) % every == 0  # after this round
        split = None  # an overlapped exchange nothing hides (the last, one a checkpoint waits for) leaves in
        # fragments (as emulated)
        if overlap is not None and (run.tokens_done + round_tokens >= run.budget or checkpoint_due):
            split = overlap.tail_split(wan, modeled_payload, round_compute_s(plan.workers, steps))
        if overlap is not None:  # the previous round's update is applied inside this one, when it arrives
            apply_at = overlap.apply_at(wp, h)
            tail = overlap.tail_send(split, wp, h, apply_at) if split is not None else None
            payload, _ = method.local_phase_overlapped(run.worker, h, wp.batch, overlap.start, apply_at,
                                                       overlap.arrive, codec, lr_at, tail)  # fmt: skip
            if split is None:
                overlap.prepare_next(payload, plan, steps, plan.exchange_s)
        else:
            payload, _ = method.local_phase(run.worker, h, wp.batch, params, codec, lr_at)
        run._mark("compute")
        compute_s = run._cursor - round_start - (overlap.waited_s if overlap is not None else 0.0)
        sent_before, wire_before = run.transport.wan_bytes, tx_bytes(run._iface)
        comm_start = run._cursor
        exchanged: torch.Tensor | None = None
        if run.is_leader:
            run.transport.barrier(run.leaders_group, what=f"the straggler barrier of round {run.rounds + 1}")
            run._mark("straggler_wait")
            comm_start = run._cursor
            since = time.perf_counter()
            if split is not None:  # the last fragment, launched as the others were; drained below
                overlap.launch_fragment(split.fragments - 1, payload[-1])
            elif overlap is not None:  # launched, not waited for: it arrives inside the next round
                overlap.launch(payload, since)
            elif dense:
                flat = torch.zeros(d + 1, dtype=torch.float32, device=run.device)
                if payload is not None:
                    decoded = combiner.decode(payload, device=run.device)
                    w = decoded.tokens / 2**20 if combiner.weighting == "tokens" else 1.0
                    torch.cat([t.reshape(-1) for t in decoded.tensors.values()], out=flat[:d])
                    flat[:d].mul_(w)
                    flat[d] = w
                exchanged = run.transport.all_reduce_sum(flat, run.leaders_group)
            else:
                exchanged = run.transport.all_gather_bytes(payload, proxy_payload, run.leaders_group, n)
            if overlap is None:
                shaper.hold(shaper_s, since)
        if run.region_group is not None and overlap is None:
            if exchanged is None:
                exchanged = (torch.empty(d + 1, dtype=torch.float32, device=run.device) if dense
                             else torch.empty(n * proxy_payload, dtype=torch.uint8))  # fmt: skip
            exchanged = run.transport.broadcast(exchanged, run.leader, run.region_group)
        run._mark("comm_wait")
        comm_s = run._cursor - comm_start
        wire_after = tx_bytes(run._iface)
        # the outer step, on every rank from the same bytes (overlapped: when the exchange arrives)
        if overlap is not None:
            comm_s += overlap.take_waited()
        elif dense:
            if float(exchanged[d]) > 0:
                flat = exchanged[:d].div(exchanged[d])
                outer.step(lay_out({s.name: flat[o : o + s.numel].view(s.shape)
                                    for s, o in zip(manifest, manifest.offsets)}))  # fmt: skip
        else:
            slots = split_gathered(exchanged, proxy_payload)
            method.apply([p for p in slots if p is not None], CombineOn(combiner, run.device, lay_out),
                         outer)  # fmt: skip
        run.tokens_done += round_tokens
        run.rounds += 1
        if overlap is not None and (run.tokens_done >= run.budget or checkpoint_due):
            # the last round's exchange (nothing is left to hide it under), or one a checkpoint must not hold
            overlap.drain()
            comm_s += overlap.take_waited()
        checksum = params_checksum(params)
        run._mark("other")
        parts = payload if split is not None else (payload,)
        info = run._round_info(checksum, compute_s, comm_s, sent_before, wire_before, wire_after,
                               proxy_bytes=sum(len(p) for p in parts if p is not None) if run.is_leader else 0,
                               dropped=any(p is None for p in parts) and run.is_leader)  # fmt: skip
        infos = run._gather_checked(info, "round", "global parameters")
        if run.rank == 0:
            run._record_round(infos, names)
        if run.evaluates and overlap is None and (run.rounds % tr.eval_every_rounds == 0
                                                  or run.tokens_done >= run.budget):  # fmt: skip
            run._evaluate(run._now())  # (overlapped: evaluated when the update arrives)
        if checkpoint_due:
            run._save_checkpoint(saver, keep)
        run._test_exit_point()
    run._final_telemetry(params, outer.buf)
    return {**run._exchange_fields(wan_nbytes, proxy_payload, modeled_payload, shaper_s, method.collective),
            "overlap": overlap is not None}
