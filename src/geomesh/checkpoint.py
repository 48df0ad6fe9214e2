"""Run checkpoints: written atomically at round boundaries, the newest K kept, verified when read back.

A checkpoint is two files in ``<run folder>/checkpoints/``:

- ``round-NNNNNN.pt``: the run's state, a ``torch.save`` of plain containers and tensors (loaded back with
  ``weights_only=True``, so a checkpoint cannot run code);
- ``round-NNNNNN.json``: the commit marker, written *after* the ``.pt`` file: format, round, tokens, modeled
  time, the ``.pt`` file's size and SHA-256, and with the run key set (``reliability.hmac_key_env`` /
  ``hmac_key_file``) a ``tag``: HMAC-SHA256 over the rest of the marker, so a checkpoint rewritten together
  with its marker by someone without the key is refused.

Each file is written to a temporary name in the same folder, flushed, ``fsync``-ed, renamed over its final
name with ``os.replace`` (atomic on POSIX) and the folder is ``fsync``-ed. A checkpoint exists only once its
marker does, so a crash or a failed write at any point leaves the previous checkpoints intact: a ``.pt``
without a marker, or one whose bytes do not match the marker's hash, is never used. Older checkpoints are
removed only after a newer one is complete.

What goes into the state is the runtime's business (:mod:`geomesh.runtime.emulated.checkpoints`, with
what both runtimes share in :mod:`geomesh.runtime.checkpoint_state`); this module only moves bytes, checks
them, estimates sizes and compares run fingerprints. No clock, no training. The distributed runtime's
checkpoints (one folder of files per checkpoint) verify with the same pieces: :func:`file_digest`,
:func:`verify_files` and :func:`check_marker_tag`.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import io
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError

CHECKPOINT_FORMAT = 1
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^round-(\d{6,})\.json$")
MiB = 1 << 20


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms that cannot open a folder (Windows): the rename is what we can do
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never a part.

    On any error the temporary file is removed and the error is raised; ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of a file, read in 1 MiB pieces (checkpoint files are large)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while piece := f.read(MiB):
            h.update(piece)
            size += len(piece)
    return {"bytes": size, "sha256": h.hexdigest()}


def blob_matches(blob: bytes, digest: dict[str, Any]) -> bool:
    """Whether bytes already in memory are the ones a marker describes (read once, checked, then parsed)."""
    return len(blob) == int(digest["bytes"]) and hashlib.sha256(blob).hexdigest() == digest["sha256"]


def verify_files(directory: Path, files: dict[str, dict[str, Any]]) -> None:
    """Check that every file a marker lists has its size and SHA-256 (CheckpointError naming the first that
    does not, or is missing). Sizes first: a truncated file is found without reading it."""
    directory = Path(directory)
    for name, want in sorted(files.items()):
        path = directory / name
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"checkpoint {directory}: its marker names {name!r}, not a file of the folder")
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"checkpoint {directory}: {name} is missing ({exc.strerror or exc})") from None
        if size != int(want["bytes"]):
            raise CheckpointError(f"checkpoint {directory}: {name} has {size} bytes, its marker says "
                                  f"{int(want['bytes'])} (truncated or changed)")  # fmt: skip
    for name, want in sorted(files.items()):
        if file_digest(directory / name)["sha256"] != want["sha256"]:
            raise CheckpointError(f"checkpoint {directory}: {name} does not match its SHA-256 in the marker "
                                  f"(damaged or changed)")  # fmt: skip


_TAG_CONTEXT = b"geomesh checkpoint marker\0"


def marker_tag(marker: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 with the run key over the marker without its ``tag`` (canonical JSON: sorted keys)."""
    body = json.dumps({k: v for k, v in marker.items() if k != "tag"}, sort_keys=True, separators=(",", ":"),
                      default=str).encode()  # fmt: skip
    return hmac.new(key, _TAG_CONTEXT + body, hashlib.sha256).hexdigest()


