"""Lightning `Trainer.fit` on 2 CPU processes with DDPStrategy on the given backend.

argv: backend (gradsync or gloo), output prefix; each rank writes its final
parameters to PREFIX.RANK as JSON.  Lightning starts rank 1 itself (it runs
this script again); nothing here imports gradsync.
"""

import json
import sys
import warnings

import lightning as L
import torch
from gloo_exit import leave_if_gloo
from lightning.pytorch.strategies import DDPStrategy

warnings.filterwarnings("ignore")
BACKEND, OUT = sys.argv[1], sys.argv[2]


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1)).double()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=generator, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def main() -> None:
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        strategy=DDPStrategy(process_group_backend=BACKEND))
    trainer.fit(model, data())
    assert torch.distributed.get_backend() == BACKEND
    params = [float(v) for p in model.parameters() for v in p.detach().flatten()]
    with open(f"{OUT}.{trainer.global_rank}", "w") as out:
        json.dump(params, out)
    leave_if_gloo()  # the reference run: torch 2.13's gloo exit abort (gloo_exit.py)


if __name__ == "__main__":
    main()
