"""One rank of benchmarks/torchft_diloco.py: a DiLoCo replica under torchft, or a DDP rank.

    python -m benchmarks.diloco_replica CONFIG_JSON

CONFIG_JSON (written by the driver) says `mode` ("diloco" or "ddp"), `pg`
("gradsync" or "gloo"), `rank`, `steps` (inner steps), `sync_every`,
`fragments`, `delay` (Streaming DiLoCo's fragment_sync_delay), `batch`,
`width`, `layers`, `host` (this node's address) and `timeout_s`.  The rest
comes from the environment: TORCHFT_LIGHTHOUSE, GRADSYNC_DAEMON,
GRADSYNC_COMPRESSION, MASTER_ADDR/MASTER_PORT (DDP), GLOO_SOCKET_IFNAME.

Every variant trains the same model from the same seed on the same batches:
an MLP of `layers` square linear layers learns a fixed random teacher (`Teacher`); rank r
at inner step s draws its batch from seed 1000 s + r.  Prints one JSON line at
the end: the monotonic time at the end of every inner step, the seconds each
step spent in DiLoCo's sync hook (prepare and perform), the loss on a fixed
held-out batch, a checksum of the parameters, torchft's committed steps.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import time
from typing import Any

import torch
from torch import nn

from benchmarks.processes import exit_without_destructors

TEACHER_SEED = 1234
MODEL_SEED = 0
EVAL_SEED = 999_999
EVAL_BATCH = 256
LATENT = 32


def make_model(width: int, layers: int) -> nn.Sequential:
    """`layers` blocks of Linear(width, width), GELU between them; seeded."""
    torch.manual_seed(MODEL_SEED)
    blocks: list[nn.Module] = []
    for index in range(layers):
        block: nn.Module = nn.Linear(width, width)
        if index < layers - 1:
            block = nn.Sequential(block, nn.GELU())
        blocks.append(block)
    return nn.Sequential(*blocks)


class Teacher:
    """A fixed random map the model learns.  Inputs lie in a random LATENT-dimensional
    subspace (x = z P, z ~ N(0, 1)); the target is y = 1.5 tanh(2 z A) B, about unit
    variance, so a few dozen steps visibly lower the loss."""

    def __init__(self, width: int) -> None:
        generator = torch.Generator().manual_seed(TEACHER_SEED)
        scale = 1 / math.sqrt(LATENT)
        self.p = torch.randn(LATENT, width, generator=generator) * scale
        self.a = torch.randn(LATENT, LATENT, generator=generator) * scale
        self.b = torch.randn(LATENT, width, generator=generator) * scale

    def batch(self, seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.randn(size, LATENT, generator=torch.Generator().manual_seed(seed))
        return z @ self.p, torch.tanh(2 * z @ self.a) @ self.b * 1.5


def fragments_of(model: nn.Sequential, count: int) -> list[nn.Module]:
    """The model's blocks cut into `count` contiguous fragments of equal length."""
    blocks = list(model)
    if len(blocks) % count:
        raise SystemExit(f"{len(blocks)} layers do not split into {count} fragments")
    size = len(blocks) // count
    return [nn.Sequential(*blocks[i * size:(i + 1) * size]) for i in range(count)]


def evaluate(model: nn.Module, teacher: Teacher) -> float:
    x, y = teacher.batch(EVAL_SEED, EVAL_BATCH)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def train(model: nn.Module, inner: torch.optim.Optimizer, teacher: Teacher,
          config: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Run the inner steps; the end time of each and its train loss."""
    ends: list[float] = []
    losses: list[float] = []
    for step in range(int(config["steps"])):
        x, y = teacher.batch(1000 * step + int(config["rank"]), int(config["batch"]))
        inner.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        inner.step()
        ends.append(time.monotonic())
        losses.append(float(loss))
    return ends, losses


def inner_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)


def run_diloco(config: dict[str, Any]) -> dict[str, Any]:
    """One torchft replica group of one rank, training through torchft's DiLoCo."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    from gradsync.client.torch.torchft_group import ProcessGroupGradsync

    teacher = Teacher(int(config["width"]))
    model = make_model(int(config["width"]), int(config["layers"]))
    fragments = fragments_of(model, int(config["fragments"]))
    inner = inner_optimizer(model)
    outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
              for f in fragments]
    host = str(config["host"])
    timeout = datetime.timedelta(seconds=float(config["timeout_s"]))
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timeout) if config["pg"] == "gloo" else \
        ProcessGroupGradsync(timeout=timeout)
    manager = Manager(
        pg=pg, hostname=host, init_sync=False, min_replica_size=2,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       inner.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"replica{config['rank']}", store_addr=host, store_port=store.port,
        rank=0, world_size=1, timeout=timeout, quorum_timeout=timeout,
        use_async_quorum=False,
        checkpoint_transport=PGTransport(pg, timeout, torch.device("cpu")),
    )
    # Time in DiLoCo's own step hook: ours run just before and just after it.
    in_sync: list[float] = []
    before: list[float] = [0.0]
    inner.register_step_post_hook(lambda *_: before.__setitem__(0, time.monotonic()))
    with DiLoCo(manager, fragments, inner, outers, sync_every=int(config["sync_every"]),
                fragment_sync_delay=int(config["delay"])):
        inner.register_step_post_hook(
            lambda *_: in_sync.append(time.monotonic() - before[0]))
        ends, losses = train(model, inner, teacher, config)
    record = {"committed": manager.current_step(),
              "errored": None if manager.errored() is None else str(manager.errored())[:300]}
    manager.shutdown(wait=False)
    return {**record, "ends": ends, "losses": losses, "in_sync": in_sync,
            "eval_loss": evaluate(model, teacher), "checksum": checksum(model),
            "parameters": sum(p.numel() for p in model.parameters())}


def run_ddp(config: dict[str, Any]) -> dict[str, Any]:
    """One rank of torch DDP (2 ranks) on backend gloo or gradsync, syncing every step."""
    import torch.distributed as dist

    if config["pg"] == "gradsync":
        import gradsync.client.torch  # noqa: F401  (registers the backend)
    teacher = Teacher(int(config["width"]))
    model = make_model(int(config["width"]), int(config["layers"]))
    dist.init_process_group(str(config["pg"]), rank=int(config["rank"]), world_size=2,
                            timeout=datetime.timedelta(seconds=float(config["timeout_s"])))
    ddp = nn.parallel.DistributedDataParallel(model)
    inner = inner_optimizer(ddp)
    ends, losses = train(ddp, inner, teacher, config)
    dist.barrier()
    dist.destroy_process_group()
    return {"committed": None, "errored": None, "ends": ends, "losses": losses,
            "in_sync": [], "eval_loss": evaluate(model, teacher), "checksum": checksum(model),
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    config = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    started = time.monotonic()
    result = run_diloco(config) if config["mode"] == "diloco" else run_ddp(config)
    result.update(rank=config["rank"], started=started)
    sys.stdout.write(json.dumps(result) + "\n")
    exit_without_destructors(0)


if __name__ == "__main__":
    main()
