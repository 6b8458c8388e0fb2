"""The torch.distributed backend "gradsync": a Python `ProcessGroup` over the local daemon.

`import gradsync.client.torch` registers it, after which
`torch.distributed.init_process_group("gradsync")` works with any launcher and
init_method; torch's DDP, FSDP2, DeviceMesh and functional collectives then run
over gradsync unchanged.  One process group is one gradsync job: rank 0 of the
group writes a fresh job name to the group's c10d store, every rank writes
which daemon it talks to, and from that each rank knows its local rank within
the group.  The store carries nothing else; data goes through the daemons.

Tensors in daemon memory (`gradsync.client.torch.empty`) are reduced where they
lie; other CPU tensors are staged through a daemon scratch segment (one copy
in, one copy out); non-contiguous tensors and list arguments get one more copy.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from gradsync.client.client import Client
from gradsync.client.environment import resolve_identity
from gradsync.client.torch.at_exit import leave_at_exit
from gradsync.client.torch.buckets import as_tensor
from gradsync.client.torch.completer import FutureCompleter
from gradsync.client.torch.fast_path import FastPathAllreduce
from gradsync.client.torch.point_to_point import EagerSends, PairJobs, SendNotes
from gradsync.client.torch.private_daemon import choose_daemon
from gradsync.client.torch.rendezvous import all_joined, fresh_round, node_identities
from gradsync.client.torch.storage_sharing import SHARER, registry_for
from gradsync.client.torch.tensors import (
    NUMPY_DTYPES,
    Staged,
    as_buffer,
    chain,
    check_same,
    copy_back_all,
    flat_wire_tensor,
    packed,
    unpack,
    wire_op,
)
from gradsync.client.torch.work import (
    CompletedWork,
    Operation,
    Pending,
    TorchWork,
    torch_error,
)
from gradsync.client.work import Work as GradsyncWork
from gradsync.protocol.errors import GradsyncError, InvalidArgumentError

BACKEND = "gradsync"
#: The longest shutting a group down waits for its small sends to be received (the
#: group's timeout if shorter): a receiver that never comes must not hold it long.
EAGER_FLUSH_S = 30.0

_LOG = logging.getLogger("gradsync.torch")

__all__ = ["BACKEND", "ProcessGroupGradsync", "empty", "register"]


# -- the process group ---------------------------------------------------------------


class ProcessGroupGradsync(dist.ProcessGroup):
    """A torch process group whose collectives run in the gradsync daemons.

    Built by torch through the registered creator; users never construct it.
    """

    def __init__(
        self,
        store: Any,  # a c10d Store (the group's PrefixStore)
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        group_id: str = "",
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._group_name = group_id
        self._group_desc = ""
        timeout_s = timeout.total_seconds()
        self._timeout_s = timeout_s if timeout_s > 0 else None
        # Rank, size, store and timeout are torch's (what init_process_group or
        # new_group was given); the environment only says where the daemon is and
        # names the job.  Local ranks come from the store exchange below.
        identity = resolve_identity(None, None, rank, size, 0, 1)
        wait_s = timeout_s if timeout_s > 0 else 300.0
        # A fresh round names the job and scopes every key below: the store may
        # still hold a dead attempt's (torchrun --max-restarts).
        round_ = fresh_round(store, rank, size, wait_s)
        store = PrefixStore(f"gradsync/{round_}/", store)
        self._job = f"{identity.job}/torch-{round_[:12]}"
        # The daemon running on this node, or one started for the job when none is.
        self._daemon = choose_daemon(store, rank, size, self._job, identity.daemon, wait_s)
        self._registry = registry_for(self._daemon)
        nodes = node_identities(store, rank, size, self._daemon)
        local = [r for r in range(size) if nodes[r] == nodes[rank]]
        self._client = self._connect(self._job, rank, size, local.index(rank), len(local))
        all_joined(store, size)
        self._pairs = PairJobs(self._job, rank, size, nodes, self._connect)
        self._notes = SendNotes(store, rank, self._timeout_s)
        self._eager = EagerSends(f"gradsync-sends-{group_id or 'default'}")
        self._issuing = threading.local()
        name = group_id or "default"
        self._completer = FutureCompleter(f"gradsync-futures-{name}", f"gradsync-callbacks-{name}")
        self._fast_path = FastPathAllreduce(self._client, self._completer, lambda: self._group_name)
        self._closed = False
        leave_at_exit(self)

    def _connect(
        self, job: str, rank: int, size: int, local_rank: int, local_size: int
    ) -> Client:
        try:
            return Client(daemon=self._daemon, job=job, rank=rank, world_size=size,
                          local_rank=local_rank, local_world_size=local_size,
                          timeout_s=self._timeout_s, _segments=self._registry)
        except GradsyncError as exc:
            raise torch_error(exc, self._group_name) from exc

    # -- names and identity ----------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def gradsync_job(self) -> str:
        """The gradsync job this group is (as `gradsync stats` shows it)."""
        return self._job

    @property
    def client(self) -> Client:
        """The group's gradsync client (its `empty()` gives zero-copy buffers)."""
        return self._client

    def __repr__(self) -> str:
        return (f"<ProcessGroupGradsync {self._group_name!r} rank {self.rank()}/{self.size()} "
                f"job {self._job!r}>")

    # -- lifecycle -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Let small sends already handed back reach their receivers (up to the
        group's timeout), leave the job, disconnect, then stop the future threads
        (joined).

        Disconnecting fails whatever else is still in flight at once, so the join
        never waits for a collective's deadline.
        """
        self._close(flush_sends=True)

    def abort(self) -> None:
        """Like `shutdown`, but at once: small sends not yet received fail too."""
        self._close(flush_sends=False)

    def _close(self, flush_sends: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if flush_sends and not self._eager.flush(min(self._timeout_s or EAGER_FLUSH_S,
                                                     EAGER_FLUSH_S)):
            _LOG.warning("gradsync: process group %r shut down with sends not yet received",
                         self._group_name)
        self._notes.close()
        self._pairs.close()
        self._eager.close()
        self._fast_path.forget()
        self._client.close()
        self._completer.close()

    @property
    def closed(self) -> bool:
        """True once `shutdown()` (torch's destroy_process_group) has run."""
        return self._closed

    # -- plumbing --------------------------------------------------------------------

    def _work(
        self,
        what: str,
        issue: Callable[[], Sequence[Pending | None]],
        outputs: list[torch.Tensor],
        finish: Callable[[], None] | None = None,
    ) -> TorchWork:
        if self._closed:
            raise dist.DistBackendError(
                f"gradsync: process group {self._group_name!r} is shut down"
            )
        tokens, self._issuing.tokens = self._tokens(), []
        try:
            works = issue()
        except GradsyncError as exc:
            SHARER.release(tokens)
            raise torch_error(exc, self._group_name) from exc
        operation = Operation(lambda: self._group_name, what, works, outputs, finish,
                              functools.partial(SHARER.release, tokens))
        return TorchWork(operation, self._completer)

    def _stage(self, tensor: torch.Tensor, copy_in: bool = True) -> Staged:
        """`tensor` as a daemon buffer (shared in place if it keeps coming back).

        The sharer's tokens wait, per thread, for the `_work` that issues them.
        """
        token = SHARER.offer(tensor, self._client)
        if token is not None:
            self._tokens().append(token)
        return Staged(tensor, copy_in)

    def _tokens(self) -> list[Any]:
        tokens: list[Any] | None = getattr(self._issuing, "tokens", None)
        if tokens is None:
            tokens = self._issuing.tokens = []
        return tokens

    # -- collectives -----------------------------------------------------------------

    def allreduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        op = reduce_op_of(opts)
        if (tensors[0].is_sparse if len(tensors) == 1  # one tensor: the common case
                else any(t.layout == torch.sparse_coo for t in tensors)):
            return self._sparse_allreduce(tensors, op)
        if not self._closed:  # small: done before this returns, if the peers are there
            done = self._fast_path(tensors, op)
            if done is not None:
                return done
        staged = [self._stage(t) for t in tensors]
        ops = [wire_op(t, op) for t in tensors]

        def issue() -> list[GradsyncWork | None]:
            return [self._client.all_reduce(s.array, op=o, async_op=True)
                    for s, o in zip(staged, ops, strict=True)]

        return self._work("allreduce", issue, tensors, copy_back_all(staged))

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: Any) -> dist.Work:
        """SUM of sparse COO tensors, as gloo does it: every rank's indices and values
        gathered (padded to the largest count), added up, coalesced into each tensor.

        Done before this returns (three all_gathers); the Work is complete."""
        if getattr(op, "op", op) != dist.ReduceOp.SUM:
            raise InvalidArgumentError(f"a sparse allreduce supports SUM only, not {op}")
        for tensor in tensors:
            if tensor.layout != torch.sparse_coo:
                raise InvalidArgumentError("allreduce: sparse and dense tensors in one call")
            tensor.copy_(self._sparse_sum(tensor.coalesce()))
        return CompletedWork(tensors)

    def _sparse_sum(self, mine: torch.Tensor) -> torch.Tensor:
        size = self.size()
        indices, values = mine.indices(), mine.values()
        counts = torch.empty(size, dtype=torch.int64)
        self._all_gather_flat(counts, torch.tensor([indices.shape[1]])).wait()
        most = int(counts.max())
        padded_indices = torch.zeros(indices.shape[0], most, dtype=torch.int64)
        padded_indices[:, : indices.shape[1]] = indices
        padded_values = torch.zeros(most, *values.shape[1:], dtype=values.dtype)
        padded_values[: values.shape[0]] = values
        all_indices = torch.empty(size * padded_indices.numel(), dtype=torch.int64)
        all_values = torch.empty(size * padded_values.numel(), dtype=values.dtype)
        self._all_gather_flat(all_indices, padded_indices.reshape(-1)).wait()
        self._all_gather_flat(all_values, padded_values.reshape(-1)).wait()
        per_rank_indices = all_indices.view(size, indices.shape[0], most)
        per_rank_values = all_values.view(size, most, *values.shape[1:])
        summed = torch.sparse_coo_tensor(
            torch.cat([per_rank_indices[r, :, : int(counts[r])] for r in range(size)], 1),
            torch.cat([per_rank_values[r, : int(counts[r])] for r in range(size)]),
            mine.shape,
        )
        return summed.coalesce()

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def broadcast(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        root = opts.rootRank if opts is not None else 0
        staged = [self._stage(t) for t in tensors]

        def issue() -> list[GradsyncWork | None]:
            return [self._client.broadcast(s.array, src=root, async_op=True) for s in staged]

        return self._work("broadcast", issue, tensors, copy_back_all(staged))

    def reduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        root = opts.rootRank if opts is not None else 0
        op = reduce_op_of(opts)
        staged = [self._stage(t) for t in tensors]
        ops = [wire_op(t, op) for t in tensors]

        def issue() -> list[GradsyncWork | None]:
            return [self._client.reduce(s.array, dst=root, op=o, async_op=True)
                    for s, o in zip(staged, ops, strict=True)]

        return self._work("reduce", issue, tensors, copy_back_all(staged))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> TorchWork:
        """`output` holds every rank's `input`, in rank order (all_gather_into_tensor)."""
        return self._all_gather_flat(output, input)

    def _all_gather_flat(
        self, output: torch.Tensor, input: torch.Tensor,
        then: Callable[[], None] | None = None,
    ) -> TorchWork:
        if output.numel() != input.numel() * self.size() or output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"all_gather_into_tensor: output must be {input.dtype} with "
                f"{self.size()} x {input.numel()} elements, got {output.dtype} with "
                f"{output.numel()}"
            )
        out, inp = self._stage(output, copy_in=False), self._stage(input)

        def issue() -> list[GradsyncWork | None]:
            return [self._client.all_gather(out.array, inp.array, async_op=True)]

        finish = out.copy_back if then is None else chain(out.copy_back, then)
        return self._work("all_gather_into_tensor", issue, [output], finish)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        return self._coalesced([self.all_gather_single(o, i, opts)
                                for o, i in zip(outputs, inputs, strict=True)], outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    def allgather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> TorchWork:
        for outputs in output_lists:
            if len(outputs) != self.size():
                raise InvalidArgumentError(
                    f"all_gather: the output list has {len(outputs)} tensors for a group "
                    f"of {self.size()}"
                )
        works = [self._gather_into(outputs, input, "all_gather")
                 for outputs, input in zip(output_lists, inputs, strict=True)]
        return self._coalesced(works, [t for outputs in output_lists for t in outputs])

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> TorchWork:
        """Rank r's `inputs[j]` lands in `output_lists[r][j]` on every rank: one
        list per rank, each shaped like `inputs` (torch's all_gather_coalesced)."""
        size = self.size()
        if len(output_lists) != size or any(len(o) != len(inputs) for o in output_lists):
            raise InvalidArgumentError(
                f"all_gather_coalesced: need {size} output lists (one per rank) of "
                f"{len(inputs)} tensors each (shaped like the inputs), got lists of "
                f"{[len(o) for o in output_lists]}"
            )
        works = [self._gather_into([output_lists[r][j] for r in range(size)], input,
                                   "all_gather_coalesced")
                 for j, input in enumerate(inputs)]
        return self._coalesced(works, [t for outputs in output_lists for t in outputs])

    def _gather_into(
        self, outputs: list[torch.Tensor], input: torch.Tensor, what: str
    ) -> TorchWork:
        """Every rank's `input` into `outputs` (one tensor per rank, any shapes)."""
        check_same(what, outputs, input)
        gathered = torch.empty(self.size() * input.numel(), dtype=input.dtype,
                               device=input.device)
        return self._all_gather_flat(gathered, input, functools.partial(unpack, gathered, outputs))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> TorchWork:
        """Rank r's `output` gets chunk r of `input` reduced over ranks (reduce_scatter_tensor)."""
        op = reduce_op_of(opts)
        if input.numel() != output.numel() * self.size() or output.dtype != input.dtype:
            raise InvalidArgumentError(
                f"reduce_scatter_tensor: input must be {output.dtype} with "
                f"{self.size()} x {output.numel()} elements, got {input.dtype} with "
                f"{input.numel()}"
            )
        reduce_op = wire_op(input, op)
        out, inp = self._stage(output, copy_in=False), self._stage(input)

        def issue() -> list[GradsyncWork | None]:
            return [self._client.reduce_scatter(out.array, inp.array, op=reduce_op,
                                                async_op=True)]

        return self._work("reduce_scatter_tensor", issue, [output], out.copy_back)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        return self._coalesced([self.reduce_scatter_single(o, i, opts)
                                for o, i in zip(outputs, inputs, strict=True)], outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> TorchWork:
        works = []
        for output, inputs in zip(outputs, input_lists, strict=True):
            if len(inputs) != self.size():
                raise InvalidArgumentError(
                    f"reduce_scatter: the input list has {len(inputs)} tensors for a group "
                    f"of {self.size()}"
                )
            check_same("reduce_scatter", inputs, output)
            works.append(self.reduce_scatter_single(output, packed(inputs, output), opts))
        return self._coalesced(works, outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> TorchWork:
        """torch's all_to_all_single; uneven splits are padded to the largest split."""
        size = self.size()
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % size or output.numel() != input.numel():
                raise InvalidArgumentError(
                    f"all_to_all_single: input and output need the same number of elements, "
                    f"divisible by {size}; got {input.numel()} and {output.numel()}"
                )
            out, inp = self._stage(output, copy_in=False), self._stage(input)

            def issue() -> list[GradsyncWork | None]:
                return [self._client.all_to_all(out.array, inp.array, async_op=True)]

            return self._work("all_to_all_single", issue, [output], out.copy_back)
        rows_in = list(input_split_sizes) or [input.shape[0] // size] * size
        rows_out = list(output_split_sizes) or [output.shape[0] // size] * size
        row = math.prod(input.shape[1:])
        in_chunks = list(input.reshape(-1).split([r * row for r in rows_in]))  # type: ignore[no-untyped-call]
        out_flat = torch.empty(output.numel(), dtype=output.dtype, device=output.device)
        out_chunks = list(out_flat.split([r * row for r in rows_out]))  # type: ignore[no-untyped-call]

        def finish() -> None:
            output.copy_(out_flat.view(output.shape))

        return self._uneven_all_to_all(out_chunks, in_chunks, [output], finish)

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        if len(outputs) != self.size() or len(inputs) != self.size():
            raise InvalidArgumentError(
                f"all_to_all: need {self.size()} input and output tensors, got "
                f"{len(inputs)} and {len(outputs)}"
            )
        return self._uneven_all_to_all(
            [t.reshape(-1) if t.is_contiguous() else t for t in outputs],
            [t.reshape(-1) for t in inputs], outputs,
        )

    def _uneven_all_to_all(
        self,
        out_chunks: list[torch.Tensor],
        in_chunks: list[torch.Tensor],
        outputs: list[torch.Tensor],
        finish: Callable[[], None] | None = None,
    ) -> TorchWork:
        """All-to-all of chunks of any sizes: every chunk padded to the group's largest.

        The largest chunk is agreed on first (one small allreduce, waited for here).
        """
        like = in_chunks[0] if in_chunks else out_chunks[0]
        largest = np.array([max([c.numel() for c in [*in_chunks, *out_chunks]] or [0])],
                           dtype=np.int64)
        try:
            self._client.all_reduce(largest, op="max")
        except GradsyncError as exc:
            raise torch_error(exc, self._group_name) from exc
        pad = int(largest[0])
        size = self.size()
        send = torch.zeros(size * pad, dtype=like.dtype, device=like.device)
        for j, chunk in enumerate(in_chunks):
            send[j * pad : j * pad + chunk.numel()].copy_(chunk.reshape(-1))
        received = torch.empty(size * pad, dtype=like.dtype, device=like.device)
        out, inp = self._stage(received, copy_in=False), self._stage(send)

        def unpad() -> None:
            for j, chunk in enumerate(out_chunks):
                chunk.copy_(received[j * pad : j * pad + chunk.numel()].view(chunk.shape))
            if finish is not None:
                finish()

        def issue() -> list[GradsyncWork | None]:
            if pad == 0:
                return []
            return [self._client.all_to_all(out.array, inp.array, async_op=True)]

        return self._work("all_to_all", issue, outputs, unpad)

    def gather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> TorchWork:
        root = opts.rootRank if opts is not None else 0
        (input,) = inputs
        outputs = output_lists[0] if output_lists else []
        if self.rank() == root:
            if len(outputs) != self.size():
                raise InvalidArgumentError(
                    f"gather: rank {root} needs {self.size()} output tensors, got {len(outputs)}"
                )
            check_same("gather", outputs, input)
        inp = self._stage(input)
        gathered = (torch.empty(self.size() * input.numel(), dtype=input.dtype,
                                device=input.device) if self.rank() == root else None)

        def issue() -> list[GradsyncWork | None]:
            out = None if gathered is None else as_buffer(flat_wire_tensor(gathered))
            return [self._client.gather(out, inp.array, dst=root, async_op=True)]

        def finish() -> None:
            if gathered is not None:
                unpack(gathered, outputs)

        return self._work("gather", issue, list(outputs), finish)

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> TorchWork:
        root = opts.rootRank if opts is not None else 0
        (output,) = outputs
        inputs = input_lists[0] if input_lists else []
        stacked = None
        if self.rank() == root:
            if len(inputs) != self.size():
                raise InvalidArgumentError(
                    f"scatter: rank {root} needs {self.size()} input tensors, got {len(inputs)}"
                )
            check_same("scatter", inputs, output)
            stacked = packed(inputs, output)
        out = self._stage(output, copy_in=False)

        def issue() -> list[GradsyncWork | None]:
            inp = None if stacked is None else as_buffer(flat_wire_tensor(stacked))
            return [self._client.scatter(out.array, inp, src=root, async_op=True)]

        return self._work("scatter", issue, [output], out.copy_back)

    def barrier(self, opts: Any = None) -> TorchWork:
        return self._work("barrier", lambda: [self._client.barrier(async_op=True)], [])

    def monitored_barrier(
        self, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False
    ) -> None:
        """`gradsync.client.torch.monitored_barrier` on this group (torch's
        `ProcessGroup.monitored_barrier` would look for a per-device backend)."""
        from gradsync.client.torch.monitored_barrier import monitored_barrier

        monitored_barrier(self, timeout, wait_all_ranks)

    # -- point to point --------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """To group rank `dst`: sends and receives between two ranks match in order, per tag.

        A small send is over for the caller at once (`_eager_send`); a larger one
        when the receiver has it.  Each send also leaves a note for a receive
        from any source (`SendNotes`).
        """
        pair = self._pairs.get(self.rank(), dst, tag)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if not self._closed and self._eager.admit(nbytes):
            return self._eager_send(pair, tensors, dst, tag, nbytes)
        staged = [self._stage(t) for t in tensors]

        def issue() -> list[GradsyncWork | None]:
            works: list[GradsyncWork | None] = [pair.broadcast(s.array, src=0, async_op=True)
                                                for s in staged]
            self._notes.sent(dst, tag)
            return works

        return self._work(f"send to rank {dst} (tag {tag})", issue, tensors)

    def _eager_send(
        self, pair: Client, tensors: list[torch.Tensor], dst: int, tag: int, nbytes: int
    ) -> dist.Work:
        """A small send, over for the caller once a private copy of it is in daemon
        scratch (the tensors may change at once); `EagerSends` finishes it."""
        what = f"send to rank {dst} (tag {tag})"
        copies = [Staged(t.detach().clone(memory_format=torch.contiguous_format))
                  for t in tensors]
        try:
            works = [pair.broadcast(c.array, src=0, async_op=True) for c in copies]
        except GradsyncError as exc:
            self._eager.release(nbytes)
            raise torch_error(exc, self._group_name) from exc
        self._notes.sent(dst, tag)
        self._eager.finish([w for w in works if w is not None], nbytes, what)
        return CompletedWork(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> TorchWork:
        staged = [self._stage(t, copy_in=False) for t in tensors]
        pair = self._pairs.get(src, self.rank(), tag)

        def issue() -> list[GradsyncWork | None]:
            works: list[GradsyncWork | None] = [pair.broadcast(s.array, src=0, async_op=True)
                                                for s in staged]
            self._notes.took(src, tag)
            return works

        work = self._work(f"recv from rank {src} (tag {tag})", issue, tensors,
                          copy_back_all(staged))
        work.source = lambda: src
        return work

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TorchWork:
        """From whichever rank sent to this one first (per tag, as gloo matches):
        the Work's `_source_rank()` names it once the receive is over."""
        if len(tensors) != 1:
            raise InvalidArgumentError(
                f"recv from any source takes one tensor, got {len(tensors)}"
            )
        staged = self._stage(tensors[0], copy_in=False)

        def post(src: int) -> GradsyncWork:
            work = self._pairs.get(src, self.rank(), tag).broadcast(staged.array, src=0,
                                                                    async_op=True)
            assert work is not None  # async_op=True always gives one
            return work

        receive = self._notes.receive(tag, post)
        work = self._work(f"recv from any rank (tag {tag})", lambda: [receive], tensors,
                          copy_back_all([staged]))
        work.source = lambda: receive.source
        return work

    # -- helpers ---------------------------------------------------------------------

    def _coalesced(self, works: list[TorchWork], outputs: list[torch.Tensor]) -> TorchWork:
        """One torch Work over several: done when all are, failed if any failed."""
        operations = [w._operation for w in works]

        def finish() -> None:
            for operation in operations:
                operation.complete()

        merged = Operation(lambda: self._group_name, "coalesced", [], outputs, finish)
        merged.works = [w for operation in operations for w in operation.works]
        return TorchWork(merged, self._completer)


# -- torch entry points --------------------------------------------------------------


def reduce_op_of(opts: Any) -> Any:
    """The reduce op of torch's options object, or the bare `ReduceOp` torch's and
    torchft's allreduce also accept; SUM when none is given."""
    if opts is None:
        return dist.ReduceOp.SUM
    return getattr(opts, "reduceOp", opts)


def _create(backend_opts: Any, backend_options: Any = None) -> ProcessGroupGradsync:
    """torch's creator (extended API): one gradsync job per process group."""
    return ProcessGroupGradsync(
        backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
        backend_opts.timeout, str(backend_opts.group_id or ""),
    )


def register() -> None:
    """Make "gradsync" a torch.distributed backend (idempotent)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def empty(
    *size: int, dtype: torch.dtype = torch.float32, group: Any = None
) -> torch.Tensor:
    """An uninitialised CPU tensor in daemon memory: collectives on it copy nothing.

    `group` is a gradsync process group (default: the default group); the
    memory stays valid while the tensor lives, and is zero-copy for every
    gradsync group of this process.
    """
    dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupGradsync):
        raise InvalidArgumentError(
            "gradsync.client.torch.empty needs a process group of backend 'gradsync' "
            f"(init_process_group('gradsync')); got {type(pg).__name__}"
        )
    np_dtype = np.dtype(np.uint8) if dtype == torch.bool else NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise InvalidArgumentError(f"gradsync.client.torch.empty: unsupported dtype {dtype}")
    tensor = as_tensor(pg.client.empty(tuple(int(d) for d in dims), np_dtype))
    return tensor.view(torch.bool) if dtype == torch.bool else tensor
