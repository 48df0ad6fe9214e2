"""Stopping rules: how much a method trains. Pure arithmetic on the plan and the WAN model (no clock).

A *token budget* (``training.tokens``, the default) gives every method the same tokens, so the method that
trains tokens fastest stops first: a time metric such as time-to-target then favours the slow. A *time
budget* (``training.time_budget_s``) gives every method the same modeled seconds instead: each method's token
budget becomes what its own plan trains in that time (:func:`tokens_in_time`), and its run then goes exactly
as a token-budgeted one (the inner learning-rate schedule spans those tokens, the last round is shortened to
what is left). The modeled clock is what the plan predicts, so runs with faults or re-planning end near, not
at, the same second.

:func:`few_outer_steps` is the warning that goes with a token budget: a balanced plan whose rounds carry many
times the reference's sequences takes that many times fewer outer steps of the same budget.
"""

from __future__ import annotations

import math

from ..config import ScenarioConfig
from ..planner import split_batch
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
        per_second = plan.sequences_per_round * seq / plan.round_s
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
