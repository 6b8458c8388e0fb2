"""What frameworks call on backend "gradsync", one scenario per run (argv[1]).

- `monitored_barrier`: the last rank is held back; the others' barrier must
  fail within its timeout, naming that rank.
- `dcp`: FSDP2-sharded model trained two steps, saved with
  torch.distributed.checkpoint into argv[2], loaded into a freshly initialised
  sharded model: its full parameters must equal the saved ones.
- `pipelining`: a 2-stage GPipe schedule (torch.distributed.pipelining) over
  send/recv; each stage's gradients must equal those of the same model run
  whole on one process.

Ranks come from env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).  Prints one
JSON line.
"""

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

SCENARIO = sys.argv[1]
dist.init_process_group("gradsync", timeout=datetime.timedelta(seconds=60))
RANK, WORLD = dist.get_rank(), dist.get_world_size()
result: dict[str, object] = {"rank": RANK, "scenario": SCENARIO}


def model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))


if SCENARIO == "monitored_barrier":
    if RANK == WORLD - 1:
        time.sleep(4.0)  # held back past the others' timeout
        result["error"] = None
    else:
        began = time.monotonic()
        try:
            # torch's own function, unchanged: it reaches gradsync's for this group.
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=1.5))
            result["error"] = None
        except dist.DistBackendError as exc:
            result["error"] = str(exc)
        result["waited_s"] = time.monotonic() - began

elif SCENARIO == "dcp":
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))

    def sharded(seed: int) -> torch.nn.Sequential:
        net = model(seed)
        for layer in net:
            fully_shard(layer, mesh=mesh)
        return fully_shard(net, mesh=mesh)

    trained = sharded(0)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    for step in range(2):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(RANK * 10 + step))
        trained(inputs).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    saved = {k: v.full_tensor().clone() for k, v in get_model_state_dict(trained).items()}
    dcp.save({"model": get_model_state_dict(trained)}, checkpoint_id=sys.argv[2])
    fresh = sharded(1)
    before = {k: v.full_tensor() for k, v in get_model_state_dict(fresh).items()}
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=sys.argv[2])
    fresh.load_state_dict(state["model"])
    loaded = {k: v.full_tensor() for k, v in get_model_state_dict(fresh).items()}
    result["keys"] = sorted(saved)
    result["differed_before"] = any(not torch.equal(before[k], saved[k]) for k in saved)
    result["equal_after"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
    result["sharded"] = all(v.to_local().numel() < v.numel()
                            for v in get_model_state_dict(fresh).values() if v.dim() == 2)

elif SCENARIO == "pipelining":
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    whole = model(0)
    inputs = torch.randn(8, 8, generator=torch.Generator().manual_seed(7))
    target = torch.randn(8, 8, generator=torch.Generator().manual_seed(8))

    def loss_fn(output: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, expected)

    # The reference: the whole model on this process, the loss averaged over the
    # same four microbatches GPipe splits the batch into (GPipe scales each
    # microbatch's gradients by 1/4).
    reference = model(0)
    microbatches = zip(inputs.chunk(4), target.chunk(4), strict=True)
    (sum(loss_fn(reference(x), y) for x, y in microbatches) / 4).backward()
    layers = list(range(2 * RANK, 2 * RANK + 2))
    part = torch.nn.Sequential(*(whole[i] for i in layers))
    stage = PipelineStage(part, RANK, WORLD, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    if RANK == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=target, losses=losses)
    result["losses"] = [float(x.detach()) for x in losses]
    result["grads_match"] = all(
        torch.allclose(whole[i].weight.grad, reference[i].weight.grad, atol=1e-6)
        and torch.allclose(whole[i].bias.grad, reference[i].bias.grad, atol=1e-6)
        for i in layers)

dist.destroy_process_group()
print(json.dumps(result), flush=True)
