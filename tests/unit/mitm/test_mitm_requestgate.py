"""The child's request gate (docs/reference/behaviour.md §19): a view is pulled once per client
and name and kept under the narrowing stamp (no round trip per request); a bump pulls again;
anything but a good 200 is None (the callers refuse)."""

from __future__ import annotations

import json
from typing import Any

from egressd.mitm.requests import view_of
from egressd.mitmchild.requestgate import RequestGate
from egressd.policy import parse_policy_obj

POLICY = parse_policy_obj(
    {"defaultAction": "deny", "egress": [{"action": "allow", "target": "api.x.io", "methods": ["GET"]}]}
)


class Resp:
    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body

    async def __aenter__(self) -> Resp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        return self.body


class Session:
    def __init__(self, answers: list[tuple[int, bytes] | Exception]) -> None:
        self.answers = answers
        self.urls: list[str] = []

    def get(self, url: str) -> Resp:
        self.urls.append(url)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return Resp(*answer)


class Seq:
    def __init__(self) -> None:
        self.value = 1

    def stamp(self, key: str) -> tuple[int, int]:
        return (1, self.value)


class Client:
    def __init__(self, session: Session) -> None:
        self._session, self.seq = session, Seq()

    def session(self) -> Session:
        return self._session


class Vaults:
    shared_port = 18081

    def __init__(self, client: Any) -> None:
        self.client = client


GOOD = (200, json.dumps(view_of("u1", POLICY, "api.x.io")).encode())


async def test_a_view_is_kept_under_its_stamp() -> None:
    session = Session([GOOD, GOOD])
    client = Client(session)
    gate = RequestGate(Vaults(client))  # type: ignore[arg-type]
    for _ in range(5):
        view = await gate.view(object(), "10.0.0.2", "api.x.io")
        assert view is not None and view.judged
    assert gate.pulls == 1
    client.seq.value += 1  # egressd bumped the client's slot: the policy may have changed
    assert await gate.view(object(), "10.0.0.2", "api.x.io") is not None
    assert gate.pulls == 2 and "name=api.x.io" in session.urls[-1] and "clientIp=10.0.0.2" in session.urls[-1]


async def test_anything_but_a_good_view_is_none() -> None:
    answers: list[tuple[int, bytes] | Exception] = [(404, b""), (503, b""), (200, b"{"), (200, b"[]"), OSError("x")]
    for answer in answers:
        gate = RequestGate(Vaults(Client(Session([answer, answer]))))  # type: ignore[arg-type]
        assert await gate.view(object(), "10.0.0.2", "api.x.io") is None
        assert await gate.judged(object(), "10.0.0.2", "api.x.io") is True  # opened, its requests refused
    gate = RequestGate(Vaults(None))  # type: ignore[arg-type]
    assert await gate.view(object(), "10.0.0.2", "api.x.io") is None
    assert await gate.judged(object(), "10.0.0.2", "api.x.io") is True  # unknown: opened, then refused
