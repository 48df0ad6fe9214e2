"""The process group of a round's quorum: torchft's reconfigurable Gloo group, whose set-up waits for the quorum's
members a bounded time.

Each quorum re-forms the group: every member publishes its address in the quorum's store and waits for the others'.
torchft waits with the group's one timeout, the round deadline (60 s by default), so a member that died right after
the quorum formed held every other member there for the whole deadline before it could ask for a quorum without
it. Members that answered the same quorum a moment ago meet within a few round trips; so the set-up waits
:func:`~.deadline.setup_s` (20 s, or ten round trips of the slowest declared link where that is longer, never
longer than the deadline). A member that is not there by then is dead or cut off: the set-up fails, the region
reports it and asks for the next quorum. The group's collectives keep the deadline.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torchft.process_group import ProcessGroupGloo

from .deadline import SETUP_S


class QuorumGroup(ProcessGroupGloo):
    """torchft's ``ProcessGroupGloo`` whose set-up (the members' rendezvous in the quorum's store) waits at most
    ``setup`` (default: :data:`~.deadline.SETUP_S`; at most ``timeout``); its collectives wait ``timeout``."""

    def __init__(self, timeout: timedelta, setup: timedelta | None = None) -> None:
        super().__init__(timeout=timeout)
        self.setup_timeout = min(timeout, setup if setup is not None else timedelta(seconds=SETUP_S))

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        # Gloo's rendezvous waits with the group's timeout, as its collectives do: created with the set-up's, then
        # given the collectives' back
        collectives, self._timeout = self._timeout, self.setup_timeout
        try:
            pg = super()._create_pg(store, rank, world_size)
        finally:
            self._timeout = collectives
        pg._get_backend(torch.device("cpu")).set_timeout(collectives)
        return pg
