"""Compressed allreduce across real daemons: every rank bit-identical, within bounds.

1 to 4 daemons, every algorithm, bf16 and fp8, float32 and float64, sum and
avg, odd sizes, NaN/Inf/-0.0 and values far beyond fp8's range
(tests/programs/compressed_allreduce.py; the bound: compression_bounds.py),
each at 1, 2 and 4 codec lanes with the same bytes at every lane count.
`auto` compression chooses none over loopback, and says why in the statistics.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from cluster import peer_args, run_spread, start_cluster

from benchmarks import topology
from conftest import DaemonProcess, poll_until
from gradsync.client.daemon_process import segments_of

StartDaemon = Callable[..., DaemonProcess]


def _by_case(records: list[list[dict[str, Any]]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    cases: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for rank_records in records:
        for record in rank_records:
            if "case" in record:
                cases.setdefault(tuple(record["case"]), []).append(record)
    return cases


#: Codec lanes the exactness matrix runs at; every count gives the same bytes.
LANES = (1, 2, 4)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("ranks_per_daemon", "algorithms", "counts", "extra"),
    [
        ((2,), "ring", "1,1000", ()),
        # 256 KiB slices, the least a codec lane takes off the loop: many slices
        # coded at once at 2 and 4 lanes.
        ((2, 1), "ring,tree,rhd,star", "1,7,1000,50001,300001",
         ("--pipeline-slice-bytes", "256KiB")),
        ((1, 1, 1), "ring,tree,rhd,star", "7,257,12001", ("--pipeline-slice-bytes", "20KiB")),
        ((1, 2, 1, 1), "ring,tree,rhd,star", "1,1000,30001", ()),
    ],
    ids=["1d", "2d", "3d-small-slices", "4d"],
)
def test_every_rank_ends_bit_identical_within_the_bound(
    start_daemon: StartDaemon, ranks_per_daemon: tuple[int, ...], algorithms: str, counts: str,
    extra: tuple[str, ...],
) -> None:
    """Ranks bit-identical and within the bound, at 1, 2 and 4 codec lanes, and the
    same bytes at each lane count: what fixes a result is the order of the additions
    into each slice, which the lanes keep, not the order slices are coded in."""
    from gradsync.client.cli.stats import fetch_snapshot

    digests: dict[int, dict[tuple[Any, ...], str]] = {}
    for lanes in LANES:
        daemons = start_cluster(start_daemon, len(ranks_per_daemon), *extra,
                                "--codec-lanes", str(lanes))
        results = run_spread(daemons, ranks_per_daemon, "compressed_allreduce.py",
                             ["bf16,fp8", algorithms, counts, str(len(daemons))], timeout_s=180)
        records = [result.records() for result in results]
        cases = _by_case(records)
        assert len(cases) == 2 * len(algorithms.split(",")) * 2 * 2 * len(counts.split(","))
        for case, per_rank in cases.items():
            assert len(per_rank) == len(results), case
            assert len({record["digest"] for record in per_rank}) == 1, (lanes, case, per_rank)
            # Rank 0's record (results come in rank order) holds the checks.
            assert per_rank[0]["over"] == 0, (case, per_rank[0])
            assert per_rank[0]["specials"] == 0, (case, per_rank[0])
            assert per_rank[0]["not_bf16"] == 0, (case, per_rank[0])
        digests[lanes] = {case: per_rank[0]["digest"] for case, per_rank in cases.items()}
        bad = records[0][0]["bad"]
        assert "int32" in bad[0] and "max" in bad[1] and "'int4'" in bad[2], bad
        assert "float16" in bad[3] and "needs a compression" in bad[4] and "int64" in bad[5], bad
        for daemon in daemons:
            daemon.assert_alive()
            assert fetch_snapshot(daemon.endpoint + ".stats", 5.0)["config"]["codec_lanes"] == lanes
    for lanes in LANES[1:]:
        differ = [case for case, digest in digests[lanes].items()
                  if digest != digests[LANES[0]][case]]
        assert not differ, f"{lanes} lanes changed {len(differ)} results, e.g. {differ[:3]}"


@pytest.mark.timeout(120)
def test_error_feedback_keeps_the_sum_of_many_steps_exact(start_daemon: StartDaemon) -> None:
    """fp8 rounds each step's sum by up to 2^-4: 40 equal steps drift by 40 such
    roundings without feedback, by about one with it; the residual is counted
    while its buffer lives and dropped once freed.  The statistics show each
    peer's bytes on the wire and before compression, and a compressed
    reduce-scatter stays within fp8's rounding."""
    from gradsync.client.cli.stats import fetch_snapshot

    daemons = start_cluster(start_daemon, 2)
    results = run_spread(daemons, (1, 1), "error_feedback_ranks.py", ["fp8", "40"],
                         timeout_s=100)
    for result in results:
        record = result.records()[-1]
        assert record["with"] < 0.1 * record["without"], record
        assert record["with"] < 3 * 2.0**-4, record  # the roundings still held, at most
        held = record["error_feedback"]
        assert held["buffers"] >= 1 and held["bytes_held"] >= 50_000 * 4, held
        assert 0 < record["scatter_error"] < 0.07, record
        (peer,) = record["peers"].values()
        for way in ("sent", "received"):
            wire, raw = peer[f"bytes_{way}"], peer[f"bytes_{way}_uncompressed"]
            assert 0.25 <= wire / raw <= 0.26, peer  # 1 + 4/256 bytes per 4
    from gradsync.client.cli.stats import render_table

    table = render_table(fetch_snapshot(daemons[0].endpoint + ".stats", 5.0))
    assert "before compression)" in table, table
    for daemon in daemons:
        # The job ended, its segments were freed, and the residuals with them.
        assert fetch_snapshot(daemon.endpoint + ".stats", 5.0)["error_feedback"] == {
            "buffers": 0, "bytes_held": 0}
        daemon.assert_alive()


