"""GeoMesh in your own PyTorch loop: your model, your optimizer, your data; GeoMesh does the rounds.

A tiny next-token model learns a fixed random bigram language. Each worker runs its own AdamW for the inner
steps the plan gives it, at the batch size the plan gives it, then ``GeoMeshSync.sync`` exchanges 1-bit
pseudo-gradients and takes the outer Nesterov step; every worker ends each round with the same parameters.

    python examples/own_loop.py                       # one process: the scenario's 2 workers in-process
    python examples/own_loop.py --nproc 2             # 2 processes over a Gloo group, one worker each
    torchrun --nproc-per-node 2 examples/own_loop.py  # the same under torchrun
    python examples/own_loop.py --single              # one model alone (a world of one, uniform plan)
    python examples/own_loop.py --nproc 2 --replan    # the plan follows the speeds the two ranks measure

``--out FILE`` writes each rank's result (final loss, a digest of its parameters) as JSON lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from geomesh.api import GeoMeshSync

VOCAB, SEQ_LEN = 64, 32
SCENARIO = Path(__file__).with_name("two_regions.yaml")


class BigramLM(nn.Module):
    """The user's model: any nn.Module works."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(x))


class BigramData:
    """The user's data loader: sequences from a fixed random bigram table (one per worker seed)."""

    def __init__(self, seed: int):
        table = torch.Generator().manual_seed(1234)  # the language is shared by every worker
        self.probs = torch.softmax(3.0 * torch.randn(VOCAB, VOCAB, generator=table), dim=-1)
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.empty(n, SEQ_LEN + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (n,), generator=self.gen)
        for t in range(SEQ_LEN):
            seq[:, t + 1] = torch.multinomial(self.probs[seq[:, t]], 1, generator=self.gen).squeeze(1)
        return seq[:, :-1], seq[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def train(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)  # tiny model; also makes every process add up floats in the same order
    group = None
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    torch.manual_seed(rank)  # different initial weights on purpose: GeoMeshSync broadcasts rank 0's
    n_local = 1 if (world > 1 or args.single) else 2
    models = [BigramLM() for _ in range(n_local)]
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models]
    data = [BigramData(seed=100 + rank * n_local + j) for j in range(n_local)]
    # the scenario's plan stays fixed unless --replan: the in-process and the two-rank runs then train the same
    # workers bit for bit (re-planned, each follows the speeds it measures, which differ between the two)
    plan_args = {"batch_size": 8, "inner_steps": 5} if args.single else {"scenario": str(SCENARIO),
                                                                          "replan": args.replan}  # fmt: skip
    sync = GeoMeshSync(models if n_local > 1 else models[0], group=group, error_feedback=True, **plan_args)
    heldout = BigramData(seed=999).batch(64)
    for _ in range(args.rounds):
        tokens = []
        for j, (model, opt, stream) in enumerate(zip(models, opts, data)):
            p = sync.plan_for_rank(replica=j)  # this worker's batch size and inner steps
            model.train()
            for _ in range(p.inner_steps):
                for _ in range(p.accum):  # micro-batches with gradient accumulation
                    x, y = stream.batch(p.micro_batch)
                    (loss_of(model, x, y) / p.accum).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            tokens.append(p.tokens(SEQ_LEN))
        result = sync.sync(tokens if n_local > 1 else tokens[0])
    with torch.no_grad():
        final = loss_of(models[0], *heldout).item()
    out = {"rank": rank, "world": world, "replicas": n_local, "rounds": sync.rounds, "final_loss": final,
           "digest": digest(models[0]), "replica_digests": [digest(m) for m in models],
           "plan": [sync.plan_for_rank(r, j).__dict__ for r in range(sync.world_size) for j in range(n_local)],
           "payload_bytes": result.payload_bytes, "bytes_sent": sync.bytes_sent}  # fmt: skip
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def _worker(rank: int, world: int, args: argparse.Namespace) -> None:
    report(train(rank, world, args), args)


def report(out: dict, args: argparse.Namespace) -> None:
    line = json.dumps(out)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=1, help="spawn this many ranks (Gloo) on this machine")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--single", action="store_true", help="one model, no peers, a uniform plan")
    ap.add_argument("--replan", action="store_true",
                    help="re-plan from each worker's measured compute time (with --nproc 2: in-process replicas "
                    "measure nothing)")
    ap.add_argument("--out", default=None, help="append each rank's result as a JSON line to this file")
    args = ap.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        report(train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args), args)
    elif args.nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.multiprocessing.spawn(_worker, args=(args.nproc, args), nprocs=args.nproc)
    else:
        report(train(0, 1, args), args)


if __name__ == "__main__":
    main()
