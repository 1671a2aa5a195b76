"""The one fake kernel of the unit tests.

:class:`FakeKernel` implements the ``Transactions`` protocol of :mod:`egressd.kernel.applier`
(the fleet control plane's kernel shell) and so also the sidecar engine's ``Kernel`` (which
needs ``run_script`` only). Every unit test that needs a kernel takes it; what differs from
test to test is given as parameters, never as another fake.

A call goes through these steps, in this order:

1. a held call (:meth:`FakeKernel.hold`) waits until :meth:`FakeKernel.release`;
2. it yields to the event loop once (``yield_each_call``), as the real shell hops to its
   kernel thread, or sleeps ``latency`` seconds (a slow libnftables call);
3. it is recorded as a :class:`Call` in :attr:`FakeKernel.calls`: every attempt, refused
   ones included, ``ok`` telling whether the kernel took it;
4. ``on_call`` sees it;
5. an injected fault (:meth:`FakeKernel.fail`, :meth:`FakeKernel.fail_randomly`) may refuse
   it, time it out, or let it apply and then lose the answer (the kinds of :data:`FAULTS`);
6. the model applies it all or nothing, as nf_tables does: a copy of the model takes the
   change and replaces the model only if no step raised.

The model is pluggable (:class:`KernelModel`). The default, :class:`AcceptAll`, takes every
transaction and keeps nothing. :class:`TextModel` keeps the table as nft text and refuses what
nf_tables refuses (see its docstring); the fault matrix plugs in its own typed model, which its
openness evaluator walks.

``run_batch_inline`` is ``run_batch`` on the real shell's fast path (a DNS answer's leases, on
the event loop thread). The fake runs it exactly like ``run_batch`` (held, yielding, faulted,
recorded as a batch with ``inline`` set): the tests that hold, hang or cancel a learn in the
middle of its kernel step (the fault matrix's ``hang``, a DNS caller that gives up) then keep
their schedule whichever of the two the control plane calls.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import random
import re
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Protocol, Self, cast, overload

from egressd.kernel.applier import NftError, NftUncertain
from egressd.kernel.netlink_dump import SetElement
from egressd.kernel.netlink_elements import interval_keys
from egressd.kernel.ops import (
    AddChain,
    AddCounter,
    AddCounterRef,
    AddElements,
    AddIface,
    AddIntervals,
    AddJump,
    AddPort,
    AddPortElems,
    AddRule,
    AddServices,
    AddSet,
    AddTimed,
    AddUid,
    AddUidCounterRef,
    AddUidJump,
    AddUidPort,
    DeleteChain,
    DeleteCounter,
    DeleteElement,
    DeleteIface,
    DeletePortElems,
    DeleteSet,
    DeleteUid,
    FlushChain,
    FlushSet,
    NetlinkBatch,
    PortElem,
    port_elem_text,
)
from egressd.policy import format_element

Kind = Literal["script", "batch", "reset"]
Fault = Literal["refused", "timeout", "hang", "late_ack", "late_timeout"]
FAULTS: tuple[Fault, ...] = ("refused", "timeout", "hang", "late_ack", "late_timeout")
"""``refused``: NftError, nothing applied (the kernel said no). ``timeout``: the call hangs
(``hang_s``), then TimeoutError, nothing applied. ``hang``: the call outlasts a bounded caller
(3 x ``hang_s``); a caller that gives up meanwhile cancels it, and the batch lands all the same
(the kernel thread does not give up). ``late_ack``: applied, then NftUncertain (the ack read
timed out). ``late_timeout``: applied, then TimeoutError."""


@dataclass(eq=False)
class Call:
    """One transaction as the kernel was asked for it. Compared by identity: a snapshot of
    :attr:`FakeKernel.calls` equals a later one only if no call came in between."""

    n: int  # 1-based, over the kernel's life
    kind: Kind
    op: str
    script: str | None = None  # a script's text, or a reset's header with its "delete table"
    batch: NetlinkBatch | None = None
    ok: bool = True  # the kernel took it (a late_ack is taken, its answer lost)
    inline: bool = False  # through run_batch_inline

    @cached_property
    def text(self) -> str:
        """The script, or the batch in nft syntax (:meth:`NetlinkBatch.describe`): computed on
        first use, so a test that never reads it never pays for a big batch's rendering."""
        if self.batch is not None:
            return self.batch.describe()
        return self.script or ""


