"""Allreduce results equal a numpy reference for every op, dtype, shape and rank count."""

from __future__ import annotations

import pytest

from conftest import DaemonProcess, run_ranks

# shapes x (float dtypes x 5 ops + int dtypes x 7: no avg, but band, bor and bxor)
EXPECTED_CASES_PER_KIND = 7 * (4 * 5 + 4 * 7)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_every_op_dtype_shape_matches_numpy(daemon: DaemonProcess, nranks: int) -> None:
    results = run_ranks(daemon.endpoint, "allreduce_matrix.py", nranks, timeout_s=280)
    for result in results:
        summary = result.records()[-1]
        assert summary["failures"] == 0, result.stdout
        assert summary["checked"] == 2 * EXPECTED_CASES_PER_KIND
    daemon.assert_alive()
