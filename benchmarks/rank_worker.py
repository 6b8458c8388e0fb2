"""Rank program: one rank of one contender, all sizes; started by `allreduce.py`.

Writes `OUT_DIR/<contender>-n<N>-rank<r>.json` after every size, so a
failure part-way still leaves what was measured.  Not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

from contenders import make_contender
from measure import make_pattern, measure_size
from plan import CONTENDER_KEYS, SamplePolicy


def result_path(out_dir: str, contender: str, nproc: int, rank: int) -> str:
    return os.path.join(out_dir, f"{contender}-n{nproc}-rank{rank}.json")


def _write(path: str, document: dict[str, Any]) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as out:
        json.dump(document, out)
    os.replace(temporary, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contender", required=True, choices=CONTENDER_KEYS)
    parser.add_argument("--sizes", required=True, help="bytes, comma-separated")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--policy", required=True, help="SamplePolicy fields as JSON")
    parser.add_argument("--init-file", default="", help="gloo file store path")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    policy = SamplePolicy(**json.loads(args.policy))

    contender = make_contender(args.contender, args.init_file, args.timeout_s)
    path = result_path(args.out_dir, args.contender, contender.world_size, contender.rank)
    document: dict[str, Any] = {
        "contender": args.contender,
        "nproc": contender.world_size,
        "rank": contender.rank,
        "pid": os.getpid(),
        "sizes": [],
        "error": None,
    }
    pattern = make_pattern()
    status = 0
    try:
        for nbytes in sizes:
            document["sizes"].append(measure_size(contender, nbytes, policy, pattern).to_json())
            _write(path, document)
    except BaseException as exc:  # record any failure, then let the driver see the status
        document["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        status = 1
    finally:
        _write(path, document)
    if status == 0:
        contender.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
