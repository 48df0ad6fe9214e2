"""torchft's own DiLoCo as a peer: one region's replica group trained with ``torchft.Manager``,
``torchft.local_sgd.DiLoCo`` and torchft's Lighthouse, the way torchft's users run it, on GeoMesh's scenario.

Started per region like a GeoMesh rank (the hosts test bed does it for ``--method torchft-diloco``)::

    TORCHFT_LIGHTHOUSE=http://HOST:29510 GEOMESH_REGION=r1-a100 torchrun --nnodes 1 --nproc-per-node 1 ... \\
        -m geomesh.integrations.torchft_diloco SCENARIO --out DIR [--tokens N] [--set training.time_budget_s=S]

What it trains is our ``diloco``'s job, built by the same code: the scenario's model from the same seed (so
every replica starts alike: ``init_sync=False``), the region's own data shard (the same stream our region
draws), the same inner optimizer (AdamW with decay on matrices, betas (0.9, 0.95), gradient clipping, the
scenario's learning rate and schedule over the run's tokens) and the same outer optimizer (``torch.optim.SGD``
with Nesterov momentum at the scenario's outer lr and momentum: what :class:`~geomesh.outer.OuterNesterov`
computes), ``training.batch`` sequences per step and ``sync_every = training.inner_steps``. torchft averages the
fp32 pseudo-gradients with its managed all-reduce (equal weights, as our ``diloco``) over its own Gloo group;
the quorum of every round comes from the Lighthouse. Nothing of torchft is changed: DiLoCo's defaults
(per-tensor all-reduces, no quantisation) are what runs.

What is added around it, to read the run beside ours (records in ``DIR/events.jsonl`` and ``DIR/summary.json``,
the formats of docs/formats.md where they apply):

- a wall clock from when the replica is ready to train (as our elastic regions start theirs) and the spans of its
  worker: ``compute`` (inner steps), ``straggler_wait`` (the round's quorum: waiting for the slowest region to
  ask for it), ``comm_wait`` (from the quorum to the outer step: the pseudo-gradients' all-reduce and
  torchft's commit vote), ``other`` (outer step, evaluation, records); timings only, taken by wrapping
  ``Manager.start_quorum`` and hooks on the optimizers, which change nothing of what runs;
- a round record and an evaluation of θ (the scenario's validation set) after every ``eval_every_rounds``
  committed rounds, on every region (as our elastic leaders do);
- the token budget in whole rounds (torchft's DiLoCo syncs every ``sync_every`` steps, so the last round is not
  shortened as ours is), or ``training.time_budget_s`` in wall-clock seconds: after every round the regions
  all-reduce their clocks (one float, torchft's managed all-reduce; its seconds are recorded apart, ``clock_s``),
  and the round at which their mean reaches the budget is the last on every region.

One rank per region (torchft's replica group of one); ``--resume`` and checkpoints are not offered. A user error
is one ``error:`` line and exit 2; a failed run (no quorum, a lost peer) one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

METHOD = "torchft-diloco"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m geomesh.integrations.torchft_diloco",
                                description="one region of torchft's DiLoCo on a GeoMesh scenario")  # fmt: skip
    p.add_argument("scenario")
    p.add_argument("--out", required=True, help="this region's run folder")
    p.add_argument("--method", default=METHOD, help=f"{METHOD} (accepted for the bed's command line)")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None, help="wall-clock seconds (training.time_budget_s)")
    p.add_argument("--min-regions", type=int, default=None, help="torchft's min_replica_size (default: all)")
    p.add_argument("--timeout", type=float, default=60.0, help="quorum and collective timeout (s)")
    p.add_argument("--wan", default="none", help="none, or latency: not applied (torchft has no WAN shaper)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--save-params", action="store_true", help="write θ to DIR/final_params.pt at the end")
    p.add_argument("--no-calibrate", action="store_true", help="(accepted; DiLoCo plans nothing)")
    p.add_argument("--resume", action="store_true", help="refused: this runner keeps no checkpoints")
    return p


def advertised_transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport (what a recovering replica fetches the live state from), its address
    given at ``GEOMESH_ADVERTISE_HOST`` rather than the machine's host name, which on the hosts test bed (every
    host one machine) names no host's own address; None (torchft's default) without that variable. The
    deployment fix a torchft user makes with a resolvable host name; nothing else of the transport changes."""
    host = os.environ.get("GEOMESH_ADVERTISE_HOST")
    if not host:
        return None
    from torchft.checkpointing.http_transport import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{f'[{host}]' if ':' in host else host}:{port}/checkpoint/"

    return AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)


