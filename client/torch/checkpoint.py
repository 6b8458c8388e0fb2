"""torch.distributed.checkpoint (DCP) storage in the daemon's memory.

```python
writer = DaemonStorageWriter(job="my-training")
dcp.save(state, storage_writer=writer, checkpoint_id=step)   # or dcp.async_save
dcp.load(state, storage_reader=DaemonStorageReader(job="my-training"))   # the newest
```

Each rank copies its tensors once into one segment the daemon owns (one
`ckpt_put` per rank and save), so the checkpoint outlives the trainers.  DCP's
coordinator commits the step in `finish()`, once every rank's write results
are in; the reader opens the job's newest committed step, so a save that dies
midway is never read.  The DCP metadata is our own msgpack record
(checkpoint_metadata.py), never a pickle.  The storage's session is a
`Client` of its own (`checkpoint_client`: job `checkpoint:<job>#<rank>`, the
rank from the default process group), or the `client` given.

With `persist_dir=DIR`, the checkpoints of steps that are multiples of
`persist_every` are also written, in the background, to `DIR/<step>/` as
ordinary DCP checkpoints (checkpoint_persist.py).

What a save blocks: the copy into the daemon's segment, which is a spare the
daemon set aside after an earlier commit and named in the previous save's reply,
and which this process mapped (pages faulted in) in the background since
(client/checkpoints.py); a big copy is cut in two, the halves copied on two
cores, with stores that bypass the caches (client/_checkpoint_memory.c: the daemon,
not this process, holds the bytes now, and a copy that does not first read each
destination line moves a third less through memory).  `dcp.async_save` stages the state into process
memory first, as torch's FileSystemWriter does (`BlockingAsyncStager`); the
copy into the daemon then runs on DCP's background thread.
"""

from __future__ import annotations

import concurrent.futures
import io
import mmap
import os
import struct
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from gradsync.client.checkpoints import (  # the compiled copy, or None: torch's copy_
    DaemonCheckpoints,
    OpenedCheckpoint,
    _checkpoint_memory,
    checkpoint_client,
)
from gradsync.client.client import Client
from gradsync.client.torch.checkpoint_metadata import (
    StoredItem,
    decode,
    dtype_name,
    encode,
    parse_dtype,
)
from gradsync.client.torch.checkpoint_persist import Persister
from gradsync.protocol.endpoint import default_endpoint

__all__ = ["DaemonStorageReader", "DaemonStorageWriter"]

#: Each rank's items of one save, in one part.
DATA_ITEM = "data"
#: The coordinator's part that holds the DCP metadata.
METADATA_ITEM = "metadata"
_ALIGN = 64
#: The metadata part: the record's length, then the record (segments are page-sized).
_LENGTH = struct.Struct("<Q")
#: Below this many bytes a save's copy stays on one thread (a thread hop costs more).
_PARALLEL_COPY_BYTES = 4 * 1024**2
_copy_helper: concurrent.futures.ThreadPoolExecutor | None = None
_copy_helper_lock = threading.Lock()


def _step(checkpoint_id: str | os.PathLike[str] | int | None) -> int | None:
    if checkpoint_id is None:
        return None
    text = os.fspath(checkpoint_id) if not isinstance(checkpoint_id, int) else str(checkpoint_id)
    if not str(text).isdigit():
        raise ValueError(f"a daemon checkpoint's checkpoint_id is its step, a non-negative "
                         f"integer; got {checkpoint_id!r}")
    return int(text)


def _is_step(checkpoint_id: Any) -> bool:
    try:
        return _step(checkpoint_id) is not None
    except (TypeError, ValueError):
        return False


#: The checkpoint sessions of this process by (job, rank, daemon): a writer and a
#: reader of one job and rank share one (the daemon admits one session per rank of
#: `checkpoint:<job>#<rank>`: a second would be refused as "already connected").
_SESSIONS: dict[tuple[str, int, str], DaemonCheckpoints] = {}
_SESSIONS_LOCK = threading.Lock()


def _connect(job: str | None, client: Client | None) -> DaemonCheckpoints:
    if client is not None:
        return DaemonCheckpoints(client, job)
    if job is None:
        raise ValueError("name the checkpoints' job (job=...) or pass a gradsync client")
    rank, daemon = 0, None
    if dist.is_initialized():
        from gradsync.client.torch.backend import ProcessGroupGradsync

        group = dist.group.WORLD
        # A gradsync group's daemon (perhaps one it started for the job), else the
        # environment's.
        daemon = group.client.daemon if isinstance(group, ProcessGroupGradsync) else None
        rank = dist.get_rank()
    # Keyed by the daemon the session would reach now: the environment may name
    # another one later in the process (a new daemon, a test's private one).
    where = daemon or os.environ.get("GRADSYNC_DAEMON") or default_endpoint()
    with _SESSIONS_LOCK:
        store = _SESSIONS.get((job, rank, where))
        if store is None or store.client.closed:
            store = _SESSIONS[(job, rank, where)] = DaemonCheckpoints(
                checkpoint_client(job, rank, where))
        return store


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat uint8 tensor (on its device)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