@dataclass
class InjectedFault:
    """A fault :meth:`FakeKernel.fail` armed: it fires on the calls matching every criterion
    given, ``left`` more times (None: until :meth:`FakeKernel.heal`). A test may set ``left``."""

    fault: Fault
    match: str | None = None
    op: str | None = None
    call: int | None = None
    kinds: Collection[str] | None = None
    left: int | None = 1
    message: str | None = None
    fired: int = 0

    def matches(self, call: Call) -> bool:
        if self.left is not None and self.left <= 0:
            return False
        if self.call is not None and self.call != call.n:
            return False
        if self.op is not None and self.op != call.op:
            return False
        if self.kinds is not None and call.kind not in self.kinds:
            return False
        return self.match is None or self.match in call.text


class KernelModel(Protocol):
    """What the fake keeps of the table. Every method that changes it raises :class:`NftError`
    for what nf_tables would refuse; the fake then drops the copy the change was made on."""

    def copy(self) -> Self: ...

    def apply_script(self, script: str) -> None: ...

    def apply_batch(self, batch: NetlinkBatch) -> None: ...

    def reset(self, header_with_delete: str, header: str) -> None: ...

    def set_elements(self, name: str) -> list[SetElement]:
        """One set's elements as a netlink dump returns them (``list_set_elements``)."""
        ...

    def elements(self, name: str) -> dict[str, str]:
        """One set's or map's elements as nft text: key -> data ("" in a set)."""
        ...

    def rules(self, chain: str) -> list[str]: ...

    def chain_names(self) -> list[str]: ...

    def set_names(self) -> list[str]:
        """Every set of the table, maps included."""
        ...


class AcceptAll:
    """Takes every transaction and keeps nothing: the kernel of a test about something else.
    A set dump is refused, as the real shell refuses one it cannot make."""

    def copy(self) -> Self:
        return self

    def apply_script(self, script: str) -> None:
        del script

    def apply_batch(self, batch: NetlinkBatch) -> None:
        del batch

    def reset(self, header_with_delete: str, header: str) -> None:
        del header_with_delete, header

    def set_elements(self, name: str) -> list[SetElement]:
        raise NftError(f"set element dump refused: the fake kernel keeps no table ({name})")

    def elements(self, name: str) -> dict[str, str]:
        del name
        return {}

    def rules(self, chain: str) -> list[str]:
        del chain
        return []

    def chain_names(self) -> list[str]:
        return []

    def set_names(self) -> list[str]:
        return []


