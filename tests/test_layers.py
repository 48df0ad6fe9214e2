"""The package's layout: imports point down the layers only, no module imports one that imports it back, and a
long file says why it is long.

Every module of ``geomesh`` is read with ``ast`` (nothing is imported): its imports at module level and inside
functions, relative imports resolved. ``from .pkg import name`` counts as importing ``pkg.name`` when that is
a module, else ``pkg``. The layers, top to bottom, are in ``LAYERS``; ``LAYER_OF`` places every module (the
first rule that matches wins; a module no rule places fails the test, so a new module gets a place here).
"""

from __future__ import annotations

import ast
from pathlib import Path

import geomesh

PACKAGE = "geomesh"
ROOT = Path(geomesh.__file__).resolve().parent

LAYERS = ["faces", "beds", "runtimes", "methods", "algorithms", "training", "facts"]  # top to bottom

# (module or package, layer): a name matches itself and every module under it; first match wins.
LAYER_OF: list[tuple[str, str]] = [
    # faces: what a user runs or calls
    ("cli", "faces"),  # `geomesh ...`: plan, profile, launch (local ranks), one rank (cli.rank), common errors
    ("run", "faces"),  # `python -m geomesh.run`: the rank's entry point for torchrun (cli.rank)
    ("api", "faces"),  # the library API for a user's own training loop
    ("compare", "faces"),  # methods side by side (`geomesh bench | demo`)
    ("report", "faces"),  # tables and plots
    ("integrations.lm_eval_adapter", "faces"),  # `geomesh eval`, lm-evaluation-harness
    # beds: regions on one machine as a team deploys them (geomesh hosts, launch --wan netns, tests, benches);
    # no runtime imports them
    ("testbed", "beds"),
    # runtimes: when things happen and how bytes move
    ("runtime", "runtimes"),
    # methods: what happens in a round
    ("methods", "methods"),
    # algorithms: pure, on numbers and tensors
    ("planner", "algorithms"),
    ("codec", "algorithms"),
    ("outer", "algorithms"),
    # training: the inner loop and what it trains on
    ("models", "training"),
    ("data", "training"),
    ("worker", "training"),
    ("evaluation", "training"),
    ("checkpoint", "training"),
    ("profiler", "training"),  # measures the inner step on a device (`geomesh profile` is the face)
    # facts: typed configs, errors, the hardware and WAN models, telemetry
    ("config", "facts"),
    ("errors", "facts"),
    ("hardware", "facts"),
    ("network", "facts"),
    ("scenarios", "facts"),
    ("model_presets", "facts"),  # the preset table config validates against (no torch)
    ("extras", "facts"),  # optional extras: require(), MissingDependencyError
    ("telemetry", "facts"),
    ("telemetry_sinks", "facts"),  # TensorBoard / W&B sinks: telemetry writers both runtimes attach
    ("integrations", "faces"),  # bridges to outside tools (lm-eval); the package __init__ re-exports extras
    ("", "facts"),  # the package itself (version, docstring)
]

# A source file longer than this says why at its top: its module docstring contains "long because"
# (e.g. "This file is long because ..."), so a reader knows the length is deliberate.
LONG_LINES = 600
LONG_REASON = "long because"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name relative to it ("" is the package itself)."""
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports (anywhere in the file), by relative dotted name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = [PACKAGE, *name.split(".")] if name else [PACKAGE]
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import x`: the module pkg.x when there is one, else pkg (x is a name defined in it)
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}"[len(PACKAGE) + 1 :] in mods else module
                       for a in node.names]  # fmt: skip
        else:
            continue
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            rel = target[len(PACKAGE) + 1 :]
            while rel not in mods and rel:
                rel = rel.rpartition(".")[0]
            if rel != name:
                found.add(rel)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _layer(name: str) -> str | None:
    for prefix, layer in LAYER_OF:
        if name == prefix or (prefix and name.startswith(prefix + ".")) or (not prefix and not name):
            return layer
    return None


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (modules that import each other, directly or
    through others), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per component of :func:`_components`."""
    cycles = []
    for comp in _components(graph):  # the shortest way from the first module back to itself, inside the component
        start, members = comp[0], set(comp)
        paths = {w: [start, w] for w in sorted(graph[start] & members)}
        frontier = list(paths)
        while start not in paths:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        cycles.append(paths[start])
    return cycles


