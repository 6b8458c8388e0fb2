"""One rank of torch's own distributed test suite, kept alive across tests (for
tests/test_conformance_torch.py).

Usage:
  torch_dist_suite_worker.py collect
      Prints one JSON object: every test of `DistributedTest._DistTestBase` with
      the gates that skip it on $BACKEND and on gloo (their reasons; none: it runs),
      decided without running it: the suite's unittest skips, and its gate
      decorators (skip_if_lt_x_gpu, skip_if_small_worldsize, ...) evaluated by
      running their own code with the test body left out.
  torch_dist_suite_worker.py serve RANK
      Imports torch and the suite once, answers {"ready": RANK}, then for each
      request line {"test", "temp_dir", "init_file", "body_backend"?} runs that test as upstream's
      spawned rank does (TestDistBackend._run: init_process_group on a fresh file
      store, barrier, the test, barrier, destroy) and answers one line
      {"test", "rank", "outcome", "detail", "clean", "seconds"}; outcome is
      passed, failed or skipped, and clean says no state was left behind.

Answers go to the stdout the parent gave; whatever the tests print goes to
stderr.  Environment: BACKEND (gradsync or gloo), WORLD_SIZE, INIT_METHOD
(file://..., which the suite's gates read at import), GRADSYNC_DAEMON for gradsync.
No pickle: requests and answers are JSON lines.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib.util
import json
import os
import signal
import sys
import time
import traceback
import types
import unittest
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.testing._internal import common_utils
from torch.testing._internal.common_distributed import TEST_SKIPS, DistTestCases

BACKEND = os.environ["BACKEND"]
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
#: The suite's feature sets gradsync belongs to (test/distributed/test_distributed_spawn.py
#: is how upstream runs the suite; a backend joins these sets to be tested as gloo is).
FEATURES = ("ddp", "subgroup")
#: Decorators of torch.testing._internal.common_distributed that skip (sys.exit with a
#: TEST_SKIPS code) at the test's start, before anything else happens.
GATE_DECORATORS = ("skip_if_", "require_n_gpus_for_nccl_backend", "nccl_skip_if_lt_x_gpu")


def prepare() -> None:
    """What upstream's spawned ranks have: gradsync registered, its feature sets."""
    torch.backends.cuda.matmul.allow_tf32 = False
    if BACKEND != "gloo":
        if BACKEND == "gradsync":
            import gradsync.client.torch  # noqa: F401  (registers the backend)
        for feature in FEATURES:
            DistTestCases.backend_feature[feature].add(BACKEND)


def load_suite(name: str = SUITE_MODULE) -> types.ModuleType:
    """The suite's module; another name imports a second copy (for another backend's view)."""
    if name == SUITE_MODULE:
        return importlib.import_module(name)
    spec = importlib.util.find_spec(SUITE_MODULE)
    assert spec is not None and spec.origin is not None
    copy_spec = importlib.util.spec_from_file_location(name, spec.origin)
    assert copy_spec is not None and copy_spec.loader is not None
    module = importlib.util.module_from_spec(copy_spec)
    copy_spec.loader.exec_module(module)
    return module


def test_class(suite: types.ModuleType) -> type[unittest.TestCase]:
    """Upstream's TestDistBackendWithSpawn: the backend's harness and the suite's tests."""
    base: type[unittest.TestCase] = suite.TestDistBackend
    tests: type = suite.DistributedTest._DistTestBase
    return type("TestDistBackendWithSpawn", (base, tests), {})


def skip_message(code: object) -> str | None:
    return next((skip.message for skip in TEST_SKIPS.values() if skip.exit_code == code), None)


def _left_out(*args: object, **kwargs: object) -> None:
    """Stands for the test body while a gate decorator's own code runs."""


def decorator_gate(layer: types.FunctionType) -> str | None:
    """Run one gate decorator's wrapper with the test body left out: its skip, or None."""
    code = layer.__code__
    cells = tuple(
        types.CellType(_left_out) if name == "func" else cell
        for name, cell in zip(code.co_freevars, layer.__closure__ or (), strict=True)
    )
    probe = types.FunctionType(code, layer.__globals__, layer.__name__, layer.__defaults__, cells)
    probe.__kwdefaults__ = layer.__kwdefaults__
    try:
        probe(object())
    except SystemExit as exc:
        return skip_message(exc.code) or f"exits {exc.code} before the test"
    except unittest.SkipTest as exc:
        return str(exc)
    return None


