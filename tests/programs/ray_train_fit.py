"""Ray Train `TorchTrainer` on 2 CPU workers of a local Ray cluster, with a given backend.

argv: backend (gradsync or gloo, or "reference": the same steps in this one
process, without Ray), output prefix.  Each worker writes PREFIX.RANK as JSON:
its final parameters, the backend torch reports, and its gradsync daemon's
pid.  Ray's workers call `init_process_group` themselves before the training
function runs; nothing here imports gradsync (torch's entry point registers
it), and no daemon is started by hand.
"""

import json
import sys
import warnings
from typing import Any

import torch

warnings.filterwarnings("ignore")
BACKEND, OUT = sys.argv[1], sys.argv[2]
WORKERS, STEPS, ROWS = 2, 8, 16


def fit(rank: int, world: int, wrap: Any) -> list[float]:
    """Rows [rank*ROWS, ...) of each step's batch of world*ROWS; the mean of the
    workers' gradients is the whole batch's (equal shares)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 1)).double()
    model = wrap(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * WORKERS * ROWS, 8, generator=generator, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin()
    share = WORKERS * ROWS // world
    for step in range(STEPS):
        start = step * WORKERS * ROWS + rank * share
        rows = slice(start, start + share)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return [float(v) for p in model.parameters() for v in p.detach().flatten()]


def train(config: dict[str, str]) -> None:
    import torch.distributed as dist
    from ray.train.torch import prepare_model

    params = fit(dist.get_rank(), dist.get_world_size(), prepare_model)  # torch DDP
    group = dist.distributed_c10d._get_default_group()
    with open(f"{config['out']}.{dist.get_rank()}", "w") as out:
        json.dump({"backend": dist.get_backend(), "params": params,
                   "daemon_pid": getattr(getattr(group, "client", None), "daemon_pid", None)},
                  out)


def main() -> None:
    if BACKEND == "reference":
        with open(f"{OUT}.0", "w") as out:
            json.dump({"params": fit(0, 1, lambda net: net)}, out)
        return
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    try:
        TorchTrainer(
            train, train_loop_config={"out": OUT},
            scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
            torch_config=TorchConfig(backend=BACKEND, timeout_s=120),
        ).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
