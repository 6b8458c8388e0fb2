"""Rank program: one rank of one contender, all sizes; started by `allreduce.py`
and `interdaemon.py`.

Writes `OUT_DIR/<contender>-n<N>-rank<r>.json` after every size, so a
failure part-way still leaves what was measured.  With `--algorithms` (gradsync
across daemons) every size is measured with every algorithm, taking turns
sample by sample on one buffer (`measure_interleaved`), into
`<label>-<algorithm>-n<N>-rank<r>.json`.
Not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

from benchmarks.contenders import GradsyncContender, make_contender
from benchmarks.measure import make_pattern, measure_interleaved, measure_size
from benchmarks.plan import ALGORITHMS, CONTENDER_KEYS, SamplePolicy, algorithm_key


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
    parser.add_argument("--algorithms", default="",
                        help=f"gradsync only: some of {','.join(ALGORITHMS)}, comma-separated")
    parser.add_argument("--label", default="gradsync",
                        help="with --algorithms: results go to LABEL-ALGORITHM files")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    policy = SamplePolicy(**json.loads(args.policy))
    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithms {unknown}; expected some of {ALGORITHMS}")

    contender = make_contender(args.contender, args.init_file, args.timeout_s)
    if algorithms and not isinstance(contender, GradsyncContender):
        parser.error("--algorithms needs a gradsync contender")
    # (result key, the algorithm measured into it, or None)
    outputs: list[tuple[str, str | None]] = (
        [(algorithm_key(a, args.label), a) for a in algorithms] or [(args.contender, None)]
    )
    documents: dict[str, dict[str, Any]] = {
        key: {
            "contender": key,
            "nproc": contender.world_size,
            "rank": contender.rank,
            "pid": os.getpid(),
            "sizes": [],
            "error": None,
        }
        for key, _ in outputs
    }

    def path(key: str) -> str:
        return result_path(args.out_dir, key, contender.world_size, contender.rank)

    pattern = make_pattern()
    status = 0
    try:
        for nbytes in sizes:
            if algorithms and isinstance(contender, GradsyncContender):
                records = measure_interleaved(contender, nbytes, policy, pattern, algorithms)
                for key, algorithm in outputs:
                    assert algorithm is not None
                    documents[key]["sizes"].append(records[algorithm].to_json())
            else:
                key = outputs[0][0]
                documents[key]["sizes"].append(
                    measure_size(contender, nbytes, policy, pattern).to_json()
                )
            for key, _ in outputs:
                _write(path(key), documents[key])
    except BaseException as exc:  # record any failure, then let the driver see the status
        for document in documents.values():
            document["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        status = 1
    finally:
        for key, document in documents.items():
            _write(path(key), document)
    if status == 0:
        contender.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
