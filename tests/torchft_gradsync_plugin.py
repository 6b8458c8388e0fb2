"""A pytest plugin that runs torchft's own test modules, unmodified, on gradsync.

tests/test_conformance_torchft.py loads it into a pytest subprocess
(`-p tests.torchft_gradsync_plugin`).  Before collection, as the environment says:

- `GRADSYNC_TORCHFT_GROUP=gradsync`: torchft's `ProcessGroupGloo` becomes gradsync's
  `ProcessGroupGradsync` where the test modules take the name from (`torchft.process_group`
  and `torchft`), so every group they build runs in the daemon at `GRADSYNC_DAEMON`.
  `gloo` changes nothing.
- `GRADSYNC_TORCHFT_TRANSPORT=gradsync`: the checkpoint transport becomes
  `GradsyncTransport`: a `Manager` built without one gets it (over the Manager's own
  process group) instead of torchft's default HTTPTransport, and `PGTransport` is
  replaced by it.  `torchft` changes nothing.
- Always (gloo too): a `Manager` asked for a fixed server port (torchft's DiLoCo test
  trainer asks for 19530 + replica id) binds a port the kernel chooses instead, as
  torchft's manager tests do: a fixed port still held by an earlier test's server,
  or by another suite on the machine, failed a test with "Address already in use".
- `GRADSYNC_TORCHFT_SELECT`: a JSON list of node-id prefixes; other collected tests are
  deselected (torchft's parametrized names are generated, so prefixes, not ids).
- `GRADSYNC_TORCHFT_REPORT=PATH`: at the end, a JSON object there gives every test's
  outcome (passed, failed, error, skipped) with the crash message, what was
  substituted, which torchft test module still holds an original class (it should be
  none), and how many GradsyncTransports were built and healed a replica.

Nothing in site-packages is edited: only module attributes, in this process.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

GROUP_VARIABLE = "GRADSYNC_TORCHFT_GROUP"
SELECT_VARIABLE = "GRADSYNC_TORCHFT_SELECT"
TRANSPORT_VARIABLE = "GRADSYNC_TORCHFT_TRANSPORT"
REPORT_VARIABLE = "GRADSYNC_TORCHFT_REPORT"

T = TypeVar("T")

#: GradsyncTransports built in this process: the report counts those that healed.
_TRANSPORTS: list[Any] = []
_ORIGINALS: dict[str, type] = {}
#: node id -> {"outcome": ..., "message": ..., "seconds": ...}, filled as tests run.
_OUTCOMES: dict[str, dict[str, Any]] = {}


def _substitute_group() -> None:
    """Where the test modules import ProcessGroupGloo from, put ProcessGroupGradsync."""
    import torchft
    import torchft.process_group

    from gradsync.client.torch.torchft_group import ProcessGroupGradsync

    _ORIGINALS["ProcessGroupGloo"] = torchft.process_group.ProcessGroupGloo
    torchft.process_group.ProcessGroupGloo = ProcessGroupGradsync
    torchft.ProcessGroupGloo = ProcessGroupGradsync


def _substitute_transport() -> None:
    """A Manager built without a checkpoint transport gets GradsyncTransport over its own
    process group; PGTransport (pg, timeout, device, state_dict) becomes GradsyncTransport."""
    import torchft.checkpointing.pg_transport

    from gradsync.client.torch.torchft_transport import GradsyncTransport

    class PGTransportStandIn(GradsyncTransport[T]):
        """GradsyncTransport under PGTransport's constructor (the device is the CPU's
        here; the state_dict callable for in-place receives is not needed)."""

        def __init__(self, pg: Any, timeout: datetime.timedelta,
                     device: torch.device | None = None, state_dict: Any = None) -> None:
            super().__init__(pg, timeout)
            _TRANSPORTS.append(self)

    def default_transport(bound: inspect.BoundArguments,
                          signature: inspect.Signature) -> None:
        if bound.arguments.get("checkpoint_transport") is None:
            timeout = bound.arguments.get("timeout", signature.parameters["timeout"].default)
            transport = GradsyncTransport[Any](bound.arguments["pg"], timeout)
            _TRANSPORTS.append(transport)
            bound.arguments["checkpoint_transport"] = transport

    _ORIGINALS["PGTransport"] = torchft.checkpointing.pg_transport.PGTransport
    _change_manager_arguments(default_transport)
    torchft.checkpointing.pg_transport.PGTransport = PGTransportStandIn


def _change_manager_arguments(
    change: Callable[[inspect.BoundArguments, inspect.Signature], None],
) -> None:
    """Every torchft Manager built from now on gets its arguments through `change`."""
    import torchft.manager

    manager_class = torchft.manager.Manager
    original_init = manager_class.__init__
    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        change(bound, signature)
        original_init(*bound.args, **bound.kwargs)

    manager_class.__init__ = init


def _kernel_chosen_manager_ports() -> None:
    """A Manager's server binds port 0 where the test asked for a fixed one (it tells the
    Lighthouse the port it got, so nothing else needs the number)."""
    def any_port(bound: inspect.BoundArguments, signature: inspect.Signature) -> None:
        if bound.arguments.get("port"):
            bound.arguments["port"] = 0

    _change_manager_arguments(any_port)


def pytest_configure(config: pytest.Config) -> None:
    """Substitute before collection imports the test modules (they bind the names then)."""
    _kernel_chosen_manager_ports()
    group = os.environ.get(GROUP_VARIABLE, "gloo")
    transport = os.environ.get(TRANSPORT_VARIABLE, "torchft")
    if group not in ("gloo", "gradsync") or transport not in ("torchft", "gradsync"):
        raise pytest.UsageError(f"{GROUP_VARIABLE}={group!r} (gloo or gradsync), "
                                f"{TRANSPORT_VARIABLE}={transport!r} (torchft or gradsync)")
    if group == "gradsync":
        _substitute_group()
    if transport == "gradsync":
        _substitute_transport()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests whose node id starts with one of the selected prefixes."""
    raw = os.environ.get(SELECT_VARIABLE)
    if not raw:
        return
    prefixes = tuple(json.loads(raw))
    kept = [item for item in items if item.nodeid.startswith(prefixes)]
    dropped = [item for item in items if not item.nodeid.startswith(prefixes)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One outcome per test: a failed setup or teardown is an error, a skip in the
    test body a skip."""
    entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "message": "",
                                                 "seconds": 0.0})
    entry["seconds"] += report.duration
    if report.when == "call" and entry["outcome"] == "passed":
        entry["outcome"] = report.outcome
    elif report.failed:
        entry["outcome"] = "error"
    elif report.skipped and report.when == "setup":
        entry["outcome"] = "skipped"
    if (report.failed or report.skipped) and not entry["message"]:
        entry["message"] = _crash_message(report)


def _crash_message(report: pytest.TestReport) -> str:
    """The exception line (or skip reason), where the crash was, in one short string."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return f"{crash.message.strip()[:400]} ({crash.path}:{crash.lineno})"
    return report.longreprtext.strip().splitlines()[-1][:400] if report.longreprtext else ""


def _still_original() -> list[str]:
    """Loaded torchft test modules (and their helpers in torchft._test) whose names still
    hold an original class: the tests there would build it."""
    found = []
    for name, module in list(sys.modules.items()):
        if not (name.startswith("torchft.") and (name.endswith("_test")
                                                 or name.startswith("torchft._test."))):
            continue
        for attribute, original in _ORIGINALS.items():
            if getattr(module, attribute, None) is original:
                found.append(f"{name}.{attribute}")
    return sorted(found)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the report the driver reads (where it asked for one)."""
    path = os.environ.get(REPORT_VARIABLE)
    if not path:
        return
    report = {
        "outcomes": _OUTCOMES,
        "exit_status": int(exitstatus),
        "group": os.environ.get(GROUP_VARIABLE, "gloo"),
        "transport": os.environ.get(TRANSPORT_VARIABLE, "torchft"),
        "substituted": sorted(_ORIGINALS),
        "still_original": _still_original(),
        "gradsync_transports": len(_TRANSPORTS),
        "gradsync_heals": sum(t.last_heal is not None for t in _TRANSPORTS),
    }
    with open(path, "w", encoding="utf-8") as out:
        json.dump(report, out)