def _show(name: str) -> str:
    return f"{PACKAGE}.{name}" if name else PACKAGE


def test_no_import_cycles():
    graph = _graph()
    comps, cycles = _components(graph), _cycles(graph)
    assert not cycles, "import cycles (module -> module it imports), with every module caught in each:\n" + "\n".join(
        "  " + " -> ".join(_show(m) for m in cycle) + f"   (modules importing each other here: {', '.join(map(_show, comp))})"
        for cycle, comp in zip(cycles, comps)
    )


def test_every_module_has_a_layer():
    missing = sorted(_show(m) for m in _modules() if _layer(m) is None)
    assert not missing, f"modules without a layer (add them to LAYER_OF in {Path(__file__).name}): {missing}"


def test_imports_point_down_the_layers():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for name, deps in sorted(_graph().items()):
        mine = _layer(name)
        for dep in sorted(deps):
            theirs = _layer(dep)
            if mine is not None and theirs is not None and rank[theirs] < rank[mine]:
                upward.append(f"  {_show(name)} ({mine}) imports {_show(dep)} ({theirs})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_long_files_say_why():
    unexplained = []
    for name, path in sorted(_modules().items()):
        lines = len(path.read_text().splitlines())
        if lines <= LONG_LINES:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if LONG_REASON not in doc.lower():
            unexplained.append(f"  {path.relative_to(ROOT.parent)}: {lines} lines")
    assert not unexplained, (
        f"files over {LONG_LINES} lines whose module docstring does not say why ({LONG_REASON!r} ...):\n"
        + "\n".join(unexplained)
    )


def test_the_layer_test_sees_a_cycle_and_an_upward_import():
    """The checks above on a made-up graph: they find what they are for."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _layer("runtime.emulated.core") == "runtimes" and _layer("codec.sign") == "algorithms"
    assert _layer("integrations.lm_eval_adapter") == "faces" and _layer("telemetry_sinks") == "facts"
    assert _layer("cli.plan") == "faces" and _layer("config") == "facts" and _layer("") == "facts"


def test_the_runtimes_and_faces_have_their_rooms():
    """The distributed runtime is a package beside the emulated one, each runtime's own files inside it, one
    module holds the distributed round loop, and the faces live in cli/ with one table of run options."""
    mods = _modules()
    assert not [m for m in mods if m.startswith("runtime.dist_") or m in ("runtime.parallel", "runtime.overlap")]
    for m in ("runtime.distributed.rounds", "runtime.distributed.exchange", "runtime.distributed.elastic",
              "runtime.emulated.parallel", "runtime.emulated.overlap", "cli.run_args", "cli.rank", "telemetry_sinks"):
        assert m in mods, m
    loops = [m for m in mods if m.startswith("runtime.distributed.")
             and "def run_loop" in mods[m].read_text()]  # fmt: skip
    assert loops == ["runtime.distributed.rounds"], loops


def test_the_round_loop_holds_its_components_and_none_reaches_back():
    """The distributed round loop holds its components (the plan, the exchanges, the region's state and records,
    the agreement): none of them imports the loop's module, and no class of the runtime is assembled from mixins
    (a base class whose methods read fields it does not set: each class of runtime/distributed derives only from
    a class of another package, an exception, or a Protocol)."""
    graph = _graph()
    loop = "runtime.distributed.rounds"
    reach_back = sorted(m for m, deps in graph.items() if loop in deps and m != "runtime.distributed")
    assert not reach_back, f"modules that import the round loop: {reach_back}"
    local = {}
    for name, path in _modules().items():
        if name.startswith("runtime.distributed"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    local[node.name] = (name, [ast.unparse(b) for b in node.bases])
    errors = {c for c, (_, bases) in local.items() if any(b.endswith(("Error", "Exception")) for b in bases)}
    while True:  # (exceptions that derive from the runtime's own exceptions)
        more = {c for c, (_, bases) in local.items() if any(b in errors for b in bases)} - errors
        if not more:
            break
        errors |= more
    # (DistributedRun picks the loop of a RankRun: a run of one kind, not a part of one)
    mixed = sorted(f"{mod}.{cls}({', '.join(bases)})" for cls, (mod, bases) in local.items()
                   if any(b in local and b not in errors for b in bases) and cls != "DistributedRun")  # fmt: skip
    assert not mixed, f"runtime classes built on another runtime class: {mixed}"