def sign_marker(marker: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """The marker with its ``tag`` when the run has a key (unchanged without one)."""
    return {**marker, "tag": marker_tag(marker, key)} if key else marker


def check_marker_tag(marker: dict[str, Any], key: bytes | None, where: str) -> None:
    """With a run key, the marker must carry the tag that key gives (CheckpointError otherwise). Without a key
    there is nothing to check: the hashes still find damage, not a rewrite by someone who also rewrote them."""
    if not key:
        return
    tag = marker.get("tag")
    if not isinstance(tag, str):
        raise CheckpointError(f"checkpoint {where}: its marker is not signed, and this run has a key")
    if not hmac.compare_digest(tag, marker_tag(marker, key)):
        raise CheckpointError(f"checkpoint {where}: its marker's tag does not match the run key (written with "
                              f"another key, or changed)")  # fmt: skip


def torch_save_atomic(path: Path, obj: Any) -> None:
    """``torch.save`` through :func:`write_atomic` (e.g. ``final_params.pt``: the old file or the whole new one)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    write_atomic(path, buf.getvalue())


def _name(round_index: int) -> str:
    return f"round-{round_index:06d}"


def list_checkpoints(directory: Path) -> list[dict[str, Any]]:
    """Markers of the complete checkpoints in ``directory``, oldest first (unreadable markers skipped)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    markers = []
    for p in directory.iterdir():
        if not _NAME.match(p.name):
            continue
        try:
            marker = json.loads(p.read_text())
            int(marker["round"]), str(marker["file"]), str(marker["sha256"]), int(marker["bytes"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            warnings.warn(f"checkpoint marker {p} is unreadable and is ignored: {exc}")
            continue
        markers.append(marker)
    return sorted(markers, key=lambda m: int(m["round"]))


def write_checkpoint(directory: Path, round_index: int, state: dict[str, Any], keep: int,
                     info: dict[str, Any] | None = None, key: bytes | None = None) -> Path:  # fmt: skip
    """Write ``state`` as the checkpoint of ``round_index`` and keep the newest ``keep``; returns the marker
    (signed with ``key``, the run key, when there is one).

    Raises ``OSError`` (disk full, folder gone, read-only, ...) with every earlier checkpoint intact."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getvalue()
    name = _name(round_index)
    write_atomic(directory / f"{name}.pt", blob)
    marker = {"format": CHECKPOINT_FORMAT, "round": round_index, "file": f"{name}.pt",
              "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob), **(info or {})}  # fmt: skip
    marker = sign_marker(marker, key)
    write_atomic(directory / f"{name}.json", (json.dumps(marker, indent=1) + "\n").encode())
    prune(directory, keep)
    return directory / f"{name}.json"


def prune(directory: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints, and any leftover ``.pt`` or temporary file."""
    markers = list_checkpoints(directory)
    kept = markers[-keep:] if keep > 0 else []
    keep_files = {m["file"] for m in kept} | {f"{_name(int(m['round']))}.json" for m in kept}
    for m in markers[: len(markers) - len(kept)]:  # the marker first: the checkpoint stops existing at once
        for fname in (f"{_name(int(m['round']))}.json", m["file"]):
            try:
                (directory / fname).unlink()
            except FileNotFoundError:
                pass
    own_tmp = f".tmp-{os.getpid()}"
    for p in directory.iterdir():
        orphan = p.name.startswith("round-") and p.name.endswith(".pt") and p.name not in keep_files
        if orphan or (p.name.startswith(".round-") and own_tmp not in p.name):
            try:
                p.unlink()
            except OSError:
                pass


def read_checkpoint(directory: Path, marker: dict[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """The state a marker points to, after checking its size and SHA-256 (and with ``key`` the marker's tag):
    CheckpointError if they differ."""
    path = Path(directory) / marker["file"]
    check_marker_tag(marker, key, str(path))
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read it: {exc.strerror or exc}") from None
    if not blob_matches(blob, marker):
        raise CheckpointError(f"checkpoint {path}: its bytes do not match its marker (damaged or half-written)")
    if int(marker.get("format", -1)) != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {marker.get('format')} (this version reads "
                              f"{CHECKPOINT_FORMAT})")  # fmt: skip
    try:
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged zip, or an object weights_only refuses
        raise CheckpointError(f"checkpoint {path}: cannot load it: {exc}") from None


def load_latest(directory: Path, key: bytes | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(marker, state) of the newest checkpoint that reads back intact (with ``key``: signed with it); a
    damaged newer one is skipped with a warning. CheckpointError when there is none."""
    directory = Path(directory)
    markers = list_checkpoints(directory)
    if not markers:
        raise CheckpointError(f"no checkpoint in {directory} (a run writes them with --checkpoint-every N or "
                              f"reliability.checkpoint_every_rounds)")  # fmt: skip
    problems = []
    for marker in reversed(markers):
        try:
            return marker, read_checkpoint(directory, marker, key)
        except CheckpointError as exc:
            problems.append(str(exc))
            warnings.warn(f"{exc}; trying the previous checkpoint")
    raise CheckpointError(f"no usable checkpoint in {directory}: " + "; ".join(problems))


# ---- sizes and free space ------------------------------------------------------------------------------


def estimate_bytes(numel: int, n_workers: int, residual: bool) -> int:
    """About how large one checkpoint of a run with ``numel`` proxy parameters and ``n_workers`` is: global
    parameters and outer momentum, and per worker its replica, AdamW's two moments and the codec residual."""
    per_worker = 3 + (1 if residual else 0)
    return 4 * numel * (2 + n_workers * per_worker) + MiB


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_free_space(path: Path, need: int, what: str) -> None:
    """Raise ``OSError(ENOSPC)`` naming ``what`` when ``path``'s file system has less than ``need`` bytes free."""
    free = free_bytes(path)
    if free < need:
        raise OSError(errno.ENOSPC, f"{_mib(free)} free, {what} need about {_mib(need)}")


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def existing_bytes(directory: Path) -> int:
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


# ---- the events log ------------------------------------------------------------------------------------


def durable_size(path: Path) -> int:
    """Flush ``path`` to disk and return its size (the offset a resumed run truncates it back to)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        return os.fstat(f.fileno()).st_size


def truncate_to(path: Path, offset: int) -> None:
    """Cut ``path`` back to ``offset`` bytes (what a checkpoint saw), so a resumed run appends after it."""
    size = path.stat().st_size if path.exists() else -1
    if size < offset:
        raise CheckpointError(f"{path} has {max(size, 0)} bytes but the checkpoint saw {offset}: the run folder "
                              f"was changed after the checkpoint; start a new run folder")  # fmt: skip
    with open(path, "r+b") as f:
        f.truncate(offset)
        f.flush()
        os.fsync(f.fileno())


# ---- fingerprints --------------------------------------------------------------------------------------

# Sections that do not change what a run computes: resuming with other values is allowed.
NEUTRAL_SECTIONS = ("reliability", "logging", "description")


def fingerprint(scenario: dict[str, Any], method: str, seed: int, tokens: int) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed: the scenario (minus the neutral sections), the
    method, the seed and the token budget. Plain JSON values; :func:`fingerprint_hash` digests it."""
    canon = json.loads(json.dumps({k: v for k, v in scenario.items() if k not in NEUTRAL_SECTIONS},
                                  sort_keys=True, default=str))  # fmt: skip
    if "model" in canon:  # hashed under the section's old name, so run ids and older checkpoints stay valid
        canon["proxy"] = canon.pop("model")
    return {"scenario": canon, "method": method, "seed": seed, "tokens": tokens}


def fingerprint_hash(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:16]


def differences(a: Any, b: Any, where: str = "", limit: int = 4) -> list[str]:
    """Dotted paths where ``a`` and ``b`` differ (at most ``limit``), e.g. ``scenario.training.outer_lr``."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if len(out) >= limit or x == y:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y), key=str):
                walk(x.get(k), y.get(k), f"{path}.{k}" if path else str(k))
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
        else:
            out.append(f"{path or '<root>'} ({_short(x)} then, {_short(y)} now)")

    walk(a, b, where)
    return out


def _short(v: Any) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
