"""Silent clients on name-checked ports (docs/reference/behaviour.md §18,
egressd/mitmchild/silence.py): decided without a name after a silence; an admitted one's first
client bytes still checked before they leave, unless the server spoke first. The mitmproxy
parts are real (Context, NextLayer, TCPFlow); egressd's answers are a stub. The kernel tests
(tests/kernel/test_named_ports_silence.py) drive it with real packets."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import pytest
from mitmproxy import options, tcp
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.test import tflow

from egressd.mitmchild.intercept import REASON_REQUESTS_UNSEEN
from egressd.mitmchild.names import NameAnswer
from egressd.mitmchild.silence import SilentClients


class Gate:
    """The name gate's surface SilentClients uses; answers by wire."""

    def __init__(self, **answers: NameAnswer) -> None:
        self.enabled = True
        self.answers = answers
        self.asked: list[tuple[str, str | None, str, int]] = []
        self.refused: list[tuple[str, str]] = []
        self.reported: list[bool] = []
        self.first_bytes: list[tuple[str, str, str, int]] = []

    async def ask(
        self, conn: Any, ip: str | None, wire: str, name: str | None, dst: str, port: int, *, report: bool = True
    ) -> NameAnswer:
        self.asked.append((wire, name, dst, port))
        self.reported.append(report)
        return self.answers.get(wire, NameAnswer(False, "no_sni"))

    def refuse_connection(self, client: Any, reason: str) -> None:
        self.refused.append((client.id, reason))

    def report_refusal(self, conn: Any, ip: str | None, wire: str, reason: str, dst: str, port: int) -> None:
        self.first_bytes.append((wire, reason, dst, port))


class Judge:
    def __init__(self, judged: bool) -> None:
        self.judged_names: list[str | None] = []
        self.result = judged

    async def judged(self, client: Any, ip: str | None, name: str | None) -> bool:
        self.judged_names.append(name)
        return self.result


def silent(gate: Gate, judge: Judge | None = None) -> tuple[SilentClients, list[tuple[Any, ...]]]:
    reports: list[tuple[Any, ...]] = []
    clients = SilentClients(gate, judge, lambda *a, **k: reports.append((a[0], a[1].decision, a[1].reason)))  # type: ignore[arg-type]
    return clients, reports


def nextlayer(port: int = 2222) -> layer.NextLayer:
    ctx = Context(tflow.tclient_conn(), options.Options())
    ctx.client.peername = ("10.203.0.11", 40000)
    ctx.server.address = ("10.204.0.6", port)
    return layer.NextLayer(ctx)


