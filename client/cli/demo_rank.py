"""`gradsync demo`: train a small MLP data-parallel through gradsync, and check it.

`gradsync demo --nproc 2` starts (or finds) a daemon the way `gradsync launch`
does, runs `--nproc` ranks of this module, and each rank trains the same MLP
on its share of every global batch of a generated spiral data set (3 classes,
seeded, no download).  Gradients are averaged while backward runs: through
`gradsync.client.torch.DistributedDataParallel` when torch is installed,
otherwise through a numpy MLP and `GradientBucketer`.  The model is float64 so
that the final check can be tight.

Rank 0 prints a progress bar per epoch with the loss and accuracy over the
global batches, then time per step, bytes synced, the share of communication
hidden behind backward, and the check that matters: the parameters are
identical on all ranks, and equal (to float tolerance) to the same model
trained in one process on the full global batches.  Every rank exits 1 if
the check fails.

This module is a rank (`python -m gradsync.client.cli.demo_rank`); the
command's side (options, launch) is `demo`, which `gradsync` imports without
paying for numpy, and the numpy MLP is `demo_model`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Protocol

import numpy as np

from gradsync.client.bucketer import GradientBucketer
from gradsync.client.cli.demo import add_demo_arguments
from gradsync.client.cli.demo_model import CLASSES, NumpyMLP
from gradsync.client.client import Client
from gradsync.client.work import Work

if TYPE_CHECKING:
    import torch

#: |DP - single process| allowed, relative to the parameters' scale: float64 sums in a
#: different order differ by ~1e-16 a step; a real bug differs by far more.
TOLERANCE = 1e-8


# -- data -----------------------------------------------------------------------


def make_spiral(seed: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """`samples` 2-d points on CLASSES interleaved noisy spiral arms, and their labels."""
    rng = np.random.default_rng(seed)
    labels = np.arange(samples) % CLASSES
    radius = rng.uniform(0.05, 1.0, samples)
    angle = labels * (2 * np.pi / CLASSES) + radius * 4.0 + rng.normal(0.0, 0.2, samples)
    points = np.stack([radius * np.sin(angle), radius * np.cos(angle)], axis=1)
    return points.astype(np.float64), labels.astype(np.int64)


def global_batches(seed: int, epoch: int, samples: int, global_batch: int) -> list[np.ndarray]:
    """This epoch's global batches of sample indices (same on every rank; the tail is
    dropped so that every rank's share has the same size and the average is exact)."""
    order = np.random.default_rng([seed, epoch]).permutation(samples)
    steps = samples // global_batch
    return [order[i * global_batch : (i + 1) * global_batch] for i in range(steps)]


# -- models ---------------------------------------------------------------------


