"""The documentation: the site builds in strict mode (every internal link and anchor resolves, every page is in
the navigation), its generated reference names every option of every command and every scenario field, pages
stay short and say their purpose first, the README's links resolve, and the deployment tutorial's commands are
the hosts test bed's: its own command builder makes them, and the bed runs them, a region lost and restarted."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
import typing
from html import unescape
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIAL = DOCS / "guide" / "deploy.md"
MAX_LINES = {"README.md": 120}  # and every page of the site: 400
PAGE_MAX = 400

# The tutorial's private network (WireGuard) and the bed's: the only things the bed changes in its commands.
TUTORIAL_NET = {"10.77.0.": "10.215.0.", "wg0": "eth0"}
# What the bed adds to a region's command, and why: a short quorum timeout for its short runs, the latency the
# kernel cannot add where it lacks sch_netem, quiet hosts, and the final parameters it compares across hosts.
BED_ONLY = {"timeout", "wan", "quiet", "save_params"}


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "NO_MKDOCS_2_WARNING": "1", **extra}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built in strict mode into a temporary folder."""
    assert importlib.util.find_spec("mkdocs"), "the docs tools are missing: pip install -e '.[docs]' (make test does)"
    out = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
               "--site-dir", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text()


def _sections(html: str) -> dict[str, str]:
    """A page's HTML by its second-level headings' text."""
    parts = re.split(r"<h2 id=\"[^\"]*\">", html)
    return {unescape(re.sub(r"<[^>]+>", "", p.split("</h2>")[0])).strip().rstrip("¶").strip(): p for p in parts[1:]}


# ---- the generated reference -------------------------------------------------------------------------------


def _commands():
    """(command, parser) of every ``geomesh`` subcommand (nested ones included) and of ``python -m geomesh.run``."""
    import argparse

    from geomesh.cli import build_parser
    from geomesh.cli.rank import build_parser as rank_parser

    out = []

    def walk(parser, prefix):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    if any(isinstance(b, argparse._SubParsersAction) for b in sub._actions):
                        walk(sub, f"{prefix} {name}")
                    else:
                        out.append((f"{prefix} {name}", sub))

    walk(build_parser(), "geomesh")
    return out + [("python -m geomesh.run", rank_parser())]


def _options(parser) -> list[str]:
    import argparse

    names = []
    for a in parser._actions:
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            names += a.option_strings or [a.dest]
    return names


def _fields(cls, prefix: str = "") -> list[str]:
    """Every scenario field as the reference writes it: sections dotted, list items ``[]``, mapping values ``NAME``."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = typing.get_args(tp)
        inner = next((a for a in args if dataclasses.is_dataclass(a)), None)
        if dataclasses.is_dataclass(tp):
            out += _fields(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is list and inner is not None:
            out += _fields(inner, f"{prefix}{f.name}[].")
            out.append(f"{prefix}{f.name}")
        elif typing.get_origin(tp) is dict and inner is not None:
            out += _fields(inner, f"{prefix}{f.name}.NAME.")
        elif inner is not None:  # an optional section (wan.actual, logging.wandb)
            out += _fields(inner, f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_the_reference_names_every_option_of_every_command(site):
    sections = _sections(_page(site, "reference/cli"))
    commands = _commands()
    assert len(commands) >= 12  # train, demo, bench, scenarios, config show, plan, profile, launch, hosts, ...
    missing = []
    for command, parser in commands:
        html = sections.get(command)
        assert html is not None, f"no section for {command!r} in the command-line reference: {sorted(sections)}"
        missing += [f"{command} {o}" for o in _options(parser) if f"<code>{o}</code>" not in html]
    assert not missing, f"options missing from the command-line reference: {missing}"


def test_the_reference_names_every_scenario_field_and_method(site):
    from geomesh.config import ScenarioConfig
    from geomesh.methods import method_names

    html = _page(site, "reference/scenario")
    fields = _fields(ScenarioConfig)
    assert len(fields) > 100 and "training.precision" in fields and "regions[].gpu" in fields
    missing = [f for f in fields if f"<code>{f}</code>" not in html]
    assert not missing, f"scenario fields missing from the reference: {missing}"
    methods = _page(site, "reference/methods")
    assert not [m for m in method_names() if f"<code>{m}</code>" not in methods]
    assert "GeoMeshSync" in _page(site, "reference/api")


# ---- pages -------------------------------------------------------------------------------------------------


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)


def _generated() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return {path: getattr(hook, maker)() for path, maker in hook.GENERATED.items()}


def test_pages_are_short_and_say_their_purpose_first():
    texts = {str(p.relative_to(DOCS)): p.read_text() for p in _pages()} | _generated()
    assert "benchmarks.md" in texts and "guide/deploy.md" in texts and "reference/cli.md" in texts
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= MAX_LINES["README.md"], "README.md is over 120 lines"
    long = {name: len(t.splitlines()) for name, t in texts.items() if len(t.splitlines()) > PAGE_MAX}
    assert not long, f"pages over {PAGE_MAX} lines: {long}"
    for name, text in texts.items():
        body = text.split("\n\n", 2)
        assert text.startswith("# ") and len(body) > 1, f"{name}: a title, then a first paragraph"
        first = body[1].strip()
        assert re.match(r"This (page|tutorial|note|section) ", first), f"{name}: no purpose first: {first[:80]!r}"


def test_the_readme_links_resolve(site):
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) >= 10
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            html = (site / target.relative_to(DOCS).with_suffix("") / "index.html").read_text()
            assert f'id="{anchor}"' in html, f"README.md links to {link}: no such anchor"


# ---- the deployment tutorial -------------------------------------------------------------------------------


def _blocks() -> dict[str, str]:
    """The tutorial's fenced blocks that have a title, by title."""
    text = TUTORIAL.read_text()
    return {m.group(1): m.group(2) for m in re.finditer(r'```\w+ title="([^"]+)"\n(.*?)\n```', text, re.S)}


