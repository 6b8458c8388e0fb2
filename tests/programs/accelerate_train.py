"""HF accelerate training under torchrun on the given backend; nothing imports gradsync.

argv: backend (gradsync or gloo), output prefix.  The process group is made first, as
accelerate's CPU path documents for a backend of one's choice (its own choice
on CPUs is gloo or mpi); `Accelerator(cpu=True)` then wraps the model in torch
DDP over it.  Each rank writes its backend, accelerate's
distributed type, the wrapped model's class, the final parameters and the
gathered losses, as JSON to PREFIX.RANK.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist
from accelerate import Accelerator
from gloo_exit import leave_if_gloo

warnings.filterwarnings("ignore")
dist.init_process_group(sys.argv[1])
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
generator = torch.Generator().manual_seed(1)
x = torch.randn(128, 8, generator=generator)
y = x.sum(dim=1, keepdim=True).sin()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for _epoch in range(2):
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.gather(loss.detach()).mean()))
record = json.dumps({
    "rank": dist.get_rank(), "backend": dist.get_backend(),
    "type": str(accelerator.distributed_type), "model": type(model).__name__,
    "params": [float(v) for p in model.parameters() for v in p.detach().flatten()],
    "losses": losses,
})
with open(f"{sys.argv[2]}.{dist.get_rank()}", "w") as out:
    out.write(record)
leave_if_gloo()  # the reference run: torch 2.13's gloo exit abort (gloo_exit.py)
