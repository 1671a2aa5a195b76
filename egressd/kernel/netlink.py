"""A small nf_tables netlink client for egressd's fixed set of batch operations: the socket.

Why not pyroute2's generic encoder: profiling the daemon showed ~75% of every transaction in
pyroute2's per-attribute Python machinery (about 3 ms for six rules) against 0.2 ms in the
kernel. The messages egressd sends are few and fixed (two rule shapes, set elements, deletes),
so they are built with ``struct`` directly: encoding is pure and unit-tested against
pyroute2's output, and :class:`NfTablesSocket` is the only I/O.

The encoder, by concern: :mod:`egressd.kernel.netlink_proto` (uapi constants, attribute and
header framing, :class:`~egressd.kernel.netlink_proto.NetlinkError`),
:mod:`egressd.kernel.netlink_rules` (rule expressions), :mod:`egressd.kernel.netlink_elements`
(set elements), :mod:`egressd.kernel.netlink_batch` (operations, batches, dump requests) and
:mod:`egressd.kernel.netlink_dump` (parsing dump replies).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from collections.abc import Callable, Iterator

from egressd.kernel.netlink_batch import encode_batch, encode_counter_dump, encode_setelem_dump
from egressd.kernel.netlink_dump import SetElement, parse_counter_dump, parse_setelem_dump
from egressd.kernel.netlink_proto import NETLINK_NETFILTER, NLMSG_ERROR, NetlinkError
from egressd.kernel.ops import AddIntervals, AddTimed, NetlinkBatch, Op

SOL_NETLINK = 270
NETLINK_CAP_ACK = 10  # error answers carry only the failed message's header, not its body
# The *FORCE variants lift net.core.{w,r}mem_max for CAP_NET_ADMIN, as libnftables does.
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)

# Receive-buffer room per answer in a batch: one ACK skb's truesize is 832 bytes (measured on
# kernel 6.18, x86-64); 1024 leaves a fifth of margin.
ACK_TRUESIZE = 1024
MIN_RCVBUF = 1 << 20


def _failed_op_text(table: str, op: Op) -> str:
    """The refused operation for the error text (it is logged and returned in a 500): a policy's
    addresses and a subject's DNS leases are summarised by count, never listed."""
    if isinstance(op, AddIntervals):
        return f"add element inet {table} {op.name} {{ <{len(op.nets)} prefixes> }}"
    if isinstance(op, AddTimed):
        return f"add element inet {table} {op.name} {{ <{len(op.leases)} leases> }}"
    return NetlinkBatch(table, (op,)).describe().strip()


# ---- the socket (shell) --------------------------------------------------------------------


def buffer_sizes(batch_bytes: int, messages: int) -> tuple[int, int]:
    """(send, receive) buffer sizes a batch needs, as given to setsockopt (the kernel doubles
    them). Send: the kernel refuses a netlink message longer than the send buffer with
    EMSGSIZE, and the whole batch is one sendmsg. Receive: the kernel handles the batch inside
    that sendmsg and queues every answer (one per message: each carries NLM_F_ACK) before it
    returns; an answer that does not fit is dropped, and then the outcome is unknown."""
    return batch_bytes + 4096, max(MIN_RCVBUF, (messages + 2) * ACK_TRUESIZE)


def _acks(buf: bytes) -> Iterator[tuple[int, int]]:
    """(seq, error code) of every NLMSG_ERROR message in ``buf``, 0 being an ACK."""
    off = 0
    while off + 20 <= len(buf):
        length, msg_type, _flags, seq, _pid = struct.unpack_from("=IHHII", buf, off)
        if length < 16:
            break
        if msg_type == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", buf, off + 16)
            yield seq, code
        off += (length + 3) & ~3


