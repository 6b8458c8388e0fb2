"""`auto`'s link costs fitted to timed collectives, and the members' agreement on them."""

from __future__ import annotations

import asyncio
import random

import pytest

from gradsync.daemon.algorithms.calibration import (
    MEASURED_MARGIN,
    MIN_GROUP_SAMPLES,
    CostMeter,
    Costs,
    measured_pick,
)
from gradsync.daemon.algorithms.cost_model import estimate_s
from gradsync.daemon.config import DaemonConfig
from gradsync.daemon.core.cost_epochs import (
    EPOCH_KEYS,
    TABLES_KEPT,
    Agreement,
    CostEpochs,
    Offer,
    epoch_of,
    epoch_to_offer,
    explores,
)
from gradsync.daemon.run.outcomes import settled
from gradsync.protocol.errors import PeerLostError

TRUE = Costs(450e-6, 1.8e-9)  # what a step and a byte really cost
PROBED = Costs(4e-3, 0.6e-9)  # what start-up probes said: far off


def _record(meter: CostMeter, daemons: int, algorithm: str, nbytes: int, times: list[float],
            truth: Costs = TRUE) -> None:
    a = estimate_s(algorithm, daemons, nbytes, 1.0, 0.0)
    b = estimate_s(algorithm, daemons, nbytes, 0.0, 1.0)
    for factor in times:
        meter.record(daemons, (algorithm, nbytes),
                     (a * truth.alpha_s + b * truth.beta_s_per_byte) * factor, (a, b))


def test_fit_recovers_alpha_and_beta_from_mixed_sizes() -> None:
    meter = CostMeter()
    for nbytes in (4096, 1 << 20, 16 << 20):
        for algorithm in ("ring", "rhd"):
            _record(meter, 4, algorithm, nbytes, [1.0] * 5)
    fitted = meter.fit(4, PROBED)
    assert fitted is not None
    assert fitted.alpha_s == pytest.approx(TRUE.alpha_s, rel=0.02)
    assert fitted.beta_s_per_byte == pytest.approx(TRUE.beta_s_per_byte, rel=0.02)


def test_a_minority_of_late_ranks_and_noise_do_not_move_the_figures() -> None:
    rng = random.Random(7)
    meter = CostMeter()
    for nbytes in (4096, 1 << 20, 16 << 20):
        for algorithm in ("ring", "rhd"):
            # A third of the collectives waited for a late rank: up to 3x longer.
            _record(meter, 4, algorithm, nbytes,
                    [1.0 + (2 * rng.random() if i % 3 == 0 else 0.02 * rng.random())
                     for i in range(12)])
    fitted = meter.fit(4, PROBED)
    assert fitted is not None
    assert fitted.alpha_s == pytest.approx(TRUE.alpha_s, rel=0.05)
    assert fitted.beta_s_per_byte == pytest.approx(TRUE.beta_s_per_byte, rel=0.05)


def test_small_buffers_alone_settle_alpha_and_leave_beta_to_the_prior() -> None:
    meter = CostMeter()
    for algorithm in ("ring", "rhd"):
        _record(meter, 4, algorithm, 4096, [1.0] * 5)
    fitted = meter.fit(4, PROBED)
    assert fitted is not None
    assert fitted.alpha_s == pytest.approx(TRUE.alpha_s, rel=0.05)
    assert fitted.beta_s_per_byte == pytest.approx(PROBED.beta_s_per_byte, rel=0.1)


def test_model_error_between_small_groups_does_not_invent_a_slow_link() -> None:
    """ring and rhd at 4 KiB differ only in steps; rhd's steps measuring 15 % dearer
    must not be read as bytes (a joint fit made that a 40 MB/s link)."""
    meter = CostMeter()
    _record(meter, 4, "ring", 4096, [1.0] * 5)
    _record(meter, 4, "rhd", 4096, [1.15] * 5)
    fitted = meter.fit(4, PROBED)
    assert fitted is not None
    assert fitted.beta_s_per_byte == pytest.approx(PROBED.beta_s_per_byte)
    assert fitted.alpha_s == pytest.approx(TRUE.alpha_s, rel=0.1)


