"""Lightning Fabric on 2 CPU processes with its DDPStrategy on the given backend.

argv: backend (gradsync or gloo), output prefix; each rank writes its final
parameters to PREFIX.RANK as JSON.  Fabric starts rank 1 itself (it runs this
script again); nothing here imports gradsync.
"""

import json
import sys
import warnings

import torch
from gloo_exit import leave_if_gloo
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

warnings.filterwarnings("ignore")
BACKEND, OUT = sys.argv[1], sys.argv[2]


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=DDPStrategy(process_group_backend=BACKEND))
    fabric.launch()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 1)).double()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    model, optimizer = fabric.setup(net, optimizer)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=generator, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin()
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=16))
    for _epoch in range(2):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    assert torch.distributed.get_backend() == BACKEND
    params = [float(v) for p in model.parameters() for v in p.detach().flatten()]
    with open(f"{OUT}.{fabric.global_rank}", "w") as out:
        json.dump(params, out)
    leave_if_gloo()  # the reference run: torch 2.13's gloo exit abort (gloo_exit.py)


if __name__ == "__main__":
    main()