#: Enough for the loss to fall to a tenth and for 1 % to tell the runs apart (their final
#: losses differ by 1e-5 of it); each step is seven runs' worth of collectives.
TRAINING_STEPS = 100


@pytest.mark.timeout(200)
@pytest.mark.frameworks
def test_torch_ddp_trains_as_well_compressed(start_daemon: StartDaemon) -> None:
    """torch DDP on backend gradsync over 2 daemons, TRAINING_STEPS steps: bf16 and fp8 with
    error feedback end within 1 % of the uncompressed run's loss, with every rank's
    parameters bit-identical, and so do gradsync's own DDP with bf16 and FSDP2
    (reduce-scatter) with bf16 against FSDP2 uncompressed; torch's
    fp16_compress_hook on gloo is printed beside."""
    from test_torch_backend import rendezvous_env

    daemons = start_cluster(start_daemon, 2)
    results = run_spread(daemons, (1, 1), "compressed_training.py", [str(TRAINING_STEPS)],
                         timeout_s=180, env=rendezvous_env())
    records = [result.records()[-1] for result in results]
    losses = records[0]["losses"]
    print(f"held-out loss: {records[0]['initial']:.4f} at first, after {TRAINING_STEPS} steps",
          json.dumps(losses), "seconds per run:", records[0]["seconds"])
    assert losses["gradsync"] < 0.5 * records[0]["initial"]  # it learned
    exact = losses["gradsync"]
    for name in ("gradsync_bf16", "gradsync_fp8_ef", "ours_bf16"):
        assert abs(losses[name] - exact) <= 0.01 * exact, losses
    assert abs(losses["fsdp2_bf16"] - losses["fsdp2"]) <= 0.01 * losses["fsdp2"], losses
    # fp8 + error feedback fed residuals back once torch's buckets were daemon memory.
    assert all(record["error_feedback"]["buffers"] >= 1 for record in records), records
    for name in losses:
        assert len({record["digests"][name] for record in records}) == 1, name
    assert losses["gloo_fp16_hook"] < 2 * exact, losses  # it trained (printed to compare)


def _links_measured(daemons: list[DaemonProcess]) -> None:
    """Wait until every daemon has measured its links (what `auto` weighs)."""
    from gradsync.client.cli.stats import fetch_snapshot

    def measured() -> bool:
        return all(link.get("bandwidth_Bps")
                   for daemon in daemons
                   for link in fetch_snapshot(daemon.endpoint + ".stats", 5.0)["peers"].values())

    poll_until(measured, 60, "the daemons measured their links")


