"""GeoMesh: workload-balanced, sign-compressed synchronous training of LLMs across regions.

Layers (imports point down only; ``tests/test_layers.py`` holds the table and checks it): faces (cli/, run,
api, compare, report, integrations/) → runtimes (runtime/) → methods (methods/) →
algorithms (planner/, codec/, outer) → training (worker, models/, data/, evaluation, checkpoint, profiler) →
facts (config, errors, hardware, network, telemetry, model_presets, extras, telemetry_sinks).
"""

__version__ = "0.1.0"