#: One item to write: DCP's item, its raw data, offset in the part, dtype and shape.
_Payload = tuple[Any, "torch.Tensor | bytes", int, "str | None", "tuple[int, ...] | None"]


def _payloads(plan: SavePlan, planner: SavePlanner) -> tuple[list[_Payload], int]:
    """Each item's raw data and place in the rank's part; the part's size."""
    payloads: list[_Payload] = []
    offset = 0
    for item in plan.items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            raw: torch.Tensor | bytes = data.getvalue()
            dtype, shape = None, None
        else:
            assert isinstance(data, torch.Tensor)
            raw, dtype, shape = _as_bytes(data), dtype_name(data.dtype), tuple(data.shape)
        payloads.append((item, raw, offset, dtype, shape))
        offset += -(-len(raw) // _ALIGN) * _ALIGN
    return payloads, offset


def _copy_in(mapping: mmap.mmap, payloads: list[_Payload], rank: int) -> list[WriteResult]:
    """Copy the payloads into the mapped part; DCP's write results for them."""
    results = []
    target = torch.frombuffer(mapping, dtype=torch.uint8, count=len(mapping))
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for item, raw, at, dtype, shape in payloads:
        size = len(raw)
        if isinstance(raw, bytes):
            mapping[at:at + size] = raw
        elif size:
            copies.append((target[at:at + size], raw))
        results.append(WriteResult(index=item.index, size_in_bytes=size,
                                   storage_data=StoredItem(rank, DATA_ITEM, at, size, dtype,
                                                           shape)))
    _copy(copies)
    del target, copies
    return results


def _copy(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (destination, source) pair of flat uint8 tensors; host sources of more
    than `_PARALLEL_COPY_BYTES` in all are cut into two halves of equal bytes, one
    copied on a helper thread (torch's copy lets go of the GIL), one here."""
    total = sum(source.numel() for _, source in copies)
    helper = _helper() if total > _PARALLEL_COPY_BYTES and all(
        source.device.type == "cpu" for _, source in copies) else None
    if helper is None:
        _copy_all(copies)
        return
    first: list[tuple[torch.Tensor, torch.Tensor]] = []
    second: list[tuple[torch.Tensor, torch.Tensor]] = []
    half, seen = total // 2, 0
    for target, source in copies:
        count = source.numel()
        cut = max(0, min(count, half - seen))
        if cut:
            first.append((target[:cut], source[:cut]))
        if cut < count:
            second.append((target[cut:], source[cut:]))
        seen += count
    done = helper.submit(_copy_all, first)
    try:
        _copy_all(second)
    finally:
        done.result()


def _copy_all(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each pair; host sources with the compiled streaming copy where it was built
    (the targets are always host memory: the daemon's segment)."""
    for target, source in copies:
        if _checkpoint_memory is not None and source.device.type == "cpu":
            _checkpoint_memory.copy(target.numpy(), source.numpy())
        else:
            target.copy_(source)


def _helper() -> concurrent.futures.ThreadPoolExecutor | None:
    """The copy's helper thread, where this process may run on two cores or more."""
    global _copy_helper
    if len(os.sched_getaffinity(0)) < 2:
        return None
    with _copy_helper_lock:
        if _copy_helper is None:
            _copy_helper = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="gradsync-checkpoint-copy")
        return _copy_helper


class _DaemonStorage:
    """What the writer and the reader share: the job's checkpoints in the local
    daemon (connected on first use) and the step (`checkpoint_id`)."""

    def __init__(self, job: str | None, step: int | None, client: Client | None) -> None:
        self._job, self._client = job, client
        self._store: DaemonCheckpoints | None = None
        self.step = step

    @property
    def store(self) -> DaemonCheckpoints:
        if self._store is None:
            self._store = _connect(self._job, self._client)
        return self._store

    def _take_step(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        step = _step(checkpoint_id)
        if step is not None:
            self.step = step


class DaemonStorageWriter(_DaemonStorage, StorageWriter, BlockingAsyncStager):
    """Saves DCP checkpoints (`checkpoint_id` = step) into daemon memory.

    `dcp.async_save` stages the state in process memory first (torch's
    `BlockingAsyncStager`, as its FileSystemWriter does), then writes it here on
    DCP's background thread.

    `persist_dir`: also write the checkpoint of every step that is a multiple of
    `persist_every` to `persist_dir/<step>/` as a plain DCP checkpoint, in the
    background (`wait_persisted`); the coordinator waits at most
    `persist_timeout_s` for the other ranks' files.  Every rank must see the same
    directory (a shared file system across nodes)."""

    def __init__(self, job: str | None = None, step: int | None = None,
                 client: Client | None = None, *,
                 persist_dir: str | os.PathLike[str] | None = None, persist_every: int = 1,
                 persist_timeout_s: float = 600.0) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self)
        _DaemonStorage.__init__(self, job, step, client)
        self.is_coordinator = False
        self.dcp_rank = 0
        #: The background writer of persisted checkpoints (None: none are persisted).
        self.persister = None if persist_dir is None else Persister(
            persist_dir, persist_every, persist_timeout_s, job)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._take_step(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise ValueError("a daemon checkpoint needs its step: dcp.save(..., "
                             "checkpoint_id=step) or DaemonStorageWriter(step=...)")
        self.is_coordinator = is_coordinator
        self.dcp_rank = int(kwargs.get("rank") or 0)  # the rank in DCP's group
        _ = self.store  # connect now: errors surface before any data moves

    def _persists(self) -> Persister | None:
        """The persister, if this step is one to persist."""
        persister = self.persister
        return persister if persister and self.step is not None and persister.wants(
            self.step) else None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if (persister := self._persists()) is not None:
            assert self.step is not None
            persister.prepare(self.step, len(plans))  # before any rank writes its files
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Copy this rank's items into one daemon segment (tensors as their raw bytes);
        on a step to persist, hand that segment to the background writer."""
        store, rank = self.store, self.store.rank
        assert self.step is not None
        payloads, size = _payloads(plan, planner)
        results: list[WriteResult] = []
        mapping = store.put(self.step, DATA_ITEM, size) if payloads else None
        persister = self._persists()
        try:
            if mapping is not None:
                results = _copy_in(mapping, payloads, rank)
            if persister is not None:
                held = [(payload[0], result.storage_data)
                        for payload, result in zip(payloads, results, strict=True)]
                persister.write_rank(self.step, self.dcp_rank, held, mapping)
                mapping = None  # the persister closes it
        finally:
            if mapping is not None:
                store.close_later(mapping)
        if not self.is_coordinator:  # done here (the coordinator's commit starts it)
            store.premap_next()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, once every rank's results are in: store the metadata,
        then commit the step (the daemon marks it complete only now)."""
        assert self.step is not None
        store = self.store
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        record = _LENGTH.pack(len(encoded := encode(metadata))) + encoded
        mapping = store.put(self.step, METADATA_ITEM, len(record))
        try:
            mapping[:len(record)] = record
        finally:
            mapping.close()
        parts = {(where.rank, where.item) for where in metadata.storage_data.values()}
        parts.add((store.rank, METADATA_ITEM))
        store.commit(self.step, sorted(parts))
        if (persister := self._persists()) is not None:
            persister.write_metadata(self.step, metadata, len(results))

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Whether the persisting this writer started has ended (each step written,
        or warned about) within `timeout` seconds; True without `persist_dir`."""
        return self.persister is None or self.persister.wait(timeout)

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_step(checkpoint_id)


class DaemonStorageReader(_DaemonStorage, StorageReader):
    """Loads the job's newest complete checkpoint (or `checkpoint_id` = step) from
    daemon memory."""

    def __init__(self, job: str | None = None, step: int | None = None,
                 client: Client | None = None) -> None:
        StorageReader.__init__(self)
        _DaemonStorage.__init__(self, job, step, client)
        self.opened: OpenedCheckpoint | None = None
        self.storage_data: dict[MetadataIndex, StoredItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._take_step(checkpoint_id)
        self.opened = None

    def read_metadata(self) -> Metadata:
        """Open (map) the checkpoint and decode its metadata record."""
        self.opened = opened = self.store.open(self.step)
        record = next((mapping for (_, item), mapping in opened.parts.items()
                       if item == METADATA_ITEM), None)
        if record is None:
            raise ValueError(f"checkpoint step {opened.step} of job {self.store.job!r} "
                             "holds no DCP metadata (saved by something else than DCP)")
        (length,) = _LENGTH.unpack_from(record)
        return decode(bytes(record[_LENGTH.size:_LENGTH.size + length]))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy each requested item out of the mapped parts into the planner's tensors."""
        if self.opened is None:
            self.read_metadata()
        assert self.opened is not None
        parts = self.opened.parts
        for request in plan.items:
            where = self.storage_data[request.storage_index]
            mapping: mmap.mmap = parts[(where.rank, where.item)]
            if where.dtype is None:
                raw = bytes(mapping[where.offset:where.offset + where.nbytes])
                planner.load_bytes(request, io.BytesIO(raw))
                continue
            dtype, shape = parse_dtype(where.dtype), where.shape or ()
            if where.nbytes:
                tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=where.nbytes,
                                          offset=where.offset).view(dtype).reshape(shape)
            else:
                tensor = torch.empty(shape, dtype=dtype)
            for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths,
                                                      strict=True)):
                tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(request).detach()
            target.copy_(tensor)
            planner.commit_tensor(request, target)
            del tensor
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _is_step(checkpoint_id)
