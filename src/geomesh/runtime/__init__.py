"""The runtimes: they decide *when* things happen and *how bytes move*; the algorithm (planner, codec, outer
optimizers, methods) is written once below them and used by both.

- The emulated runtime, :mod:`geomesh.runtime.emulated` (a package, one loop per module): every worker trains
  in one process and time is modeled. :mod:`~geomesh.runtime.emulated.rounds` holds the round loop of the
  round-based methods, :mod:`~geomesh.runtime.emulated.ddp` the DDP baseline's steps,
  :mod:`~geomesh.runtime.emulated.events` the asynchronous baseline's event queue, over
  :mod:`~geomesh.runtime.emulated.core`, :mod:`~geomesh.runtime.emulated.checkpoints` and
  :mod:`~geomesh.runtime.emulated.cluster`; :mod:`.parallel` trains a round's workers in processes,
  :mod:`.overlap` schedules the overlapped round.
- The distributed runtime, :mod:`geomesh.runtime.distributed` (picks the loop): one process per rank, real
  time and bytes. :mod:`.dist_rounds` holds the round loop, :mod:`.dist_ddp` the DDP baseline's steps,
  :mod:`.elastic` the elastic regions' loop (with :mod:`.elastic_state` and :mod:`.membership`, torchft's
  quorum), over :mod:`.dist_run` (set-up, clock, records, summary), :mod:`.layout` (ranks and regions),
  :mod:`.region` (a region's worker), :mod:`.transport` (collectives, WAN shaper), :mod:`.dist_checkpoint`
  (DCP checkpoints) and :mod:`.dist_overlap`.
- Shared by both, what is neither time nor transport: :mod:`.options` (run options and how they resolve),
  :mod:`.faults` (the fault schedule, injection, health checks), :mod:`.payloads` (screening and combining
  received payloads), :mod:`.checkpoint_state` (fingerprint, RNG states, cutting events back on resume) and
  :mod:`.summary` (the summary's layout).

Imports inside the package point one way: a loop module imports the shared plumbing and its runtime's base,
never the module that picks the loop.
"""
