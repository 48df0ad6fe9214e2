"""The run folder of a distributed world (one ``torchrun``: a static run, or one elastic region): rank 0
prepares it, and every rank must see what rank 0 writes there.

A static run keeps one folder for all its ranks: rank 0 writes the records, the summary and the checkpoint
markers there, and every rank reads the checkpoints back from it on ``--resume``. Ranks on hosts that do not
share it (no shared file system, or another path on each host) would train, then fail at the first resume or
read another run's files; so rank 0 leaves a token of this start in the folder, every rank looks for it in
its own ``--out``, and a rank that does not see it stops every rank before training, with one line naming the
ranks, their hosts and the fix (a shared folder, or elastic regions: each region its own ``torchrun`` and its
own folder, docs/distributed.md)."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path
from typing import Any

from ...errors import RunError
from ..options import prepare_run_dir

TOKEN_PREFIX = ".geomesh-start-"


def _leave_token(out_dir: Path) -> str:
    prepare_run_dir(out_dir)
    name = f"{TOKEN_PREFIX}{secrets.token_hex(8)}"
    (out_dir / name).write_text("rank 0 started here\n")
    return name


def prepare_shared_run_dir(run: Any) -> None:
    """Every rank of ``run``'s world: rank 0 prepares the folder; a rank that does not see it stops them all."""
    out_dir: Path = run.out_dir
    token = run._on_rank0("preparing the run folder", lambda: _leave_token(out_dir))
    try:
        if run.world > 1:
            seen = run.transport.all_gather_framed({"seen": (out_dir / token).exists(), "host": socket.gethostname()},
                                                   what="checking that all ranks share the run folder")  # fmt: skip
            blind = [(r, s.get("host") if isinstance(s, dict) else None) for r, s in enumerate(seen)
                     if not (isinstance(s, dict) and s.get("seen") is True)]  # fmt: skip
            if blind:
                who = ", ".join(f"rank {r} (host {h})" for r, h in blind)
                raise RunError(f"the run folder {out_dir} is not shared: {who} cannot see what rank 0 writes there; "
                               f"a static run keeps one folder for all its ranks (a shared file system, the same path "
                               f"on every host), or run the regions elastic, each with its own torchrun and its own "
                               f"folder (--min-regions, docs/distributed.md)")  # fmt: skip
    finally:
        if run.rank == 0:
            (out_dir / token).unlink(missing_ok=True)