def test_bytes_lost_in_the_noise_leave_beta_alone() -> None:
    """At 64 KiB over four daemons the bytes are a few per cent of a step: timings
    3 % apart must not set beta (they made star look dear and auto ran rhd)."""
    meter = CostMeter()
    for algorithm in ("ring", "rhd"):
        _record(meter, 4, algorithm, 4096, [1.0] * 5)
        _record(meter, 4, algorithm, 64 << 10, [0.97] * 5)
    fitted = meter.fit(4, PROBED)
    assert fitted is not None
    assert fitted.beta_s_per_byte == pytest.approx(PROBED.beta_s_per_byte)
    assert fitted.alpha_s == pytest.approx(TRUE.alpha_s, rel=0.05)


def test_one_size_alone_gets_its_own_time_right() -> None:
    """One group cannot tell alpha from beta; whatever split the prior suggests,
    the model must then price that collective as it measured."""
    meter = CostMeter()
    _record(meter, 4, "ring", 64 << 20, [1.0] * 5)
    fitted = meter.fit(4, PROBED)
    assert fitted is not None
    modelled = estimate_s("ring", 4, 64 << 20, fitted.alpha_s, fitted.beta_s_per_byte)
    assert modelled == pytest.approx(estimate_s("ring", 4, 64 << 20, *TRUE), rel=0.02)
    assert fitted.beta_s_per_byte == pytest.approx(TRUE.beta_s_per_byte, rel=0.25)


def test_no_figures_before_a_group_has_enough_samples_and_per_daemon_count() -> None:
    meter = CostMeter()
    _record(meter, 4, "ring", 4096, [1.0] * (MIN_GROUP_SAMPLES - 1))
    assert meter.fit(4, PROBED) is None
    _record(meter, 4, "ring", 4096, [1.0])
    assert meter.fit(4, PROBED) is not None
    assert meter.fit(2, PROBED) is None  # other daemon counts keep their own timings
    assert meter.fit(4, Costs(0.0, 0.0)) is None  # no usable prior


def test_useless_samples_are_ignored_and_the_window_is_bounded() -> None:
    meter = CostMeter(kept=8)
    meter.record(4, "g", 0.0, (1.0, 1.0))
    meter.record(4, "g", float("nan"), (1.0, 1.0))
    assert meter.samples(4) == 0
    # Terms no model produces: the timing counts, the fit does not see it.
    for terms in ((-1.0, 1.0), (0.0, 0.0), (0.0, 0.0)):
        meter.record(4, "g", 1.0, terms)
    assert meter.fit(4, PROBED) is None and meter.timings(4) == {"g": 1.0}
    for _ in range(20):
        meter.record(4, "g", 1.0, (1.0, 1.0))
    assert meter.samples(4) == 8


def test_figures_stay_non_negative() -> None:
    meter = CostMeter()
    # Times that fall as the message count grows: no positive alpha explains them.
    for steps, seconds in ((2, 1.0), (6, 0.9), (12, 0.8)):
        for _ in range(3):
            meter.record(4, steps, seconds, (float(steps), 1e8))
    fitted = meter.fit(4, PROBED)
    assert fitted is not None and fitted.alpha_s >= 0 and fitted.beta_s_per_byte > 0


# -- agreeing on them ----------------------------------------------------------


