"""The learning and destination-verification path both profiles share (egressd.engine.learning)."""

from __future__ import annotations

import ipaddress
import math

import pytest

from egressd.addr import IPAddress
from egressd.engine import learning
from egressd.kernel.applier import NftError
from egressd.policy import ip_sets, parse_policy
from egressd.subject.leases import Grant, LeaseBook

API, CDN = ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("93.184.216.35")
PINNED = ipaddress.ip_address("198.51.100.7")
ALLOW_API = parse_policy(
    '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.x.io"},'
    '{"action":"allow","target":"198.51.100.7"}]}'
)
ALLOW_CDN = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"cdn.x.io"}]}')
NOW = 1000.0


class Kernel:
    """A backend's kernel step that records what it was sent, or raises."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.sent: list[list[tuple[IPAddress, int]]] = []
        self.fail = fail

    async def add(self, admitted: list[Grant]) -> None:
        self.sent.append([(g.ip, g.seconds) for g in admitted])
        if self.fail is not None:
            raise self.fail


def test_the_question_is_normalised_and_a_refresh_has_none() -> None:
    assert learning.question(" API.X.io. ") == "api.x.io"
    assert learning.question(None) is None


async def test_an_allowed_answer_reaches_the_kernel_then_the_book() -> None:
    book, kernel = LeaseBook(), Kernel()
    got = await learning.learn(book, ALLOW_API, [(API, 300), (API, 60)], "API.x.io.", NOW, kernel.add)
    assert got == [API]
    assert kernel.sent == [[(API, 300)]]  # one element per address, the longest lifetime
    assert book.verified(API, "api.x.io", NOW) and book.live(NOW) == {API: NOW + 300}


async def test_a_denied_answer_sends_nothing_and_learns_nothing() -> None:
    book, kernel = LeaseBook(), Kernel()
    assert await learning.learn(book, ALLOW_API, [(CDN, 300)], "cdn.x.io", NOW, kernel.add) == []
    assert kernel.sent == [] and not len(book)


async def test_a_refresh_renews_only_what_a_still_allowed_name_taught() -> None:
    book, kernel = LeaseBook(), Kernel()
    await learning.learn(book, ALLOW_API, [(API, 300)], "api.x.io", NOW, kernel.add)
    assert await learning.learn(book, ALLOW_API, [(API, 600), (CDN, 600)], None, NOW, kernel.add) == [API]
    assert await learning.learn(book, ALLOW_CDN, [(API, 600)], None, NOW, kernel.add) == []
    assert kernel.sent[1:] == [[(API, 600)]]


async def test_the_lease_cap_holds() -> None:
    book, kernel = LeaseBook(cap=1), Kernel()
    got = await learning.learn(book, ALLOW_API, [(API, 300), (CDN, 300)], "api.x.io", NOW, kernel.add)
    assert got == [API] and len(book) == 1


@pytest.mark.parametrize("may_hold", [False, True])
async def test_a_failed_kernel_step_is_recorded_only_when_the_kernel_may_hold_it(may_hold: bool) -> None:
    book, kernel = LeaseBook(), Kernel(fail=NftError("refused"))
    with pytest.raises(NftError):
        await learning.learn(
            book, ALLOW_API, [(API, 300)], "api.x.io", NOW, kernel.add, kernel_may_hold=lambda _: may_hold
        )
    assert (API in book.live(NOW)) is may_hold


async def test_a_destination_is_verified_by_the_answer_that_taught_it_or_an_explicit_ip_rule() -> None:
    book, sets = LeaseBook(), ip_sets(ALLOW_API)
    await learning.learn(book, ALLOW_API, [(API, 300)], "api.x.io", NOW, Kernel().add)
    assert learning.verified(book, sets, "API.x.io.", API, NOW)
    assert learning.verified_until(book, sets, "api.x.io", API, NOW) == NOW + 300
    assert not learning.verified(book, sets, "other.x.io", API, NOW)  # a forged Host/SNI
    assert learning.verified_until(book, sets, "other.x.io", API, NOW) == 0.0
    assert learning.verified(None, sets, "anything", PINNED, NOW)
    assert learning.verified_until(None, sets, "anything", PINNED, NOW) == math.inf
    assert not learning.verified(book, None, "api.x.io", API, NOW + 301)  # the lease ended