def client_hello(sni: str) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ctx.wrap_bio(incoming, outgoing, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        conn.do_handshake()
    return outgoing.read()


def message_of(from_client: bool, content: bytes) -> tcp.TCPMessage:
    return tcp.TCPMessage(from_client, content)  # type: ignore[no-untyped-call]


def flow_of(nl: layer.NextLayer, *messages: tuple[bool, bytes]) -> tcp.TCPFlow:
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    flow.messages = [message_of(from_client, content) for from_client, content in messages]
    return flow


def test_a_silent_client_no_name_admits_is_waited_for_and_nothing_reported() -> None:
    """A refusal without a name only means "not without one": a slow TLS client or a pool's
    early connect may still speak, and is then decided (and reported) by what it sends."""
    gate = Gate()
    clients, reports = silent(gate)
    nl = nextlayer()
    clients.woken.add(nl.context.client.id)
    asyncio.run(clients.decide(nl))
    assert gate.asked == [("tcp", None, "10.204.0.6", 2222)] and gate.reported == [False]
    assert nl.layer is None and gate.refused == [] and reports == []
    assert nl.context.client.id not in clients.woken


def admitted(gate: Gate, judge: Judge | None = None) -> tuple[SilentClients, layer.NextLayer]:
    clients, _ = silent(gate, judge)
    nl = nextlayer()
    asyncio.run(clients.decide(nl))
    assert isinstance(nl.layer, layers.TCPLayer) and nl.layer.flow is not None
    return clients, nl


def test_an_admitted_silent_client_is_relayed_and_its_server_first_protocol_runs() -> None:
    gate = Gate(tcp=NameAnswer(True, None))
    clients, nl = admitted(gate)
    banner = flow_of(nl, (False, b"220 smtp.x.io ESMTP\r\n"))
    asyncio.run(clients.tcp_message(banner))
    assert banner.messages == []  # nothing kept
    hello = flow_of(nl, (True, b"EHLO me\r\n"))  # looks like a request line: after a banner, it is not
    asyncio.run(clients.tcp_message(hello))
    assert hello.messages == [] and gate.refused == [] and nl.context.client.id not in clients.watched


def test_tls_after_silence_is_name_checked_before_it_leaves() -> None:
    gate = Gate(tcp=NameAnswer(True, None), tls=NameAnswer(False, "sni_not_allowed"))
    clients, nl = admitted(gate)
    message = message_of(True, client_hello("b.cdn.test"))
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    flow.messages = [message]
    asyncio.run(clients.tcp_message(flow))
    assert gate.asked[-1] == ("tls", "b.cdn.test", "10.204.0.6", 2222)
    assert message.content == b"" and gate.refused == [(nl.context.client.id, "sni_not_allowed")]
    assert gate.first_bytes == []  # the name check that refused it reported it already


def test_tls_after_silence_with_an_allowed_sni_passes_unless_request_rules_judge_it() -> None:
    gate = Gate(tcp=NameAnswer(True, None), tls=NameAnswer(True, None))
    clients, nl = admitted(gate)
    hello = client_hello("a.cdn.test")
    message = message_of(True, hello)
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    flow.messages = [message]
    asyncio.run(clients.tcp_message(flow))
    assert message.content == hello and gate.refused == []
    judge = Judge(True)
    clients, nl = admitted(gate, judge)
    message = message_of(True, hello)
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    flow.messages = [message]
    asyncio.run(clients.tcp_message(flow))
    assert judge.judged_names == ["a.cdn.test"] and message.content == b""
    assert gate.refused == [(nl.context.client.id, REASON_REQUESTS_UNSEEN)]


@pytest.mark.parametrize("data", [b"GET / HTTP/1.1\r\nHost: b.cdn.test\r\n\r\n", b"\r\nGET / HTTP/1.1\r\n"])
def test_http_after_silence_is_refused(data: bytes) -> None:
    gate = Gate(tcp=NameAnswer(True, None))
    clients, nl = admitted(gate)
    message = message_of(True, data)
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    flow.messages = [message]
    asyncio.run(clients.tcp_message(flow))
    assert message.content == b"" and gate.refused == [(nl.context.client.id, "host_not_allowed")]
    # No name was asked about: the refusal is reported to egressd as one from the first bytes.
    assert [(w, r) for w, r, _, _ in gate.first_bytes] == [("http", "host_not_allowed")]


def test_a_request_line_split_after_its_method_is_refused_before_the_rest_leaves() -> None:
    """A client that stalls on "GET" is admitted without a name (no request yet: relayed), and
    the rest of its request line is refused before it leaves."""
    gate = Gate(tcp=NameAnswer(True, None))
    clients, nl = admitted(gate)
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    method = message_of(True, b"GET")
    flow.messages = [method]
    asyncio.run(clients.tcp_message(flow))
    assert method.content == b"GET" and gate.refused == []
    rest = message_of(True, b" / HTTP/1.1\r\nHost: b.cdn.test\r\n\r\n")
    flow.messages = [rest]
    asyncio.run(clients.tcp_message(flow))
    assert rest.content == b"" and gate.refused == [(nl.context.client.id, "host_not_allowed")]


def test_a_word_without_a_request_line_is_relayed_and_then_left_alone() -> None:
    gate = Gate(tcp=NameAnswer(True, None))
    clients, nl = admitted(gate)
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    for part in (b"ping", b"\r\n", b"GET / HTTP/1.1\r\n"):
        message = message_of(True, part)
        flow.messages = [message]
        asyncio.run(clients.tcp_message(flow))
        assert message.content == part
    assert gate.refused == [] and nl.context.client.id not in clients.watched


def test_other_bytes_after_silence_pass_and_only_the_first_read_is_looked_at() -> None:
    gate = Gate(tcp=NameAnswer(True, None))
    clients, nl = admitted(gate)
    first = message_of(True, b"SSH-2.0-OpenSSH_9.6\r\n")
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    flow.messages = [message_of(True, b"")]  # an empty read (the wake-up's) is no first read
    asyncio.run(clients.tcp_message(flow))
    assert nl.context.client.id in clients.watched
    flow.messages = [first]
    asyncio.run(clients.tcp_message(flow))
    assert first.content.startswith(b"SSH") and nl.context.client.id not in clients.watched
    later = message_of(True, b"GET / HTTP/1.1\r\n")
    flow.messages = [later]
    asyncio.run(clients.tcp_message(flow))
    assert later.content and gate.refused == []


def test_a_gone_client_leaves_nothing_behind() -> None:
    gate = Gate(tcp=NameAnswer(True, None))
    clients, nl = admitted(gate)
    clients.woken.add(nl.context.client.id)
    clients.client_disconnected(nl.context.client)
    assert clients.watched == {} and clients.woken == set() and clients.timers == {}


def test_nothing_is_timed_without_the_name_check() -> None:
    gate = Gate()
    gate.enabled = False
    clients, _ = silent(gate)

    async def connect() -> None:
        clients.client_connected(nextlayer().context.client)

    asyncio.run(connect())
    assert clients.timers == {}


def test_a_client_that_spoke_is_not_woken() -> None:
    clients, _ = silent(Gate())

    async def connect_and_speak() -> None:
        client = nextlayer().context.client
        clients.client_connected(client)
        assert client.id in clients.timers
        clients.spoke(client)

    asyncio.run(connect_and_speak())
    assert clients.timers == {}


def test_a_clienthello_split_over_reads_is_held_until_whole_then_checked() -> None:
    gate = Gate(tcp=NameAnswer(True, None), tls=NameAnswer(True, None))
    clients, nl = admitted(gate)
    hello = client_hello("a.cdn.test")
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    first = message_of(True, hello[:40])
    flow.messages = [first]
    asyncio.run(clients.tcp_message(flow))
    assert first.content == b"" and gate.asked[-1][0] == "tcp"  # held back, not yet asked
    rest = message_of(True, hello[40:])
    flow.messages = [rest]
    asyncio.run(clients.tcp_message(flow))
    assert gate.asked[-1] == ("tls", "a.cdn.test", "10.204.0.6", 2222)
    assert rest.content == hello and gate.refused == []  # the whole hello leaves, in order


def test_a_held_clienthello_of_a_refused_name_never_leaves() -> None:
    gate = Gate(tcp=NameAnswer(True, None), tls=NameAnswer(False, "sni_not_allowed"))
    clients, nl = admitted(gate)
    hello = client_hello("b.cdn.test")
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    parts = [message_of(True, hello[:40]), message_of(True, hello[40:])]
    for part in parts:
        flow.messages = [part]
        asyncio.run(clients.tcp_message(flow))
    assert [p.content for p in parts] == [b"", b""]
    assert gate.refused == [(nl.context.client.id, "sni_not_allowed")]


def test_an_error_while_looking_fails_closed() -> None:
    class Broken(Gate):
        async def ask(self, *args: Any, **kwargs: Any) -> NameAnswer:
            if args[2] == "tls":
                raise RuntimeError("boom")
            return NameAnswer(True, None)

    gate = Broken()
    clients, nl = admitted(gate)
    message = message_of(True, client_hello("a.cdn.test"))
    flow = tcp.TCPFlow(nl.context.client, nl.context.server)
    flow.messages = [message]
    asyncio.run(clients.tcp_message(flow))
    assert message.content == b"" and gate.refused and nl.context.client.id not in clients.watched