def _region_blocks(scenario) -> dict[str, str]:
    blocks = _blocks()
    out = {}
    for r in scenario.regions:
        titled = [t for t in blocks if t.startswith(f"{r.name} (")]
        assert len(titled) == 1, f"the tutorial has no block of its own for region {r.name}: {sorted(blocks)}"
        out[r.name] = blocks[titled[0]]
    return out


def _on_the_bed(text: str) -> str:
    for mine, beds in TUTORIAL_NET.items():
        text = text.replace(mine, beds)
    return text


def _exports_and_command(block: str) -> tuple[dict[str, str], list[str]]:
    exports, command = {}, []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            name, _, value = words[1].partition("=")
            exports[name] = value
        elif words:
            assert not command, f"one command per region block, not: {block}"
            command = words
    return exports, command


def _tutorial_scenario(folder: Path):
    from geomesh.config import load_scenario

    path = folder / "cluster.yaml"
    path.write_text(_blocks()["cluster.yaml"] + "\n")
    return path, load_scenario(path)


def _bed_modules():
    """The modules ``geomesh hosts`` takes the bed and its netns check from (wherever they live now)."""
    import geomesh.cli.hosts as face

    src = Path(face.__file__).read_text()
    bed = re.search(r"from \.\.([\w.]+) import [^\n]*HostsBed", src).group(1)
    net = re.search(r"from \.\.([\w.]+) import [^\n]*netns_unavailable_reason", src).group(1)
    return importlib.import_module(f"geomesh.{bed}"), importlib.import_module(f"geomesh.{net}")


