"""The generated reference: pages written from the code at every docs build, so they cannot drift from it.

- ``reference/cli.md``: every ``geomesh`` subcommand and the rank's ``python -m geomesh.run``, from their argparse
  parsers (the usage line, and one row per option: its value, default and help).
- ``reference/scenario.md``: every scenario field, from the dataclasses of ``geomesh.config``: its type, its
  default, what the validator allows, and the comment the code gives it. "Allowed" is what the validator itself
  says when it refuses a value: each field is loaded with a few out-of-range values and the refusals naming that
  field are collected.
- ``reference/methods.md``: the methods and the scenario presets, from their tables.

An MkDocs hook (``mkdocs.yml``: ``hooks:``). It imports the package of this checkout (``src/``) and only reads it.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import io
import re
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

GENERATED = {
    "reference/cli.md": "cli_page",
    "reference/scenario.md": "scenario_page",
    "reference/methods.md": "methods_page",
}


def _use_this_checkout() -> None:
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))


# ---- MkDocs events ------------------------------------------------------------------------------------------


def on_files(files, config):
    from mkdocs.structure.files import File

    _use_this_checkout()
    for path, maker in GENERATED.items():
        files.append(File.generated(config, path, content=globals()[maker]()))
    return files


# ---- the command line -------------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    """Text for one table cell: no line breaks, pipes escaped outside code spans (a table keeps those whole)."""
    parts = " ".join(str(text).split()).split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def _code(text: str) -> str:
    return f"`{text}`"


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is False or d == [] or d == argparse.SUPPRESS or isinstance(action, argparse._StoreTrueAction):
        return ""
    return _code(str(d))


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "(a flag)"
    if action.choices:
        return " ".join(_code(str(c)) for c in action.choices)
    name = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    kind = {int: "integer", float: "number"}.get(action.type, "")
    text = _code(str(name)) + (f" ({kind})" if kind else "")
    if isinstance(action, argparse._AppendAction):
        text += ", repeatable"
    if action.nargs == "?":
        text += ", optional"
    return text


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | value | default | what it does |", "|---|---|---|---|"]
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(a.option_strings) if a.option_strings else a.dest
        default = "required" if a.required and a.option_strings else _default(a)
        rows.append(f"| {_code(name)} | {_value(a)} | {default} | {_cell(a.help or '')} |")
    return rows


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(command, one-line help, parser) of every subcommand, nested ones included, in the parser's order."""
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in a._choices_actions}
            for name, sub in a.choices.items():
                command = f"{prefix} {name}"
                if any(isinstance(b, argparse._SubParsersAction) for b in sub._actions):
                    out += _subcommands(sub, command)
                else:
                    out.append((command, helps.get(name, ""), sub))
    return out


def _module_doc(parser: argparse.ArgumentParser, command: str) -> str:
    """The docstring of the module that is this one command's (``geomesh.cli.hosts`` for ``geomesh hosts``), as
    Markdown: its cross-reference roles dropped."""
    func = parser.get_default("func")
    module = sys.modules.get(getattr(func, "__module__", ""), None)
    if module is None or module.__name__.rpartition(".")[2] != command.rpartition(" ")[2] or not module.__doc__:
        return ""
    return re.sub(r":(?:mod|class|func|meth|data|attr):`~?\.?([^`]+)`", r"``\1``", module.__doc__.strip())


