"""`auto` compression's decision (core/compression_policy.py) on given rates, and
the inputs every member agrees on: the codec rates and loopback flag announced
with a job, their slowest value in the formation, and the names a client may ask."""

from __future__ import annotations

import pytest

from gradsync.client.compression import Compression, choose
from gradsync.daemon.core.compression_policy import (
    MIN_SPEEDUP,
    choose_format,
    rate_key,
    wire_ratio,
)
from gradsync.daemon.core.membership import Announcement, form
from gradsync.protocol.compression import AUTO_CHOICES, allowed_formats, parse_compression
from gradsync.protocol.errors import InvalidArgumentError, ProtocolError
from gradsync.protocol.peer import Announce

GB = 1e9
#: Codec rates of the order this machine measures (C module, float32).
RATES = {"bf16": 9 * GB, "fp8": 5 * GB, "bf16/float64": 2 * GB, "fp8/float64": 0.1 * GB}


def decide(link: float, allowed: tuple[str, ...] = ("bf16", "fp8"), dtype: str = "float32",
           rates: dict[str, float] | None = None, loopback: bool = False):  # type: ignore[no-untyped-def]
    itemsize = 8 if dtype == "float64" else 4
    return choose_format(allowed, dtype, itemsize, link, RATES if rates is None else rates,
                         loopback)


def test_a_slow_link_gets_the_format_that_pays_most() -> None:
    """2 Gbit/s (250 MB/s): fp8 moves a quarter of the bytes at a codec 20 times the
    link's rate; bf16 if only bf16 is allowed; the estimates are 1 / (r + L/C)."""
    choice = decide(0.25 * GB)
    assert choice.format == "fp8", choice
    speedups = dict(choice.speedups)
    assert speedups["fp8"] == pytest.approx(1 / (wire_ratio("fp8", 4) + 0.25 / 5))
    assert speedups["bf16"] == pytest.approx(1 / (0.5 + 0.25 / 9))
    assert "below the codec" in choice.reason and "0.25 GB/s" in choice.reason
    assert choice.link_Bps == 0.25 * GB and dict(choice.codec_Bps) == RATES
    only_bf16 = decide(0.25 * GB, ("bf16",))
    assert only_bf16.format == "bf16" and set(dict(only_bf16.speedups)) == {"bf16"}


def test_a_fast_link_gets_none_and_says_why() -> None:
    """25 Gbit/s against a 5 GB/s fp8 codec: coding would cost more than it saves."""
    choice = decide(3.1 * GB)
    assert choice.format is None
    assert max(dict(choice.speedups).values()) < MIN_SPEEDUP
    assert "too fast for the codec" in choice.reason and "3.1 GB/s" in choice.reason


def test_the_threshold_is_the_estimated_speed_up() -> None:
    """fp8 alone: chosen exactly while 1 / (r + L/C) >= MIN_SPEEDUP."""
    ratio = wire_ratio("fp8", 4)
    edge = (1 / MIN_SPEEDUP - ratio) * RATES["fp8"]  # the link rate at the edge
    assert decide(edge * 0.99, ("fp8",)).format == "fp8"
    assert decide(edge * 1.01, ("fp8",)).format is None


def test_bf16_wins_where_fp8_would_not_be_clearly_faster() -> None:
    """A slow fp8 codec: both pay, fp8 barely more, so bf16 (twice the precision)."""
    rates = {"bf16": 10 * GB, "fp8": 1.3 * GB}
    choice = decide(0.3 * GB, rates=rates)
    speedups = dict(choice.speedups)
    assert speedups["fp8"] > speedups["bf16"] >= MIN_SPEEDUP
    assert choice.format == "bf16", choice


def test_loopback_members_and_missing_figures_get_none() -> None:
    assert "loopback" in decide(0.1 * GB, loopback=True).reason
    assert decide(0.1 * GB, loopback=True).format is None
    assert decide(0.0).format is None and "no link rate" in decide(0.0).reason
    missing = decide(0.1 * GB, rates={})
    assert missing.format is None and "no codec rate" in missing.reason
    defaults = choose_format(("fp8",), "float32", 4, 0.1 * GB, RATES, False, False)
    assert defaults.format is None and "before it had measured its links" in defaults.reason