def test_the_tutorial_commands_are_the_ones_the_hosts_bed_builds(tmp_path, monkeypatch, capsys):
    """``geomesh hosts`` on the tutorial's own scenario, with the network and the processes left out: the bed's
    command builder makes the quorum service's command and each region's, and they are the tutorial's (on the
    bed's addresses), but for what the bed adds to a region's options (``BED_ONLY``)."""
    from geomesh.cli import main
    from geomesh.cli.rank import build_parser as rank_parser

    path, scenario = _tutorial_scenario(tmp_path)
    hosts_mod, net_mod = _bed_modules()
    started: list[tuple[list[str], dict]] = []

    class Proc:
        pid, returncode = 0, 0

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    def popen(argv, **kw):
        started.append((list(argv), kw))
        return Proc()

    class CommandsOnly(hosts_mod.HostsBed):
        """The bed's own command builder, without namespaces, links or processes."""

        def setup(self) -> None:
            pass

        def tx_bytes(self, region: int):
            return None

    fake = SimpleNamespace(Popen=popen, STDOUT=subprocess.STDOUT,
                           run=lambda *a, **k: subprocess.CompletedProcess(a, 1, "", ""))  # fmt: skip
    monkeypatch.setattr(hosts_mod, "subprocess", fake)
    monkeypatch.setattr(hosts_mod, "namespace_pids", lambda ns: set(), raising=False)
    monkeypatch.setattr(hosts_mod, "HostsBed", CommandsOnly)
    monkeypatch.setattr(net_mod, "netns_unavailable_reason", lambda: None)
    quorum_exports, quorum = _exports_and_command(_blocks()["quorum host (10.77.0.1)"])
    min_regions = quorum[quorum.index("--min-regions") + 1]
    main(["hosts", str(path), "--method", "geomesh", "--out", str(tmp_path / "bed"), "--min-regions", min_regions])
    capsys.readouterr()
    assert len(started) == 1 + len(scenario.regions), started

    # the quorum service: the same command
    beds_quorum = started[0][0][started[0][0].index("exec") + 2:]
    assert not quorum_exports and quorum[0] == "python"
    assert [sys.executable, *_on_the_bed(shlex.join(quorum[1:])).split()] == beds_quorum

    # each region: the same launcher, options, environment
    rank = rank_parser()
    for (argv, kw), (region, block) in zip(started[1:], _region_blocks(scenario).items()):
        beds = argv[argv.index("exec") + 2:]
        exports, command = _exports_and_command(_on_the_bed(block))
        assert command[0] == "torchrun" and "geomesh.run" in command
        cut, bed_cut = command.index("geomesh.run") + 1, beds.index("geomesh.run") + 1
        assert [sys.executable, "-m", "torch.distributed.run", *command[1:cut]] == beds[:bed_cut], region
        mine, theirs = vars(rank.parse_args(command[cut:])), vars(rank.parse_args(beds[bed_cut:]))
        assert Path(theirs.pop("scenario")).name == mine.pop("scenario") == "cluster.yaml"
        assert not Path(mine.pop("out")).is_absolute()  # a host's own disk: relative to where it runs
        assert Path(theirs.pop("out")).is_relative_to(kw["cwd"])  # the bed: inside the host's own folder
        differ = {k for k in mine if mine[k] != theirs[k]}
        assert differ <= BED_ONLY, f"{region}: the tutorial's options differ from the bed's in {differ - BED_ONLY}"
        key = scenario.reliability.hmac_key_env
        assert key in exports and kw["env"].get(key), f"{region}: the run key, in {key}"
        own = {k for k, v in kw["env"].items() if os.environ.get(k) != v} - {"OMP_NUM_THREADS"}
        assert own == set(exports), f"{region}: the bed sets {sorted(own)}, the tutorial exports {sorted(exports)}"
        assert all(kw["env"][k] == v for k, v in exports.items() if k != key), (region, exports)
        assert exports["GEOMESH_REGION"] == region


def _netns_reason() -> str | None:
    try:
        _, net_mod = _bed_modules()
    except Exception as exc:  # noqa: BLE001 - the bed's modules are not where the face says
        return f"the hosts test bed's modules cannot be imported: {exc}"
    return net_mod.netns_unavailable_reason()


def _records(folder: Path) -> list[dict]:
    path = folder / "runs" / "prod" / "events.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # (a line being written)
    return out


