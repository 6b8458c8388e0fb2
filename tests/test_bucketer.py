"""`GradientBucketer`: real ranks against a real daemon, checked against numpy."""

from __future__ import annotations

import pytest

from conftest import DaemonProcess, run_ranks

#: What LAYOUT in programs/bucketer_ranks.py packs into with a 1 KiB cap: float32 and
#: float64 arrays fill separate buckets; a bucket goes out once it reaches the cap.
EXPECTED_BUCKETS = [
    140 + 20 + 8448,  # head.weight, head.bias, mid.norm (float32): full at mid.norm
    2400,             # mid.weight (float64): full on its own
    264,              # mid.bias (float64): flushed by wait()
    4000,             # embed.weight (float32): full on its own
    4,                # scale (float32, 0-d): flushed by wait()
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nranks", [2, 3])
def test_buckets_average_like_numpy(daemon: DaemonProcess, nranks: int) -> None:
    results = run_ranks(daemon.endpoint, "bucketer_ranks.py", nranks, ["average"], timeout_s=50)
    records = [result.records()[-1] for result in results]
    for record in records:
        assert record["failures"] == [], record["failures"]
        assert record["bucket_sizes"] == EXPECTED_BUCKETS
        assert record["layout"] == records[0]["layout"]
        # During "backward", before wait(): in the first step the three full buckets;
        # once the layout is fixed, every bucket as soon as its last array arrives.
        assert record["in_flight_before_wait"] == [3, 5, 5]
        for step in record["steps"]:
            assert step["buckets"] == len(EXPECTED_BUCKETS)
            assert step["bytes"] == sum(EXPECTED_BUCKETS)
            assert step["comm_s"] > 0
            assert 0.0 <= step["hidden_share"] <= 1.0


@pytest.mark.timeout(60)
def test_later_steps_must_follow_the_first_steps_layout(daemon: DaemonProcess) -> None:
    (result,) = run_ranks(daemon.endpoint, "bucketer_ranks.py", 1, ["misuse"], timeout_s=50)
    record = result.records()[-1]
    errors = record["errors"]
    assert "expects 'a'" in errors["order"] and "'b'" in errors["order"]
    assert "float32[5]" in errors["shape"] and "float32[4]" in errors["shape"]
    assert "float64[4]" in errors["dtype"]
    assert "1 of the 2 arrays" in errors["missing"] and "'b'" in errors["missing"]
    assert "'c' added after all 2 arrays" in errors["extra"]
    assert record["steps"] == 6
    assert record["a"] == [1.0] * 4  # the average of one rank is itself


@pytest.mark.timeout(60)
def test_ranks_that_add_in_different_orders_get_a_mismatch(daemon: DaemonProcess) -> None:
    results = run_ranks(daemon.endpoint, "bucketer_ranks.py", 2, ["disagree"], timeout_s=50)
    for result in results:
        record = result.records()[-1]
        assert record["error"] == "MismatchError", record
        assert "same names in the same order" in record["message"]