class NfTablesSocket:
    """A NETLINK_NETFILTER socket applying batches; one per kernel thread, bound to its netns."""

    def __init__(self, timeout: float = 5.0) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._sndbuf = 0
        self._rcvbuf = 0
        self._grow_buffers(0, 0)
        with contextlib.suppress(OSError):  # kernels before 4.3: full echoes, still parsed
            self._sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        self._sock.bind((0, 0))
        self._sock.settimeout(timeout)
        self._seq = 1

    def _set_buffer(self, force: int, plain: int, size: int) -> int:
        """Set a buffer size; the FORCE option (root) passes the sysctl cap, the plain one is
        the fallback. Returns the size the kernel reports (twice the request when granted)."""
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, force, size)
        except PermissionError:
            self._sock.setsockopt(socket.SOL_SOCKET, plain, size)
        return int(self._sock.getsockopt(socket.SOL_SOCKET, plain))

    def _grow_buffers(self, batch_bytes: int, messages: int) -> None:
        snd, rcv = buffer_sizes(batch_bytes, messages)
        if snd > self._sndbuf:
            self._sndbuf = max(snd, self._set_buffer(SO_SNDBUFFORCE, socket.SO_SNDBUF, snd))
        if rcv > self._rcvbuf:
            self._rcvbuf = max(rcv, self._set_buffer(SO_RCVBUFFORCE, socket.SO_RCVBUF, rcv))

    def run(self, batch: NetlinkBatch) -> None:
        if not batch.ops:
            return
        first = self._seq
        data, by_seq = encode_batch(batch, first)
        self._seq += len(by_seq) + 2
        self._grow_buffers(len(data), len(by_seq))
        self._sock.sendall(data)
        pending = set(by_seq)
        failure: NetlinkError | None = None
        # One ACK or error per message (every message carries NLM_F_ACK), all queued before
        # sendall returns. An error on the batch framing itself (e.g. EPERM) ends the wait.
        while pending:
            for seq, code in _acks(self._recv_answers()):
                if seq in pending:
                    pending.discard(seq)
                    if code != 0 and failure is None:
                        failure = NetlinkError(-code, _failed_op_text(batch.table, by_seq[seq]))
                elif code != 0 and first <= seq < self._seq:
                    raise NetlinkError(-code, "batch")
        if failure is not None:
            raise failure

    def _recv_answers(self) -> bytes:
        try:
            return self._sock.recv(1 << 16)
        except TimeoutError:
            raise NetlinkError(errno.ETIMEDOUT, "waiting for the kernel's answer") from None
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                # Answers were dropped: the kernel may have committed the batch.
                raise NetlinkError(errno.ENOBUFS, "answers lost (receive buffer full)") from None
            raise

    def _dump[T](
        self, request: Callable[[int], bytes], parse: Callable[[bytes], tuple[list[T], bool]], what: str
    ) -> list[T]:
        """Send one dump request and collect the parsed items of every reply until DONE."""
        seq = self._seq
        self._seq += 1
        self._sock.sendall(request(seq))
        out: list[T] = []
        while True:
            try:
                buf = self._sock.recv(1 << 20)
            except TimeoutError:
                raise NetlinkError(errno.ETIMEDOUT, f"waiting for the {what} dump") from None
            part, done = parse(buf)
            out.extend(part)
            if done:
                return out

    def counters(self, table: str) -> dict[str, int]:
        """Every counter object of ``table``: name -> packets (one netlink dump, no cache fill)."""

        def parse(buf: bytes) -> tuple[list[tuple[str, int]], bool]:
            part, done = parse_counter_dump(buf)
            return list(part.items()), done

        return dict(self._dump(lambda seq: encode_counter_dump(table, seq), parse, "counter"))

    def set_elements(self, table: str, set_name: str) -> list[SetElement]:
        """One set's elements as the kernel holds them (one netlink dump of that set only)."""
        return self._dump(
            lambda seq: encode_setelem_dump(table, set_name, seq), parse_setelem_dump, "set element"
        )

    def close(self) -> None:
        self._sock.close()
