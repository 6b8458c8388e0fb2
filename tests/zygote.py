"""A zygote for the suite's rank and daemon processes: fork a warm interpreter instead of
starting one.

A rank program spends about 2 s of CPU in `import torch` (and ml_dtypes, numpy, ...)
before it does anything, and the suite starts hundreds of them.  The zygote is a
server, one per pytest session, that has imported those libraries once and then
forks a child per rank program; the child becomes what `python PROGRAM ARGS...`
would have been (environment, working folder, argv, sys.path[0], stdio, signal
dispositions, fresh random seeds) and runs the program as `__main__`.

The same goes for the tests' gradsyncd (`python -m gradsync.daemon`, run as `-m` runs
a module): tests/conftest.py keeps daemon zygotes that preload only the daemon's
libraries (DAEMON_PRELOAD), without torch.

Server: `python tests/zygote.py SOCKET PARENT_PID [PRELOAD,...]`, single-threaded, one select loop
over a SOCK_SEQPACKET Unix socket.  A request is one message (JSON: argv, env, cwd)
carrying the child's stdin, stdout and stderr as SCM_RIGHTS; the reply carries the
child's pid and a pidfd (signals cannot reach a reused pid), and, on the same
connection once the zygote has reaped the child, its wait status.  It dies with
pytest (PR_SET_PDEATHSIG); its children do not, as rank processes never did.

It imports no gradsync module: the children must import the tree as a fresh process
would, and some tests look at which gradsync modules a program has loaded.  It
refuses (and the client starts the program the ordinary way) whatever a fork cannot
give: another interpreter, a variable read at interpreter or library start-up that
differs from the zygote's (PYTHON*, LD_*, locale, OpenMP/BLAS, TORCH_*), or a server
that is not single-threaded at the moment of the fork.

A request may name a network namespace (`ip netns add`'s name): the child enters it
(setns) before it becomes the program, so the "hosts" of the multi-node tests fork
too.  A child that only sets OMP_NUM_THREADS otherwise goes to a variant zygote
started with that value (`Zygote._serving`).

Client: `Zygote`, started on first use, and `ZygoteProcess`, a subprocess.Popen whose
child the zygote forked (the Popen API unchanged: pipes, communicate, wait with a
timeout, kill, returncode -signum).  GRADSYNC_TEST_ZYGOTE=0 turns it off.
"""

from __future__ import annotations

import atexit
import builtins
import collections
import contextlib
import ctypes
import gc
import importlib
import importlib.machinery
import io
import json
import linecache
import os
import random
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

#: What the rank zygote imports once for every child (third-party only; see the docstring).
PRELOAD = ("numpy", "msgpack", "zmq", "ml_dtypes", "torch", "torch.distributed")
#: What a daemon zygote imports: gradsyncd's third-party libraries, without torch.
DAEMON_PRELOAD = ("asyncio", "numpy", "msgpack", "zmq", "zmq.asyncio", "uvloop",
                  "cryptography.hazmat.primitives.ciphers.aead")
#: Variables an interpreter or a preloaded library reads as it starts: a child whose
#: value differs from the zygote's needs a fresh process.
FRESH_ONLY = ("PYTHON", "LD_", "MALLOC_", "GLIBC_TUNABLES", "LANG", "LC_", "OMP_", "GOMP_",
              "KMP_", "MKL_", "OPENBLAS_", "NUMPY_", "TORCH_", "PYTORCH_")
#: torch's switch for its `torch.backends` entry points, which `import torch` calls: the
#: zygote imports torch without them and each child calls them, under its own environment.
AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
#: Start-up variables a child may set to its own value and still be forked: by a zygote
#: of its own, started (once) with that value.  The suite gives OMP_NUM_THREADS=1 to
#: the ranks of every torchrun-like test, so those would otherwise all start fresh.
VARIANT_VARIABLES = ("OMP_NUM_THREADS",)
#: The most zygotes of their own a session starts for such values.
MAX_VARIANTS = 2
ENABLE_VARIABLE = "GRADSYNC_TEST_ZYGOTE"
MAX_REQUEST = 1 << 20
PR_SET_PDEATHSIG = 1
CLONE_NEWNET = 0x40000000
#: Where `ip netns add NAME` keeps a network namespace (a child may be asked to enter one).
NETNS_DIR = "/run/netns"


