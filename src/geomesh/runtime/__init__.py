"""The runtimes: they decide *when* things happen and *how bytes move*; the algorithm (planner, codec, outer
optimizers, methods) is written once below them and used by both.

- The emulated runtime, :mod:`geomesh.runtime.emulated` (a package, one loop per module): every worker trains
  in one process and time is modeled. :mod:`~geomesh.runtime.emulated.rounds` holds the round loop of the
  round-based methods, :mod:`~geomesh.runtime.emulated.ddp` the DDP baseline's steps,
  :mod:`~geomesh.runtime.emulated.events` the asynchronous baseline's event queue, over
  :mod:`~geomesh.runtime.emulated.core`, :mod:`~geomesh.runtime.emulated.checkpoints` and
  :mod:`~geomesh.runtime.emulated.cluster`; :mod:`~geomesh.runtime.emulated.parallel` trains a round's workers
  in processes, :mod:`~geomesh.runtime.emulated.overlap` schedules the overlapped round.
- The distributed runtime, :mod:`geomesh.runtime.distributed` (a package laid out like the emulated one):
  one process per rank, real time and bytes. ``rounds`` holds the round loop, ``ddp`` the DDP baseline's
  steps, ``elastic`` the elastic regions (with ``elastic_state`` and ``membership``, torchft's quorum), over
  ``core`` (set-up, clock, records, summary), ``layout`` (ranks and regions), ``region`` (a region's worker),
  ``transport`` (collectives, WAN shaper), ``checkpoints`` (DCP checkpoints) and ``overlap``.
- Shared by both, what is neither time nor transport: :mod:`.options` (run options and how they resolve),
  :mod:`.faults` (the fault schedule, injection, health checks), :mod:`.payloads` (screening and combining
  received payloads), :mod:`.checkpoint_state` (fingerprint, RNG states, cutting events back on resume) and
  :mod:`.summary` (the summary's layout).

Imports inside the package point one way: a loop module imports the shared plumbing and its runtime's base,
never the module that picks the loop.
"""