class FakeKernel[M: KernelModel]:
    """The fake ``Transactions`` (see the module docstring for what a call goes through)."""

    @overload
    def __init__(
        self: FakeKernel[AcceptAll],
        *,
        model: None = None,
        table_name: str | None = None,
        yield_each_call: bool = True,
        latency: float = 0.0,
        hang_s: float = 0.002,
    ) -> None: ...

    @overload
    def __init__(
        self,
        *,
        model: M,
        table_name: str | None = None,
        yield_each_call: bool = True,
        latency: float = 0.0,
        hang_s: float = 0.002,
    ) -> None: ...

    def __init__(
        self,
        *,
        model: M | None = None,
        table_name: str | None = None,
        yield_each_call: bool = True,
        latency: float = 0.0,
        hang_s: float = 0.002,
    ) -> None:
        """``table_name``: every batch must be for that table (None: not checked).
        ``hang_s``: how long a hung call lasts; the real shell's socket timeout bounds it."""
        self.table: M = model if model is not None else cast(M, AcceptAll())  # the modelled table
        self.table_name = table_name
        self.yield_each_call = yield_each_call
        self.latency = latency
        self.hang_s = hang_s
        self.calls: list[Call] = []
        # Off: calls are numbered but not kept (a test that measures egressd's own memory).
        self.recording = True
        self.on_call: Callable[[Call], None] | None = None
        self.fired = False  # some injected fault fired (a test may clear it)
        self.entered = asyncio.Event()  # a held call is waiting
        self._count = 0
        self._cleared = 0
        self._faults: list[InjectedFault] = []
        self._random: tuple[random.Random, float] | None = None
        self._hold_when: Callable[[str, NetlinkBatch | None], bool] | None = None
        self._gate = asyncio.Event()

    # -- failure injection -------------------------------------------------------------

    def fail(
        self,
        *,
        match: str | None = None,
        op: str | None = None,
        call: int | None = None,
        kinds: Collection[str] | None = None,
        times: int | None = 1,
        fault: str = "refused",
        message: str | None = None,
    ) -> InjectedFault:
        """Make the next ``times`` calls (None: all, until :meth:`heal`) that match every
        criterion given fail as ``fault``: ``match`` a substring of the call's text, ``op`` its
        op, ``call`` its 1-based number (:meth:`mark` + 1 is the next call), ``kinds`` its kind."""
        assert fault in FAULTS, fault  # a str, so a parametrised test can pass its own
        armed = InjectedFault(fault, match, op, call, kinds, times, message)
        self._faults.append(armed)
        return armed

    def fail_randomly(self, rng: random.Random, rate: float) -> None:
        """Refuse each script and batch (never a reset) with probability ``rate``, drawing
        one number from ``rng`` per call."""
        self._random = (rng, rate)

    def heal(self) -> None:
        """Disarm every injected fault."""
        self._faults.clear()
        self._random = None

    # -- holding calls -----------------------------------------------------------------

    def hold(self, when: Callable[[str, NetlinkBatch | None], bool] | None = None) -> None:
        """Hold every call from now on (or those for which ``when(op, batch)`` is true; a
        script has no batch) until :meth:`release`; :attr:`entered` is set when one waits."""
        self._hold_when = when if when is not None else (lambda op, batch: True)
        self._gate = asyncio.Event()
        self.entered = asyncio.Event()

    def release(self) -> None:
        self._hold_when = None
        self._gate.set()

    @property
    def held(self) -> bool:
        return self._hold_when is not None

    # -- Transactions protocol -----------------------------------------------------------

    async def run_script(self, script: str, *, op: str) -> None:
        await self._run("script", op, None, lambda t: t.apply_script(script), script=script)

    async def run_batch(self, batch: NetlinkBatch, *, op: str) -> None:
        self._check_table(batch)
        await self._run("batch", op, batch, lambda t: t.apply_batch(batch))

    async def run_batch_inline(self, batch: NetlinkBatch, *, op: str) -> None:
        self._check_table(batch)
        await self._run("batch", op, batch, lambda t: t.apply_batch(batch), inline=True)

    async def reset_table(self, header_with_delete: str, header: str) -> None:
        await self._run(
            "reset", "reset", None, lambda t: t.reset(header_with_delete, header), script=header_with_delete
        )

    async def list_set_elements(self, table: str, set_name: str) -> list[SetElement]:
        # A read, as on the real shell: not a transaction, so neither recorded nor faulted.
        assert self.table_name is None or table == self.table_name, table
        if self.yield_each_call:
            await asyncio.sleep(0)
        return self.table.set_elements(set_name)

    async def close(self) -> None:
        pass

    def _check_table(self, batch: NetlinkBatch) -> None:
        assert self.table_name is None or batch.table == self.table_name, batch.table

    async def _run(
        self,
        kind: Kind,
        op: str,
        batch: NetlinkBatch | None,
        apply: Callable[[M], None],
        *,
        script: str | None = None,
        inline: bool = False,
    ) -> None:
        when = self._hold_when
        if when is not None and when(op, batch) and not self._gate.is_set():
            self.entered.set()
            await self._gate.wait()
        if self.latency:
            await asyncio.sleep(self.latency)
        elif self.yield_each_call:
            await asyncio.sleep(0)
        self._count += 1
        call = Call(self._count, kind, op, script, batch, inline=inline)
        if self.recording:
            self.calls.append(call)
        if self.on_call is not None:
            self.on_call(call)
        armed = self._fault_for(call)
        fault = armed.fault if armed is not None else None
        if fault == "refused":
            call.ok = False
            assert armed is not None
            raise NftError(
                armed.message or f"Error: Could not process rule: injected failure of call {call.n} ({op})"
            )
        if fault == "timeout":
            call.ok = False
            await asyncio.sleep(self.hang_s)
            raise TimeoutError(f"injected hang of call {call.n} ({op})")
        if fault == "hang":
            try:
                await asyncio.sleep(self.hang_s * 3)
            except asyncio.CancelledError:
                self._commit(call, apply)
                raise
        self._commit(call, apply)
        if fault == "late_ack":
            raise NftUncertain(f"netlink batch unanswered: [Errno 110] injected lost answer of call {call.n}")
        if fault == "late_timeout":
            await asyncio.sleep(self.hang_s)
            raise TimeoutError(f"injected timeout after call {call.n} applied")

    def _fault_for(self, call: Call) -> InjectedFault | None:
        if self._random is not None and call.kind != "reset":
            rng, rate = self._random
            if rng.random() < rate:
                self.fired = True
                return InjectedFault("refused", message="injected")
        for armed in self._faults:
            if armed.matches(call):
                if armed.left is not None:
                    armed.left -= 1
                armed.fired += 1
                self.fired = True
                return armed
        return None

    def _commit(self, call: Call, apply: Callable[[M], None]) -> None:
        scratch = self.table.copy()
        try:
            apply(scratch)
        except NftError:
            call.ok = False
            raise
        self.table = scratch

    # -- what the kernel was asked, and holds --------------------------------------------

    def mark(self) -> int:
        """The number of the last call so far: :meth:`since` of it lists the calls after."""
        return self._count

    def since(self, mark: int) -> list[Call]:
        """Every call after ``mark``, refused ones included."""
        return [c for c in self.calls if c.n > mark]

    def applied_since(self, mark: int, op: str | None = None) -> list[str]:
        """The text of each transaction the kernel took after ``mark`` (resets included)."""
        return [c.text for c in self.since(mark) if c.ok and (op is None or c.op == op)]

    def ok_calls(self, op: str | None = None) -> list[Call]:
        """Every script and batch the kernel took (never a reset)."""
        return [c for c in self.calls if c.ok and (op is None or c.op == op) and c.kind != "reset"]

    def clear(self) -> None:
        """Start :attr:`scripts`, :attr:`batches`, :attr:`applied` and :meth:`ops` afresh."""
        self._cleared = self._count

    def _taken(self) -> list[Call]:
        return [c for c in self.calls if c.ok and c.n > self._cleared]

    @property
    def scripts(self) -> list[tuple[str, str]]:
        """(op, script) of each script the kernel took since :meth:`clear`."""
        return [(c.op, c.text) for c in self._taken() if c.kind == "script"]

    @property
    def batches(self) -> list[tuple[str, NetlinkBatch]]:
        """(op, batch) of each batch the kernel took since :meth:`clear`."""
        return [(c.op, c.batch) for c in self._taken() if c.batch is not None]

    @property
    def applied(self) -> list[tuple[str, str]]:
        """(op, text) of each script and batch the kernel took since :meth:`clear`."""
        return [(c.op, c.text) for c in self._taken() if c.kind != "reset"]

    @property
    def resets(self) -> int:
        """How many times the table was reset."""
        return sum(1 for c in self.calls if c.kind == "reset")

    def ops(self, op: str) -> list[NetlinkBatch]:
        """The batches of ``op`` the kernel took since :meth:`clear`."""
        return [b for o, b in self.batches if o == op]

    def elements(self, name: str) -> dict[str, str]:
        return self.table.elements(name)

    def rules(self, chain: str) -> list[str]:
        return self.table.rules(chain)

    def has_chain(self, chain: str) -> bool:
        return chain in self.table.chain_names()

    def subject_objects(self, nid: str) -> list[str]:
        """The chains and sets of the subject with kernel id ``nid``."""
        names = [*self.table.chain_names(), *self.table.set_names()]
        return sorted(n for n in names if n in (f"subj_{nid}", f"mark_{nid}") or n.startswith(f"subj_{nid}_"))