def fresh_only_differences(env: Mapping[str, str], baseline: Mapping[str, str]) -> list[str]:
    """Start-up variables whose value in `env` differs from `baseline`."""
    return sorted(name for name in set(env) | set(baseline)
                  if name.startswith(FRESH_ONLY) and name != AUTOLOAD
                  and env.get(name) != baseline.get(name))


def task_count() -> int:
    """Threads of this process as the kernel sees them (native ones included)."""
    return len(os.listdir("/proc/self/task"))


# -- server ---------------------------------------------------------------------


def _die_with(parent: int) -> None:
    """SIGKILL when pytest dies; already gone (the race with prctl) means exit now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(0)


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace `name`, as
    `ip netns exec NAME` does for the sockets it opens."""
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


class Inherited:
    """Signal dispositions and mask as this interpreter started: what a fresh one has."""

    def __init__(self) -> None:
        self.handlers: dict[int, Any] = {}
        for signum in signal.valid_signals():
            try:
                handler = signal.getsignal(signum)
            except (OSError, ValueError):
                continue
            if handler is not None:  # None: set outside Python, leave it be
                self.handlers[signum] = handler
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    def restore(self) -> None:
        for signum, handler in self.handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)


def _preload(modules: Sequence[str]) -> tuple[list[str], list[Any] | None]:
    """Import `modules` (what fails is left to the children); torch's backend entry
    points, resolved but not loaded (None where torch did not import)."""
    problems = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    backends = None
    if "torch" in sys.modules:
        from importlib.metadata import entry_points

        backends = list(entry_points(group="torch.backends"))
    return problems, backends


