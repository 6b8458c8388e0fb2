"""What the persisted-checkpoint programs share, torch only (the plain loader imports
it without gradsync): the models, a training step, and a state dict flattened into
comparable text (tensors as the hex of their bytes, whole even where sharded)."""

from __future__ import annotations

from typing import Any

import torch


def make_model(fsdp: bool) -> torch.nn.Module:
    """The DDP program's MLP, or four square layers for FSDP2 (same seed each time)."""
    torch.manual_seed(0)
    if fsdp:
        return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               rank: int, width: int) -> None:
    """One step on a batch fixed by (step, rank)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(8, width, generator=generator)
    optimizer.zero_grad()
    model(inputs).pow(2).mean().backward()
    optimizer.step()


def flatten(state: Any, prefix: str = "") -> dict[str, str]:
    """Every leaf of a nested state dict as text: a tensor's dtype, shape and bytes."""
    if isinstance(state, dict):
        out: dict[str, str] = {}
        for key, value in state.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(state, list | tuple):
        return flatten(dict(enumerate(state)), prefix)
    if isinstance(state, torch.Tensor):
        whole = state.full_tensor() if hasattr(state, "full_tensor") else state
        data = whole.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {prefix[:-1]: f"{whole.dtype} {tuple(whole.shape)} {data.hex()}"}
    return {prefix[:-1]: repr(state)}