class RoundTimes:
    """When the phases of one round began and ended on this replica's clock (seconds since its start)."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.compute_end = self.quorum = self.outer = None

    def mark(self, name: str, value: Any = None) -> None:
        setattr(self, name, self.clock() if value is None else value)


class TorchftRegion:
    """One region's replica of torchft's DiLoCo over the scenario (see the module's docstring)."""

    def __init__(self, args: argparse.Namespace):
        from ..config import ConfigError, load_scenario, parse_overrides

        if args.method != METHOD:
            raise ConfigError(f"--method {args.method!r}: this runner is {METHOD}")
        if args.resume:
            raise ConfigError(f"--resume: {METHOD} keeps no checkpoints (run it again from the start)")
        sc = load_scenario(args.scenario, parse_overrides(args.set))
        if args.time_budget is not None:
            if not 0 < args.time_budget < math.inf:
                raise ConfigError(f"--time-budget {args.time_budget:g}: expected wall-clock seconds > 0")
            sc.training.time_budget_s = float(args.time_budget)
        if sc.training.time_budget_s is not None and args.tokens is not None:
            raise ConfigError("give a token budget (--tokens) or a time budget (training.time_budget_s), not both")
        names = [r.name for r in sc.regions]
        region = os.environ.get("GEOMESH_REGION")
        if region not in names:
            raise ConfigError(f"$GEOMESH_REGION {region!r}: expected this host's region, one of {', '.join(names)}")
        if int(os.environ.get("WORLD_SIZE", "1")) != 1:
            raise ConfigError(f"{METHOD}: one rank per region (torchrun --nproc-per-node 1)")
        if not os.environ.get("TORCHFT_LIGHTHOUSE"):
            raise ConfigError("$TORCHFT_LIGHTHOUSE is not set: the address of torchft's Lighthouse (http://HOST:PORT)")
        self.sc, self.names, self.me, self.name = sc, names, names.index(region), region
        self.args = args
        self.budget = args.tokens if args.tokens is not None else sc.training.tokens
        self.out = Path(args.out)

    # ---- set-up ----------------------------------------------------------------------------------------
    def build(self) -> None:
        import torch

        from ..methods.diloco import DILOCO
        from ..runtime.distributed.region import build_training
        from ..worker import Worker

        sc, tr = self.sc, self.sc.training
        torch.manual_seed(tr.seed)
        built = build_training(sc, self.me, tr.seed, torch.device("cpu"))
        self.model = built.replica  # every replica built from the seed: θ alike everywhere (init_sync=False)
        self.worker = Worker(self.name, self.model, built.stream, tr)  # our inner step: AdamW, clipping, batches
        self.val_x, self.val_y = built.corpus.val_batches(sc.model.seq_len, tr.eval_sequences)
        self.model_name, self.params = built.name, self.model.num_params()
        outer_lr, momentum = DILOCO.outer_settings(sc)
        self.outer = torch.optim.SGD(self.model.parameters(), lr=outer_lr, momentum=momentum, nesterov=True)
        self.lr_tokens = self.budget
        if tr.time_budget_s is not None:  # the tokens DiLoCo's first plan predicts in the budget, as our diloco
            from ..methods.budget import plan_tokens_in_time

            plan = DILOCO.plan(sc, sc.worker_profiles(), exchange_bytes=DILOCO.modeled_payload_bytes(sc))
            self.lr_tokens = plan_tokens_in_time(plan, sc.model.seq_len, tr.time_budget_s, tr.batch * sc.model.seq_len)

    def connect(self) -> None:
        from ..runtime.distributed.torchft_logs import quiet_torchft_logs

        quiet_torchft_logs()
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        timeout = timedelta(seconds=self.args.timeout)
        advertised = os.environ.get("GEOMESH_ADVERTISE_HOST") or socket.gethostname()
        store_addr = os.environ.get("GEOMESH_ADVERTISE_HOST") or os.environ.get("MASTER_ADDR", "127.0.0.1")
        min_regions = self.args.min_regions or len(self.names)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=self._load_state, state_dict=self._state,
            min_replica_size=min_regions, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout, rank=0, world_size=1, store_addr=store_addr,
            store_port=int(os.environ.get("MASTER_PORT", "29500")), replica_id=f"region{self.me:03d}_{self.name}",
            hostname=advertised, init_sync=False, checkpoint_transport=advertised_transport(timeout),
        )  # fmt: skip
        self.diloco = DiLoCo(self.manager, [self.model], self.worker.optimizer, self.outer,
                             sync_every=self.sc.training.inner_steps)  # fmt: skip

    def _state(self) -> dict[str, Any]:  # what torchft hands a replica that recovers from this one
        return {"model": self.model.state_dict(), "inner_optim": self.worker.optimizer.state_dict(),
                "outer_optim": self.outer.state_dict()}  # fmt: skip

    def _load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.worker.optimizer.load_state_dict(state["inner_optim"])
        self.outer.load_state_dict(state["outer_optim"])

    # ---- the run -----------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        import torch

        from ..evaluation import evaluate
        from ..methods.budget import elapsed_of_round
        from ..network import WanModel
        from ..telemetry import Telemetry, write_json_atomic
        from ..worker import inner_lr

        sc, tr, seq = self.sc, self.sc.training, self.sc.model.seq_len
        h, b = tr.inner_steps, tr.batch
        self.out.mkdir(parents=True, exist_ok=True)
        tel = Telemetry(self.out / "events.jsonl")
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        times = RoundTimes(clock)
        real_quorum = self.manager.start_quorum

        def timed_quorum(*a: Any, **k: Any) -> Any:
            start = clock()
            try:
                return real_quorum(*a, **k)
            finally:
                times.mark("quorum", (start, clock()))

        self.manager.start_quorum = timed_quorum  # (timing only)
        steps_in_round = [0]

        def after_inner_step(*_: Any) -> None:  # registered before DiLoCo's own hook: runs first
            steps_in_round[0] += 1
            if steps_in_round[0] == h:
                times.mark("compute_end")

        hooks = [self.worker.optimizer.register_step_post_hook(after_inner_step),
                 self.outer.register_step_pre_hook(lambda *_: times.mark("outer"))]  # fmt: skip
        payload = 4 * sum(p.numel() for p in self.model.parameters())  # fp32 pseudo-gradients
        n = len(self.names)
        sent_per_round = WanModel.allreduce_bytes_per_worker(payload, n)
        tel.emit({"type": "run", "runtime": "distributed", "method": METHOD, "scenario": sc.name, "seed": tr.seed,
                  "tokens_budget": self.budget, "model": self.model_name, "model_params": self.params,
                  "workers": self.names, "region": self.name, "backend": "gloo (torchft ProcessGroupGloo)",
                  "wan": "kernel", "elastic": True, "min_regions": self.manager._min_replica_size,
                  "sync_every": h})  # fmt: skip
        rounds = tokens = 0
        cursor, quorum_s, comm_s, clock_s = 0.0, 0.0, 0.0, 0.0
        stopped_by, elapsed_agreed = None, None
        time_budget = tr.time_budget_s

        def span(kind: str, until: float) -> None:
            nonlocal cursor
            tel.span(self.name, kind, cursor, max(until, cursor), rounds)  # (0-based, as our runtime's spans)
            cursor = max(until, cursor)

        with self.diloco:
            while stopped_by is None:
                times.reset()
                round_start = clock()
                committed_before = self.manager.batches_committed()
                round_tokens = n * b * h * seq  # (the lr schedule spreads the round's tokens over its steps)
                self.model.train()
                for k in range(h):  # the H-th step's optimizer hook runs torchft's sync (quorum, all-reduce, outer)
                    self.worker.inner_step(b, inner_lr(tokens + k / h * round_tokens, self.lr_tokens, tr))
                steps_in_round[0] = 0
                end_sync = clock()
                committed = self.manager.batches_committed() - committed_before  # replicas in the committed round
                q0, q1 = times.quorum if times.quorum else (end_sync, end_sync)
                compute_end = times.compute_end if times.compute_end is not None else q0
                outer_at = times.outer if times.outer is not None else end_sync
                span("compute", compute_end)
                span("other", q0)
                span("straggler_wait", q1)
                span("comm_wait", outer_at)
                span("other", end_sync)
                quorum_s += q1 - q0
                comm_s += outer_at - q1
                if committed <= 0:  # torchft discarded the round (its parameters were restored): train it again
                    tel.emit({"type": "warning", "round": rounds + 1, "time": end_sync,
                              "message": "torchft did not commit the round; its steps are discarded"})  # fmt: skip
                    continue
                rounds += 1
                tokens += committed * b * h * seq
                if time_budget is not None:  # the regions' clocks, averaged by torchft's managed all-reduce
                    c0 = clock()
                    mine = torch.tensor([end_sync], dtype=torch.float64)
                    self.manager.allreduce(mine).wait()
                    clock_s += clock() - c0
                    agreed = float(mine.item()) if self.manager.errored() is None else end_sync
                    elapsed_agreed = elapsed_of_round([agreed])
                    if elapsed_agreed is not None and elapsed_agreed >= time_budget:
                        stopped_by = "time_budget"
                elif tokens >= self.budget:
                    stopped_by = "token_budget"
                tel.emit({"type": "round", "round": rounds, "time": end_sync, "tokens": tokens,
                          "participants": committed, "compute_s": [compute_end - round_start],
                          "exchange_s": outer_at - q1, "quorum_s": q1 - q0, "bytes_sent": sent_per_round,
                          **({"elapsed_s": elapsed_agreed} if time_budget is not None else {})})  # fmt: skip
                if rounds % tr.eval_every_rounds == 0 or stopped_by is not None:
                    loss = evaluate(self.model, self.val_x, self.val_y)
                    tel.evaluation(end_sync, tokens, rounds, loss)
                    if not self.args.quiet:
                        print(f"[{METHOD}] region {self.name} round {rounds} tokens {tokens:,} t={end_sync:.1f}s "
                              f"val_loss {loss:.4f}", file=sys.stderr, flush=True)  # fmt: skip
                span("other", clock())
        for hook in hooks:
            hook.remove()
        end = clock()
        from ..runtime.distributed.region import params_checksum

        theta = {k: p.detach() for k, p in self.model.named_parameters()}
        summary = {
            "method": METHOD, "scenario": sc.name, "runtime": "distributed (torchft)", "region": self.name,
            "seed": tr.seed, "tokens": tokens, "rounds": rounds, "modeled_time_s": end,
            "final_val_loss": tel.evals[-1]["val_loss"] if tel.evals else None,
            **tel.idle_fractions(), "per_worker": tel.per_worker(),
            "curve": [[e["time"], e["tokens"], e["val_loss"]] for e in tel.evals],
            "bytes_sent": sent_per_round * rounds, "bytes_per_round": sent_per_round,
            "payload_bytes_per_worker": payload, "collective": "all_reduce",
            "exchange_s_per_round": comm_s / max(rounds, 1), "quorum_s_per_round": quorum_s / max(rounds, 1),
            "clock_s_per_round": clock_s / max(rounds, 1), "model": self.model_name, "model_params": self.params,
            "stopped_by": stopped_by, "time_budget_s": time_budget, "time_budget_elapsed_s": elapsed_agreed,
            "param_checksums": {self.name: params_checksum(theta)},
            "torchft": {"sync_every": h, "min_replica_size": self.manager._min_replica_size,
                        "use_bucketization": False, "should_quantize": False, "init_sync": False},
            "modeled": ([] if self.args.wan == "none" else
                        ["nothing: the links' latency is not added (torchft has no WAN shaper; the kernel's rate "
                         "limits apply)"]),
            "wall_clock_s": end,
        }  # fmt: skip
        tel.close()
        write_json_atomic(self.out / "summary.json", summary)
        if self.args.save_params:
            from ..checkpoint import torch_save_atomic

            torch_save_atomic(self.out / "final_params.pt", {k: v.clone() for k, v in self.model.state_dict().items()})
        return summary


def main(argv: list[str] | None = None) -> int:
    from ..errors import USER_ERRORS

    args = build_parser().parse_args(argv)
    try:
        region = TorchftRegion(args)
        region.build()
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        region.connect()
        summary = region.run()
    except Exception as exc:  # noqa: BLE001 - torchft raises RuntimeError/TimeoutError from its RPCs and collectives
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: {METHOD} region {region.name}: {first[:400]} (torchft's Lighthouse at "
              f"{os.environ.get('TORCHFT_LIGHTHOUSE')})", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    finally:
        manager = getattr(region, "manager", None)
        if manager is not None:
            manager.shutdown(wait=False)
    if not args.quiet:
        print(json.dumps({k: summary[k] for k in ("rounds", "tokens", "final_val_loss", "stopped_by")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