def _settle() -> str | None:
    """One fork that exits at once: libraries park their threads in their fork handlers
    (OpenBLAS starts one as numpy loads); then the zygote must be one thread."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return _threads_problem()


def _threads_problem() -> str | None:
    if threading.active_count() != 1 or task_count() != 1:
        return (f"the zygote runs {threading.active_count()} Python threads and "
                f"{task_count()} tasks; it forks only single-threaded")
    return None


class Server:
    """The select loop: requests in, children forked, exit statuses back."""

    def __init__(self, listener: socket.socket, problem: str | None, inherited: Inherited,
                 backends: list[Any] | None) -> None:
        self.listener = listener
        self.problem = problem
        self.inherited = inherited
        self.backends = backends
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket | None] = {}
        self.wake_read, self.wake_write = os.pipe()
        self.pid = os.getpid()

    def run(self) -> Child:
        """Serve until SIGTERM or PDEATHSIG; returns only in a forked child."""
        os.set_blocking(self.wake_read, False)
        os.set_blocking(self.wake_write, False)
        signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_read, selectors.EVENT_READ)
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.listener:
                    try:
                        connection, _ = self.listener.accept()
                    except OSError as exc:  # out of descriptors, say: the client falls back
                        print(f"zygote: accept: {exc}", file=sys.stderr, flush=True)
                        continue
                    self.selector.register(connection, selectors.EVENT_READ)
                elif key.fileobj == self.wake_read:
                    while True:
                        try:
                            if not os.read(self.wake_read, 4096):
                                break
                        except BlockingIOError:
                            break
                    self.reap()
                else:
                    assert isinstance(key.fileobj, socket.socket)
                    child = self.answer(key.fileobj)
                    if child is not None:
                        return child

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is not None:
                self.send(connection, {"status": status})
                self.close(connection)

    def send(self, connection: socket.socket, message: dict[str, Any],
             fds: Sequence[int] = ()) -> None:
        with contextlib.suppress(OSError):  # the client went away; the child runs on
            socket.send_fds(connection, [json.dumps(message).encode()], list(fds))

    def close(self, connection: socket.socket) -> None:
        self.selector.unregister(connection)
        connection.close()
        for pid, owner in self.children.items():
            if owner is connection:
                self.children[pid] = None

    def answer(self, connection: socket.socket) -> Child | None:
        try:
            data, fds, flags, _ = socket.recv_fds(connection, MAX_REQUEST, 3)
        except OSError:
            data, fds, flags = b"", [], 0
        if not data:
            self.close(connection)
            return None
        try:
            try:
                request = json.loads(data)
                if request.get("hello"):
                    self.send(connection, {"ready": self.problem is None,
                                           "problem": self.problem, "pid": os.getpid()})
                    return None
                refusal = self.refusal(request, fds, flags)
            except Exception as exc:  # a malformed request must not end the zygote
                refusal = f"a malformed request: {type(exc).__name__}: {exc}"
            if refusal is not None:
                self.send(connection, {"refused": refusal})
                return None
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as exc:
                self.send(connection, {"refused": f"fork failed: {exc}"})
                return None
            if pid == 0:
                return Child(request, fds, self.abandon, self.inherited, self.backends)
            self.children[pid] = connection
            try:
                pidfd: int | None = os.pidfd_open(pid)
            except (AttributeError, OSError):  # the client signals by pid, after a poll
                pidfd = None
            self.send(connection, {"pid": pid}, [] if pidfd is None else [pidfd])
            if pidfd is not None:
                os.close(pidfd)
            return None
        finally:
            if os.getpid() == self.pid:  # the child keeps them: its stdio
                for fd in fds:
                    os.close(fd)

    def abandon(self) -> None:
        """In a child: close the server's sockets and pipe (through their objects, so
        that nothing closes a number the program has opened since)."""
        signal.set_wakeup_fd(-1)
        for key in list(self.selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
        self.listener.close()
        self.selector.close()  # the child's epoll descriptor only: nothing unregistered
        os.close(self.wake_read)
        os.close(self.wake_write)

    def refusal(self, request: dict[str, Any], fds: list[int], flags: int) -> str | None:
        """Why this request needs a fresh process (None: the zygote can serve it)."""
        if self.problem is not None:
            return self.problem
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 3:
            return "a request must be one message with three descriptors"
        argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd")
        if not (isinstance(argv, list) and len(argv) >= 2 and isinstance(env, dict)
                and isinstance(cwd, str)):
            return "a request needs argv (the interpreter and a program), env and cwd"
        if os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
            return f"another interpreter: {argv[0]}"
        program = argv[1]
        if program == "-m":
            if len(argv) < 3 or not all(part.isidentifier() for part in argv[2].split(".")):
                return f"not a module name: {argv[2:3]}"
        elif program.startswith("-") or not program.endswith(".py") or not os.path.isfile(
                program):
            return f"not a Python file the zygote can run: {program}"
        if not os.path.isdir(cwd):
            return f"no such folder: {cwd}"
        netns = request.get("netns")
        if netns is not None and not (isinstance(netns, str) and netns == os.path.basename(netns)
                                      and os.path.exists(os.path.join(NETNS_DIR, netns))):
            return f"no such network namespace: {netns!r}"
        differing = fresh_only_differences(env, os.environ)
        if differing:
            return f"start-up variables differ from the zygote's: {', '.join(differing)}"
        return _threads_problem()


class Child:
    """In a forked child: become `python PROGRAM ARGS...` and run it; never returns."""

    def __init__(self, request: dict[str, Any], fds: list[int], abandon: Callable[[], None],
                 inherited: Inherited, backends: list[Any] | None) -> None:
        self.argv: list[str] = request["argv"]
        self.env: dict[str, str] = request["env"]
        self.cwd: str = request["cwd"]
        self.netns: str | None = request.get("netns")
        self.fds = fds
        self.abandon = abandon
        self.inherited = inherited
        self.backends = backends

    def become(self) -> None:
        self.abandon()
        for target, fd in enumerate(self.fds):
            os.dup2(fd, target)
        for fd in set(self.fds):
            if fd > 2:
                os.close(fd)
        self.inherited.restore()
        if self.netns is not None:
            _enter_netns(self.netns)
        os.chdir(self.cwd)
        os.environ.clear()  # unsetenv/putenv: the C environment follows
        os.environ.update(self.env)
        program = self.argv[1]
        sys.argv = self.argv[1:] if program != "-m" else ["-m", *self.argv[3:]]
        sys.orig_argv = list(self.argv)
        # `python -m` puts the working folder first, `python FILE` the file's folder.
        sys.path.insert(0, os.getcwd() if program == "-m" else
                        os.path.dirname(os.path.realpath(program)))
        importlib.invalidate_caches()
        linecache.clearcache()
        tempfile.tempdir = None
        random.seed()
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            numpy_random.seed()
        if sys.stdout is not None and sys.stdout.line_buffering != os.isatty(1):
            sys.stdout.reconfigure(line_buffering=os.isatty(1))  # type: ignore[union-attr]

    def autoload(self) -> None:
        """What `import torch` does with its `torch.backends` entry points."""
        if self.backends is None or os.environ.get(AUTOLOAD, "1") != "1":
            return
        for entry in self.backends:
            try:
                entry.load()()
            except Exception as err:
                raise RuntimeError(
                    f"Failed to load the backend extension: {entry.name}. You can disable "
                    f"extension auto-loading with {AUTOLOAD}=0.") from err

    def run(self) -> NoReturn:
        try:
            self.become()
        except BaseException:  # never back into the server's frames
            with contextlib.suppress(BaseException):
                sys.excepthook(*sys.exc_info())
                _flush_stdio()
            os._exit(1)
        path = self.argv[1]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        if path != "-m":
            main.__dict__.update(
                __file__=path, __cached__=None, __package__=None, __spec__=None,
                __loader__=importlib.machinery.SourceFileLoader("__main__", path))
        sys.modules["__main__"] = main
        code, interrupted = 0, False
        try:
            self.autoload()
            if path == "-m":  # as `python -m MODULE` runs it: into the fresh __main__
                runpy._run_module_as_main(self.argv[2])  # type: ignore[attr-defined]
            else:
                with io.open_code(path) as source:
                    compiled = compile(source.read(), path, "exec", dont_inherit=True)
                exec(compiled, main.__dict__)
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException as exc:
            # The traceback as the interpreter shows it: from the program's frames on.
            traceback = exc.__traceback__.tb_next if exc.__traceback__ else None
            exc.__traceback__ = traceback
            sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, traceback
            sys.excepthook(type(exc), exc, traceback)
            code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
        try:
            _exit(code, interrupted)
        finally:
            os._exit(1)  # only where the way out itself failed


def _exit_code(exc: SystemExit) -> int:
    """The status `raise SystemExit(code)` gives an interpreter."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    with contextlib.suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


