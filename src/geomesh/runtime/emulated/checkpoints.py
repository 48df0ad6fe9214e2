"""The emulated run's checkpoints: what goes into one (models, AdamW states, codecs' residuals, the outer
optimizer, the loop's state, the random generators, fault records, telemetry totals), when one is written,
whether the run folder has room for them, and how ``--resume`` finds, checks and restores the newest one
(written and read with :mod:`geomesh.checkpoint`; the shared pieces are in
:mod:`geomesh.runtime.checkpoint_state`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import checkpoint as ckpt
from ...errors import RunError
from ...methods.base import OuterLoopMethod
from ...outer import OuterNesterov
from ...planner import OnlinePlanner, Plan, WanEstimator
from ..checkpoint_state import rng_state, run_fingerprint, set_rng_state, truncate_events
from .cluster import Cluster, LoopState, Stop


class EmulatedCheckpoints:
    """Checkpoint writing, space checks and resume of :class:`~geomesh.runtime.emulated.EmulatedRun` (a part
    of its class: it reads the run's counters, options and telemetry)."""

    def _claim_run_folder(self) -> None:
        """One run folder, one run (:mod:`geomesh.runtime.run_folder`): this process holds the folder's lock
        until it exits; a fresh start into a folder another run left, or a start into a live run's folder, is
        one RunError with nothing changed. The folder's run id goes into every checkpoint marker."""
        from ..run_folder import claim

        self._run_folder = claim(self.out_dir, resume=bool(self.options.resume))
        self.run_id = self._run_folder.run_id

    def _fingerprint(self) -> dict[str, Any]:
        return run_fingerprint(self.scenario, self.method.name, self.seed, self.budget)

    def _check_space(self) -> None:
        """A full run folder is one clear error before training: room for the events, the summary and, when
        checkpointing, ``keep + 1`` checkpoints (the newest K and the one being written)."""
        need, what = ckpt.MiB, "the events and the summary"
        if self.checkpoint_every > 0 and self.method.kind != "async":
            one = self._checkpoint_estimate()
            existing = ckpt.existing_bytes(ckpt.checkpoint_dir(self.out_dir))
            need += max(0, (self.keep_checkpoints + 1) * one - existing)
            what = f"{self.keep_checkpoints} checkpoint(s) of ~{one / ckpt.MiB:,.1f} MiB (+1 being written)"
        try:
            ckpt.check_free_space(self.out_dir, need, what)
        except OSError as exc:
            raise RunError(f"run folder {self.out_dir} is full: {exc.strerror or exc}; free some space, keep fewer "
                           f"checkpoints (--keep) or choose another --out") from None  # fmt: skip

    def _checkpoint_estimate(self) -> int:
        from ...methods.base import proxy_manifest

        try:
            numel = 0 if self.scenario.model.is_hf else proxy_manifest(self.scenario).numel
        except Exception:  # an estimate only: never the reason a run cannot start
            numel = 0
        m = self.method
        residual = isinstance(m, OuterLoopMethod) and ((m.codec == "sign" and self.scenario.geomesh.error_feedback)
                                                       or m.codec == "sparse")  # (sparse: codec/sparse.py)
        return ckpt.estimate_bytes(numel, len(self.scenario.regions), residual)

    def _checkpoint_due(self, rounds: int | None = None) -> bool:
        """Whether the round that just ended (or the one that ends with ``rounds`` done) writes a checkpoint."""
        done = self.rounds if rounds is None else rounds
        return self.out_dir is not None and self.checkpoint_every > 0 and done % self.checkpoint_every == 0

    def _maybe_checkpoint(self, state: Callable[[], dict[str, Any]]) -> None:
        if not self._checkpoint_due():
            return
        directory = ckpt.checkpoint_dir(self.out_dir)
        info = {"tokens": self.tokens_done, "time": self.clock, "method": self.method.name,
                "fingerprint": ckpt.fingerprint_hash(self._fingerprint()), "run_id": getattr(self, "run_id", None)}  # fmt: skip
        try:  # signed with the run key when there is one (checked on --resume before the state is loaded)
            ckpt.write_checkpoint(directory, self.rounds, state(), self.keep_checkpoints, info, key=self._key)
        except OSError as exc:
            raise Stop(f"could not write the checkpoint of round {self.rounds} in {directory}: "
                        f"{exc.strerror or exc}") from None  # fmt: skip

    def _state(self, cluster: Cluster, loop: LoopState, outer: OuterNesterov | None = None,
               codecs: list[Any] | None = None, overlap: Any = None) -> dict[str, Any]:  # fmt: skip
        """Everything the run needs to continue from this round boundary as if it had never stopped."""
        tel = self.telemetry
        events = self.out_dir / "events.jsonl"
        return {
            "format": ckpt.CHECKPOINT_FORMAT,
            "fingerprint": self._fingerprint(),
            "rounds": self.rounds, "clock": self.clock, "tokens_done": self.tokens_done,
            "bytes_sent": self.bytes_sent, "proxy_bytes_sent": self.proxy_bytes_sent,
            "global_model": cluster.global_model.state_dict(),
            "outer": outer.state_dict() if outer is not None else None,
            "overlap": overlap.state_dict() if overlap is not None else None,
            "workers": [w.state_dict() for w in cluster.workers],
            "codecs": [c.state_dict() if hasattr(c, "state_dict") else None for c in codecs] if codecs else None,
            "rng": rng_state(),
            "plans": [p.to_json() for p in self.plans],
            "loop": loop.state_dict(),
            "faults": self.faults,
            "fail_streak": list(self._fail_streak),
            "checkpointing": {"every": self.checkpoint_every, "keep": self.keep_checkpoints},
            "last_round": self._last_round,
            "telemetry": {"events_offset": ckpt.durable_size(events), **tel.state_dict()},
        }  # fmt: skip

    def _load_resume(self) -> None:
        """Find the newest intact checkpoint, check it belongs to this run, cut events.jsonl back to it."""
        if self.method.kind == "async":
            raise RunError(f"--resume: {self.method.name} cannot be resumed: the parameter server's queue of "
                           f"in-flight, stale updates is not checkpointed; run it again from the start")  # fmt: skip
        try:
            marker, state = ckpt.load_latest(ckpt.checkpoint_dir(self.out_dir), key=self._key)
        except ckpt.CheckpointError as exc:
            raise RunError(f"--resume {self.out_dir}: {exc}") from None
        mine_id = getattr(self, "run_id", None)
        if mine_id is not None and marker.get("run_id") not in (None, mine_id):
            raise RunError(f"--resume {self.out_dir}: the checkpoint of round {marker['round']} was written by run "
                           f"{marker['run_id']}, not by this folder's run {mine_id}; start a new run folder")  # fmt: skip
        mine, theirs = self._fingerprint(), state.get("fingerprint")
        if theirs != mine:
            diffs = ckpt.differences(theirs, mine)
            raise RunError(f"--resume {self.out_dir}: the checkpoint of round {marker['round']} belongs to another "
                           f"run (scenario hash {ckpt.fingerprint_hash(theirs or {})}, this one "
                           f"{ckpt.fingerprint_hash(mine)}): {'; '.join(diffs)}. Resume with the same scenario, "
                           f"method, seed and token budget, or start a new run folder")  # fmt: skip
        truncate_events(self.out_dir, state["telemetry"]["events_offset"])
        self._resume = state
        self.resumed_from = int(state["rounds"])

    def _restore(self, cluster: Cluster, loop: LoopState, outer: OuterNesterov | None = None,
                 codecs: list[Any] | None = None, make_online: Callable[[list[int]], OnlinePlanner] | None = None,
                 overlap: Any = None, make_wan: Callable[[], WanEstimator] | None = None) -> None:  # fmt: skip
        s = self._resume
        cluster.global_model.load_state_dict(s["global_model"])
        for worker, ws in zip(cluster.workers, s["workers"]):
            worker.load_state_dict(ws)
        if outer is not None:
            outer.load_state_dict(s["outer"])
        if overlap is not None:
            overlap.load_state_dict(s["overlap"])
        for codec, cs in zip(codecs or [], s["codecs"] or []):
            if cs is not None and hasattr(codec, "load_state_dict"):
                codec.load_state_dict(cs)
        self.rounds, self.clock, self.tokens_done = int(s["rounds"]), float(s["clock"]), int(s["tokens_done"])
        self.bytes_sent, self.proxy_bytes_sent = float(s["bytes_sent"]), int(s["proxy_bytes_sent"])
        self.plans = [Plan.from_json(p) for p in s["plans"]]
        self.faults[:] = [dict(f) for f in s["faults"]]
        self._fail_streak = [int(k) for k in s["fail_streak"]]
        self._last_round = s["last_round"]
        self.telemetry.load_state_dict(s["telemetry"])
        loop.load_state_dict(s["loop"], make_online, make_wan)
        set_rng_state(s["rng"])
        self._resume = None  # the state is in the run now; free it