@pytest.mark.timeout(120)
def test_auto_compresses_nothing_over_loopback_and_says_why(start_daemon: StartDaemon) -> None:
    """`auto`, `auto:bf16` in the call and `GRADSYNC_COMPRESSION=auto:fp8` over
    127.0.0.1: every result exact (nothing was rounded), no byte saved on the
    wire, and the statistics give the choice, none, and its basis: the members
    reach each other over loopback, with this daemon's measured codec rates."""
    from gradsync.client.cli.stats import fetch_snapshot, render_table

    daemons = start_cluster(start_daemon, 2)
    _links_measured(daemons)
    results = run_spread(daemons, (1, 1), "auto_compression.py",
                         ["auto,auto:bf16,env", str(1 << 20), "3"], timeout_s=100,
                         env={"GRADSYNC_COMPRESSION": "auto:fp8"})
    for result in results:
        *records, last = result.records()
        assert last == {"done": True}
        assert [record["mode"] for record in records] == ["auto", "auto:bf16", "env"]
        assert all(all(record["exact"]) for record in records), records
    for daemon in daemons:
        snapshot = fetch_snapshot(daemon.endpoint + ".stats", 5.0)
        chosen = snapshot["jobs"]["multi"]["compression_auto"]
        assert set(chosen) == {"auto", "auto:bf16", "auto:fp8"}, chosen
        for entry in chosen.values():
            assert entry["last"] == "none" and entry["picks"] == {"none": 3}, entry
            assert "loopback" in entry["reason"], entry
            # The codec is timed for a bounded while on its own thread: under load a
            # format may miss the cut (then `auto` cannot pick it), never a bad rate.
            assert entry["link_Bps"] > 0, entry
            assert all(rate > 0 for rate in entry["codec_Bps"].values()), entry
        codec = snapshot["codec"]
        assert codec["peers_on_this_host"] and codec["lanes"] >= 1, codec
        rates = codec["rates_Bps"]
        assert rates and set(rates) <= {"bf16", "fp8", "bf16/float64", "fp8/float64"}, codec
        assert all(rate > 0 for rate in rates.values()), codec
        (peer,) = snapshot["peers"].values()
        assert peer["bytes_sent"] == peer["bytes_sent_uncompressed"] > 0, peer
        table = render_table(snapshot)
        assert "compression auto: now none (every member daemon reaches" in table, table
        assert "codec: " in table and "peers on this host" in table, table
        daemon.assert_alive()


@pytest.mark.timeout(240)
def test_auto_compresses_over_a_slow_link(start_daemon: StartDaemon) -> None:
    """Two daemons in network namespaces joined by a veth pair shaped to 2 Gbit/s
    (250 MB/s, far below the codec's rate): `auto` compresses (bf16 or fp8, the
    one it estimates faster), `auto:bf16` bf16; the results are rounded, every
    rank's the same, the wire carries fewer bytes, and the statistics say why
    (printed)."""
    from gradsync.client.cli.stats import fetch_snapshot, render_table

    reason = topology.namespaces_unavailable(shaped=True)
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            topo = stack.enter_context(topology.namespaces(2, "2gbit"))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot create shaped network namespaces here: {exc}")
        endpoints = topo.endpoints()[0]
        daemons = [start_daemon(*peer_args(i, endpoints, "--insecure"), prefix=topo.prefix(i))
                   for i in range(2)]
        _links_measured(daemons)
        results = run_spread(daemons, (1, 1), "auto_compression.py",
                             ["auto,auto:bf16", str(1 << 21), "2"], timeout_s=150)
        records = [result.records() for result in results]
        for rank_records in records:
            assert rank_records[-1] == {"done": True}
            assert not any(any(record["exact"]) for record in rank_records[:-1]), rank_records
        assert [r["digest"] for r in records[0][:-1]] == [r["digest"] for r in records[1][:-1]]
        for daemon in daemons:
            snapshot = fetch_snapshot(daemon.endpoint + ".stats", 5.0)
            print(render_table(snapshot))
            chosen = snapshot["jobs"]["multi"]["compression_auto"]
            assert chosen["auto"]["last"] in ("bf16", "fp8"), chosen
            assert chosen["auto:bf16"]["last"] == "bf16", chosen
            for entry in chosen.values():
                assert "below the codec" in entry["reason"], entry
                assert entry["link_Bps"] < 0.5e9, entry  # the shaped link, as measured
            assert not snapshot["codec"]["peers_on_this_host"], snapshot["codec"]
            (peer,) = snapshot["peers"].values()
            assert peer["bytes_sent"] <= 0.51 * peer["bytes_sent_uncompressed"], peer
        for daemon in daemons:  # before their namespaces go
            assert daemon.stop() == 0, daemon.log()
            assert not segments_of(daemon.pid)
