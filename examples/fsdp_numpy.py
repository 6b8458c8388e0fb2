"""Sharded data parallelism (FSDP / ZeRO-3 style) with gradsync, in plain numpy.

Run:  gradsync launch --nproc-per-node 2 examples/fsdp_numpy.py

Each rank keeps only its shard of the flat parameter vector (and of the
optimizer state).  Every step it all-gathers the full parameters for the
forward and backward pass on its own slice of the batch, reduce-scatters the
averaged gradient so that it receives just its shard's part, and updates its
shard.  At the end the full model is gathered and compared with the same model
trained unsharded, in one process, on the full batch: they must match.
"""

from __future__ import annotations

import sys

import numpy as np

from gradsync.client import Client

FEATURES, HIDDEN, CLASSES = 16, 32, 4
SAMPLES, STEPS, LEARNING_RATE, MOMENTUM = 512, 60, 0.5, 0.9


def layout() -> list[tuple[str, tuple[int, ...]]]:
    return [("w1", (FEATURES, HIDDEN)), ("b1", (HIDDEN,)),
            ("w2", (HIDDEN, CLASSES)), ("b2", (CLASSES,))]


def unflatten(flat: np.ndarray) -> dict[str, np.ndarray]:
    params, offset = {}, 0
    for name, shape in layout():
        size = int(np.prod(shape))
        params[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    return params


def parameter_count() -> int:
    return sum(int(np.prod(shape)) for _, shape in layout())


def loss_and_gradient(flat: np.ndarray, x: np.ndarray, y: np.ndarray, total: int
                      ) -> tuple[float, np.ndarray]:
    """Softmax cross-entropy of a tanh MLP, summed over x and divided by `total`."""
    p = unflatten(flat)
    hidden = np.tanh(x @ p["w1"] + p["b1"])
    logits = hidden @ p["w2"] + p["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = -np.log(probs[np.arange(len(y)), y]).sum() / total
    d_logits = probs
    d_logits[np.arange(len(y)), y] -= 1
    d_logits /= total
    grads = {"w2": hidden.T @ d_logits, "b2": d_logits.sum(axis=0)}
    d_hidden = (d_logits @ p["w2"].T) * (1 - hidden**2)
    grads["w1"] = x.T @ d_hidden
    grads["b1"] = d_hidden.sum(axis=0)
    return float(loss), np.concatenate([grads[name].ravel() for name, _ in layout()])


def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, FEATURES))
    y = (x[:, :CLASSES] * np.arange(1, CLASSES + 1)).argmax(axis=1)
    init = rng.standard_normal(parameter_count()) * 0.3
    return x, y, init


def train_unsharded(x: np.ndarray, y: np.ndarray, init: np.ndarray) -> np.ndarray:
    flat, velocity = init.copy(), np.zeros_like(init)
    for _ in range(STEPS):
        _, grad = loss_and_gradient(flat, x, y, len(y))
        velocity = MOMENTUM * velocity + grad
        flat -= LEARNING_RATE * velocity
    return flat


def main() -> int:
    x, y, init = data()
    with Client() as client:
        world, rank = client.world_size, client.rank
        shard = -(-parameter_count() // world)          # padded so shards are equal
        padded = shard * world
        mine = slice(rank * shard, (rank + 1) * shard)
        full = client.empty(padded, np.float64)          # all-gathered parameters
        grads = client.empty(padded, np.float64)         # local gradient, all ranks' layout
        my_params = client.empty(shard, np.float64)      # this rank's shard
        my_grad = client.empty(shard, np.float64)
        start = np.zeros(padded)
        start[: parameter_count()] = init
        my_params[...] = start[mine]
        velocity = np.zeros(shard)                       # optimizer state: sharded too
        rows = np.array_split(np.arange(SAMPLES), world)[rank]
        for step in range(STEPS):
            client.all_gather(full, my_params)
            loss, grad = loss_and_gradient(full[: parameter_count()], x[rows], y[rows], SAMPLES)
            grads[...] = 0
            grads[: parameter_count()] = grad
            # Sum, not avg: each rank already divided by the global batch size.
            client.reduce_scatter(my_grad, grads, op="sum")
            velocity = MOMENTUM * velocity + my_grad
            my_params -= LEARNING_RATE * velocity
            losses = np.array([loss])
            client.all_reduce(losses, op="sum")
            if rank == 0 and step % 10 == 0:
                print(f"step {step:3d}  loss {losses[0]:.4f}", flush=True)
        client.all_gather(full, my_params)
        trained = np.array(full[: parameter_count()])
    reference = train_unsharded(x, y, init)
    error = float(np.max(np.abs(trained - reference)))
    ok = error < 1e-10
    if rank == 0:
        print(f"sharded across {world} ranks vs unsharded in one process: max |diff| = "
              f"{error:.2e} -> {'MATCH' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
