"""Rank program: ranks submit different sizes, expect MismatchError, then carry on."""

from __future__ import annotations

import json
import sys

import numpy as np

from gradsync.client import Client, MismatchError


def main() -> int:
    with Client() as client:
        mine = np.full(10 + 10 * client.rank, client.rank + 1, np.float32)
        before = mine.copy()
        try:
            client.all_reduce(mine)
        except MismatchError as exc:
            print(json.dumps({"mismatch": exc.message, "details": exc.details,
                              "untouched": bool((mine == before).all())}), flush=True)
        else:
            print(json.dumps({"mismatch": None}), flush=True)
            return 1
        after = np.ones(5, np.float64)
        client.all_reduce(after)
        print(json.dumps({"after": after.tolist()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
