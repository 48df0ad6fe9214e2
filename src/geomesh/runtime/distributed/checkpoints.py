"""The checkpoint folder of the distributed runtime, written, verified and read with ``torch.distributed.checkpoint``
(DCP): what is written, what is checked before anything is read, and what is restored are one format and sit
together here, so that none of them drifts from the others. What a run's ranks put into a checkpoint is
:mod:`.run_checkpoint`; which checkpoint a resumed run starts from is :mod:`.resume`.

A checkpoint is a folder ``<run folder>/checkpoints/round-NNNNNN/`` that holds the tensors, written by DCP
(its ``.metadata`` and one or more ``__<rank>_<k>.distcp`` files), every rank's other state as JSON
(``rank-<r>.json``), and ``geomesh.json``, the marker: the round, the tokens, the run's fingerprint (scenario
without its neutral sections, method, seed, token budget and ranks per region), the run id, the size and
SHA-256 of every other file of the folder and, with the run key set, a ``tag`` (HMAC-SHA256 over the rest of the
marker; :func:`geomesh.checkpoint.check_marker_tag`). Every rank takes part: DCP writes each tensor once
(replicated tensors such as θ are de-duplicated across ranks; FSDP shards are written by the ranks that own
them and can be read back by another layout).

Nothing is deserialised before it is verified, and nothing in a checkpoint can run code:

- on ``--resume`` every rank checks the newest checkpoint's files against the marker (sizes, hashes, the
  tag) and the ranks agree on the verdict; a damaged or changed one is skipped by all of them together, with a
  warning, for the previous intact one (:func:`.resume.check_resume`); none intact is one error;
- DCP's ``.metadata`` is a pickle: it is read once into memory, its hash checked against the marker, and only
  then unpickled, by an unpickler that builds DCP's own metadata classes, ``torch.Size``, dtypes and paths
  and nothing else (:class:`_MetadataUnpickler`); every file it points to must be one the marker lists;
- the tensors are read by DCP with ``torch.load(weights_only=True)``; DCP's path for non-tensor items
  (``torch.load(weights_only=False)``) is never taken: this module stores none (:func:`split_plain`), and a
  checkpoint whose metadata claims one is refused (:class:`_TensorOnlyPlanner`);
- the non-tensor state (the data position, the loop's counters and plans, the RNGs' Python and numpy states,
  the optimizer's hyper-parameters, telemetry totals) is JSON, hash-checked before it is parsed.

Atomicity: every rank writes its ``rank-<r>.json`` and DCP writes into ``.tmp-round-NNNNNN/``; once every rank
is done (``dcp.save`` is collective and returns after the metadata is written), the coordinating rank hashes
the folder's files, writes ``geomesh.json`` into it, ``fsync``-s,
renames the folder to ``round-NNNNNN`` (``os.replace``, atomic) and only then removes checkpoints beyond the
newest K. A folder without ``geomesh.json`` or still named ``.tmp-*`` is never read. The folder must be
visible to every rank (one machine, or a shared file system on a cluster).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ... import checkpoint as ckpt
from ...errors import CheckpointError

MARKER = "geomesh.json"
FORMAT = 2  # 2: every file hashed in the marker, non-tensor state as JSON (1 had neither and is not read)
METADATA = ".metadata"
_NAME = re.compile(r"^round-(\d{6,})$")


def rank_file(rank: int) -> str:
    """The name of one rank's JSON state in a checkpoint folder."""
    return f"rank-{rank}.json"


class DistCheckpointError(RuntimeError):
    """No usable checkpoint, or one that belongs to another run (the message says which and why)."""


