"""Sealing and verifying a checkpoint on every rank that wrote part of it.

Each rank fsyncs and hashes the files it wrote itself (`own_files`), in parallel with the others,
and reports them; rank 0 writes `manifest.json` from all the reports, each file with the rank that
wrote it. One failed or missing report and the checkpoint is not sealed: no manifest, and every
rank raises `NotSealed`. Verification is split the same way: every rank checks the files of the
manifest that its rank wrote, so a node that does not share the run directory's filesystem still
has its own shards checked, on its own disk.

The seal's collectives run on a gloo group of their own (`seal_group`) whose timeout is longer
than the training process group's by design: hashing a rank's shards or converting a checkpoint
takes as long as the disk needs, and one slow disk must not trip the timeout that guards the
training collectives against a hung peer. A dead peer still fails the seal within that timeout. A
group rather than `monitored_barrier`: the reports travel by all-gather, which has no monitored form.

ADVISOR_INJECT_FSYNC_FAILURE (`rank=R` and optionally `step=S`) makes that rank's fsync fail,
at every save or only at step S's, as a full or broken disk would.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specs import environment
from specs.errors import UsageError
from specs.run_dir import CHECKPOINT_STATE_FILE

MANIFEST = "manifest.json"
DELAY_ENV = "ADVISOR_CHECKPOINT_DELAY_S"
FSYNC_FAILURE_ENV = "ADVISOR_INJECT_FSYNC_FAILURE"
# The seal's timeout: SEAL_TIMEOUT_FACTOR times the training group's (an hour at `advisor train`'s
# default 600 s), never under the floor. Long enough for a rank to hash a shard of hundreds of GB at
# disk speed; it is also how long the others wait when a peer dies silently during a seal.
SEAL_TIMEOUT_FACTOR = 6
SEAL_TIMEOUT_FLOOR = datetime.timedelta(minutes=10)

# Files named after the rank that writes them: its RNG state, its DCP shards (`__R_N.distcp`, and
# `__R.metadata` when DCP does not coordinate), its DeepSpeed ZeRO partitions. Every other file
# (trainer.json, plain/DDP's engine.pt, DCP's `.metadata`, DeepSpeed's common files, the hand-off
# weights) is written by rank 0.
_WRITER_PATTERNS = (re.compile(r"(?:^|/)rng-(\d+)\.pt$"), re.compile(r"(?:^|/)__(\d+)(?:_\d+\.distcp|\.metadata)$"),
                    re.compile(r"zero_pp_rank_(\d+)_"))


class NotSealed(RuntimeError):
    """A checkpoint some rank could not seal (its files are not known to be on the disk)."""


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_made: list[Any] = []  # [the training group, its seal group]: the training group held, so never mistaken for a new one


def seal_group() -> Any:
    """The gloo group the seal's collectives run on (None without a process group of several
    ranks). Made by every rank at its first seal or verification, which all ranks reach together;
    made again for a new training group (a destroyed one's goes with it)."""
    _, world = _world()
    if world == 1:
        return None
    if not _made or _made[0] is not dist.group.WORLD:
        _made[:] = [dist.group.WORLD, dist.new_group(backend="gloo", timeout=seal_timeout())]
    return _made[1]


def seal_timeout() -> datetime.timedelta:
    """SEAL_TIMEOUT_FACTOR times the training group's timeout, at least SEAL_TIMEOUT_FLOOR (the group's
    is read from its backend's options, which torch exposes only privately; torch's default when it
    cannot be read)."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        group_timeout = backend.options._timeout
    except (AttributeError, RuntimeError):
        group_timeout = dist.default_pg_timeout
    return max(SEAL_TIMEOUT_FLOOR, SEAL_TIMEOUT_FACTOR * group_timeout)


def long_barrier() -> None:
    """A barrier under the seal's timeout: for ranks waiting on one rank's disk work."""
    group = seal_group()
    if group is not None:
        dist.barrier(group=group)


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, by rank, on every rank (under the seal's timeout)."""
    group = seal_group()
    if group is None:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value, group=group)
    return values


def from_rank_zero(value: Any) -> Any:
    """Rank 0's `value` on every rank (under the seal's timeout)."""
    group = seal_group()
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def pause() -> None:
    """The injectable delay between a save's files (tests kill the run inside it)."""
    delay = environment.read_seconds(DELAY_ENV)
    if delay > 0:
        time.sleep(delay)


def writer_of(name: str) -> int:
    """The rank that writes the checkpoint file `name` (relative to the checkpoint folder)."""
    for pattern in _WRITER_PATTERNS:
        found = pattern.search(name)
        if found:
            return int(found.group(1))
    return 0