class Trainer(Protocol):
    """One rank's model and optimizer; `step` does forward, backward (synced) and update."""

    description: str
    parameter_count: int

    def step(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Train on one batch; return its (loss, accuracy) before the update."""
        ...

    def flat_parameters(self) -> np.ndarray:
        """All parameters, flattened into one float64 array in a fixed order."""
        ...

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Class labels for `x`."""
        ...

    def perturb(self) -> None:
        """Nudge one parameter (the demo's sabotage switch)."""
        ...

    def comm_stats(self) -> CommStats:
        """What was synchronised so far."""
        ...


@dataclasses.dataclass
class CommStats:
    """Totals over the steps: bytes handed to the daemon, and the time from each bucket's
    hand-over to the daemon's `completed` timestamp, all of it and the part before
    backward ended."""

    steps: int = 0
    bytes: int = 0
    buckets: int = 0
    comm_s: float = 0.0
    hidden_s: float = 0.0


class NumpyTrainer:
    """The numpy MLP, its gradients averaged through a `GradientBucketer`."""

    def __init__(self, client: Client, args: argparse.Namespace) -> None:
        self.model = NumpyMLP(args.hidden, args.seed, args.lr)
        for param in self.model.params.values():  # every rank starts from rank 0's init
            client.broadcast(param, src=0)
        self.bucketer = GradientBucketer(client, bucket_cap_bytes=int(args.bucket_kib * 1024))
        self.parameter_count = sum(p.size for p in self.model.params.values())
        self.description = f"numpy MLP 2-{args.hidden}-{args.hidden}-{CLASSES} (GradientBucketer)"
        self.stats = CommStats()

    def _out(self, name: str) -> np.ndarray | None:
        # Once the layout is fixed, backward writes each gradient straight into its bucket.
        return self.bucketer.slot(name) if self.bucketer.steps else None

    def step(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        activations = self.model.forward(x)
        loss, accuracy, dlogits = self.model.loss_and_accuracy(activations[-1], y)
        grads = {}
        for name, grad in self.model.backward(activations, dlogits, self._out):
            self.bucketer.add(name, grad)  # a full bucket goes to the daemon right here
            grads[name] = grad
        step = self.bucketer.wait()  # the rest; grads now hold the average over ranks
        self.model.update(grads)
        self.stats.steps += 1
        self.stats.bytes += step.bytes
        self.stats.buckets = step.buckets
        self.stats.comm_s += step.comm_s
        self.stats.hidden_s += step.hidden_s
        return loss, accuracy

    def flat_parameters(self) -> np.ndarray:
        return self.model.flat_parameters()

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.model.predict(x)

    def perturb(self) -> None:
        self.model.params["fc3.bias"][0] += 1e-3

    def comm_stats(self) -> CommStats:
        return self.stats


def numpy_reference(args: argparse.Namespace, world_size: int) -> np.ndarray:
    """The same numpy model trained in one process on the full global batches."""
    x, y = make_spiral(args.seed, args.samples)
    model = NumpyMLP(args.hidden, args.seed, args.lr)
    for epoch in range(args.epochs):
        for batch in global_batches(args.seed, epoch, args.samples, world_size * args.batch_size):
            model.local_step(x[batch], y[batch])
    return model.flat_parameters()


def _torch_mlp(hidden: int, seed: int) -> torch.nn.Sequential:
    """The torch twin of `NumpyMLP` (torch's default init, seeded), in float64."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(2, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, CLASSES),
    ).double()


def _flat_torch(module: torch.nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().reshape(-1).numpy() for p in module.parameters()])


class TorchTrainer:
    """The torch MLP in `gradsync.client.torch.DistributedDataParallel`."""

    def __init__(self, client: Client, args: argparse.Namespace) -> None:
        import torch

        from gradsync.client.torch import DistributedDataParallel

        cap_mb = args.bucket_kib / 1024
        self.model = _torch_mlp(args.hidden, args.seed)
        self.ddp = DistributedDataParallel(
            self.model, client=client, bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb / 4
        )
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=args.lr, momentum=0.9)
        self.parameter_count = sum(p.numel() for p in self.model.parameters())
        self.description = (f"torch MLP 2-{args.hidden}-{args.hidden}-{CLASSES} "
                            "(gradsync DistributedDataParallel)")
        self.stats = CommStats()

    def step(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        import torch

        inputs, labels = torch.from_numpy(x), torch.from_numpy(y)
        self.optimizer.zero_grad()
        logits = self.ddp(inputs)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        # Buckets are averaged while this runs; they are in place when it returns.
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        record = self.ddp.last_step
        if record is not None:
            self.stats.steps += 1
            self.stats.buckets = len(record.buckets)
            for bucket in record.buckets:
                completed = bucket.timing.get("completed", record.synced)
                self.stats.bytes += bucket.nbytes
                self.stats.comm_s += max(0.0, completed - bucket.handed_over)
                self.stats.hidden_s += max(
                    0.0, min(completed, record.backward_end) - bucket.handed_over)
        accuracy = float((logits.argmax(dim=1) == labels).double().mean())
        return float(loss.detach()), accuracy

    def flat_parameters(self) -> np.ndarray:
        return _flat_torch(self.model)

    def predict(self, x: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            return np.asarray(self.model(torch.from_numpy(x)).argmax(dim=1).numpy())

    def perturb(self) -> None:
        import torch

        with torch.no_grad():
            list(self.model.parameters())[-1].view(-1)[0] += 1e-3  # the last bias

    def comm_stats(self) -> CommStats:
        return self.stats


def torch_reference(args: argparse.Namespace, world_size: int) -> np.ndarray:
    """The same torch model trained in one process on the full global batches."""
    import torch

    x, y = make_spiral(args.seed, args.samples)
    model = _torch_mlp(args.hidden, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        for batch in global_batches(args.seed, epoch, args.samples, world_size * args.batch_size):
            optimizer.zero_grad()
            logits = model(torch.from_numpy(x[batch]))
            loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y[batch]))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
    return _flat_torch(model)


def torch_available() -> str | None:
    """None when the torch path can run, else why not."""
    try:
        import gradsync.client.torch  # noqa: F401  (imports torch)
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            return "torch is not installed"
        return f"gradsync.client.torch cannot be imported ({exc})"
    except ImportError as exc:
        return f"gradsync.client.torch cannot be imported ({exc})"
    return None


def make_trainer(client: Client, args: argparse.Namespace) -> tuple[Trainer, str | None]:
    """The trainer for `--backend`, and a note when auto fell back to numpy."""
    if args.backend == "numpy":
        return NumpyTrainer(client, args), None
    missing = torch_available()
    if missing is None:
        return TorchTrainer(client, args), None
    if args.backend == "torch":
        raise SystemExit(f"gradsync demo: --backend torch: {missing}")
    return NumpyTrainer(client, args), f"{missing}: training a numpy MLP with GradientBucketer"


def reference_parameters(trainer: Trainer, args: argparse.Namespace, world: int) -> np.ndarray:
    if isinstance(trainer, NumpyTrainer):
        return numpy_reference(args, world)
    return torch_reference(args, world)


# -- output ---------------------------------------------------------------------


class Progress:
    """A plain-text bar per epoch: redrawn with \\r on a terminal, one line per epoch else."""

    def __init__(self, stream: IO[str], epochs: int, steps: int) -> None:
        self.stream = stream
        self.epochs = epochs
        self.steps = steps
        self.live = stream.isatty()
        self._drawn = 0.0

    def _line(self, epoch: int, step: int, loss: float, accuracy: float) -> str:
        width = 24
        filled = width * step // self.steps
        return (f"epoch {epoch + 1:>{len(str(self.epochs))}}/{self.epochs} "
                f"[{'#' * filled}{'.' * (width - filled)}] {step:>{len(str(self.steps))}}/"
                f"{self.steps}  loss {loss:.4f}  acc {accuracy:6.1%}")

    def update(self, epoch: int, step: int, loss: float, accuracy: float) -> None:
        now = time.monotonic()
        if self.live and now - self._drawn > 0.05:
            self._drawn = now
            self.stream.write("\r" + self._line(epoch, step, loss, accuracy))
            self.stream.flush()

    def end_epoch(self, epoch: int, loss: float, accuracy: float, seconds: float) -> None:
        line = self._line(epoch, self.steps, loss, accuracy) + f"  {seconds:.2f}s"
        self.stream.write(("\r" if self.live else "") + line + "\n")
        self.stream.flush()


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


class MetricsSync:
    """Averages each step's (loss, accuracy) over the ranks without waiting for it:
    the allreduce of step t is collected at step t+1, so two buffers take turns."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.buffers = [client.empty(2, np.float64), client.empty(2, np.float64)]
        self.pending: list[Work | None] = [None, None]
        self.turn = 0

    def submit(self, loss: float, accuracy: float) -> np.ndarray | None:
        """Send this step's values; return the previous step's averages, if any."""
        self.buffers[self.turn][...] = (loss, accuracy)
        self.pending[self.turn] = self.client.all_reduce(
            self.buffers[self.turn], "avg", async_op=True)
        self.turn ^= 1
        return self._collect(self.turn)

    def flush(self) -> np.ndarray | None:
        """The last step's averages."""
        return self._collect(self.turn ^ 1)

    def _collect(self, turn: int) -> np.ndarray | None:
        work, self.pending[turn] = self.pending[turn], None
        if work is None:
            return None
        work.wait()
        return self.buffers[turn].copy()


# -- a rank ---------------------------------------------------------------------


def parameters_identical(client: Client, flat: np.ndarray) -> tuple[bool, float]:
    """Whether every rank holds exactly `flat` (elementwise max of [p, -p] over ranks),
    and the largest spread between ranks."""
    both = client.empty(2 * flat.size, np.float64)
    both[: flat.size] = flat
    both[flat.size :] = -flat
    client.all_reduce(both, "max")
    high, low = both[: flat.size], -both[flat.size :]
    spread = float(np.max(high - low)) if flat.size else 0.0
    return bool(np.array_equal(high, flat) and np.array_equal(low, flat)), spread


def train(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    rank, world = client.rank, client.world_size
    lead = rank == 0

    def say(line: str) -> None:
        if lead:
            out.write(line + "\n")
            out.flush()

    x, y = make_spiral(args.seed, args.samples)
    trainer, note = make_trainer(client, args)
    if note:
        say(f"gradsync demo: {note}")
    say(f"gradsync demo: {_count(world, 'rank')} x {args.batch_size} samples per step, "
        f"{trainer.description}, {trainer.parameter_count:,} float64 parameters; "
        f"spiral data, {args.samples} points in {CLASSES} classes; daemon pid "
        f"{client.daemon_pid} at {client.daemon}")
    global_batch = world * args.batch_size
    steps_per_epoch = args.samples // global_batch
    progress = Progress(out, args.epochs, steps_per_epoch)
    metrics = MetricsSync(client)
    steps = 0
    started = time.perf_counter()
    for epoch in range(args.epochs):
        epoch_started = time.perf_counter()
        totals = np.zeros(2)
        for index, batch in enumerate(
            global_batches(args.seed, epoch, args.samples, global_batch)
        ):
            mine = batch[rank * args.batch_size : (rank + 1) * args.batch_size]
            loss, accuracy = trainer.step(x[mine], y[mine])
            steps += 1
            if args._break and rank == world - 1 and steps == max(1, steps_per_epoch // 2):
                trainer.perturb()
            previous = metrics.submit(loss, accuracy)
            if previous is not None:
                totals += previous
                if lead:
                    progress.update(epoch, index, totals[0] / index, totals[1] / index)
        last = metrics.flush()
        assert last is not None
        totals += last
        if lead:
            mean = totals / steps_per_epoch
            progress.end_epoch(epoch, mean[0], mean[1], time.perf_counter() - epoch_started)
    elapsed = time.perf_counter() - started

    flat = trainer.flat_parameters()
    identical, spread = parameters_identical(client, flat)
    stats = trainer.comm_stats()
    say(f"time per step: {elapsed / steps * 1e3:.2f} ms ({steps} steps in {elapsed:.2f} s)")
    say(f"bytes synced: {human_bytes(stats.bytes)} per rank "
        f"({human_bytes(stats.bytes / max(stats.steps, 1))} per step in "
        f"{_count(stats.buckets, 'bucket')})")
    if stats.comm_s > 0:
        say(f"communication hidden behind backward: {stats.hidden_s / stats.comm_s:.0%} "
            f"({stats.hidden_s / stats.steps * 1e3:.3f} of "
            f"{stats.comm_s / stats.steps * 1e3:.3f} ms per step, daemon timestamps)")
    accuracy = float((trainer.predict(x) == y).mean())
    say(f"accuracy on the whole data set: {accuracy:.1%}")
    verdict = client.empty(1, np.int8)
    if lead:
        ok = identical
        say(f"check: parameters identical on all {_count(world, 'rank')}: "
            + ("yes" if identical else f"NO (largest spread between ranks {spread:.3g})"))
        reference = reference_parameters(trainer, args, world)
        error = float(np.max(np.abs(flat - reference)))
        bound = TOLERANCE * max(1.0, float(np.max(np.abs(reference))))
        matches = error <= bound
        ok = ok and matches
        say(f"check: equal to the same model trained in one process on the full "
            f"{global_batch}-sample batches: max abs difference {error:.2e} "
            f"(tolerance {bound:.1e}): " + ("yes" if matches else "NO"))
        say("OK: data-parallel training through gradsync matches single-process training"
            if ok else "FAIL: the data-parallel model is not the single-process model")
        verdict[0] = 1 if ok else 0
    client.broadcast(verdict, src=0)  # every rank exits with rank 0's verdict
    return 0 if verdict[0] == 1 and identical else 1


def main(argv: Sequence[str] | None = None) -> int:
    """A rank of the demo (started by `gradsync demo`, with the launch variables set)."""
    parser = argparse.ArgumentParser(prog="python -m gradsync.client.cli.demo_rank",
                                     description="one rank of `gradsync demo`",
                                     allow_abbrev=False)
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    with Client() as client:
        return train(client, args, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())

