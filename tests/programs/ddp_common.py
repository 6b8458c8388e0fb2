"""Shared pieces of the DDP rank programs: models, data shards, single-process references."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch

IN, HIDDEN, OUT = 16, 32, 4
PER_RANK = 6  # rows of each rank's shard per micro-batch


class Net(torch.nn.Module):
    """A small MLP; `extra` joins the output only when asked, `unused` never does."""

    def __init__(self, with_spare: bool = False, head_first: bool = False) -> None:
        super().__init__()
        if head_first:  # registered before the body, though its gradient comes first
            self.head = torch.nn.Linear(HIDDEN, OUT)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
        )
        self.extra = torch.nn.Parameter(torch.randn(IN, OUT) * 0.1) if with_spare else None
        self.unused = torch.nn.Linear(3, 3) if with_spare else None
        if not head_first:
            self.head = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(x))
        if use_extra and self.extra is not None:
            out = out + x @ self.extra
        return out


def make_net(
    seed: int, dtype: torch.dtype, with_spare: bool = False, head_first: bool = False
) -> Net:
    """The same weights for the same seed (built in float32, then converted)."""
    torch.manual_seed(seed)
    return Net(with_spare, head_first).to(dtype)


def batch(
    step: int, micro: int, world: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-step: `world` shards of PER_RANK rows."""
    generator = torch.Generator().manual_seed(10_000 + 97 * step + micro)
    x = torch.randn(world * PER_RANK, IN, generator=generator, dtype=torch.float64)
    y = torch.randn(world * PER_RANK, OUT, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * PER_RANK : (rank + 1) * PER_RANK]


def uses_extra(rank: int, step: int) -> bool:
    """The spare parameter is used on rank 0 at even steps only: globally unused at odd ones."""
    return rank == 0 and step % 2 == 0


def loss_fn(model: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor,
            use_extra: bool = False) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x, use_extra=use_extra), y)


class Optimizer:
    """SGD with momentum or Adam, written out: `torch.optim` costs each process a
    torch._dynamo import (seconds on a busy two-core machine).  Like torch's,
    it skips parameters whose grad is None."""

    def __init__(self, params: Iterable[torch.nn.Parameter], kind: str) -> None:
        self.params = list(params)
        self.kind = kind
        self.state: dict[int, list[torch.Tensor]] = {}
        self.steps = 0

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for index, param in enumerate(self.params):
            grad = param.grad
            if grad is None:
                continue
            if self.kind == "adam":
                m, v = self.state.setdefault(
                    index, [torch.zeros_like(param), torch.zeros_like(param)])
                m.mul_(0.9).add_(grad, alpha=0.1)
                v.mul_(0.999).addcmul_(grad, grad, value=0.001)
                m_hat = m / (1 - 0.9**self.steps)
                v_hat = v / (1 - 0.999**self.steps)
                param.sub_(0.01 * m_hat / (v_hat.sqrt() + 1e-8))
            else:
                if index not in self.state:
                    self.state[index] = [grad.clone()]
                else:
                    self.state[index][0].mul_(0.9).add_(grad)
                param.sub_(0.1 * self.state[index][0])


def make_optimizer(params: Iterable[torch.nn.Parameter], kind: str) -> Optimizer:
    return Optimizer(params, kind)


def reference_train(
    dtype: torch.dtype, world: int, steps: int, micros: int, optimizer: str,
    spare: bool = False, head_first: bool = False,
) -> Net:
    """Single-process training on the concatenated batch of all ranks."""
    model = make_net(1000, dtype, spare, head_first)
    opt = make_optimizer(model.parameters(), optimizer)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(micros):
            x, y = batch(step, micro, world, dtype)
            if spare:
                # Each rank's shard with its own use of `extra`; the ranks' mean.
                loss = sum(
                    loss_fn(model, shard(x, r), shard(y, r), uses_extra(r, step))
                    for r in range(world)
                ) / world
            else:
                loss = loss_fn(model, x, y)
            assert isinstance(loss, torch.Tensor)
            loss.backward()
        opt.step()
    return model


def max_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    return max(
        float((a.detach().double() - b.detach().double()).abs().max())
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
    )


def digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal on all ranks iff they hold the same model."""
    hasher = hashlib.sha256()
    for param in model.parameters():
        hasher.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:16]