def own_files(folder: Path, rank: int) -> list[Path]:
    """The files in `folder` that `rank` wrote (on a shared filesystem every rank sees them all)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and writer_of(str(p.relative_to(folder))) == rank)


def fsync(path: Path) -> None:
    """Flush a file, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _injected_fsync_failure(rank: int, step: int) -> bool:
    """Whether ADVISOR_INJECT_FSYNC_FAILURE makes this rank's fsync fail at this step's save."""
    spec = environment.read(FSYNC_FAILURE_ENV).strip()
    if not spec:
        return False
    fields = dict(part.strip().partition("=")[::2] for part in spec.split(","))
    if not set(fields) <= {"rank", "step"} or "rank" not in fields or not all(v.isdigit() for v in fields.values()):
        raise UsageError(f"{FSYNC_FAILURE_ENV}={spec!r}: expected rank=R and optionally step=S")
    return int(fields["rank"]) == rank and int(fields.get("step", step)) == step


def seal_own(folder: Path, step: int) -> dict[str, Any]:
    """This rank's report: each file it wrote into `folder` fsynced (DCP has synced its shards
    already, which makes that fsync free) and hashed, and their folders fsynced; or the error that
    stopped it."""
    rank, _ = _world()
    files: dict[str, dict[str, Any]] = {}
    try:
        mine = own_files(folder, rank)
        for path in mine:
            pause()
            if _injected_fsync_failure(rank, step):
                raise OSError(f"fsync of {path.name} failed (injected by {FSYNC_FAILURE_ENV})")
            fsync(path)
            files[str(path.relative_to(folder))] = {"size": path.stat().st_size, "sha256": sha256(path), "rank": rank}
        for parent in sorted({p.parent for p in mine}, reverse=True):
            fsync(parent)
    except OSError as exc:
        return {"rank": rank, "files": files, "error": str(exc)}
    return {"rank": rank, "files": files, "error": None}


def seal(folder: Path, step: int) -> None:
    """Collective: every rank seals what it wrote; rank 0 writes the manifest from all reports, last.
    A rank's error, or a rank that reports nothing (each writes at least its RNG state), leaves the
    checkpoint unsealed: NotSealed on every rank."""
    reports = gather(seal_own(folder, step))
    missing = [f"rank {r['rank']}: {r['error']}" for r in reports if r["error"]]
    missing += [f"rank {r['rank']}: no files" for r in reports if not r["error"] and not r["files"]]
    if missing:
        raise NotSealed(f"checkpoint of step {step} is not sealed ({'; '.join(missing)})")
    if _world()[0] == 0:
        files = {name: entry for report in reports for name, entry in sorted(report["files"].items())}
        manifest = folder / MANIFEST
        manifest.write_text(json.dumps({"step": step, "ranks": len(reports), "files": files}, indent=1))
        fsync(manifest)
        fsync(folder)


def _read_manifest(path: Path) -> dict[str, Any] | str:
    """The manifest of the checkpoint `path`, or why it has none that counts."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        ranks = int(manifest.get("ranks", 1))
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}"
    if CHECKPOINT_STATE_FILE not in files:
        return f"no {CHECKPOINT_STATE_FILE}"
    reporting = {entry.get("rank", 0) for entry in files.values()}
    if not reporting >= set(range(ranks)):  # a manifest written before every rank had reported
        return f"no files of rank {min(set(range(ranks)) - reporting)}"
    return manifest


def file_problem(path: Path, name: str, expected: dict[str, Any]) -> str | None:
    """Why the file `name` of the checkpoint `path` differs from its manifest entry, or None."""
    file = path / name
    if not file.is_file():
        return f"{name} is missing"
    if file.stat().st_size != expected["size"]:
        return f"{name} has {file.stat().st_size} bytes, the manifest says {expected['size']}"
    if sha256(file) != expected["sha256"]:
        return f"{name} does not match its sha256"
    return None


def verify(path: Path) -> str | None:
    """Collective: why the checkpoint `path` cannot be loaded, or None when every file verifies.
    Rank 0 reads the manifest; each rank checks the files its rank wrote (a file of a rank beyond
    this world: the rank it wraps to), in parallel."""
    rank, world = _world()
    manifest = from_rank_zero(_read_manifest(path) if rank == 0 else None)
    if isinstance(manifest, str):
        return manifest
    problem = None
    for name, expected in manifest["files"].items():
        if expected.get("rank", 0) % world == rank:
            problem = file_problem(path, name, expected)
            if problem:
                break
    return next((p for p in gather(problem) if p), None)