def _command_section(command: str, help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    parser.prog = command
    usage = " ".join(parser.format_usage().split())
    doc = _module_doc(parser, command)
    return [f"## `{command}`", "", help_text[:1].upper() + help_text[1:] + ("." if help_text else ""), "",
            "```text", usage, "```", "", *([doc, ""] if doc else []), *_options_table(parser), ""]


def cli_page() -> str:
    from geomesh.cli import build_parser
    from geomesh.cli.rank import build_parser as rank_parser

    commands = _subcommands(build_parser(), "geomesh")
    lines = ["# Command line", "",
             "This page lists every `geomesh` subcommand and every option, generated from the command's own parser "
             "at each docs build. An error a user can cause ends with one `error: ...` line and exit status 2.", "",
             "| command | what it does |", "|---|---|"]
    lines += [f"| [`{c}`](#{c.replace(' ', '-')}) | {_cell(h)} |" for c, h, _ in commands]
    lines += ["| [`python -m geomesh.run`](#python-m-geomeshrun) | one rank of a real run, under `torchrun` |", ""]
    for command, help_text, parser in commands:
        lines += _command_section(command, help_text, parser)
    rank = rank_parser()
    lines += _command_section("python -m geomesh.run", "one rank of a real run, started by torchrun (`geomesh launch` "
                              "starts these for you on one machine)", rank)
    return "\n".join(lines) + "\n"


# ---- the scenario ------------------------------------------------------------------------------------------


def _comments(path: Path) -> dict[int, str]:
    """Line number -> the comment on that line (``# fmt: ...`` and ``noqa`` markers left out)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if not text.startswith(("fmt:", "noqa", "type:")):
                out[tok.start[0]] = text
    return out


DANGLING = ("'s", ",", "(", ";", ":", " and", " or", " the", " a", " of", " to", " with", " in")


def _field_notes(path: Path) -> dict[tuple[str, str], str]:
    """(class, field) -> what the code says of it: the comment block right above the field and the comment on
    its line. A line's comment that breaks off mid-phrase (``... geomesh-sparse's``) runs on into the next
    comment line, which is then the field's and not the next field's."""
    text = path.read_text()
    lines = text.splitlines()
    comments = _comments(path)

    def runs_on(n: int) -> bool:  # line n is code whose comment breaks off, and line n + 1 is a comment line
        return (n in comments and not lines[n - 1].strip().startswith("#") and comments[n].endswith(DANGLING)
                and n + 1 in comments and lines[n].strip().startswith("#"))

    notes = {}
    for node in ast.parse(text).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            above, n = [], stmt.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#") and n in comments:
                above.insert(0, comments[n])
                n -= 1
            if above and runs_on(n):
                above = above[1:]
            end = stmt.end_lineno or stmt.lineno
            on = [comments[k] for k in range(stmt.lineno, end + 1) if k in comments]
            if runs_on(end):
                on.append(comments[end + 1])
            notes[(node.name, stmt.target.id)] = " ".join(above + on)
    return notes


def _type_name(tp: Any) -> str:
    from geomesh import config

    name = getattr(config, "_type_name", None)
    return name(tp) if name else getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    import yaml

    if dataclasses.is_dataclass(value):
        return "(a section)"
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return _code(text.removesuffix("\n...").removesuffix("..."))


def _probes(tp: Any) -> list[Any]:
    """Values of the right type that a validator may refuse (a wrong type is the type column's business)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) else [tp]
    numbers = [-10**9, -1, 0, 1, 10**9]
    out: list[Any] = []
    for a in args:
        if a is int:
            out += numbers
        elif a is float:
            out += [float(x) for x in numbers] + [0.5, 1e-6]
        elif a is str:
            out += ["", "no-such-value"]
        elif a is Any:
            out += ["no-such-value", -1, [[1]]]
    return out


def _allowed(setter, where: str, tp: Any, base: dict) -> str:
    """What the validator says is allowed for one field: its refusals of out-of-range values, each once."""
    from geomesh import config

    said: list[str] = []
    for value in _probes(tp):
        data = copy.deepcopy(base)
        setter(data, value)
        try:
            built = config._build(config.ScenarioConfig, data, "scenario")
        except Exception:  # a wrong type for this field (or a probe the loader cannot take): not a range
            continue
        try:
            config.validate(built)
        except config.ConfigError as exc:
            head, sep, rest = str(exc).partition(": ")
            allowed = rest.partition(" is not allowed; ")[2]
            n = len(base["regions"])
            allowed = allowed.replace(f"a {n}x{n} matrix", "an NxN matrix")
            if head.removeprefix("scenario.") == where and allowed and allowed not in said:
                said.append(allowed)
        except Exception:
            continue
    return "; ".join(said)


def _section_rows(cls: type, prefix: str, where_prefix: str, setter_for, base: dict, notes) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.default is not dataclasses.MISSING:
            default = _show(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _show(f.default_factory())
        elif cls.__name__ == "ScenarioConfig" and f.name == "name":
            default = "the file's name"  # load_scenario names a scenario after its file (or preset)
        else:
            default = "required"
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp) or (inner and typing.get_origin(tp) is not list):
            continue  # a section of its own, below
        allowed = _allowed(setter_for(f.name), f"{where_prefix}{f.name}", tp, base)
        note = notes.get((cls.__name__, f.name), "")
        rows.append(f"| {_code(prefix + f.name)} | {_cell(_type_name(tp))} | {default} | {_cell(allowed)} | "
                    f"{_cell(note)} |")
    return rows


def _set_path(*keys):
    def setter(name):
        def put(data, value):
            node = data
            for k in keys:
                node = node.setdefault(k, {}) if not isinstance(k, int) else node[k]
            node[name] = value

        return put

    return setter


def scenario_page() -> str:
    import yaml

    from geomesh import config

    notes = _field_notes(Path(config.__file__))
    base = yaml.safe_load(config._read_scenario_text("default")[0])
    base.setdefault("name", "default")
    first = base["regions"][0]["name"]

    def with_gpu(name):
        def put(data, value):
            data["gpus"] = {"MY-GPU": {"tflops": 100.0, "memory_gb": 80.0, name: value}}

        return put

    def with_fault(name):
        def put(data, value):
            data["faults"] = [{"at_round": 1, "region": first, "kind": "slowdown", name: value}]

        return put

    def with_actual(name):
        def put(data, value):
            data.setdefault("wan", {})["actual"] = {name: value}

        return put

    def with_wandb(name):
        def put(data, value):
            data.setdefault("logging", {})["wandb"] = {name: value}

        return put

    top = typing.get_type_hints(config.ScenarioConfig)
    sections = [
        ("Top level", None, config.ScenarioConfig, "", "", _set_path()),
        ("regions", "regions", config.RegionConfig, "regions[].", "regions[0].", _set_path("regions", 0)),
        ("gpus", "gpus", config.GpuConfig, "gpus.NAME.", "gpus.MY-GPU.", with_gpu),
        ("wan", "wan", config.WanConfig, "wan.", "wan.", _set_path("wan")),
        ("wan.actual", None, config.WanActualConfig, "wan.actual.", "wan.actual.", with_actual),
        ("timing_model", "timing_model", config.TimingConfig, "timing_model.", "timing_model.",
         _set_path("timing_model")),
        ("model", "model", config.ModelConfig, "model.", "model.", _set_path("model")),
        ("data", "data", config.DataConfig, "data.", "data.", _set_path("data")),
        ("training", "training", config.TrainingConfig, "training.", "training.", _set_path("training")),
        ("geomesh", "geomesh", config.GeoMeshConfig, "geomesh.", "geomesh.", _set_path("geomesh")),
        ("compression", "compression", config.CompressionConfig, "compression.", "compression.",
         _set_path("compression")),
        ("faults", "faults", config.FaultConfig, "faults[].", "faults[0].", with_fault),
        ("reliability", "reliability", config.ReliabilityConfig, "reliability.", "reliability.",
         _set_path("reliability")),
        ("logging", "logging", config.LoggingConfig, "logging.", "logging.", _set_path("logging")),
        ("logging.wandb", None, config.WandbConfig, "logging.wandb.", "logging.wandb.", with_wandb),
    ]
    lines = ["# Scenario fields", "",
             "This page lists every field a scenario YAML file can set, generated from the scenario's dataclasses at "
             "each docs build. "
             "\"Allowed\" is what the validator says when it refuses a value (a wrong type is refused too, by the "
             "type column); \"notes\" is the comment the code gives the field. Only `regions` has no default.", "",
             "A field is written in YAML as its section and name (`training.seed: 3` is `training: {seed: 3}`), and "
             "set from the command line with `--set FIELD=VALUE` (the value is read as YAML: `--set "
             "wan.bandwidth_gbps=0.5`). `geomesh config show SCENARIO` prints the effective scenario.", ""]
    for title, attr, cls, prefix, where_prefix, setter in sections:
        doc = (cls.__doc__ or "").strip()
        generated_doc = doc.startswith(cls.__name__ + "(")  # a dataclass without a docstring of its own
        note = notes.get(("ScenarioConfig", attr), "") if attr else ""
        what = " ".join(doc.split()) if doc and not generated_doc else ""
        kind = _type_name(top[attr]) if attr else ""
        lines += [f"## `{title}`" if attr or title != "Top level" else "## Top level", ""]
        for x in (f"Type: {kind}." if kind else "", what, note):
            lines += [x, ""] if x else []
        lines += ["| field | type | default | allowed | notes |", "|---|---|---|---|---|"]
        lines += _section_rows(cls, prefix, where_prefix, setter, base, notes)
        lines += [""]
    return "\n".join(lines) + "\n"


# ---- methods and presets -----------------------------------------------------------------------------------


def methods_page() -> str:
    from geomesh.config import load_scenario, preset_names
    from geomesh.methods import get_method, method_names

    lines = ["# Methods and presets", "",
             "This page lists the methods `--method` takes and the scenario presets a command takes by name, "
             "generated from their tables at each docs build.", "",
             "## Methods", "", "| method | what it is |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(get_method(name).description)} |" for name in method_names()]
    lines += ["", "## Presets", "", "`geomesh scenarios` lists them; `geomesh config show NAME` prints one whole.", "",
              "| preset | regions | what it is |", "|---|---|---|"]
    for name in preset_names():
        s = load_scenario(name)
        gpus = ", ".join(f"{r.count}×{r.gpu}" for r in s.regions)
        lines.append(f"| `{name}` | {gpus} | {_cell(s.description)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # print one page: python docs/hooks/reference.py cli|scenario|methods
    _use_this_checkout()
    print(globals()[f"{sys.argv[1]}_page"]())