def gates(function: Callable[..., Any]) -> list[str]:
    """Why the suite skips this test without running it: every gate that does (none: it runs)."""
    found = []
    if getattr(function, "__unittest_skip__", False):
        found.append(str(getattr(function, "__unittest_skip_why__", "skipped")))
    layer: Any = function
    while layer is not None:
        code = getattr(layer, "__code__", None)
        if (code is not None and code.co_qualname.startswith(GATE_DECORATORS)
                and "func" in code.co_freevars):
            reason = decorator_gate(layer)
            if reason is not None:
                found.append(reason)
        layer = getattr(layer, "__wrapped__", None)
    return found


@contextmanager
def backend_seen_as(backend: str) -> Iterator[None]:
    """BACKEND in the environment for a while (some gates read it when they run)."""
    saved = os.environ["BACKEND"]
    os.environ["BACKEND"] = backend
    try:
        yield
    finally:
        os.environ["BACKEND"] = saved


def gates_of(cls: type[unittest.TestCase]) -> dict[str, list[str]]:
    return {name: gates(getattr(cls, name))
            for name in unittest.TestLoader().getTestCaseNames(cls)}


def collect() -> None:
    prepare()
    mine = gates_of(test_class(load_suite()))
    if BACKEND == "gloo":
        gloo = mine
    else:
        with backend_seen_as("gloo"):
            gloo = gates_of(test_class(load_suite("distributed_test_as_gloo")))
    tests = {name: {"skip": mine[name], "gloo_skip": gloo.get(name, [])} for name in mine}
    json.dump({"torch": torch.__version__, "backend": BACKEND, "tests": tests}, sys.stdout)
    sys.stdout.write("\n")


# -- serving tests --------------------------------------------------------------------


def tidy_up() -> bool:
    """Destroy what the test left (every group); False if that failed."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
        return False
    return True


def run_one(suite: Any, cls: type[Any], rank: int,
            request: dict[str, str]) -> dict[str, object]:
    """One test on this rank, as TestDistBackend._run and MultiProcessTestCase.run_test."""
    name = request["test"]
    print(f"=== {name} (rank {rank})", file=sys.stderr, flush=True)
    environment = dict(os.environ)
    os.environ["TEMP_DIR"] = request["temp_dir"]
    # What upstream's parent sets up per test (initialize_temp_directories): tests that
    # re-initialise the default group use INIT_METHOD; the file barrier counts from 0.
    shared_init_file = os.path.join(request["temp_dir"], "init_dir", "shared_init_file")
    suite.INIT_METHOD = "file://" + shared_init_file
    suite.Barrier.barrier_id = 0
    started = time.monotonic()
    outcome, detail = "passed", ""
    try:
        case = cls(name)
        case.rank = rank
        case.file_name = request["init_file"]
        common_utils.set_rng_seed()  # type: ignore[no-untyped-call]
        timeout_s = suite.CUSTOM_PG_TIMEOUT.get(name, suite.default_pg_timeout)
        dist.init_process_group(init_method=case.init_method, backend=BACKEND,
                                world_size=int(case.world_size), rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
        case._barrier()
        # A test whose body branches on the backend's name may read it as another
        # backend's, while it runs on this one's process group (created above).
        suite.BACKEND = request.get("body_backend") or BACKEND
        try:
            getattr(case, name)()
        finally:
            suite.BACKEND = BACKEND
        case._barrier()
    except unittest.SkipTest as exc:
        outcome, detail = "skipped", str(exc)
    except SystemExit as exc:
        message = skip_message(exc.code)
        if message is not None:
            outcome, detail = "skipped", message
        else:
            outcome, detail = "failed", f"the test exited {exc.code}\n{traceback.format_exc()}"
    except BaseException:
        outcome, detail = "failed", traceback.format_exc()
    # After a failure the peer may still wait in a collective: destroying would hang, so
    # the parent restarts both ranks instead.
    clean = outcome != "failed" and tidy_up()
    os.environ.clear()  # and the debug level, which with_dist_debug_levels changes
    os.environ.update(environment)
    dist.set_debug_level_from_env()  # type: ignore[attr-defined]
    return {"test": name, "rank": rank, "outcome": outcome, "detail": detail, "clean": clean,
            "seconds": round(time.monotonic() - started, 3)}


def serve(rank: int) -> None:
    answers: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the tests' prints (and C++'s) go to stderr, not into the answers
    sys.stdout = sys.stderr
    os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's look at a hang
    prepare()
    suite = load_suite()
    cls = test_class(suite)

    def answer(record: dict[str, object]) -> None:
        answers.write(json.dumps(record) + "\n")

    answer({"ready": rank, "pid": os.getpid()})
    for line in sys.stdin:
        if line.strip():
            answer(run_one(suite, cls, rank, json.loads(line)))


def main() -> None:
    if sys.argv[1:2] == ["collect"]:
        collect()
    elif sys.argv[1:2] == ["serve"] and len(sys.argv) == 3:
        serve(int(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} collect | serve RANK")


if __name__ == "__main__":
    main()