@pytest.mark.waits
@pytest.mark.bed
@pytest.mark.skipif(_netns_reason() is not None, reason=f"the hosts test bed cannot run here: {_netns_reason()}")
def test_the_tutorial_runs_on_the_hosts_bed(tmp_path, small_corpus):
    """The tutorial's blocks, run as written by bash on the bed's hosts (the private network is the bed's): the
    quorum service, one block per region, a region lost mid-run and its block run again, ``geomesh status`` at
    the end, and the lost region's block once more after the end. Every region ends with exit 0 and one checksum;
    the restarted region rejoined; the late one stops at once with exit 0 and its one line."""
    from conftest import tiny_scenario_dict

    hosts_mod, _ = _bed_modules()
    _, tutorial = _tutorial_scenario(tmp_path)
    names = [r.name for r in tutorial.regions]
    # the tutorial's regions and reliability on the suite's tiny model; a wall-clock budget outlasts a restart
    data = tiny_scenario_dict(small_corpus, gpus=tuple(r.gpu for r in tutorial.regions), time_budget_s=90.0)
    for region, name in zip(data["regions"], names):
        region["name"] = name
    data["reliability"] = {"hmac_key_env": tutorial.reliability.hmac_key_env}
    data["training"]["inner_steps"] = 20
    blocks = _blocks()
    quorum_block = blocks["quorum host (10.77.0.1)"]
    region_blocks = _region_blocks(tutorial)
    env = {**_env(), "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "OMP_NUM_THREADS": "1"}  # (torchrun, python and geomesh from this venv; one thread a host, as the bed)
    for k in ("GEOMESH_REGION", "MASTER_ADDR", "MASTER_PORT", tutorial.reliability.hmac_key_env):
        env.pop(k, None)
    bed = hosts_mod.HostsBed(tutorial.wan_model(), names, tmp_path / "bed")
    try:
        bed.setup()
        quorum_dir = tmp_path / "bed" / "quorum"
        quorum_dir.mkdir(parents=True)
        with open(quorum_dir / "quorum.log", "w") as log:
            bed.quorum = subprocess.Popen(["ip", "netns", "exec", bed.ns(0), "bash", "-c", _on_the_bed(quorum_block)],
                                          cwd=quorum_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)  # fmt: skip
        hosts = []
        for i, name in enumerate(names):
            folder = tmp_path / "bed" / name
            folder.mkdir(parents=True)
            (folder / "cluster.yaml").write_text(yaml.safe_dump(data))  # the same scenario on every host
            (folder / "run.key").write_text("the run's key, the same on every host\n")
            host = hosts_mod.Host(i, name, bed.ns(i + 1), hosts_mod.host_address(i + 1), folder,
                                  ["bash", "-c", _on_the_bed(region_blocks[name])], dict(env))  # fmt: skip
            bed.hosts.append(host)
            hosts.append(host)
        deadline = time.monotonic() + 120  # the quorum service listens first (it says so)
        while "listening on" not in (quorum_dir / "quorum.log").read_text(errors="replace"):
            assert time.monotonic() < deadline and bed.quorum.poll() is None, (quorum_dir / "quorum.log").read_text()
            time.sleep(0.1)
        for h in hosts:
            h.start()
        lost = hosts[1]
        deadline = time.monotonic() + 300
        while max((e.get("round", 0) for e in _records(hosts[0].folder) if e.get("type") == "round"), default=0) < 2:
            assert time.monotonic() < deadline and all(h.proc.poll() is None for h in hosts), _tail(hosts)
            time.sleep(0.5)
        lost.kill()  # the region is lost, every process of it, and the others see it ...
        deadline = time.monotonic() + 300
        while not any(e.get("type") == "leave" and e.get("region") == lost.name for e in _records(hosts[0].folder)):
            assert time.monotonic() < deadline and hosts[0].proc.poll() is None, _tail(hosts)
            time.sleep(0.2)
        lost.start()  # ... and its block is run again, unchanged
        assert hosts_mod.wait_all(hosts, 600), "the run did not end in time\n" + _tail(hosts)
        assert [h.proc.returncode for h in hosts] == [0] * len(hosts), _tail(hosts)
        status = subprocess.run(["bash", "-c", blocks["any region's host"]], cwd=hosts[0].folder, env=env,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert status.returncode == 0 and "finished" in status.stdout, status.stdout + status.stderr
        lost.start()  # after the end: it reads the run board and stops at once
        assert hosts_mod.wait_all([lost], 300), _tail([lost])
        late = lost.log.read_text()
        assert lost.proc.returncode == 0 and "the run finished at round" in late, late[-3000:]
    finally:
        bed.close()
    sums = {}
    for h in hosts:
        summary = json.loads((h.folder / "runs" / "prod" / "summary.json").read_text())
        sums.update(summary.get("param_checksums") or {})
    assert sorted(sums) == sorted(names) and len(set(sums.values())) == 1, sums
    joins = {e["region"] for e in _records(hosts[0].folder) if e.get("type") == "join"}
    assert lost.name in joins, joins


def _tail(hosts) -> str:
    return "\n".join(f"--- {h.name}\n" + "\n".join(h.log.read_text(errors="replace").splitlines()[-12:])
                     for h in hosts if h.log is not None and h.log.exists())  # fmt: skip
