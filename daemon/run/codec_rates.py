"""What `auto` compression weighs on this daemon: how fast it codes, and
whether its peers share its host (core/compression_policy.py decides).

The codec rate is measured, once, where it is first needed (the first
multi-node job's announcement): every codec lane encodes and decodes-and-adds
a slice of its own at the same time, and the rate is the buffer bytes all of
them got through per second, the best of a few rounds (as the link probes take
their best reading: a disturbed round only ever reads slower).  float32 slices
run the C module where it is built; float64 ones run numpy, far slower, hence
rates of their own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Iterable

import numpy as np

from gradsync.daemon.backends.wire_codec import CODECS
from gradsync.daemon.core.compression_policy import rate_key
from gradsync.protocol.endpoint import parse_tcp_endpoint

log = logging.getLogger("gradsync.daemon.cluster")

__all__ = ["measure_codec_rates", "on_this_host", "peers_on_this_host"]

#: Bytes each lane codes per round, by dtype (numpy's float64 codec is slow).
SAMPLE_BYTES = {"float32": 4 * 1024 * 1024, "float64": 128 * 1024}
ROUNDS = 5


def measure_codec_rates(
    pool: concurrent.futures.Executor, lanes: int, slice_bytes: int, timeout_s: float = 30.0,
) -> dict[str, float]:
    """Buffer bytes/s that `lanes` threads of `pool` encode plus decode-and-add, per
    format and dtype (`rate_key` names); a rate that could not be measured in
    `timeout_s` is left out."""
    rates: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    for dtype, sample in SAMPLE_BYTES.items():
        itemsize = np.dtype(dtype).itemsize
        count = max(4096, min(sample, slice_bytes) // itemsize)
        values = np.random.default_rng(0).standard_normal(count).astype(dtype)
        for name, codec in CODECS.items():
            work = [values.copy() for _ in range(lanes)]
            targets = [np.zeros(count, dtype) for _ in range(lanes)]

            def code(lane: int, codec=codec, work=work, targets=targets) -> None:  # type: ignore[no-untyped-def]
                payload = codec.encode(work[lane])
                codec.decode_into(payload, targets[lane], True)

            best = float("inf")
            for _ in range(ROUNDS):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                start = time.perf_counter()
                futures = [pool.submit(code, lane) for lane in range(lanes)]
                done, _ = concurrent.futures.wait(futures, remaining)
                if len(done) < lanes:
                    break
                for future in done:
                    future.result()
                best = min(best, time.perf_counter() - start)
            if best < float("inf"):
                rates[rate_key(name, dtype)] = lanes * count * itemsize / max(best, 1e-9)
    log.info("codec rates with %d lane(s): %s", lanes,
             ", ".join(f"{name} {rate / 1e9:.2f} GB/s" for name, rate in rates.items()))
    return rates


def on_this_host(endpoint: str) -> bool:
    """Whether `tcp://HOST:PORT` names this host: a loopback address, `localhost`,
    or an address of one of its interfaces (in this network namespace).  Host
    names other than localhost are not resolved (that could block): not this host."""
    try:
        host = parse_tcp_endpoint(endpoint).host.strip("[]")
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if address.is_loopback:
        return True
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.bind((host, 0))  # only an address of this host's interfaces binds
        return True
    return False


def peers_on_this_host(peers: Iterable[str]) -> bool:
    """Whether there are `peers` (this daemon's others) and all are on this host."""
    others = list(peers)
    return bool(others) and all(on_this_host(peer) for peer in others)
