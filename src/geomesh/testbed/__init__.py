"""The test bed: a scenario's regions on one machine as a team would deploy them, for tests, benchmarks and
``geomesh hosts`` / ``geomesh launch --wan netns``. Not part of a training run.

- :mod:`.netns`: real links, Linux network namespaces on one bridge, shaped per destination from a WAN model;
- :mod:`.hosts`: the hosts test bed, one namespace, address, folder and ``torchrun`` per region, and host-level
  faults (a host lost, a link cut or slowed);
- :mod:`.quotas`: CPU-time quotas, one control group per region, so regions compute at their own speeds.
"""