def test_float64_buffers_use_their_own_rates_and_ratios() -> None:
    """numpy codes float64: slow fp8 (0.1 GB/s) loses at 1 GB/s where bf16 at
    2 GB/s (a quarter of float64's bytes) still pays."""
    assert rate_key("fp8", "float64") == "fp8/float64" and rate_key("fp8", "float32") == "fp8"
    assert wire_ratio("bf16", 8) == 0.25
    choice = decide(0.5 * GB, dtype="float64")
    assert choice.format == "bf16", choice
    assert dict(choice.speedups)["fp8"] < 1


def test_the_announcement_carries_codec_rates_and_the_formation_the_slowest() -> None:
    rates = (("bf16", 9e9), ("fp8", 5e9))
    share = Announce("job", 1, 7, 2, (0,), 1e-5, 1e-9, rates, True)
    wire = share.to_wire()
    assert wire["codec_Bps"] == dict(rates) and wire["loopback"] is True
    assert Announce.from_wire(wire) == share
    bare = Announce("job", 1, 7, 2, (0,), 1e-5, 1e-9)
    assert "codec_Bps" not in bare.to_wire() and "loopback" not in bare.to_wire()
    assert Announce.from_wire(bare.to_wire()) == bare  # what an older peer sends
    guessed = Announce("job", 1, 7, 2, (0,), 1e-5, 1e-9, rates, False, True)
    assert Announce.from_wire(guessed.to_wire()).unmeasured
    for bad in ({"bf16": -1.0}, {"bf16": float("nan")}, {"bf16": "fast"}, [1.0],
                {f"r{i}": 1.0 for i in range(9)}):
        with pytest.raises(ProtocolError, match="codec_Bps"):
            Announce.from_wire({**wire, "codec_Bps": bad})
    with pytest.raises(ProtocolError, match="loopback"):
        Announce.from_wire({**wire, "loopback": 1})
    with pytest.raises(ProtocolError, match="unmeasured"):
        Announce.from_wire({**wire, "unmeasured": "no"})

    slow = Announce("job", 2, 8, 2, (1,), 1e-5, 1e-9, (("bf16", 3e9),), False)
    formation = form({"a": Announcement("a", share), "b": Announcement("b", slow)}, 2)
    assert formation is not None
    # fp8 was not measured on b: left out; bf16 at the slower member's rate.
    assert formation.codec_Bps == (("bf16", 3e9),) and formation.loopback is False
    assert formation.links_measured
    late = Announce("job", 2, 8, 2, (1,), 1e-5, 1e-9, rates, True, True)
    unsure = form({"a": Announcement("a", share), "b": Announcement("b", late)}, 2)
    assert unsure is not None and not unsure.links_measured
    both = form({"a": Announcement("a", share),
                 "b": Announcement("b", Announce("job", 2, 8, 2, (1,), 1e-5, 1e-9, rates,
                                                 True))}, 2)
    assert both is not None and both.loopback and both.codec_Bps == rates


def test_clients_may_ask_for_auto_and_name_the_format_allowed() -> None:
    assert AUTO_CHOICES == ("auto", "auto:bf16", "auto:fp8")
    for name in AUTO_CHOICES:
        assert parse_compression(name) == name
    assert allowed_formats("auto") == ("bf16", "fp8") and allowed_formats("auto:fp8") == ("fp8",)
    with pytest.raises(InvalidArgumentError, match="auto:fp8"):
        parse_compression("auto:int4")
    assert Compression.parse("auto", error_feedback=True) == Compression("auto", True)
    # Like a format where it applies; as a job-wide default, left out where it cannot.
    assert choose("auto:bf16", False, Compression(), "allreduce", "float32", "sum").format == (
        "auto:bf16")
    with pytest.raises(InvalidArgumentError, match="int32"):
        choose("auto", False, Compression(), "allreduce", "int32", "sum")
    default = Compression("auto")
    assert choose(None, False, default, "allreduce", "int32", "sum").format is None
    assert choose(None, False, default, "allreduce", "float32", "avg").format == "auto"
    # Device buffers are reduced exactly: `auto` there is simply none.
    assert choose("auto", False, Compression(), "allreduce", "float32", "sum",
                  on_device=True) == Compression()
