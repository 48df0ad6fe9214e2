"""Stopping rules: how much a method trains. Pure arithmetic on the plan and the WAN model (no clock).

A *token budget* (``training.tokens``, the default) gives every method the same tokens, so the method that
trains tokens fastest stops first: a time metric such as time-to-target then favours the slow. A *time
budget* (``training.time_budget_s``) gives every method the same modeled seconds instead: each method's token
budget becomes what its own plan trains in that time (:func:`tokens_in_time`), and its run then goes exactly
as a token-budgeted one (the inner learning-rate schedule spans those tokens, the last round is shortened to
what is left). The modeled clock is what the plan predicts, so runs with faults or re-planning end near, not
at, the same second.

The distributed runtime honours a time budget in wall-clock seconds instead (docs/distributed.md): the run
stops after the round in which the regions' clocks, as they report them with that round, reach it
(:func:`elapsed_of_round`: every rank computes the same number from the same gathered clocks); its inner
learning-rate schedule spans what its first plan predicts it trains in that time (:func:`plan_tokens_in_time`).

:func:`few_outer_steps` is the warning that goes with a token budget: a balanced plan whose rounds carry many
times the reference's sequences takes that many times fewer outer steps of the same budget.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import ScenarioConfig
from ..planner import Plan, split_batch
from .base import Method, OuterLoopMethod, proxy_manifest

FEW_OUTER_STEPS = 4  # a token budget that leaves a balanced plan at most a quarter of the reference's rounds


def budget_rule(scenario: ScenarioConfig) -> str:
    """The stopping rule in words, for tables and logs."""
    t = scenario.training.time_budget_s
    if t is None:
        return f"token budget: {scenario.training.tokens:,} proxy tokens per method"
    return f"time budget: {t:,.0f} modeled seconds per method (each trains what its plan fits in them)"


def tokens_in_time(method: Method, scenario: ScenarioConfig, seconds: float) -> int:
    """The proxy tokens ``method`` trains in ``seconds`` of modeled time on ``scenario`` (at least one round's
    worth of one step, so every method trains something)."""
    tr, seq = scenario.training, scenario.model.seq_len
    profiles = scenario.worker_profiles()
    wan = scenario.wan_model()
    n = len(profiles)
    if isinstance(method, OuterLoopMethod):
        payload = method.modeled_payload_bytes(scenario, proxy_manifest(scenario))
        exchange_s, _ = method.exchange(wan, payload)
        plan = method.plan(scenario, profiles, exchange_bytes=payload, exchange_s=exchange_s)
        return plan_tokens_in_time(plan, seq, seconds, tr.batch * seq)
    elif method.kind == "ddp":  # one all-reduce of fp32 gradients per step of the slowest worker
        step_s = max(p.step_s(*split_batch(tr.batch, p.max_micro_batch)) for p in profiles)
        per_second = n * tr.batch * seq / (step_s + wan.allreduce_s(4 * scenario.timing().params))
    else:  # asynchronous: every worker's cycle (its DyLU steps, push and pull) runs on its own
        from .async_local_sgd import dynamic_local_updates

        server = getattr(method, "server", 0)
        fp32 = 4 * scenario.timing().params
        steps = dynamic_local_updates(profiles, tr.batch, tr.inner_steps)
        per_second = 0.0
        for i, (p, h) in enumerate(zip(profiles, steps)):
            transfer = 0.0 if i == server else wan.rtt_s[i][server] / 2 + fp32 / wan.bandwidth_Bps[i][server]
            cycle = h * p.step_s(*split_batch(tr.batch, p.max_micro_batch)) + 2 * transfer
            per_second += h * tr.batch * seq / cycle
    return max(tr.batch * seq, math.floor(per_second * seconds))


def plan_tokens_in_time(plan: Plan, seq_len: int, seconds: float, floor: int) -> int:
    """The tokens ``plan`` trains in ``seconds`` (its rounds' tokens over its predicted round time), at least
    ``floor``."""
    per_second = plan.sequences_per_round * seq_len / plan.round_s if plan.round_s > 0 else 0.0
    return max(floor, math.floor(per_second * seconds))


def elapsed_of_round(clocks: list[Any]) -> float | None:
    """The run's elapsed seconds at a round, from the clocks its regions reported with it (each region's own
    wall clock; a resumed or healed region's goes on from the time the run had reached): their mean, so that
    no region's clock decides alone. Entries that are not finite seconds >= 0 (a malformed report) are left
    out; None when none is left. Pure: every rank that gathered the same reports gets the same number."""
    times = [float(c) for c in clocks
             if isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0]  # fmt: skip
    if not times:
        return None
    return math.fsum(times) / len(times)


def few_outer_steps(scenario: ScenarioConfig, method: OuterLoopMethod, tokens: int) -> str | None:
    """A warning when ``tokens`` leave ``method``'s balanced plan at most 1/``FEW_OUTER_STEPS`` of the outer
    steps the reference plan (training.batch × inner_steps on every region) takes, else None."""
    if not method.balanced or scenario.geomesh.round_sequences_factor is not None:
        return None
    tr, seq = scenario.training, scenario.model.seq_len
    profiles = scenario.worker_profiles()
    plan = method.plan(scenario, profiles)
    ref_rounds = tokens / (len(profiles) * tr.batch * tr.inner_steps * seq)
    rounds = tokens / (plan.sequences_per_round * seq)
    if rounds * FEW_OUTER_STEPS > ref_rounds or rounds > 8:
        return None
    return (f"{method.name}: this token budget gives {rounds:.1f} outer steps against the reference plan's "
            f"{ref_rounds:.1f} (each round carries {plan.sequences_per_round / (len(profiles) * tr.batch * tr.inner_steps):.1f}× "
            f"its sequences); few outer steps cost loss per token. Give every method the same time instead "
            f"(--time-budget SECONDS, training.time_budget_s), or keep the reference's sequences per round and "
            f"shorten the round (--set geomesh.round_sequences_factor=1)")  # fmt: skip
