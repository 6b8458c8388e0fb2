"""Recovery from daemon checkpoints: a killed rank, and a lost node (issue 50).

    python -m benchmarks.checkpoint_recovery [--part rank,node] [--mib 240] [--rounds 3]
        [--node-mib 256] [--rate 2gbit] [--dir D]

1. A killed rank.  One private daemon (benchmarks/private_daemon.py, its
   defaults), torch DDP on backend "gradsync", 2 ranks, Adam on a model whose
   state (parameters + Adam's two moments) is about MIB MiB, a DCP checkpoint
   every step.  After step 2's save rank 1 is SIGKILLed; the driver then kills
   rank 0 too and starts both again (what torchrun's agent does: it restarts the
   whole group), and they load the newest checkpoint and take their next step.
   Two ways, taking turns round by round in one run: the daemon
   (`DaemonStorageWriter` / `DaemonStorageReader`) and disk (`FileSystemWriter`
   / `FileSystemReader`, torch's defaults, one folder per step, in a temporary
   folder under D: default the current one, on its disk).  Times from the
   SIGKILL, for the slower of the two ranks: the driver's restart (kill to
   spawn), process start (spawn to the first line after `import torch` and
   gradsync), the process group, the model, DDP and Adam's state made, the load,
   the first step; median over ROUNDS.  "after start" is the goal's "within 2 s
   plus process start" part.
2. A lost node.  Two network namespaces joined by a veth pair
   (benchmarks/topology.py), shaped to RATE each way with tbf, then unshaped;
   one daemon per node with CURVE keys (sealed data streams) and the default
   `--checkpoint-replicas 1`; one rank per node, each saving a shard of its own
   (NODE_MIB / 2 MiB each, as FSDP would) into its daemon.  Once each node's
   part is confirmed on the other, node 1 is lost: its daemon SIGKILLed, its segments
   and its checkpoint manifest removed.  A fresh daemon starts on node 1 and
   node 0 pushes it the parts of its own newest checkpoint (awaited); then both
   ranks `dcp.load`, and node 1's daemon pulls what it still lacks from node 0.
   Node 1's rank's `dcp.load` time and, within it, the daemon's open (the
   pull), the bytes its daemon pulled, the rates, and those against the link
   rate and against plain TCP between the two namespaces, measured in the same
   run (one socket, 256 MiB); and the pull alone, as node 1's daemon logs it
   (without the request and the rank's mapping of the parts).

Prints markdown tables.  Part 2 needs root and iproute2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import machine, topology
from benchmarks.interdaemon import _make_keys
from benchmarks.private_daemon import DaemonRun, daemon_cluster, private_daemon
from benchmarks.processes import clean_env, exit_without_destructors, module_command, rank_env

MIB = 1 << 20
#: Rank 1 is killed once this step's checkpoint is saved.
KILL_AFTER = 2
#: The plain-TCP reference transfer between the namespaces.
TCP_BYTES = 256 * MIB
_START_TIMEOUT_S = 300.0


# -- the ranks ----------------------------------------------------------------


def _say(**record: Any) -> None:
    print(json.dumps({"t": time.time(), **record}), flush=True)


def _layers(mib: int) -> int:
    """Linear(2048, 2048) layers whose parameters and Adam moments make about `mib` MiB."""
    per_layer = 3 * (2048 * 2048 + 2048) * 4  # parameters, exp_avg, exp_avg_sq
    return max(1, round(mib * MIB / per_layer))


def _newest_on_disk(folder: str) -> str | None:
    """The newest step folder a FileSystemWriter finished (it writes .metadata last)."""
    done = [
        int(name)
        for name in os.listdir(folder)
        if name.isdigit() and os.path.exists(os.path.join(folder, name, ".metadata"))
    ]
    return os.path.join(folder, str(max(done))) if done else None


def train_worker(way: str, job: str, folder: str, mib: int, resume: bool) -> None:
    """One DDP rank: train with a checkpoint every step (until killed), or, with
    `resume`, load the newest checkpoint and take one step."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import gradsync.client.torch  # noqa: F401
    from gradsync.client.torch.checkpoint import DaemonStorageReader, DaemonStorageWriter

    _say(event="imported")
    torch.set_num_threads(1)
    dist.init_process_group("gradsync")
    rank = dist.get_rank()
    _say(event="group")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2048, 2048) for _ in range(_layers(mib))]
    _say(event="model")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    _say(event="ddp")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def state(step: int) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}

    def train_step(step: int) -> None:
        batch = torch.randn(16, 2048, generator=torch.Generator().manual_seed(step * 2 + rank))
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()

    start = 0
    if resume:
        restored = state(-1)  # get_state_dict makes Adam's state (a step at lr 0)
        _say(event="built")
        if way == "daemon":
            dcp.load(restored, storage_reader=DaemonStorageReader(job=job))
        else:
            newest = _newest_on_disk(folder)
            assert newest is not None, f"no finished checkpoint in {folder}"
            dcp.load(restored, storage_reader=dcp.FileSystemReader(newest))
        set_state_dict(
            model, optimizer, model_state_dict=restored["model"], optim_state_dict=restored["optim"]
        )
        start = int(restored["step"]) + 1
        _say(event="loaded", step=start - 1)
        train_step(start)
        _say(event="stepped", step=start)
        dist.destroy_process_group()
        exit_without_destructors(0)
    writer = DaemonStorageWriter(job=job) if way == "daemon" else None
    for step in range(start, 10**6):
        train_step(step)
        saved = state(step)
        if writer is not None:
            dcp.save(saved, storage_writer=writer, checkpoint_id=str(step))
        else:
            target = os.path.join(folder, str(step))
            dcp.save(saved, storage_writer=dcp.FileSystemWriter(target))
            if rank == 0:  # keep two steps on disk, as the daemon keeps two
                shutil.rmtree(os.path.join(folder, str(step - 2)), ignore_errors=True)
        _say(event="saved", step=step)


