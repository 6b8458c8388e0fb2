"""The demo's hand-written numpy MLP: forward, backward layer by layer, SGD with momentum.

It serves `gradsync demo` alone (the numpy path of `demo_rank`, and its
single-process reference), so it lives with the command, not in the
installed library's core.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

#: The spiral data set's classes: the MLP's output width.
CLASSES = 3


class NumpyMLP:
    """2 -> hidden -> hidden -> CLASSES, ReLU, softmax cross-entropy; SGD with momentum."""

    def __init__(self, hidden: int, seed: int, lr: float, momentum: float = 0.9) -> None:
        rng = np.random.default_rng([seed, 1])
        sizes = [2, hidden, hidden, CLASSES]
        #: Registration order (forward); gradients come in the reverse order.
        self.params: dict[str, np.ndarray] = {}
        for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes), 1):
            bound = 1.0 / np.sqrt(fan_in)
            self.params[f"fc{layer}.weight"] = rng.uniform(-bound, bound, (fan_in, fan_out))
            self.params[f"fc{layer}.bias"] = rng.uniform(-bound, bound, fan_out)
        self.lr = lr
        self.momentum = momentum
        self.velocity = {name: np.zeros_like(p) for name, p in self.params.items()}

    def forward(self, x: np.ndarray) -> list[np.ndarray]:
        """Activations: input, both hidden layers, logits."""
        p = self.params
        h1 = np.maximum(x @ p["fc1.weight"] + p["fc1.bias"], 0.0)
        h2 = np.maximum(h1 @ p["fc2.weight"] + p["fc2.bias"], 0.0)
        return [x, h1, h2, h2 @ p["fc3.weight"] + p["fc3.bias"]]

    @staticmethod
    def loss_and_accuracy(logits: np.ndarray, y: np.ndarray) -> tuple[float, float, np.ndarray]:
        """Mean cross-entropy, accuracy, and d(loss)/d(logits)."""
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        rows = np.arange(len(y))
        loss = float(-log_probs[rows, y].mean())
        accuracy = float((logits.argmax(axis=1) == y).mean())
        dlogits = np.exp(log_probs)
        dlogits[rows, y] -= 1.0
        return loss, accuracy, dlogits / len(y)

    def backward(
        self, activations: list[np.ndarray], dlogits: np.ndarray,
        out: Callable[[str], np.ndarray | None],
    ) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (name, gradient) last layer first, each as soon as it is computed.

        `out(name)` may give the array to write a gradient into (a bucket slot).
        """
        delta = dlogits
        for layer in (3, 2, 1):
            below = activations[layer - 1]
            weight_name, bias_name = f"fc{layer}.weight", f"fc{layer}.bias"
            yield weight_name, np.matmul(below.T, delta, out=out(weight_name))
            yield bias_name, np.sum(delta, axis=0, out=out(bias_name))
            if layer > 1:
                delta = (delta @ self.params[weight_name].T) * (below > 0)

    def update(self, grads: dict[str, np.ndarray]) -> None:
        """SGD with momentum, as torch.optim.SGD does it."""
        for name, param in self.params.items():
            velocity = self.velocity[name]
            velocity *= self.momentum
            velocity += grads[name]
            param -= self.lr * velocity

    def flat_parameters(self) -> np.ndarray:
        return np.concatenate([p.reshape(-1) for p in self.params.values()])

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self.forward(x)[-1].argmax(axis=1))

    def local_step(self, x: np.ndarray, y: np.ndarray) -> None:
        """One step in one process (the reference): no synchronisation."""
        activations = self.forward(x)
        _, _, dlogits = self.loss_and_accuracy(activations[-1], y)
        self.update(dict(self.backward(activations, dlogits, lambda name: None)))
