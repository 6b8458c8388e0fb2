"""Daemon checkpoints persisted as ordinary DCP directories (`FileSystemReader` reads
them without gradsync).

DCP's on-disk format is torch's own (`torch.save` per tensor, a pickled
`.metadata`), so torch's `FileSystemWriter` writes it, in each rank's process,
never the daemon: each rank writes its own items of the step from the daemon
segment it just filled into `DIR/<step>/__<rank>_0.distcp` on a background
thread, then leaves a small msgpack file listing where each item went; DCP's
coordinator, once the step is committed, waits for every rank's list (up to a
deadline), and lets `FileSystemWriter.finish` write `.metadata` (a temporary
name, then a rename): a directory is complete only once `.metadata` exists.
A failure is a `CheckpointPersistWarning` naming the directory and the step,
never an error of the save.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import mmap
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, cast

import msgpack
import torch
from torch.distributed.checkpoint.filesystem import (
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from gradsync.client.torch.checkpoint_metadata import StoredItem, parse_dtype

__all__ = ["CheckpointPersistWarning", "Persister"]

# _StorageInfo and _StoragePrefix are torch's private classes, on purpose: `.metadata`
# must hold torch's own _StorageInfo (one of ours would make unpickling it need
# gradsync), and FileSystemWriter takes each rank's file-name prefix as a _StoragePrefix.

#: The record each rank leaves beside its data file: where its items went.
FORMAT = "gradsync-dcp-persist-1"
_METADATA = ".metadata"
_POLL_S = 0.05


class CheckpointPersistWarning(UserWarning):
    """A checkpoint could not be persisted to its directory (the one in daemon
    memory is unaffected)."""


def _rank_record(directory: Path, rank: int) -> Path:
    return directory / f".gradsync-rank{rank}.msgpack"


class _HeldItems:
    """The part of `SavePlanner` that `FileSystemWriter.write_data` uses: each item's
    data, read from the daemon segment this rank wrote (not from the live state)."""

    def __init__(self, mapping: mmap.mmap | None, where: dict[MetadataIndex, StoredItem]) -> None:
        self.mapping, self.where = mapping, where

    def resolve_data(self, item: WriteItem) -> torch.Tensor | io.BytesIO:
        stored = self.where[item.index]
        if self.mapping is None or not stored.nbytes:  # an empty item (no segment)
            if stored.dtype is None:
                return io.BytesIO()
            return torch.empty(stored.shape or (), dtype=parse_dtype(stored.dtype))
        if stored.dtype is None:
            return io.BytesIO(self.mapping[stored.offset:stored.offset + stored.nbytes])
        return torch.frombuffer(self.mapping, dtype=torch.uint8, count=stored.nbytes,
                                offset=stored.offset).view(parse_dtype(stored.dtype)).reshape(
                                    stored.shape or ())


def _encode_results(step: int, rank: int, results: list[WriteResult]) -> bytes:
    items = []
    for result in results:
        index, info = result.index, result.storage_data
        items.append([index.fqn, None if index.offset is None else list(index.offset),
                      index.index, info.relative_path, info.offset, info.length,
                      None if info.transform_descriptors is None
                      else list(info.transform_descriptors)])
    return msgpack.packb({"format": FORMAT, "step": step, "rank": rank, "items": items},
                         use_bin_type=True)


def _decode_results(data: bytes, step: int, rank: int) -> list[WriteResult]:
    """The results `_encode_results` wrote for (`step`, `rank`); ValueError otherwise."""
    body = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError("not a gradsync persisted-checkpoint record")
    if (body.get("step"), body.get("rank")) != (step, rank):
        raise ValueError(f"the record is of step {body.get('step')} rank {body.get('rank')}")
    if "error" in body:
        raise ValueError(f"rank {rank} failed: {body['error']}")
    results = []
    for fqn, offset, index, path, at, length, transforms in body["items"]:
        _check_item(rank, fqn, offset, index, path, at, length, transforms)
        results.append(WriteResult(
            index=MetadataIndex(fqn, None if offset is None else torch.Size(offset), index),
            size_in_bytes=length,
            storage_data=_StorageInfo(path, at, length, transforms)))
    return results


def _check_item(rank: int, fqn: Any, offset: Any, index: Any, path: Any, at: Any, length: Any,
                transforms: Any) -> None:
    """Refuse an item entry whose fields are not what `_encode_results` writes (or
    whose file is not the rank's own, in the directory itself)."""
    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(type(v) is int for v in value)

    if not (isinstance(fqn, str) and (offset is None or ints(offset))
            and (index is None or type(index) is int) and ints([at, length])
            and min(at, length) >= 0 and isinstance(path, str)
            and path.startswith(f"__{rank}_") and os.sep not in path
            and (transforms is None or (isinstance(transforms, list)
                                        and all(isinstance(t, str) for t in transforms)))):
        raise ValueError(f"rank {rank}'s record has a malformed item for {fqn!r}")


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


class Persister:
    """Writes the checkpoints of steps that are multiples of `every` into
    `directory/<step>/` as plain DCP checkpoints, on one background thread.

    Each rank writes at most one step's items at a time: a step to persist while
    the rank's previous one is still being written waits for it (memory stays
    bounded by one held checkpoint; the disk sets the pace only when it is slower
    than `every` steps).  The coordinator's wait for the other ranks runs on a
    thread of its own and never holds up a save.
    """

    def __init__(self, directory: str | os.PathLike[str], every: int, timeout_s: float,
                 job: str | None) -> None:
        if every < 1:
            raise ValueError(f"persist_every must be a positive number of steps, got {every}")
        self.directory, self.every, self.timeout_s, self.job = (
            Path(directory), every, timeout_s, job)
        self._data = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradsync-persist")
        self._metadata = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="gradsync-persist-metadata")
        self._writing: concurrent.futures.Future[None] | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._lock = threading.Lock()
        #: What went wrong, one line per failure (each also warned).
        self.errors: list[str] = []
        #: Steps whose `.metadata` this process wrote (the coordinator's).
        self.persisted: list[int] = []

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def step_directory(self, step: int) -> Path:
        return self.directory / str(step)

    def prepare(self, step: int, world: int) -> None:
        """On the coordinator, before any rank writes: make the step's directory and
        remove what an earlier save of the same step left (its `.metadata` first, so
        that the directory is never taken for complete while it is rewritten)."""
        directory = self.step_directory(step)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / _METADATA).unlink(missing_ok=True)
            for rank in range(world):
                _rank_record(directory, rank).unlink(missing_ok=True)
        except OSError as exc:
            self._warn(step, exc)

    def write_rank(self, step: int, rank: int, items: list[tuple[WriteItem, StoredItem]],
                   mapping: mmap.mmap | None) -> None:
        """Write this rank's `items` of `step` from `mapping` (closed when done)."""
        if self._writing is not None:
            concurrent.futures.wait([self._writing])
        self._writing = self._submit(self._data, self._write_rank, step, rank, items, mapping)

    def write_metadata(self, step: int, metadata: Metadata, world: int) -> None:
        """On the coordinator, after the commit: `.metadata` once all `world` ranks
        have written their items (a copy of `metadata` is kept)."""
        self._submit(self._metadata, self._write_metadata, step, dataclasses.replace(metadata),
                     world)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every persistence started here has ended (written or warned)
        within `timeout` seconds."""
        with self._lock:
            pending = list(self._pending)
        _, left = concurrent.futures.wait(pending, timeout)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
        return not left

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor, function: Any,
                *args: Any) -> concurrent.futures.Future[None]:
        with self._lock:
            self._pending.append(future := pool.submit(function, *args))
        return future

    def _write_rank(self, step: int, rank: int, items: list[tuple[WriteItem, StoredItem]],
                    mapping: mmap.mmap | None) -> None:
        directory = self.step_directory(step)
        held = _HeldItems(mapping, {item.index: stored for item, stored in items})
        try:
            directory.mkdir(parents=True, exist_ok=True)
            plan = SavePlan([item for item, _ in items], storage_data=_StoragePrefix(f"__{rank}_"))
            results = FileSystemWriter(directory).write_data(plan, cast(SavePlanner, held))
            _write_atomically(_rank_record(directory, rank),
                              _encode_results(step, rank, results.value()))
        except Exception as exc:  # any failure is a warning, never the save's
            self._warn(step, exc)
            with contextlib.suppress(Exception):  # the coordinator stops waiting for us
                _write_atomically(_rank_record(directory, rank), msgpack.packb(
                    {"format": FORMAT, "step": step, "rank": rank, "error": str(exc)}))
        finally:
            del held
            if mapping is not None:
                with contextlib.suppress(BufferError):  # a view survived: GC frees it
                    mapping.close()

    def _write_metadata(self, step: int, metadata: Metadata, world: int) -> None:
        directory = self.step_directory(step)
        try:
            deadline = time.monotonic() + self.timeout_s
            results = [self._rank_results(directory, step, rank, deadline)
                       for rank in range(world)]
            # FileSystemWriter.finish sets storage_data and storage_meta from `results`.
            metadata.storage_data, metadata.storage_meta = None, None
            FileSystemWriter(directory).finish(metadata, results)
            for rank in range(world):
                _rank_record(directory, rank).unlink(missing_ok=True)
            self.persisted.append(step)
        except Exception as exc:  # any failure is a warning, never the save's
            self._warn(step, exc)

    def _rank_results(self, directory: Path, step: int, rank: int,
                      deadline: float) -> list[WriteResult]:
        record = _rank_record(directory, rank)
        while not record.exists():
            if not directory.is_dir():
                raise FileNotFoundError(f"the directory {directory} does not exist")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}'s items were not written within "
                                   f"{self.timeout_s:g} s (persist_timeout_s)")
            time.sleep(_POLL_S)
        return _decode_results(record.read_bytes(), step, rank)

    def _warn(self, step: int, exc: BaseException) -> None:
        message = (f"could not persist checkpoint step {step} of job {self.job!r} to "
                   f"{self.step_directory(step)}: {type(exc).__name__}: {exc} (the checkpoint "
                   "in daemon memory is unaffected)")
        self.errors.append(message)
        warnings.warn(message, CheckpointPersistWarning, stacklevel=2)