def test_epochs_follow_the_keys_and_named_keys_keep_the_formation_figures() -> None:
    assert epoch_of(0) == epoch_of(EPOCH_KEYS - 1) == 0
    assert epoch_of(EPOCH_KEYS) == 1
    assert epoch_of("warmup") == epoch_of(-3) == 0
    # Figures for an epoch go out half an epoch before it starts.
    assert epoch_to_offer(EPOCH_KEYS // 2 - 1) == 0
    assert epoch_to_offer(EPOCH_KEYS // 2) == 1
    assert epoch_to_offer("warmup") == 0


def test_members_agree_on_the_medians_once_all_have_sent() -> None:
    daemons = ("a", "b", "c")
    epochs = CostEpochs()
    assert epochs.first_offer(7, 1) and not epochs.first_offer(7, 1)
    assert epochs.add(7, 1, "a", Offer(Costs(1e-3, 3e-9), {}))
    assert epochs.add(7, 1, "b", Offer(Costs(2e-3, 1e-9), {}))
    assert epochs.agreed(7, 1, daemons) is None
    assert epochs.missing(7, 1, daemons) == ["c"]
    assert not epochs.add(7, 1, "b", Offer(Costs(9.0, 9.0), {}))  # the first figures stand
    assert epochs.add(7, 1, "c", Offer(Costs(5e-3, 2e-9), {}))
    assert epochs.agreed(7, 1, daemons) == Agreement(Costs(2e-3, 2e-9), {})
    assert epochs.agreed(8, 1, daemons) is None  # another generation: nothing yet
    # The newest agreement is what a daemon's next fit leans on.
    assert epochs.latest == Costs(2e-3, 2e-9)
    for daemon in daemons:
        epochs.add(7, 0, daemon, Offer(Costs(9e-3, 9e-9), {}))
    assert epochs.agreed(7, 0, daemons) == Agreement(Costs(9e-3, 9e-9), {})
    assert epochs.latest == Costs(2e-3, 2e-9)  # an older epoch does not replace it


def test_a_waiter_gets_the_figures_or_the_jobs_error() -> None:
    daemons = ("a", "b")
    epochs = CostEpochs()
    waiting = epochs.waiter(1, 2)
    epochs.add(1, 2, "a", Offer(Costs(1e-3, 1e-9), {}))
    epochs.notify(1, 2, daemons)
    assert not waiting.done()
    epochs.add(1, 2, "b", Offer(Costs(3e-3, 3e-9), {}))
    epochs.notify(1, 2, daemons)
    assert waiting.result().costs == Costs(2e-3, 2e-9)
    broken = epochs.waiter(1, 3)
    epochs.fail(PeerLostError("peer b was lost"))
    with pytest.raises(PeerLostError):
        broken.result()


def test_a_waiter_on_the_loop_gets_the_figures_or_its_timeout() -> None:
    """run/outcomes.settled: the agreed figures when they come, TimeoutError when they
    do not, and the outcome unchanged by the waiter that gave up."""
    async def scenario() -> None:
        epochs = CostEpochs()
        waiting = epochs.waiter(1, 2)
        asyncio.get_running_loop().call_soon(lambda: (
            epochs.add(1, 2, "a", Offer(Costs(1e-3, 1e-9), {})), epochs.notify(1, 2, ("a",))))
        assert (await settled(waiting, 5.0)).costs == Costs(1e-3, 1e-9)
        late = epochs.waiter(1, 3)
        with pytest.raises(TimeoutError):
            await settled(late, 0.01)
        assert not late.done()
        epochs.fail(PeerLostError("peer b was lost"))
        with pytest.raises(PeerLostError):
            await settled(late, 5.0)

    asyncio.run(scenario())


def test_tables_are_bounded_but_an_awaited_one_is_kept() -> None:
    async def scenario() -> None:
        epochs = CostEpochs()
        epochs.waiter(1, 1)
        epochs.add(1, 1, "a", Offer(Costs(1e-3, 1e-9), {}))
        for epoch in range(2, 3 * TABLES_KEPT):
            epochs.add(1, epoch, "a", Offer(Costs(1e-3, 1e-9), {}))
        assert epochs.missing(1, 1, ("a", "b")) == ["b"]  # still there
        assert epochs.missing(1, 2, ("a",)) == ["a"]  # dropped long ago
        epochs.fail(PeerLostError("done"))

    asyncio.run(scenario())


# -- timings, and picking by them -------------------------------------------------


def test_timings_are_each_groups_median_and_only_calibrating_ones_fit() -> None:
    meter = CostMeter()
    _record(meter, 4, "ring", 4096, [1.0, 1.1, 3.0])
    _record(meter, 4, "rhd", 1 << 20, [1.0] * 5)
    fitted = meter.fit(4, PROBED)
    for seconds in (2e-3, 1e-3, 9e-3, 1.5e-3):  # star: timed, but not modelled exactly
        meter.record(4, ("star", 4096), seconds)
    meter.record(4, ("tree", 4096), 1e-3)  # too few samples to count
    assert meter.fit(4, PROBED) == fitted
    timings = meter.timings(4)
    assert set(timings) == {("ring", 4096), ("rhd", 1 << 20), ("star", 4096)}
    assert timings[("star", 4096)] == 2e-3  # the middle of 4: the upper one
    ring_step = estimate_s("ring", 4, 4096, TRUE.alpha_s, TRUE.beta_s_per_byte)
    assert timings[("ring", 4096)] == pytest.approx(1.1 * ring_step)
    assert meter.timings(2) == {}


FACTOR = DaemonConfig().auto_explore_factor
ESTIMATES = (("ring", 1.0e-3), ("rhd", 1.2e-3), ("tree", 1.4e-3), ("star", 2.0e-3))


def test_measured_pick_times_every_close_contender_then_takes_the_fastest() -> None:
    assert 1.4 <= FACTOR < 2.0  # tree is a contender here, star is not
    n = 65536
    times: dict[tuple[str, int], float] = {("star", n): 1e-6, ("rhd", 2 * n): 1e-6}
    order = []
    for _ in range(3):  # the model's choice first, then by estimate
        name, basis = measured_pick("ring", ESTIMATES, n, times, FACTOR)
        assert basis == "explored"
        order.append(name)
        times[(name, n)] = {"ring": 1.0e-3, "rhd": 0.9e-3, "tree": 1.2e-3}[name]
    assert order == ["ring", "rhd", "tree"]
    # rhd measured 10 % faster than the model's choice; star, though timed
    # fastest, is priced out of contention.
    assert measured_pick("ring", ESTIMATES, n, times, FACTOR) == ("rhd", "measured")
    times[("rhd", n)] = 1.0e-3 / (1 + MEASURED_MARGIN / 2)
    assert measured_pick("ring", ESTIMATES, n, times, FACTOR) == ("ring", "measured")  # noise
    # The model's choice need not be its cheapest estimate (a latency-bound tie
    # goes to fewer steps); it is explored first and keeps ties all the same.
    assert measured_pick("rhd", ESTIMATES, 2 * n, {}, FACTOR) == ("rhd", "explored")
    assert measured_pick("rhd", ESTIMATES, n, times, FACTOR) == ("rhd", "measured")


def test_members_agree_on_each_groups_median_time_in_any_arrival_order() -> None:
    daemons = ("a", "b", "c")
    offers = {
        "a": Offer(Costs(1e-3, 1e-9), {("ring", 4096): 1e-3, ("star", 4096): 4e-3}),
        "b": Offer(Costs(1e-3, 1e-9), {("ring", 4096): 2e-3}),
        "c": Offer(Costs(1e-3, 1e-9), {("ring", 4096): 9e-3, ("star", 4096): 2e-3}),
    }
    agreements = []
    for order in (("a", "b", "c"), ("c", "a", "b")):
        epochs = CostEpochs()
        for daemon in order:
            epochs.add(3, 1, daemon, offers[daemon])
        agreements.append(epochs.agreed(3, 1, daemons))
    assert agreements[0] == agreements[1] == Agreement(
        Costs(1e-3, 1e-9), {("ring", 4096): 2e-3, ("star", 4096): 3e-3})


def test_a_wider_explore_factor_admits_more_contenders() -> None:
    timed = {("ring", 4096): 5e-3, ("rhd", 4096): 1e-3, ("tree", 4096): 0.5e-3}
    assert measured_pick("ring", ESTIMATES, 4096, timed, 1.5) == ("tree", "measured")
    # Star, priced at twice ring, becomes a contender: timed first, then faster, it wins.
    assert measured_pick("ring", ESTIMATES, 4096, timed, 2.0) == ("star", "explored")
    timed[("star", 4096)] = 0.4e-3
    assert measured_pick("ring", ESTIMATES, 4096, timed, 2.0) == ("star", "measured")


def test_outside_the_exploring_keys_auto_only_chooses_among_timed_contenders() -> None:
    n = 4096
    timed = {("ring", n): 2e-3, ("rhd", n): 1e-3}  # tree, a contender, is untimed
    assert measured_pick("ring", ESTIMATES, n, timed, FACTOR) == ("tree", "explored")
    assert measured_pick("ring", ESTIMATES, n, timed, FACTOR, explore=False) == (
        "rhd", "measured")
    # An untimed model's choice stands on the model alone.
    assert measured_pick("tree", ESTIMATES, n, timed, FACTOR, explore=False) == (
        "tree", "model")
    # Only the first half of an epoch explores: its timings make the next offer.
    assert [explores(key) for key in (0, EPOCH_KEYS // 2 - 1, EPOCH_KEYS // 2,
                                      EPOCH_KEYS - 1, EPOCH_KEYS)] == [
        True, True, False, False, True]
    assert not explores("warmup") and not explores(-1)


def test_the_smallest_explore_factor_holds_for_every_member() -> None:
    epochs = CostEpochs()
    for daemon, factor in (("a", 3.0), ("b", 1.0), ("c", 1.5)):
        epochs.add(1, 1, daemon, Offer(Costs(1e-3, 1e-9), {}, factor))
    agreement = epochs.agreed(1, 1, ("a", "b", "c"))
    assert agreement is not None and agreement.explore_factor == 1.0
