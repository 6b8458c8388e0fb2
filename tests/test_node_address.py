"""How a job's private daemons choose the address they offer peers (client/node_address.py).

Real interfaces and real routes of this machine: loopback always exists, and a
name no interface has must get an error listing the ones that do.
"""

from __future__ import annotations

import socket

import pytest

from gradsync.client.node_address import (
    free_port,
    interface_address,
    is_loopback,
    node_key,
    route_address,
)
from gradsync.protocol.errors import InvalidArgumentError


def test_an_interface_by_name_gives_its_ipv4_address() -> None:
    assert interface_address("lo") == "127.0.0.1"


def test_an_unknown_interface_is_named_with_the_ones_that_exist() -> None:
    with pytest.raises(InvalidArgumentError) as error:
        interface_address("gsnone0")
    message = str(error.value)
    assert "GRADSYNC_IFNAME=gsnone0: no such interface" in message
    assert "lo" in message.split("interfaces here:")[1]


def test_the_route_to_a_host_picks_the_address_that_reaches_it() -> None:
    assert route_address("127.0.0.1", 29500) == "127.0.0.1"
    assert is_loopback(route_address("localhost", 29500))


def test_an_unresolvable_store_host_says_what_to_set() -> None:
    with pytest.raises(InvalidArgumentError, match=r"cannot resolve the store's host.*IFNAME"):
        route_address("no-such-host.invalid", 29500)


def test_a_free_port_can_be_bound() -> None:
    port = free_port("127.0.0.1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def test_the_node_key_names_host_boot_and_network_namespace() -> None:
    host, boot, namespace = node_key().split("/")
    assert host == socket.gethostname()
    assert boot != "-" and namespace.isdigit()