# --------------------------------------------------------------------------- text model


_ELEMENTS = re.compile(r"elements = \{ (.*) \} \}$")


def _uid_key(uid: int, port: int | None) -> str:
    """A uid-keyed element as nft prints it: ``100001`` or ``100001 . 16000``."""
    return str(uid) if port is None else f"{uid} . {port}"


def _parse_port_elem(text: str) -> PortElem:
    """``prefix . proto . lo[-hi]`` back into an element (the model's keys are nft's text)."""
    net, proto, ports = text.split(" . ")
    lo, _, hi = ports.partition("-")
    return ipaddress.ip_network(net), proto, int(lo), int(hi or lo)


def _err(msg: str) -> NftError:
    return NftError(f"Error: Could not process rule: {msg}")


@dataclass
class TextModel:
    """The table as nft text. libnftables scripts (header, subject objects, dispatch entries)
    are parsed as text; netlink batches are applied op by op. The model enforces only kernel
    behaviour verified with nft 1.0 on Linux:

    * a transaction (script or batch) is atomic: a failing one changes nothing (the fake
      applies it to a copy);
    * re-adding a map element with *different* data fails (``File exists``);
    * deleting an element, chain or set that does not exist fails (``No such file or
      directory``), also when the same batch already deleted it; so does flushing or filling a
      missing set;
    * rules may only reference declared sets/maps and live in declared chains;
    * a chain still referenced by a map element (``jump``) and a set still referenced by a rule
      cannot be deleted (``Device or resource busy``); deleting a chain deletes its rules.
    """

    name: str = "T"  # the table (family inet)
    exists: bool = False
    chains: dict[str, list[str]] = field(default_factory=dict)
    sets: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> key -> data ("" for sets)
    maps: set[str] = field(default_factory=set)
    set_kinds: dict[str, str] = field(default_factory=dict)  # name -> "<fam>:<kind>"
    counters: set[str] = field(default_factory=set)

    def copy(self) -> Self:
        return copy.deepcopy(self)

    def _wipe(self) -> None:
        fresh = TextModel(self.name)
        self.exists, self.chains, self.sets = fresh.exists, fresh.chains, fresh.sets
        self.maps, self.set_kinds, self.counters = fresh.maps, fresh.set_kinds, fresh.counters

    def reset(self, header_with_delete: str, header: str) -> None:
        try:
            self.apply_script(header_with_delete)
        except NftError:
            # "delete table" of a missing table: the shell retries without it, on no table.
            self._wipe()
            self.apply_script(header)

    def apply_script(self, script: str) -> None:
        for line in script.splitlines():
            verb, kind, fam, table, *rest = line.split(" ", 4)
            assert fam == "inet" and table == self.name, line
            body = rest[0] if rest else ""
            if kind == "table":
                if verb == "delete":
                    if not self.exists:
                        raise _err("No such file or directory")
                    self._wipe()
                else:
                    self.exists = True
                continue
            if not self.exists:
                raise _err("No such file or directory")
            name = body.split(" ", 1)[0]
            if kind == "chain":
                self._script_chain(verb, name, line)
            elif kind in ("set", "map"):
                self._script_set(verb, kind, name, body, line)
            elif kind == "rule":
                assert verb == "add", line
                self._script_rule(name, body.split(" ", 1)[1])
            elif kind == "counter":
                assert verb == "add", line
                self.counters.add(name)  # the header's unattributed_dropped
            else:
                raise AssertionError(line)

    def _script_rule(self, chain: str, rule: str) -> None:
        if chain not in self.chains:
            raise _err("No such file or directory")
        for ref in re.findall(r"@(\w+)", rule):
            if ref not in self.sets:
                raise _err(f"Could not process rule: set {ref} does not exist")
        self.chains[chain].append(rule)

    def _script_chain(self, verb: str, name: str, line: str) -> None:
        if verb == "add":
            self.chains.setdefault(name, [])
        elif verb == "flush":
            if name not in self.chains:
                raise _err("No such file or directory")
            self.chains[name] = []
        else:
            raise AssertionError(line)

    def _script_set(self, verb: str, kind: str, name: str, body: str, line: str) -> None:
        if verb == "add":
            elements = self.sets.setdefault(name, {})
            if kind == "map":
                self.maps.add(name)
            fam = "v6" if "ipv6_addr" in body else ("uid" if "type uid" in body else "ifname" if "type ifname" in body else "v4")
            fam += "p" if "inet_proto" in body else ""
            self.set_kinds.setdefault(name, f"{fam}:{'interval' if 'flags interval' in body else kind}")
            m = _ELEMENTS.search(body)
            if m:
                for element in m.group(1).split(", "):
                    key, _, data = element.partition(" : ")
                    key = key.split(" ")[0]
                    if key in elements and elements[key] != data:
                        raise _err("File exists")
                    elements[key] = data
        elif verb == "flush":
            if name not in self.sets:
                raise _err("No such file or directory")
            self.sets[name] = {}
        else:
            raise AssertionError(line)

    def apply_batch(self, batch: NetlinkBatch) -> None:
        if batch.ops and not self.exists:
            raise _err("No such file or directory")
        for op in batch.ops:
            _BATCH_OPS[type(op)](self, op)

    def _add_set(self, op: AddSet) -> None:
        kind = "services:interval" if op.services else f"{op.fam}p:interval" if op.ports else f"{op.fam}:{op.kind}"
        if op.name in self.sets and self.set_kinds.get(op.name, kind) != kind:
            raise _err("File exists")
        self.sets.setdefault(op.name, {})
        self.set_kinds[op.name] = kind

    def _add_chain(self, op: AddChain) -> None:
        self.chains.setdefault(op.name, [])

    def _add_counter(self, op: AddCounter) -> None:
        self.counters.add(op.name)

    def _delete_counter(self, op: DeleteCounter) -> None:
        if op.name not in self.counters:
            raise _err("No such file or directory")
        if any(f'counter name "{op.name}"' in r for rules in self.chains.values() for r in rules):
            raise _err("Device or resource busy")
        if any(d == f'"{op.name}"' for els in self.sets.values() for d in els.values()):
            raise _err("Device or resource busy")  # a counter map element refers to it
        self.counters.discard(op.name)

    def _add_counter_ref(self, op: AddCounterRef) -> None:
        elements = self.sets.get(op.map)
        if elements is None or op.counter not in self.counters:
            raise _err("No such file or directory")
        data = f'"{op.counter}"'
        if elements.get(str(op.key), data) != data:
            raise _err("Device or resource busy")
        elements[str(op.key)] = data

    def _add_port(self, op: AddPort) -> None:
        elements = self.sets.get(op.map)
        if elements is None:
            raise _err("No such file or directory")
        data = str(op.to_port)
        if elements.get(str(op.key), data) != data:
            raise _err("Device or resource busy")
        elements[str(op.key)] = data

    def _add_jump(self, op: AddJump) -> None:
        elements = self.sets.get(op.map)
        if elements is None or op.chain not in self.chains:
            raise _err("No such file or directory")
        data = f"jump {op.chain}"
        if elements.get(str(op.key), data) != data:
            raise _err("File exists")
        elements[str(op.key)] = data

    def _uid_element(self, name: str, key: str, data: str) -> None:
        elements = self._need(name)
        if elements.get(key, data) != data:
            raise _err("File exists")
        elements[key] = data

    def _add_uid_jump(self, op: AddUidJump) -> None:
        if op.chain not in self.chains:
            raise _err("No such file or directory")
        self._uid_element(op.map, _uid_key(op.uid, op.port), f"jump {op.chain}")

    def _add_uid_port(self, op: AddUidPort) -> None:
        self._uid_element(op.map, str(op.uid), str(op.to_port))

    def _add_uid_counter_ref(self, op: AddUidCounterRef) -> None:
        if op.counter not in self.counters:
            raise _err("No such file or directory")
        self._uid_element(op.map, str(op.uid), f'"{op.counter}"')

    def _add_uid(self, op: AddUid) -> None:
        self._uid_element(op.name, _uid_key(op.uid, op.port), "")

    def _delete_uid(self, op: DeleteUid) -> None:
        elements = self.sets.get(op.name)
        key = _uid_key(op.uid, op.port)
        if elements is None or key not in elements:
            raise _err("No such file or directory")
        del elements[key]

    def _add_iface(self, op: AddIface) -> None:
        self._need(op.name)[f'"{op.iface}"'] = ""

    def _delete_iface(self, op: DeleteIface) -> None:
        elements = self.sets.get(op.name)
        if elements is None or f'"{op.iface}"' not in elements:
            raise _err("No such file or directory")
        del elements[f'"{op.iface}"']

    def _add_elements(self, op: AddElements) -> None:
        elements = self._need(op.name)
        for key in op.keys:
            elements.setdefault(str(key), "")

    def _add_keys(self, op: AddIntervals | AddTimed) -> None:
        elements = self._need(op.name)
        keys = (
            [format_element(n) for n in op.nets]
            if isinstance(op, AddIntervals)
            else [str(ip) for ip, _ in op.leases]
        )
        for text in keys:
            elements[text] = ""

    def _add_port_elems(self, op: AddPortElems) -> None:
        """A pipapo set: an element equal to one held is a re-add; one that partly overlaps
        another (same address and protocol, overlapping ports) is refused."""
        elements = self._need(op.name)
        for elem in op.elems:
            text = port_elem_text(elem)
            if text in elements:
                continue
            for held in map(_parse_port_elem, elements):
                if held[1] == elem[1] and held[0].overlaps(elem[0]) and held[2] <= elem[3] and elem[2] <= held[3]:
                    raise _err("File exists")
            elements[text] = ""

    def _add_services(self, op: AddServices) -> None:
        elements = self._need(op.name)
        for proto, lo, hi in op.elems:
            elements[f"{proto} . {lo}" if lo == hi else f"{proto} . {lo}-{hi}"] = ""

    def _delete_port_elems(self, op: DeletePortElems) -> None:
        elements = self._need(op.name)
        for elem in op.elems:
            text = port_elem_text(elem)
            if text not in elements:
                raise _err("No such file or directory")
            del elements[text]

    def _flush_set(self, op: FlushSet) -> None:
        self._need(op.name)
        self.sets[op.name] = {}

    def _delete_element(self, op: DeleteElement) -> None:
        elements = self.sets.get(op.name)
        if elements is None or str(op.key) not in elements:
            raise _err("No such file or directory")
        del elements[str(op.key)]

    def _delete_chain(self, op: DeleteChain) -> None:
        if op.name not in self.chains:
            raise _err("No such file or directory")
        if any(d == f"jump {op.name}" for els in self.sets.values() for d in els.values()):
            raise _err("Device or resource busy")
        del self.chains[op.name]  # with its rules

    def _flush_chain(self, op: FlushChain) -> None:
        if op.name not in self.chains:
            raise _err("No such file or directory")
        self.chains[op.name] = []

    def _delete_set(self, op: DeleteSet) -> None:
        self._need(op.name)
        if any(op.name in re.findall(r"@(\w+)", r) for rules in self.chains.values() for r in rules):
            raise _err("Device or resource busy")
        del self.sets[op.name]
        self.maps.discard(op.name)

    def _need(self, name: str) -> dict[str, str]:
        elements = self.sets.get(name)
        if elements is None:
            raise _err("No such file or directory")
        return elements

    def _add_rule(self, op: AddRule) -> None:
        if op.chain not in self.chains:
            raise _err("No such file or directory")
        rule = op.rule.render()
        for ref in re.findall(r"@(\w+)", rule):
            if ref not in self.sets:
                raise _err(f"Could not process rule: set {ref} does not exist")
        for ref in re.findall(r'counter name "(\w+)"', rule):
            if ref not in self.counters:
                raise _err(f"Could not process rule: counter {ref} does not exist")
        self.chains[op.chain].append(rule)

    # -- reads ---------------------------------------------------------------------------

    def set_elements(self, name: str) -> list[SetElement]:
        elements = self.sets.get(name)
        if elements is None:
            raise NftError(f"set element dump refused: No such file or directory ({name})")
        fam, _, kind = self.set_kinds.get(name, "v4:plain").partition(":")
        if fam == "uid":
            return [SetElement(struct.pack("=I", int(key.split(" ")[0]))) for key in elements]
        if kind != "interval":
            return [SetElement(ipaddress.ip_address(key).packed) for key in elements]
        nets = [ipaddress.ip_network(key) for key in elements]
        width = 4 if fam == "v4" else 16
        return [SetElement(k.to_bytes(width, "big"), end) for k, end in interval_keys(nets, fam)]

    def elements(self, name: str) -> dict[str, str]:
        return dict(self.sets.get(name, {}))

    def rules(self, chain: str) -> list[str]:
        return list(self.chains.get(chain, []))

    def chain_names(self) -> list[str]:
        return list(self.chains)

    def set_names(self) -> list[str]:
        return list(self.sets)