def _flush_stdio() -> bool:
    ok = True
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:
            ok = False
    return ok


def _exit(code: int, interrupted: bool) -> NoReturn:
    """An interpreter's way out: non-daemon threads, atexit, stdio flushed, __main__'s
    globals released (their objects' finalizers run), then _exit."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        sys.excepthook(*sys.exc_info())
    atexit._run_exitfuncs()
    flushed = _flush_stdio()
    main = sys.modules.get("__main__")
    if main is not None:
        names = [name for name in main.__dict__ if name != "__builtins__"]
        for name in sorted(names, key=lambda n: not (n.startswith("_") and n[1:2] != "_")):
            main.__dict__[name] = None
    sys.last_type = sys.last_value = sys.last_traceback = None
    gc.collect()
    flushed = _flush_stdio() and flushed
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(128 + signal.SIGINT)
    os._exit((code if flushed else 120) & 0xFF)


def main(argv: Sequence[str]) -> None:
    socket_path, parent = argv[1], int(argv[2])
    preload = argv[3].split(",") if len(argv) > 3 else PRELOAD
    inherited = Inherited()
    _die_with(parent)
    # Ctrl-C reaches the ranks through the process group; pytest then stops the zygote.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    del sys.path[0]  # this folder: the child puts its program's there
    problems, backends = _preload(preload)
    for problem in problems:
        print(f"zygote: not preloaded: {problem}", file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()  # the children leave the preloaded objects' pages shared
    child = Server(listener, _settle(), inherited, backends).run()
    child.run()


# -- client ---------------------------------------------------------------------


class Zygote:
    """The session's zygote: started on first use, stopped at the end of the session.

    A child whose only differing start-up variables are VARIANT_VARIABLES goes to a
    variant: a zygote of its own, started with those values (counted in this one's
    `forked` and `fallbacks`)."""

    def __init__(self, enabled: bool = True, environ: Mapping[str, str] | None = None,
                 root: Zygote | None = None, preload: Sequence[str] = PRELOAD,
                 what: str = "rank") -> None:
        self.enabled = enabled
        #: What it imports before it forks, and what its children are (for the summary).
        self.preload = tuple(preload)
        self.what = what
        #: The environment the zygote starts with (the session's, as it began).
        self.environ = dict(os.environ if environ is None else environ)
        self.forked = 0
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self._root = self if root is None else root
        self._variants: dict[tuple[tuple[str, str | None], ...], Zygote] = {}
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._folder: Path | None = None

    def popen(self, args: Sequence[str], env: Mapping[str, str] | None = None,
              netns: str | None = None) -> subprocess.Popen[str]:
        """`subprocess.Popen(args, env=env, stdout=PIPE, stderr=PIPE, text=True)`, forked
        by the zygote where it can; in network namespace `netns` if given (started fresh:
        under `ip netns exec NETNS`)."""
        return self.process(args, env, netns, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)

    def process(self, args: Sequence[str], env: Mapping[str, str] | None = None,
                netns: str | None = None, **popen: Any) -> subprocess.Popen[str]:
        """`subprocess.Popen(args, env=env, **popen)`, forked where the zygote can."""
        zygote = self._serving(env)
        return ZygoteProcess(list(args), zygote if zygote._ready() else None, env=env,
                             netns=netns, **popen)

    def _serving(self, env: Mapping[str, str] | None) -> Zygote:
        """This zygote, or the variant for `env`'s values of VARIANT_VARIABLES (where
        those are all it changes, and a variant is or may be started for them)."""
        wanted = os.environ if env is None else env
        differing = fresh_only_differences(wanted, self.environ)
        if not differing or not set(differing) <= set(VARIANT_VARIABLES) or not self.enabled:
            return self
        values = tuple((name, wanted.get(name)) for name in differing)
        with self._lock:
            variant = self._variants.get(values)
            if variant is None:
                if len(self._variants) >= MAX_VARIANTS:
                    return self
                environ = {**self.environ, **{n: v for n, v in values if v is not None}}
                for name, value in values:
                    if value is None:
                        environ.pop(name, None)
                variant = self._variants[values] = Zygote(True, environ, self, self.preload,
                                                          self.what)
            return variant

    @property
    def socket_path(self) -> Path:
        assert self._folder is not None
        return self._folder / "zygote.sock"

    def _ready(self) -> bool:
        with self._lock:
            if not self.enabled:
                return False
            if self._process is None:
                if threading.current_thread() is not threading.main_thread():
                    # PR_SET_PDEATHSIG fires when the starting *thread* ends.
                    self._root.fallbacks["asked first from a thread other than pytest's main"] += 1
                    return False
                self._start()
            return self.enabled

    def _start(self) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="gs-zygote-", dir="/tmp"))
        log_path = self._folder / "zygote.log"
        with open(log_path, "wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, __file__, str(self.socket_path), str(os.getpid()),
                 ",".join(self.preload)],
                env={**self.environ, AUTOLOAD: "0"}, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, cwd=self._folder)
        problem = self._hello()
        if problem is not None:
            log_text = log_path.read_text(errors="replace")[-3000:]
            self.stop()
            self.enabled = False
            warnings.warn(f"the {self.what} zygote did not start ({problem}); {self.what} "
                          f"programs start as fresh processes\n{log_text}", stacklevel=4)

    def _hello(self) -> str | None:
        assert self._process is not None
        deadline = time.monotonic() + 120
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            while True:
                try:
                    connection.connect(str(self.socket_path))
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if self._process.poll() is not None:
                        return f"it exited {self._process.returncode}"
                    if time.monotonic() > deadline:
                        return "its socket did not appear"
                    time.sleep(0.02)
            connection.sendall(json.dumps({"hello": True}).encode())
            # The answer comes once the imports are done.
            connection.settimeout(max(1.0, deadline - time.monotonic()))
            data = connection.recv(65536)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()
        reply = json.loads(data) if data else {"problem": f"it exited {self._process.wait()}"}
        return None if reply.get("ready") else str(reply.get("problem"))

    def fork(self, argv: list[str], env: Mapping[str, str] | None, cwd: str | None,
             stdio: Sequence[int], netns: str | None = None
             ) -> tuple[int, socket.socket, int | None] | None:
        """Ask the zygote for a child: (pid, the connection its status comes on, a pidfd),
        or None where it cannot serve this one (the caller starts a fresh process)."""
        request = {"argv": argv, "env": dict(os.environ if env is None else env),
                   "cwd": os.getcwd() if cwd is None else os.fspath(cwd)}
        if netns is not None:
            request["netns"] = netns
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.settimeout(60)
        with _Stdio(stdio) as fds:
            try:
                connection.connect(str(self.socket_path))
                socket.send_fds(connection, [json.dumps(request).encode()], fds)
                data, received, _, _ = socket.recv_fds(connection, 65536, 1)
            except OSError as exc:
                connection.close()
                self._broken(f"{type(exc).__name__}: {exc}")
                return None
        reply = json.loads(data) if data else {}
        if "pid" not in reply:
            connection.close()
            for fd in received:
                os.close(fd)
            if not data:
                self._broken("it closed the connection")
                return None
            self._root.fallbacks[str(reply.get("refused"))] += 1
            return None
        connection.settimeout(None)
        self._root.forked += 1
        return int(reply["pid"]), connection, received[0] if received else None

    def _broken(self, problem: str) -> None:
        self._root.fallbacks["the zygote broke"] += 1
        with self._lock:
            if self.enabled:
                self.enabled = False
                warnings.warn(f"the {self.what} zygote failed ({problem}); {self.what} "
                              "programs start as fresh processes from now on", stacklevel=5)

    def stop(self) -> None:
        """End the zygote and its variants (children they forked run on, as rank
        processes outlive pytest)."""
        for variant in self._variants.values():
            variant.stop()
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def summary(self) -> str:
        fresh = sum(self.fallbacks.values())
        reasons = "; ".join(f"{count}× {reason}" for reason, count in self.fallbacks.items())
        variants = "".join(f"; {', '.join(f'{n}={v}' for n, v in values)}: a zygote of its own"
                           for values in self._variants)
        return (f"{self.what} zygote: {self.forked} {self.what} processes forked, {fresh} "
                f"started fresh"
                + (f" ({reasons})" if reasons else "") + variants)


class _Stdio:
    """The child's stdin, stdout, stderr: Popen's ends, or this process's own (-1)."""

    def __init__(self, stdio: Sequence[int]) -> None:
        self.stdio = stdio
        self.opened: list[int] = []

    def __enter__(self) -> list[int]:
        fds = []
        for fd, own in zip(self.stdio, (0, 1, 2), strict=True):
            fd = own if fd == -1 else fd
            try:
                os.fstat(fd)
            except OSError:  # closed here: the child gets /dev/null
                fd = os.open(os.devnull, os.O_RDWR)
                self.opened.append(fd)
            fds.append(fd)
        return fds

    def __exit__(self, *exc: object) -> None:
        for fd in self.opened:
            os.close(fd)


