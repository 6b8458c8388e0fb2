"""What a compressed allreduce may differ from the exact sum, and its test inputs.

The bound proved here, from the per-rounding bounds of
daemon/backends/wire_codec.py.  Let S be the exact sum over the W ranks, A the
elementwise sum of the ranks' |x|, M the number
of daemons, H = M + 1 (no element's partial sum is rounded more than M times:
ring M - 1 hops and the owner's, tree its depth and the root's, rhd at most
log2 M + 2, star 2; forwarding a rounded value rounds it again to itself).
Each rounding q of a partial P has |q(P) - P| <= eps * |P| + delta, with
|P| <= A (1 + eps)^h after h roundings, and each of the at most W float adds
errs by u = 2^-53 (float64) or 2^-24 (float32) of its result.  By induction:

    |r - S| <= ((1 + eps)^H - 1 + W u (1 + eps)^H) A + H delta (1 + eps)^H

with bf16: eps = 2^-8 + 2^-24, delta = 2^-134; fp8: eps = 2^-4,
delta = 2^-17 B_j (half e4m3's subnormal step at a scale below B_j / 224),
B_j the largest A within 255 elements of j: any block of 256 holding j (they
start where a slice does) lies there.
Avg divides r and S by W once more: a relative u.
"""

from __future__ import annotations

import numpy as np

EPS = {"bf16": 2.0**-8 + 2.0**-24, "fp8": 2.0**-4}


def error_bound(fmt: str, inputs: list[np.ndarray], daemons: int, avg: bool) -> np.ndarray:
    """The elementwise bound above for `inputs` (every rank's, finite), float64."""
    magnitude = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
    unit = 2.0**-53 if inputs[0].dtype == np.float64 else 2.0**-24
    eps, roundings, world = EPS[fmt], daemons + 1, len(inputs)
    grow = (1 + eps) ** roundings
    delta = 2.0**-134 if fmt == "bf16" else 2.0**-17 * _nearby_max(magnitude, 256)
    bound = (grow - 1 + world * unit * grow) * magnitude + roundings * delta * grow
    if avg:
        bound = bound / world + unit * magnitude / world
    return bound


def _nearby_max(values: np.ndarray, block: int) -> np.ndarray:
    """Per element, the largest value within block - 1 of it (over-estimated by
    the three aligned blocks around it)."""
    count = values.size
    blocks = -(-count // block)
    padded = np.zeros(blocks * block)
    padded[:count] = values
    per_block = padded.reshape(blocks, block).max(axis=1)
    around = per_block.copy()
    around[1:] = np.maximum(around[1:], per_block[:-1])
    around[:-1] = np.maximum(around[:-1], per_block[1:])
    return around.repeat(block)[:count]


def make_inputs(world: int, count: int, dtype: str, seed: int) -> list[np.ndarray]:
    """Every rank's input: magnitudes over 60 decades (values far beyond fp8's
    range, and tiny ones) in blocks of varying scale, with -0.0 everywhere at
    index 7, +inf (index 3), NaN (5) and +inf against -inf (9) on some ranks."""
    return [rank_input(world, count, dtype, seed, rank) for rank in range(world)]


def rank_input(world: int, count: int, dtype: str, seed: int, rank: int) -> np.ndarray:
    """Rank `rank`'s input of `make_inputs` (each rank's comes from its own generator)."""
    rng = np.random.default_rng([seed, rank])
    scale = 10.0 ** rng.uniform(-30, 30, size=-(-count // 300) + 1).repeat(300)[:count]
    values = (rng.standard_normal(count) * scale).astype(dtype)
    if count > 10:
        values[7] = -0.0
        if rank == 0:
            values[3] = np.inf
            values[9] = -np.inf
        if rank == world - 1:
            values[5] = np.nan
            values[9] = np.inf if world > 1 else values[9]
    return values
