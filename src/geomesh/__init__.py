"""GeoMesh: workload-balanced, sign-compressed synchronous training of LLMs across regions.

Layers (imports point down): faces (cli, report) → runtimes (runtime/) → methods (methods/) → algorithms
(planner, codec, outer) → training (worker, model, data, evaluation) → facts (config, hardware, network,
telemetry).
"""

__version__ = "0.1.0"