class ZygoteProcess(subprocess.Popen[str]):
    """subprocess.Popen whose child the zygote forks (where `zygote` is None or refuses,
    an ordinary child).  Popen's own code makes the pipes and reads them
    (communicate, timeouts); this class replaces how the child starts, how its exit
    status arrives (from the zygote, which reaps it) and how it is signalled (a pidfd)."""

    def __init__(self, args: list[str], zygote: Zygote | None, netns: str | None = None,
                 **kwargs: Any) -> None:
        self._zygote = zygote
        self._netns = netns
        #: What the zygote runs; started fresh, the same under `ip netns exec NETNS`.
        self._program = args
        self._status: socket.socket | None = None
        self._pidfd: int | None = None
        #: Whether the zygote forked this child (False: started fresh).
        self.forked = False
        super().__init__(args if netns is None else ["ip", "netns", "exec", netns, *args],
                         **kwargs)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: bool,
                       pass_fds: Iterable[int], cwd: Any, env: Any, startupinfo: Any,
                       creationflags: int, shell: bool, p2cread: int, p2cwrite: int,
                       c2pread: int, c2pwrite: int, errread: int, errwrite: int,
                       *rest: Any) -> None:
        if (self._zygote is not None and executable is None and preexec_fn is None
                and not shell and not tuple(pass_fds)):
            forked = self._zygote.fork([os.fspath(a) for a in self._program], env, cwd,
                                       (p2cread, c2pwrite, errwrite), self._netns)
            if forked is not None:
                self.pid, self._status, self._pidfd = forked
                self._child_created = True
                self.forked = True
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite,  # type: ignore[attr-defined]
                                     errread, errwrite)
                return
        super()._execute_child(  # type: ignore[misc]
            args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
            creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest)

    def _internal_poll(self, _deadstate: int | None = None, *args: Any, **kwargs: Any
                       ) -> int | None:
        if not self.forked:
            return super()._internal_poll(_deadstate)  # type: ignore[misc, no-any-return]
        if self.returncode is None and self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
            try:
                self._read_status(0.0, _deadstate)
            except Exception:
                if _deadstate is None:
                    raise
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if not self.forked:
            return super()._wait(timeout)  # type: ignore[misc, no-any-return]
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            if not self._waitpid_lock.acquire(timeout=-1 if remaining is None else remaining):  # type: ignore[attr-defined]
                continue
            try:
                if self.returncode is None:
                    self._read_status(remaining, None)
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode

    def _read_status(self, timeout: float | None, deadstate: int | None) -> None:
        """Take the exit status if the zygote has sent it (waiting up to `timeout`)."""
        connection = self._status
        if connection is None:
            return
        if not select.select([connection], [], [], timeout)[0]:
            return
        try:
            data = connection.recv(4096)
        except OSError:
            data = b""
        message = json.loads(data) if data else {}
        if "status" in message:
            self._handle_exitstatus(message["status"])  # type: ignore[attr-defined]
        elif deadstate is not None:
            self.returncode = deadstate
        else:
            self._close_status()
            raise ChildProcessError(f"the rank zygote ended before its child {self.pid}: "
                                    "the exit status is lost")
        self._close_status()

    def _close_status(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def send_signal(self, sig: int) -> None:
        if not self.forked:
            return super().send_signal(sig)
        self.poll()
        if self.returncode is not None:
            return None  # reaped: the pid may be someone else's now
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass
        return None


if __name__ == "__main__":
    main(sys.argv)
