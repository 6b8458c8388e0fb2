"""torchft's reconfigurable process group on gradsync: one gradsync job per quorum.

`Manager(pg=ProcessGroupGradsync(timeout=...), ...)` runs torchft's Manager,
DistributedDataParallel, Optimizer and PGTransport over the daemons.  Every
`configure()` (one per quorum, each with a fresh prefixed store) builds a new
`backend.ProcessGroupGradsync`, so a new gradsync job: the old job's
collectives can never match the new one's.  `abort()` closes the group's
daemon connections: its own outstanding Work fails at once, and the daemon
sees the session end and fails the job for every other replica now, not at
their timeout.  `errored()` reports the first failed collective without
blocking.  Imports torchft (`pip install torchft`); nothing else here does.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any

import torch.distributed as dist
from torchft.process_group import ProcessGroupWrapper

from gradsync.client.environment import resolve_identity
from gradsync.client.ping import query
from gradsync.client.torch import backend
from gradsync.protocol.errors import DaemonUnavailableError

__all__ = ["ProcessGroupGradsync"]

_LOG = logging.getLogger("gradsync.torchft")


class ProcessGroupGradsync(ProcessGroupWrapper):  # type: ignore[misc]
    """A torchft process group whose collectives run in the gradsync daemons.

    `timeout` is the collective timeout of every quorum's group (and the store's
    connect timeout); the daemons notice lost ranks and peers on their own,
    independent of it.
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._error_lock = threading.Lock()
        self._error: Exception | None = None
        self._outstanding: list[dist.Work] = []

    def getBackendName(self) -> str:
        return "torchft-gradsync"

    def _create_pg(self, store: Any, rank: int, world_size: int) -> dist.ProcessGroup:
        """A fresh gradsync job for this quorum (named through the quorum's store)."""
        with self._error_lock:
            self._error, self._outstanding = None, []
        self._wait_for_daemon()
        pg = backend.ProcessGroupGradsync(
            store, rank, world_size, self._timeout,
            group_id=f"torchft-{self._replica_id}-q{self._quorum_id}",
        )
        _LOG.info("gradsync: quorum %s: rank %d of %d in job %s", self._quorum_id, rank,
                  world_size, pg.gradsync_job)
        return pg

    def _wait_for_daemon(self) -> None:
        """Wait (up to the timeout) for the local daemon to answer: after a daemon
        restart (systemd's Restart=) the next quorum waits for it, not fails."""
        endpoint = resolve_identity(None, None, 0, 1, 0, 1).daemon
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            try:
                query(endpoint, 2.0)
                return
            except DaemonUnavailableError as exc:
                if time.monotonic() > deadline:
                    raise dist.DistBackendError(
                        f"gradsync: no daemon answers at {endpoint} within "
                        f"{self._timeout.total_seconds()}s for quorum {self._quorum_id}: {exc}"
                    ) from exc
                time.sleep(0.1)

    def _wrap_work(self, work: dist.Work, opts: object) -> dist.Work:
        """Keep the Work so that `errored()` can see it fail."""
        with self._error_lock:
            self._outstanding.append(work)
        return work

    def errored(self) -> Exception | None:
        """The first collective error of the current quorum's group; never blocks.

        A poll of the outstanding Work, not a future callback: creating a future
        here would complete it on the completer thread, after torchft's Manager
        has chained its callbacks onto it.
        """
        with self._error_lock:
            still = []
            for work in self._outstanding:
                if not work.is_completed():
                    still.append(work)
                elif self._error is None and work.exception() is not None:
                    self._error = work.exception()
            self._outstanding = still
            return self._error

    def abort(self, errored: bool = True) -> None:
        """Fail every outstanding Work now and withdraw this rank from the job."""
        super().abort(errored=errored)

    def shutdown(self) -> None:
        """Leave the job and join the group's threads."""
        pg = self.quorum_group
        self._pg = None
        if pg is not None:
            pg.shutdown()

    @property
    def quorum_group(self) -> backend.ProcessGroupGradsync | None:
        """The current quorum's gradsync process group (None before the first
        configure): its `empty()` memory is zero-copy for this group's sends."""
        pg: Any = vars(self).get("_pg")  # the base class's attribute (untyped)
        return pg if isinstance(pg, backend.ProcessGroupGradsync) else None

    @property
    def gradsync_job(self) -> str | None:
        """The current quorum's gradsync job (None before the first configure)."""
        pg = self.quorum_group
        return pg.gradsync_job if pg is not None else None
