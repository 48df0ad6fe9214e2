"""What an emulated run trains with and the state its loops carry: the cluster (the global proxy model,
every worker's replica and data stream, the profiles, the validation batches), built once from a scenario;
the round loop's own state (:class:`LoopState`: cluster health, the plan, the online planner, the WAN
measured), which a checkpoint carries besides models and optimizers; the device a run trains on; a worker's
state as bytes (for worker processes); and :class:`Stop`, which ends a run cleanly."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...config import ScenarioConfig
from ...data import Corpus
from ...errors import RunError
from ...hardware import WorkerProfile
from ...models import GPT
from ...planner import OnlinePlanner, Plan, WanEstimator
from ...worker import Worker
from ..faults import ClusterState


class Stop(Exception):
    """Raised inside a run to stop it cleanly: the summary of what was done is written, then RunError."""


@dataclass
class Cluster:
    """Everything a run trains with, built once from a scenario."""

    scenario: ScenarioConfig
    corpus: Corpus
    global_model: GPT
    workers: list[Worker]
    profiles: list[WorkerProfile]
    val_x: torch.Tensor
    val_y: torch.Tensor
    seed: int
    budget: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def global_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.global_model.named_parameters()}


def build_cluster(scenario: ScenarioConfig, seed: int, budget: int, cache_dir: Path | None = None,
                  device: torch.device | str = "cpu") -> Cluster:  # fmt: skip
    # The corpus and the model come from hooks: the text corpus or memory-mapped token sources
    # (data.format), the built-in GPT or a transformers model (proxy.hf_*); see docs/ecosystem.md.
    import copy

    from ...data import load_corpus, worker_stream
    from ...models import build_proxy_model

    corpus = load_corpus(scenario.data, cache_dir=cache_dir)
    global_model = build_proxy_model(scenario.model, corpus.vocab_size, seed).to(device)
    n = len(scenario.regions)
    workers = []
    for i, region in enumerate(scenario.regions):
        # a pretrained model is loaded once and copied; the others are built from the seed (bit-identical)
        replica = (copy.deepcopy(global_model) if scenario.model.hf_pretrained
                   else build_proxy_model(scenario.model, corpus.vocab_size, seed)).to(device)  # fmt: skip
        stream = worker_stream(corpus, i, n, scenario.model.seq_len, seed * 1009 + i)
        workers.append(Worker(region.name, replica, stream, scenario.training, precision=scenario.region_precision(i)))
    profiles = scenario.worker_profiles()
    val_x, val_y = corpus.val_batches(scenario.model.seq_len, scenario.training.eval_sequences)
    val_x, val_y = val_x.to(device), val_y.to(device)
    return Cluster(scenario, corpus, global_model, workers, profiles, val_x, val_y, seed, budget)



class LoopState:
    """The round loop's own state, which a checkpoint carries besides models and optimizers."""

    def __init__(self, scenario: ScenarioConfig):
        self.cluster = ClusterState(scenario)
        self.plan: Plan | None = None
        self.exchange_s = 0.0  # what the plan expects a round's exchange to take (on the WAN it assumes)
        self.actual_s = 0.0  # what it takes on the cluster's WAN (the modeled clock's)
        self.kind: str | None = None  # the exchange the plan chose (all_gather, sharded, all_reduce)
        self.parts = (0.0, 0.0)  # its (latency, transfer) seconds on the declared WAN: what is measured against
        self.sent = 0.0  # bytes each live worker sends per round
        self.online: OnlinePlanner | None = None
        self.wan: WanEstimator | None = None  # the WAN measured (closed loop), None: the declared WAN
        self.last_loss: float | None = None

    def state_dict(self) -> dict[str, Any]:
        online = None
        if self.online is not None:
            o = self.online
            online = {"factors": dict(o.factors), "assumed": dict(o.assumed),
                      "current": o.current.to_json() if o.current is not None else None}  # fmt: skip
        return {"cluster": self.cluster.state_dict(), "plan": self.plan.to_json() if self.plan else None,
                "exchange_s": self.exchange_s, "actual_s": self.actual_s, "kind": self.kind,
                "parts": list(self.parts), "sent": self.sent, "last_loss": self.last_loss, "online": online,
                "wan": self.wan.state_dict() if self.wan is not None else None}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], make_online: Callable[[list[int]], OnlinePlanner] | None,
                        make_wan: Callable[[], WanEstimator] | None = None) -> None:  # fmt: skip
        self.cluster.load_state_dict(state["cluster"])
        self.plan = Plan.from_json(state["plan"]) if state["plan"] is not None else None
        self.exchange_s, self.sent, self.last_loss = state["exchange_s"], state["sent"], state["last_loss"]
        self.actual_s, self.kind = float(state.get("actual_s", self.exchange_s)), state.get("kind")
        self.parts = tuple(float(x) for x in state.get("parts", (0.0, 0.0)))
        if state.get("wan") is not None and make_wan is not None:
            self.wan = make_wan()
            self.wan.load_state_dict(state["wan"])
        saved = state["online"]
        if saved is not None and make_online is not None:
            self.online = make_online(self.cluster.live())
            self.online.factors = dict(saved["factors"])
            self.online.assumed = dict(saved["assumed"])
            self.online.current = Plan.from_json(saved["current"]) if saved["current"] is not None else None



def resolve_device(name: str) -> torch.device:
    """The device a run trains on (``--device``), refused in one line when it cannot be used here."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise RunError(f"--device {name}: not a device; expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise RunError(f"--device {name}: the emulated runtime trains on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RunError(f"--device {name}: no CUDA device is available here (torch {torch.__version__}, "
                           f"CUDA build: {torch.version.cuda or 'none'}); use --device cpu")  # fmt: skip
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise RunError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device



def state_bytes(worker: Worker, codec: Any) -> bytes:
    """A worker's state and its codec's, serialised (a copy: nothing shared with the process it came from)."""
    buf = io.BytesIO()
    torch.save((worker.state_dict(), codec.state_dict() if hasattr(codec, "state_dict") else None), buf)
    return buf.getvalue()