def list_complete(directory: Path) -> list[tuple[int, Path, dict[str, Any]]]:
    """(round, folder, marker) of every complete checkpoint, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if not m or not p.is_dir():
            continue
        try:
            marker = json.loads((p / MARKER).read_text())
            int(marker["round"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # incomplete (no marker yet) or damaged: never used
        if not (p / ".metadata").is_file():
            continue
        out.append((int(marker["round"]), p, marker))
    return sorted(out, key=lambda t: t[0])


def newest(directory: Path) -> tuple[int, Path, dict[str, Any]]:
    found = list_complete(directory)
    if not found:
        raise DistCheckpointError(f"no checkpoint in {directory} (a run writes them with --checkpoint-every N or "
                                  f"reliability.checkpoint_every_rounds)")  # fmt: skip
    return found[-1]


def verify(path: Path, marker: dict[str, Any], key: bytes | None) -> None:
    """Check a checkpoint folder against its marker before anything in it is read: the format, the tag (with
    a run key), and the size and SHA-256 of every file it lists. DistCheckpointError says what is wrong."""
    try:
        if int(marker.get("format", -1)) != FORMAT:
            raise CheckpointError(f"checkpoint {path}: format {marker.get('format')} (this version reads "
                                  f"{FORMAT}: every file hashed in the marker)")  # fmt: skip
        ckpt.check_marker_tag(marker, key, str(path))
        files = marker.get("files")
        if not isinstance(files, dict) or METADATA not in files:
            raise CheckpointError(f"checkpoint {path}: its marker lists no files")
        ckpt.verify_files(path, files)
    except (CheckpointError, ValueError, TypeError, KeyError) as exc:
        raise DistCheckpointError(str(exc)) from None
    read_metadata(path, files)  # hashes can be rewritten by whoever rewrote a file: it must also be DCP's own


def split_plain(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, the rest) of a nested state dict, each keeping the nesting: DCP gets the tensors, the rest
    is written as JSON. Lists and tuples are plain values (DCP would flatten them; none holds a tensor)."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        elif isinstance(v, dict):
            t, p = split_plain(v)
            if t:
                tensors[k] = t
            if p or not t:
                plain[k] = p
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            raise TypeError(f"checkpoint state {k!r}: a list of tensors (give them names in a dict)")
        else:
            plain[k] = v
    return tensors, plain


def _join_plain(template: Any, loaded: Any) -> Any:
    """``loaded`` (a JSON value) in the shape of ``template``: tuples come back as tuples, dicts are merged
    into the template's dicts (where DCP already put the tensors)."""
    if isinstance(template, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            template[k] = _join_plain(template.get(k), v)
        return template
    if isinstance(template, (list, tuple)) and isinstance(loaded, list) and len(template) == len(loaded):
        joined = [_join_plain(a, b) for a, b in zip(template, loaded)]
        return tuple(joined) if isinstance(template, tuple) else joined
    return loaded


def _folder_files(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file of a checkpoint folder but the marker (and temporary files)."""
    return {p.name: ckpt.file_digest(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != MARKER and ".tmp-" not in p.name}  # fmt: skip


def save(directory: Path, round_index: int, state: dict[str, Any], *, keep: int, coordinator: bool,
         marker: dict[str, Any], process_group=None, rank: int = 0, key: bytes | None = None) -> Path:  # fmt: skip
    """Write ``state`` (this rank's part) as the checkpoint of ``round_index``; collective over the group.
    The tensors go through DCP, the rest into ``rank-<rank>.json``; the coordinator's marker lists every file's
    size and SHA-256 (signed with ``key``, the run key, when there is one).

    Raises OSError (disk full, read-only) with every earlier checkpoint intact."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    name = f"round-{round_index:06d}"
    tmp, final = directory / f".tmp-{name}", directory / name
    if coordinator:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed while writing
        tmp.mkdir()
    if dist.is_initialized():
        dist.barrier(group=process_group)  # the folder exists before anyone writes into it
    tensors, plain = split_plain(state)
    ckpt.write_atomic(tmp / rank_file(rank), json.dumps({"format": FORMAT, "rank": rank, "state": plain}).encode())
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True), process_group=process_group)
    if coordinator:  # dcp.save returned: every rank's files are written (and its JSON before them)
        full = ckpt.sign_marker({"format": FORMAT, "round": round_index, **marker, "files": _folder_files(tmp)}, key)
        ckpt.write_atomic(tmp / MARKER, (json.dumps(full, indent=1, default=str) + "\n").encode())
        old = None
        if final.exists():  # the same round written again (a resumed run that repeats it): swap atomically
            old = directory / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        ckpt._fsync_dir(directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        prune(directory, keep)
    return final


def prune(directory: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints (the marker first, so each stops existing at
    once), and leftovers of interrupted writes."""
    found = list_complete(directory)
    for _, path, _ in found[: max(0, len(found) - keep)]:
        try:
            (path / MARKER).unlink()
        except OSError:
            pass
        shutil.rmtree(path, ignore_errors=True)


# DCP's metadata pickle may name only these: its own dataclasses, sizes, dtypes, layouts and paths.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
} | {(module, name) for module in ("pathlib", "pathlib._local")
     for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` building nothing but :data:`_METADATA_CLASSES` and dtypes: a pickle that
    names anything else (``os.system``, ``builtins.exec``, ...) is refused before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                      torch.dtype)):  # fmt: skip
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")


def _files_of(path: Path) -> dict[str, dict[str, Any]]:
    marker = json.loads((Path(path) / MARKER).read_text())
    return marker.get("files") or {}


def read_metadata(path: Path, files: dict[str, dict[str, Any]]):
    """DCP's metadata of the checkpoint at ``path``: read once, checked against its hash in the marker
    (``files``), then unpickled by :class:`_MetadataUnpickler`; every file it points to must be listed."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = Path(path) / METADATA
    try:
        blob = where.read_bytes()
    except OSError as exc:
        raise DistCheckpointError(f"checkpoint {path}: cannot read {METADATA}: {exc.strerror or exc}") from None
    if METADATA not in files or not ckpt.blob_matches(blob, files[METADATA]):
        raise DistCheckpointError(f"checkpoint {path}: {METADATA} does not match its SHA-256 in the marker")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # noqa: BLE001 - whatever a doctored pickle raises, it is refused, never run
        raise DistCheckpointError(f"checkpoint {path}: {METADATA} is refused: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise DistCheckpointError(f"checkpoint {path}: {METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        if getattr(info, "relative_path", None) not in files:
            raise DistCheckpointError(f"checkpoint {path}: {METADATA} points to a file its marker does not list")
    return metadata


def _reader(path: Path, files: dict[str, dict[str, Any]]):
    """DCP's file reader, with the metadata read by :func:`read_metadata`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:  # per-rank metadata files: this module never writes them
                raise DistCheckpointError(f"checkpoint {path}: per-rank metadata is not read")
            metadata = read_metadata(path, files)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader(str(path))


def _tensor_only_planner():
    """DCP's load planner, refusing the non-tensor items it would ``torch.load(weights_only=False)``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class TensorOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise DistCheckpointError(f"the checkpoint stores {read_item.dest_index.fqn} as a pickled object; "
                                      "this version stores only tensors there and refuses it")  # fmt: skip

    return TensorOnlyPlanner()


def load(path: Path, state: dict[str, Any], process_group=None, key: bytes | None = None) -> dict[str, Any]:
    """Fill ``state`` (this rank's template: tensors are loaded in place, the rest from this rank's JSON)
    from the checkpoint at ``path``. The marker's tag (with ``key``) and the hashes of the files read here
    are checked before each is parsed; :func:`.resume.check_resume` verified every file on every rank before."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
        ckpt.check_marker_tag(marker, key, str(path))
    except (OSError, ValueError, CheckpointError) as exc:
        raise DistCheckpointError(f"checkpoint {path}: {exc}") from None
    files = marker.get("files") or {}
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    name = rank_file(rank)
    try:
        blob = (path / name).read_bytes()
    except OSError as exc:
        raise DistCheckpointError(f"checkpoint {path}: cannot read {name}: {exc.strerror or exc}") from None
    if name not in files or not ckpt.blob_matches(blob, files[name]):
        raise DistCheckpointError(f"checkpoint {path}: {name} does not match its SHA-256 in the marker")
    try:
        plain = json.loads(blob)["state"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DistCheckpointError(f"checkpoint {path}: {name} is not this version's JSON state ({exc})") from None
    read_metadata(path, files)  # refused here, in one line, rather than inside DCP's collective
    tensors, _ = split_plain(state)
    try:
        dcp.load(tensors, storage_reader=_reader(path, files), planner=_tensor_only_planner(),
                 process_group=process_group)  # fmt: skip
    except DistCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - DCP wraps every rank's failure; one line names the checkpoint
        text = str(exc).strip().splitlines()
        raise DistCheckpointError(f"checkpoint {path}: DCP could not load it: {text[-1] if text else type(exc).__name__}") from None
    _join_plain(state, plain)
    return state


def _flat_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= _flat_keys(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def stored_keys(path: Path) -> set[str]:
    """The flat keys a checkpoint holds: DCP's tensors and every rank's JSON state (to build templates for
    state that exists only after a round). Each file is hash-checked before it is parsed."""
    path = Path(path)
    files = _files_of(path)
    keys = set(read_metadata(path, files).state_dict_metadata)
    for name in sorted(files):
        if re.fullmatch(r"rank-\d+\.json", name):
            blob = (path / name).read_bytes()
            if not ckpt.blob_matches(blob, files[name]):
                raise DistCheckpointError(f"checkpoint {path}: {name} does not match its SHA-256 in the marker")
            keys |= _flat_keys(json.loads(blob)["state"])
    return keys
