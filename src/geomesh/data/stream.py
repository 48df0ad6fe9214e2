"""Worker shards and their batches (the training layer's batch streams, for every token source).

**Worker shards.** :func:`shard_bounds` cuts ``train_tokens`` into contiguous, disjoint, equal-size shards,
one per worker; a :class:`BatchStream` draws a worker's batches from its shard: non-overlapping windows of
``seq_len + 1`` tokens in a seeded random order, reshuffled every epoch, resumable from a ``state_dict``.

:class:`~geomesh.data.tokens.MemmapBatchStream` serves the same order from memory-mapped token files.
"""

from __future__ import annotations

import torch

from ..errors import DataError


def shard_bounds(n_tokens: int, worker: int, n_workers: int) -> tuple[int, int]:
    """``(start, end)`` of worker ``worker``'s shard: equal contiguous slices, the last < n_workers tokens unused."""
    if n_workers < 1:
        raise ValueError(f"n_workers = {n_workers}: must be at least 1")
    if not 0 <= worker < n_workers:
        raise ValueError(f"worker = {worker}: must be in [0, {n_workers})")
    size = n_tokens // n_workers
    return worker * size, (worker + 1) * size


class BatchStream:
    """Training batches from one shard: windows of ``seq_len + 1`` tokens in a seeded order per epoch.

    The shard is cut into non-overlapping windows; epoch ``e`` visits them in ``randperm`` order seeded with
    ``seed + e``. ``state_dict()`` / ``load_state_dict()`` save and restore the position exactly.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int):
        self._init_order(len(tokens), seq_len, seed)
        window = seq_len + 1
        self.windows = tokens[: self.n_windows * window].long().reshape(self.n_windows, window)

    def _init_order(self, n_tokens: int, seq_len: int, seed: int) -> None:
        """The window count and the position in the seeded order (shared with streams over other storage)."""
        if seq_len < 1:
            raise ValueError(f"seq_len = {seq_len}: must be positive")
        window = seq_len + 1
        n_windows = n_tokens // window
        if n_windows < 1:
            raise DataError(f"shard has {n_tokens} tokens, fewer than one window of seq_len + 1 = {window}")
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = n_windows
        self.epoch = 0
        self.position = 0  # windows of the current epoch already served
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def _rows(self, picks: torch.Tensor) -> torch.Tensor:
        """The windows at indices ``picks``, int64 [len(picks), seq_len + 1]."""
        return self.windows[picks]

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order = torch.randperm(self.n_windows, generator=generator)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self, n_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, int64 [n_sequences, seq_len], with ``y`` the next token of ``x``."""
        if n_sequences < 1:
            raise ValueError(f"n_sequences = {n_sequences}: must be positive")
        picks = []
        while n_sequences > 0:
            take = min(n_sequences, self.n_windows - self.position)
            picks.append(self._epoch_order()[self.position : self.position + take])
            self.position += take
            n_sequences -= take
            if self.position == self.n_windows:
                self.epoch, self.position = self.epoch + 1, 0
        rows = self._rows(torch.cat(picks) if len(picks) > 1 else picks[0])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        """Where the stream is (epoch, position), with the seed and shape it belongs to."""
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "n_windows": self.n_windows,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; it must come from a stream over the same shard, seq_len and seed."""
        for name in ("seed", "seq_len", "n_windows"):
            if state[name] != getattr(self, name):
                raise ValueError(f"BatchStream state has {name} = {state[name]}, this stream {getattr(self, name)}")
        if not 0 <= state["position"] < self.n_windows:
            raise ValueError(f"BatchStream state position = {state['position']}: must be in [0, {self.n_windows})")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
