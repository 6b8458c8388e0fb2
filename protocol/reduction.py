"""The arithmetic of a reduction, shared by the daemon and the fast path.

Both reduce the ranks' values in rank order with the same numpy ufuncs (avg:
sum, then one division by the number of ranks), so a collective's result is
bit-identical whichever path ran it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradsync.protocol.dtypes import ReduceOp

UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PROD: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def reduce_in_rank_order(out: np.ndarray, inputs: Sequence[np.ndarray], op: ReduceOp) -> None:
    """out ← inputs[0] op inputs[1] op …, left to right (avg divides once at the end).

    Overflow to inf or integer wrap-around is the caller's arithmetic, as in NCCL.
    """
    ufunc = UFUNCS[op]
    np.copyto(out, inputs[0])
    if len(inputs) == 1:
        return
    if out.dtype.kind in "iu":  # integer ufuncs wrap around without a warning
        for values in inputs[1:]:
            ufunc(out, values, out=out)
        return
    with np.errstate(all="ignore"):
        for values in inputs[1:]:
            ufunc(out, values, out=out)
        if op is ReduceOp.AVG:
            np.divide(out, len(inputs), out=out)
