"""θ's evaluation on a rank of a distributed run (:class:`Validation`): the fixed validation batches on this rank's
device, the validation loss during the run and the held-out zero-shot score at its end (:mod:`geomesh.evaluation`
computes both). Which ranks evaluate, and where the loss is recorded, is
:class:`~geomesh.runtime.distributed.core.RankRun`'s.
"""

from __future__ import annotations

from typing import Any

import torch

from ...evaluation import evaluate, heldout_zero_shot
from .region import reshard


class Validation:
    """What θ is evaluated on: ``corpus``'s first ``sequences`` validation windows of ``seq_len`` tokens (on
    ``device``) and, at the end, ``zero_shot_items`` held-out multiple-choice items. A sharded θ (``sharded``:
    FSDP) is gathered for the forward and sharded again after it, by every rank of its region together."""

    def __init__(self, corpus: Any, seq_len: int, sequences: int, zero_shot_items: int, device: torch.device):
        vx, vy = corpus.val_batches(seq_len, sequences)
        self.x, self.y = vx.to(device), vy.to(device)
        self.corpus, self.seq_len, self.zero_shot_items = corpus, seq_len, zero_shot_items

    def loss(self, model: Any, sharded: bool) -> float:
        """The validation loss of θ (``model``)."""
        loss = evaluate(model, self.x, self.y)
        if sharded:
            reshard(model)
        return loss

    def zero_shot(self, model: Any, sharded: bool) -> dict[str, float] | None:
        """The held-out zero-shot score of θ (None without items)."""
        score = heldout_zero_shot(model, self.corpus, self.seq_len, self.zero_shot_items)
        if sharded:
            reshard(model)
        return score
