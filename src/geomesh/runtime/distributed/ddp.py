"""The ``ddp`` baseline in the distributed runtime: every inner step, the gradient is all-reduced across
all regions, and every rank applies the same AdamW step.

As in the emulated runtime (:mod:`geomesh.runtime.emulated.ddp`), each region draws ``training.batch`` sequences per
step from its own shard and the step is the mean of the regions' batch gradients; one step is one round
(``rounds`` counts steps; the global model is evaluated every ``training.inner_steps`` steps and at the end).

How the gradient moves: inside a region, the region's ranks reduce their slices with DDP (as for the
round-based methods); across regions, the leaders all-reduce one flat fp32 buffer over their group (the
WAN, held by the shaper to ``WanModel.allreduce_s`` for its bytes, like any other exchange) and broadcast
the sum inside their region. Spans per step, as for a round: ``compute`` (forward/backward), ``straggler_wait``
(the leaders' barrier), ``comm_wait`` (all-reduce, shaper hold, broadcast), ``other`` (the step, checksum,
telemetry, evaluation). With ``--checkpoint-every N`` every N steps are a DCP checkpoint (the replica and
AdamW state of each region, data positions, RNG, clock; θ is the replica), and ``--resume`` continues bit for
bit, as for the round-based methods. Under a time budget (``--time-budget``) each region's clock rides with its
gradient as one more float of the all-reduce: the step at which the regions' mean clock reaches the budget is
the last, on every rank.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ...planner import Plan, plan_uniform
from ...worker import inner_lr
from .run_checkpoint import RunCheckpointer
from .core import RankRun, params_checksum
from .wan_shaper import WanShaper, tx_bytes


def _flat_grads(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=device)
             for p in model.parameters()]  # fmt: skip
    return torch.cat(grads).to(device=device, dtype=torch.float32)


def _set_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        piece = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = piece.clone()
        else:
            p.grad.copy_(piece)
        offset += p.numel()


def run_ddp(run: RankRun) -> dict[str, Any]:
    """The step loop of ``ddp`` on this rank of ``run`` (set up); returns the summary's method fields."""
    sc, tr = run.scenario, run.scenario.training
    worker = run.worker
    model = worker.model
    names = [r.name for r in sc.regions]
    n = len(names)
    seq = sc.model.seq_len
    d = sum(p.numel() for p in model.parameters())
    grad_nbytes = 4 * d  # what one leader hands to the cross-region all-reduce per step
    timing_nbytes = 4 * sc.timing().params  # the same gradient at the timing model's size (what the plan used)
    wan = sc.wan_model()
    shaper = WanShaper(wan, run.options.wan)
    shaper_s = shaper.allreduce_s(grad_nbytes)

    def make_plan() -> dict:
        return plan_uniform(run.profile_source.read(), tr.batch, 1, exchange_bytes=timing_nbytes,
                            exchange_s=wan.allreduce_s(timing_nbytes)).to_json()  # fmt: skip

    plan = Plan.from_json(run._on_rank0("planning", make_plan))
    run.plans.append(plan)
    worker.follow_plan(plan.workers[run.region])
    worker.load_global({k: p.detach() for k, p in run.global_model.named_parameters()})
    run._start_records(plan)
    run._start_clock()
    every, keep = run.checkpoints.cadence()
    saver = None
    if every > 0 or run.checkpoints.resume_from is not None:  # θ is the replica: the region's model holds it
        saver = RunCheckpointer(run, {}, None, None, run.checkpoints.fingerprint)
    if run.checkpoints.resume_from is not None:
        saver.restore(Path(run.checkpoints.resume_from))
        run.clock.resume(run._cursor)  # the clock goes on from the checkpoint's time
        run._say(f"[ddp] resumed from the checkpoint of step {run.rounds} ({run.checkpoints.resume_from})")
    step_tokens = n * tr.batch * seq
    model.train()
    timed = run.stopping.timed
    while not run.stopping.spent(run.tokens_done):
        run._mark("other")
        step_start = run._cursor
        worker.optimizer.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss, _ = worker.accumulate_grad(tr.batch, weight=1.0 / n)  # the region's batch, reduced in the region
        if worker.slowdown > 1:
            time.sleep((worker.slowdown - 1) * (time.perf_counter() - started))
        run._mark("compute")
        compute_s = run._cursor - step_start
        sent_before, wire_before = run.transport.wan_bytes, tx_bytes(run._iface)
        comm_start = run._cursor
        flat = _flat_grads(model, run.device)
        if timed:  # this region's clock rides with the gradient: every rank gets the sum of the regions' clocks
            flat = torch.cat([flat, torch.tensor([run._now()], dtype=torch.float32, device=flat.device)])
        if run.is_leader:
            run.transport.barrier(run.leaders_group, what=f"the straggler barrier of step {run.rounds + 1}")
            run._mark("straggler_wait")
            comm_start = run._cursor
            since = time.perf_counter()
            flat = run.transport.all_reduce_sum(flat, run.leaders_group)  # Σ over regions of (1/n)·region mean
            shaper.hold(shaper_s, since)
        if run.region_group is not None:
            flat = run.transport.broadcast(flat, run.leader, run.region_group)
        run._mark("comm_wait")
        comm_s = run._cursor - comm_start
        wire_after = tx_bytes(run._iface)
        clocks = None
        if timed:
            clocks, flat = [float(flat[-1]) / n], flat[:-1]  # the regions' mean clock (the same on every rank)
        # every rank holds the same summed gradient: skip a non-finite step everywhere, else step everywhere
        finite = bool(torch.isfinite(flat).all())
        if finite:
            _set_grads(model, flat)
            worker.apply_step(inner_lr(run.tokens_done, run.stopping.lr_tokens(run.plans), tr))
        worker.optimizer.zero_grad(set_to_none=True)
        run.tokens_done += step_tokens
        run.rounds += 1
        run.stopping.agree_elapsed(clocks)  # the time budget: the step at which the regions' mean clock reaches it is the last
        params = {k: p.detach() for k, p in model.named_parameters()}
        run._mark("other")
        info = run._round_info(params_checksum(params), compute_s, comm_s, sent_before, wire_before, wire_after,
                               proxy_bytes=grad_nbytes if run.is_leader else 0,
                               dropped=not finite and run.rank == 0, loss=loss)  # fmt: skip
        infos = run.reports.checked(info, "step", "parameters", run.rounds)
        if run.rank == 0:
            if not finite:
                run.telemetry.emit({"type": "warning", "round": run.rounds, "worker": "all",
                                    "message": "non-finite gradient; the all-reduced step is skipped"})  # fmt: skip
            run._record_round(infos, names, **({"elapsed_s": run.stopping.time_elapsed_s} if timed else {}))
            if run.rounds % tr.inner_steps == 0 or run.stopping.spent(run.tokens_done):
                run.global_model.load_state_dict(model.state_dict())
                run._evaluate(run._now())
        if every > 0 and run.rounds % every == 0:
            run._save_checkpoint(saver, keep)
        run._test_exit_point()
    run.global_model.load_state_dict(model.state_dict())  # θ = the replica every rank holds
    run._final_telemetry({k: p.detach() for k, p in model.named_parameters()})
    return run.ledger.exchange_fields(run.rounds, grad_nbytes, grad_nbytes, timing_nbytes, shaper_s, "all_reduce")