def shard_worker(mode: str, job: str, mib: int) -> None:
    """One rank of the lost-node run: save a shard of its own (`mode` save), or load
    it back (`mode` load) and say how long the load took and whether it is bitwise."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import gradsync.client.torch  # noqa: F401
    from gradsync.client.torch.checkpoint import DaemonStorageReader, DaemonStorageWriter

    dist.init_process_group("gradsync")
    rank = dist.get_rank()
    shard = torch.rand(mib * MIB // 4, generator=torch.Generator().manual_seed(rank))
    key = f"shard{rank}"
    if mode == "save":
        dcp.save({key: shard}, storage_writer=DaemonStorageWriter(job=job), checkpoint_id="1")
        _say(event="saved", rank=rank)
    else:
        loaded = {key: torch.zeros_like(shard)}
        dist.barrier()
        started = time.perf_counter()
        reader = DaemonStorageReader(job=job)
        opened = _timed_open(reader)
        dcp.load(loaded, storage_reader=reader)
        seconds = time.perf_counter() - started
        _say(
            event="loaded",
            rank=rank,
            load_s=seconds,
            bitwise=bool(torch.equal(loaded[key], shard)),
            nbytes=shard.numel() * 4,
            open_s=sum(opened),
        )
    dist.barrier()
    dist.destroy_process_group()
    exit_without_destructors(0)


def _timed_open(reader: Any) -> list[float]:
    """Time the reader's `read_metadata` (the daemon's ckpt_open: the pull on a fresh node);
    the seconds of each call land in the list returned."""
    spent: list[float] = []
    read_metadata = reader.read_metadata

    def timed() -> Any:
        started = time.perf_counter()
        try:
            return read_metadata()
        finally:
            spent.append(time.perf_counter() - started)

    reader.read_metadata = timed
    return spent


def tcp_worker(role: str, host: str, port: int, nbytes: int) -> None:
    """Plain TCP, one socket: `sink` receives `nbytes` and says how long from the first
    byte; `source` sends them."""
    buffer = bytearray(4 * MIB)
    if role == "source":
        with socket.create_connection((host, port), timeout=60) as sock:
            sent = 0
            while sent < nbytes:
                sock.sendall(memoryview(buffer)[: min(len(buffer), nbytes - sent)])
                sent += min(len(buffer), nbytes - sent)
        return
    with socket.create_server((host, port)) as server:
        _say(event="listening")
        conn, _ = server.accept()
        with conn:
            got = conn.recv_into(buffer)
            started = time.perf_counter()
            while got < nbytes:
                count = conn.recv_into(buffer)
                if not count:
                    break
                got += count
            _say(event="received", nbytes=got, seconds=time.perf_counter() - started)


# -- part 1: a killed rank ------------------------------------------------------


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                found.append(json.loads(line))
    return found


def spawn_ranks(
    args: Sequence[str],
    daemons: str | Sequence[str],
    logs: Sequence[Path],
    topo: topology.Topology | None = None,
    port: int | None = None,
    module: str = "checkpoint_recovery",
) -> list[subprocess.Popen[bytes]]:
    """Ranks 0.. running `benchmarks.MODULE --worker ARGS`, output to `logs`, in their own
    sessions; `daemons`: one endpoint for all, or one each; with `topo`, rank i runs in
    node i's namespace (gloo on its interface) and the store is on node 0."""
    port = topology.free_ports(1)[0] if port is None else port
    ranks = []
    for rank, log in enumerate(logs):
        with open(log, "wb") as out:
            env = rank_env(
                clean_env(),
                RANK=str(rank),
                WORLD_SIZE=str(len(logs)),
                LOCAL_RANK="0",
                MASTER_ADDR="127.0.0.1" if topo is None else topo.hosts[0],
                MASTER_PORT=str(port),
                GRADSYNC_DAEMON=daemons if isinstance(daemons, str) else daemons[rank],
                **({} if topo is None else {"GLOO_SOCKET_IFNAME": topo.interfaces[rank]}),
            )
            prefix = [] if topo is None else topo.prefix(rank)
            ranks.append(
                subprocess.Popen(
                    [*prefix, *module_command(module, "--worker", *args)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
    return ranks


def kill_ranks(ranks: Sequence[subprocess.Popen[bytes]]) -> None:
    for rank in ranks:
        if rank.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank.pid, signal.SIGKILL)
    for rank in ranks:
        rank.wait(30)


def _wait_for(
    logs: Sequence[Path],
    ranks: Sequence[subprocess.Popen[bytes]],
    event: str,
    timeout_s: float,
    step: int | None = None,
) -> None:
    """Until every rank's log has `event` (at `step`, if given); a rank that exits
    first, or the timeout, raises with the logs' tails."""
    deadline = time.monotonic() + timeout_s
    while True:
        if all(
            any(
                r.get("event") == event and (step is None or r.get("step") == step)
                for r in _records(log)
            )
            for log in logs
        ):
            return
        failed = [r.returncode for r in ranks if r.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            tails = "\n".join(
                f"--- {log.name}:\n" + log.read_text(errors="replace")[-3000:] for log in logs
            )
            raise RuntimeError(f"ranks never reached {event!r} (exit codes {failed}):\n{tails}")
        time.sleep(0.01)


def recover_once(way: str, daemon: str, folder: Path, mib: int, round_: int) -> dict[str, float]:
    """One kill and resume; seconds from the SIGKILL to each phase, slower rank."""
    job = f"bench-recovery-{round_}"
    disk = folder / f"disk-{round_}"
    disk.mkdir()
    common = [way, job, str(disk), str(mib)]
    logs = [folder / f"{way}-{round_}-r{rank}.log" for rank in range(2)]
    ranks = spawn_ranks(["train", *common], daemon, logs)
    try:
        _wait_for(logs, ranks, "saved", _START_TIMEOUT_S, step=KILL_AFTER)
        os.kill(ranks[1].pid, signal.SIGKILL)
        killed = time.time()
        kill_ranks(ranks)  # the agent stops the group
        spawned = time.time()
        logs = [folder / f"{way}-{round_}-r{rank}-resume.log" for rank in range(2)]
        ranks = spawn_ranks(["train", *common, "--resume"], daemon, logs)
        _wait_for(logs, ranks, "stepped", _START_TIMEOUT_S)
        for rank in ranks:
            rank.wait(60)
    finally:
        kill_ranks(ranks)
        shutil.rmtree(disk, ignore_errors=True)
    times = [{r["event"]: r["t"] - killed for r in _records(log)} for log in logs]
    loaded = {int(r["step"]) for log in logs for r in _records(log) if r["event"] == "loaded"}
    if len(loaded) != 1 or min(loaded) < KILL_AFTER:  # the next save may have ended too
        raise RuntimeError(f"{way}: resumed from steps {loaded}, not {KILL_AFTER}")
    slower = max(times, key=lambda t: t["stepped"])
    return {
        "restart": spawned - killed,
        "start": slower["imported"] - (spawned - killed),
        "group": slower["group"] - slower["imported"],
        "model": slower["model"] - slower["group"],
        "DDP": slower["ddp"] - slower["model"],
        "Adam state": slower["built"] - slower["ddp"],
        "load": slower["loaded"] - slower["built"],
        "step": slower["stepped"] - slower["loaded"],
        "total": slower["stepped"],
        "after start": slower["stepped"] - slower["imported"],
    }


def killed_rank(mib: int, rounds: int, where: str) -> None:
    folder = Path(tempfile.mkdtemp(prefix="ckpt-recovery-", dir=where))
    results: dict[str, list[dict[str, float]]] = {"daemon": [], "disk": []}
    try:
        # Its defaults: each round's job keeps its two newest checkpoints, within 8 GiB.
        with private_daemon() as daemon:
            for round_ in range(rounds):
                for way in results:
                    results[way].append(
                        recover_once(
                            way, daemon.endpoint, folder, mib, round_ * 2 + (way == "disk")
                        )
                    )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    state_mib = _layers(mib) * 3 * (2048 * 2048 + 2048) * 4 / MIB
    print(
        f"\n### A killed rank: torch DDP, 2 ranks on one node, {state_mib:.0f} MiB of state "
        f"(model + Adam), a checkpoint every step\n"
    )
    print(
        f"{machine.cpu_model()}, {os.cpu_count()} cores; median of {rounds} kills per way "
        "(ways in turns); seconds from the SIGKILL, slower rank; disk: "
        f"{_fs_type(where)} under {os.path.abspath(where)}\n"
    )
    columns = (
        "restart",
        "start",
        "group",
        "model",
        "DDP",
        "Adam state",
        "load",
        "step",
        "after start",
        "total",
    )
    print("| way | " + " | ".join(columns) + " | total max - min |")
    print("| --- |" + " ---: |" * (len(columns) + 1))
    for way, runs in results.items():
        cells = [f"{statistics.median(r[c] for r in runs):.2f}" for c in columns]
        spread = max(r["total"] for r in runs) - min(r["total"] for r in runs)
        print(f"| {way} | " + " | ".join(cells) + f" | {spread:.2f} |")
    print(
        "\nrestart: the driver reaps both ranks and spawns them again; start: spawn to "
        "the first line after `import torch` and gradsync; group: init_process_group; "
        "model: its layers made; DDP: the wrapper (it broadcasts rank 0's parameters); "
        "Adam state: get_state_dict (a step at lr 0 makes Adam's state); "
        "load: dcp.load + set_state_dict; step: the first step after it; "
        "after start: everything after the start."
    )


def _fs_type(path: str) -> str:
    done = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return done.stdout.strip() or "?"


# -- part 2: a lost node ----------------------------------------------------------


def _stats(run: DaemonRun) -> dict[str, Any]:
    from gradsync.client.cli.stats import fetch_snapshot

    return fetch_snapshot(run.endpoint + ".stats", 5.0)  # type: ignore[no-any-return]


def _poll(what: str, check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _replica_bytes(snapshot: dict[str, Any], job: str) -> int:
    """Bytes of the whole replicas of `job` a daemon's stats snapshot lists."""
    return sum(r["bytes"] for r in snapshot["checkpoint_replicas"].get(job, []) if r["complete"])


def _settled_replicas(run: DaemonRun, job: str, timeout_s: float = 120.0) -> int:
    """Bytes of the whole replicas of `job` the daemon holds, once none is arriving and
    two snapshots a second apart agree."""
    deadline = time.monotonic() + timeout_s
    before = None
    while time.monotonic() < deadline:
        held = _stats(run)["checkpoint_replicas"].get(job, [])
        if held == before and all(r["complete"] for r in held):
            return _replica_bytes({"checkpoint_replicas": {job: held}}, job)
        before = held
        time.sleep(1.0)
    raise RuntimeError(f"the replicas of {job!r} on {run.endpoint} never settled")


def _lose(run: DaemonRun) -> None:
    """SIGKILL the daemon and remove what its machine's memory held."""
    from gradsync.daemon.checkpoint_manifest import manifest_name
    from gradsync.protocol.shm import SHM_DIR

    run.process.send_signal(signal.SIGKILL)
    run.process.wait(30)
    run.sweep_segments()
    manifest = os.path.join(SHM_DIR, manifest_name(run.endpoint.removeprefix("ipc://")))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(manifest)


def _tcp_rate(topo: topology.Topology, folder: Path) -> float:
    """Bytes per second of one plain TCP socket from node 0 to node 1."""
    port = str(topology.NETNS_BASE_PORT + 70)
    log = folder / "tcp.log"
    with open(log, "wb") as out:
        sink = subprocess.Popen(
            [
                *topo.prefix(1),
                *module_command(
                    "checkpoint_recovery",
                    "--worker",
                    "tcp",
                    "sink",
                    topo.hosts[1],
                    port,
                    str(TCP_BYTES),
                ),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for([log], [sink], "listening", 60)
        subprocess.run(
            [
                *topo.prefix(0),
                *module_command(
                    "checkpoint_recovery",
                    "--worker",
                    "tcp",
                    "source",
                    topo.hosts[1],
                    port,
                    str(TCP_BYTES),
                ),
            ],
            check=True,
            timeout=300,
        )
        sink.wait(60)
    finally:
        kill_ranks([sink])
    record = next(r for r in _records(log) if r.get("event") == "received")
    return float(record["nbytes"]) / float(record["seconds"])


@contextlib.contextmanager
def _ranks(
    topo: topology.Topology, daemons: Sequence[str], args: Sequence[str], folder: Path, label: str
) -> Iterator[list[Path]]:
    logs = [folder / f"{label}-r{rank}.log" for rank in range(2)]
    save = args[1] == "save"
    ranks = spawn_ranks(args, daemons, logs, topo, port=topology.NETNS_BASE_PORT + 60 + save)
    try:
        _wait_for(logs, ranks, "saved" if save else "loaded", _START_TIMEOUT_S)
        for rank in ranks:
            rank.wait(120)
        yield logs
    finally:
        kill_ranks(ranks)


def sealed_flags(topo: topology.Topology, folder: Path) -> list[list[str]]:
    """Each node's daemon flags: peers with each other, CURVE keys made under `folder`."""
    endpoints = topo.endpoints()[0]
    keys = _make_keys(tempfile.mkdtemp(prefix="keys-", dir=folder), endpoints)
    return [
        ["--listen", endpoint, "--peers", ",".join(endpoints), "--curve-secret", secret,
         "--curve-authorized", authorized]
        for endpoint, (secret, authorized) in zip(endpoints, keys, strict=True)
    ]  # fmt: skip


def lose_node_once(rate: str | None, mib: int, folder: Path) -> dict[str, Any]:
    """One save, node 1 lost, a fresh daemon there, the load."""
    job = "bench-lost-node"
    shard = mib // 2
    with topology.namespaces(2, rate) as topo:
        tcp = _tcp_rate(topo, folder)
        endpoints = topo.endpoints()[0]
        flags = sealed_flags(topo, folder)
        prefixes = [topo.prefix(0), topo.prefix(1)]
        logs = folder / (rate or "unshaped")
        (logs / "fresh").mkdir(parents=True)
        with daemon_cluster(flags, prefixes, logs_to=str(logs)) as runs:
            label = rate or "unshaped"
            with _ranks(
                topo,
                [r.endpoint for r in runs],
                ["shard", "save", job, str(shard)],
                folder,
                f"{label}-save",
            ):
                pass

            def replicated() -> bool:  # each node's parts confirmed on the other
                held = [_stats(run)["checkpoints"].get(job, []) for run in runs]
                return all(
                    h and other in h[0].get("replicas", [])
                    for h, other in zip(held, reversed(endpoints), strict=True)
                )

            _poll("each node's part confirmed on the other", replicated, 300)
            _lose(runs[1])
            with daemon_cluster([flags[1]], [prefixes[1]], logs_to=str(logs / "fresh")) as (fresh,):
                _poll(
                    "the fresh daemon's link to node 0",
                    lambda: _stats(fresh)["peers"].get(endpoints[0], {}).get("state") == "up",
                    120,
                )
                # Node 0 sends the peer that came up its newest checkpoint's parts on its
                # own: wait for that push to end, so that the load pulls the rest alone.
                pushed = _settled_replicas(fresh, job)
                daemons = [runs[0].endpoint, fresh.endpoint]
                with _ranks(
                    topo, daemons, ["shard", "load", job, str(shard)], folder, f"{label}-load"
                ) as logs:
                    loaded = [
                        next(r for r in _records(log) if r.get("event") == "loaded") for log in logs
                    ]
                snapshot = _stats(fresh)
                pulled = _replica_bytes(snapshot, job) - pushed
                stream = snapshot["peers"].get(endpoints[0], {}).get("data_stream")
    if not all(r["bitwise"] for r in loaded):
        raise RuntimeError(f"a rank loaded other bytes than it saved: {loaded}")
    link = None
    if rate is not None:
        link = float(rate[:-4]) * {"g": 1e9, "m": 1e6, "k": 1e3}[rate[-4]] / 8
    return {
        "link": label,
        "load_s": float(loaded[1]["load_s"]),
        "open_s": float(loaded[1]["open_s"]),
        "pull_s": _pull_seconds(folder / (rate or "unshaped") / "fresh"),  # stopped: all out
        "pulled": pulled,
        "pushed": pushed,
        "needed": int(loaded[1]["nbytes"]),
        "link_Bps": link,
        "tcp_Bps": tcp,
        "stream": stream,
    }


def _pull_seconds(logs: Path) -> float | None:
    """How long the daemon whose logs are in `logs` took to pull the parts its open
    lacked, as it logs it (None: it does not say)."""
    for log in sorted(logs.glob("*.log")):
        found = re.search(r"pulled in ([0-9.]+)s", log.read_text(errors="replace"))
        if found:
            return float(found.group(1))
    return None


def lost_node(mib: int, rate: str, keep: bool) -> None:
    reason = topology.namespaces_unavailable(shaped=True)
    if reason:
        print(f"\nA lost node: cannot run ({reason})")
        return
    topology.sweep_stale()
    folder = Path(tempfile.mkdtemp(prefix="ckpt-lost-node-", dir="/tmp"))
    if keep:
        print(f"logs in {folder}", file=sys.stderr)
    try:
        results = [lose_node_once(r, mib, folder) for r in (rate, None)]
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(
        f"\n### A lost node: 2 namespace nodes, 1 rank each, {mib} MiB saved "
        f"({mib // 2} MiB per rank), sealed streams, `--checkpoint-replicas 1`\n"
    )
    print(
        "| link | pushed to node 1 before the load (MiB) "
        "| node 1's dcp.load (s) | its open: the pull (s) | pulled (MiB) "
        "| node 1's rank needs (MiB) | rate, load (MB/s) | rate, open (MB/s) "
        "| load / link rate | open / link rate | plain TCP (MB/s) | open / plain TCP "
        "| the daemon's pull (s) | pull / link rate | pull / plain TCP | data stream |"
    )
    print("| --- |" + " ---: |" * 14 + " --- |")
    for r in results:
        load, opened = r["pulled"] / r["load_s"], r["pulled"] / r["open_s"]
        pull = r["pulled"] / r["pull_s"] if r["pull_s"] else None
        shares = (
            ["-", "-", "-"]
            if r["link_Bps"] is None
            else [f"{bps / r['link_Bps']:.2f}" if bps else "-" for bps in (load, opened, pull)]
        )
        pulls = ["-", "-"] if pull is None else [f"{r['pull_s']:.3f}",
                                                 f"{pull / r['tcp_Bps']:.2f}"]
        shown = f"veth, tbf {r['link']}" if r["link_Bps"] else "veth, unshaped"
        print(
            f"| {shown} | {r['pushed'] / MIB:.0f} | {r['load_s']:.2f} | {r['open_s']:.2f} "
            f"| {r['pulled'] / MIB:.0f} "
            f"| {r['needed'] / MIB:.0f} | {load / 1e6:.0f} | {opened / 1e6:.0f} "
            f"| {shares[0]} | {shares[1]} | {r['tcp_Bps'] / 1e6:.0f} "
            f"| {opened / r['tcp_Bps']:.2f} | {pulls[0]} | {shares[2]} | {pulls[1]} "
            f"| {r['stream']} |"
        )
    print(
        "\nNode 0 sends a peer that comes up its own parts of its newest checkpoint "
        "(a replica push), which is awaited before the load; the load then pulls what "
        "is still missing.  Rates: bytes pulled / seconds.  dcp.load: node 1's whole "
        "load (DCP's planning "
        "collectives, the open, the copy into the tensors); open: its DaemonStorageReader's "
        "read_metadata, the daemon's ckpt_open (ask the peers, pull the parts), the "
        "mapping of the parts; the daemon's pull: the pull alone, as node 1's daemon "
        "logs it (from the step chosen to the last part here).  Plain TCP: one socket "
        "between the same namespaces, in the same run."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--part", default="rank,node", help="rank, node or both")
    parser.add_argument(
        "--mib", type=int, default=240, help="a killed rank: the model + Adam state, MiB"
    )
    parser.add_argument("--rounds", type=int, default=3, help="a killed rank: kills per way")
    parser.add_argument(
        "--node-mib", type=int, default=256, help="a lost node: the checkpoint, MiB (half per rank)"
    )
    parser.add_argument("--rate", default="2gbit", help="a lost node: the shaped link's rate")
    parser.add_argument("--dir", default=".", help="where the disk checkpoints go")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="a lost node: keep the ranks' and daemons' logs (printed folder)",
    )
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        if kind == "train":
            way, job, folder, mib, *flag = rest
            train_worker(way, job, folder, int(mib), flag == ["--resume"])
        elif kind == "shard":
            shard_worker(rest[0], rest[1], int(rest[2]))
        else:
            tcp_worker(rest[0], rest[1], int(rest[2]), int(rest[3]))
        return 0
    parts = args.part.split(",")
    topology.check_rate(args.rate)
    if "rank" in parts:
        killed_rank(args.mib, args.rounds, args.dir)
    if "node" in parts:
        lost_node(args.node_mib, args.rate, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