# One handler per op the fleet sends; an op without one is a KeyError: the model must learn it.
_BATCH_OPS: dict[type, Callable[[TextModel, Any], None]] = {
    AddSet: TextModel._add_set,
    AddChain: TextModel._add_chain,
    AddCounter: TextModel._add_counter,
    DeleteCounter: TextModel._delete_counter,
    AddCounterRef: TextModel._add_counter_ref,
    AddPort: TextModel._add_port,
    AddJump: TextModel._add_jump,
    AddElements: TextModel._add_elements,
    AddRule: TextModel._add_rule,
    FlushSet: TextModel._flush_set,
    FlushChain: TextModel._flush_chain,
    AddIntervals: TextModel._add_keys,
    AddTimed: TextModel._add_keys,
    AddPortElems: TextModel._add_port_elems,
    AddServices: TextModel._add_services,
    DeletePortElems: TextModel._delete_port_elems,
    AddUidJump: TextModel._add_uid_jump,
    AddUidPort: TextModel._add_uid_port,
    AddUidCounterRef: TextModel._add_uid_counter_ref,
    AddUid: TextModel._add_uid,
    DeleteUid: TextModel._delete_uid,
    AddIface: TextModel._add_iface,
    DeleteIface: TextModel._delete_iface,
    DeleteElement: TextModel._delete_element,
    DeleteChain: TextModel._delete_chain,
    DeleteSet: TextModel._delete_set,
}


def text_kernel(table: str = "T", *, yield_each_call: bool = True) -> FakeKernel[TextModel]:
    """A fake kernel that keeps ``table`` as a :class:`TextModel` and takes batches for it only."""
    return FakeKernel(model=TextModel(table), table_name=table, yield_each_call=yield_each_call)


FakeTx = FakeKernel[AcceptAll]
"""The kernel of a test about something else: takes every transaction, keeps no table."""
TextKernel = FakeKernel[TextModel]
"""A kernel that keeps its table as nft text (:func:`text_kernel`)."""
