"""Parsing and validation of the Fastlet action envelope (``sandbox.fast.io/actions/v1``).

Pure: no I/O, no logging. :func:`parse_action` turns a request body into one of the
typed actions or raises :class:`EnvelopeError` whose message is a short, one-line
reason (the HTTP layer prefixes ``invalid action envelope: ``). Reasons never contain
the binding input; other echoed values are truncated and escaped.

Checks run in a fixed order so the reported reason is deterministic:
JSON object -> apiVersion -> sandbox.uid -> operation -> operation-specific fields -> fence.

A JSON ``null`` counts as an absent field everywhere except ``binding.input``, where it
is the meaningful "binding removed" value.
"""

from __future__ import annotations

import enum
import ipaddress
import json
from dataclasses import dataclass, field
from typing import NoReturn, cast

from egressd.addr import IPAddress, unmap_ip
from egressd.subject.hostuid import DEFAULT_UID_RANGE, UidRange, host_uid_problem
from egressd.subject.model import Fence, uid_problem

__all__ = [
    "API_VERSION",
    "MAX_BODY_BYTES",
    "Action",
    "Attachment",
    "EnvelopeError",
    "HookName",
    "LifecycleHook",
    "ProcessAttachment",
    "RemoveBinding",
    "SetBinding",
    "parse_action",
]

API_VERSION = "sandbox.fast.io/actions/v1"
MAX_BODY_BYTES = 1_048_576

_MAX_ECHO = 64
_UINT64_MAX = 2**64 - 1

_OP_SET_BINDING = "SET_BINDING"
_OP_LIFECYCLE_HOOK = "LIFECYCLE_HOOK"
_OP_REMOVE_BINDING = "REMOVE_BINDING"
_OPERATIONS = (_OP_SET_BINDING, _OP_LIFECYCLE_HOOK, _OP_REMOVE_BINDING)

_JSONObject = dict[str, object]


class EnvelopeError(ValueError):
    """The body is not a valid action envelope; ``str(err)`` is a one-line reason."""


class HookName(enum.StrEnum):
    RUNTIME_READY = "sandbox.runtime-ready"
    DATA_PLANE_READY = "sandbox.data-plane-ready"


@dataclass(frozen=True, slots=True)
class Attachment:
    """``attachment.network`` of a SET_BINDING; ``ip`` is the dispatch key (unmapped)."""

    ip: IPAddress
    host_veth: str
    gateway: IPAddress | None
    private_cidr: ipaddress.IPv4Network | ipaddress.IPv6Network | None


@dataclass(frozen=True, slots=True)
class ProcessAttachment:
    """``attachment.process`` of a SET_BINDING (docs/reference/behaviour.md §17): the sandbox is every process of
    host uid ``uid`` in egressd's own network namespace; that uid is the dispatch key."""

    uid: int


@dataclass(frozen=True, slots=True)
class SetBinding:
    """SET_BINDING. ``input`` None is the JSON literal null (binding removal).

    At most one of ``attachment`` (a network sandbox, keyed by source IP) and ``process``
    (a host-uid sandbox) is set. ``input`` is kept out of ``repr`` so the binding input never
    reaches logs.
    """

    uid: str
    fence: Fence
    spec_generation: int
    attachment: Attachment | None
    input: str | None = field(repr=False)
    process: ProcessAttachment | None = None

    def __repr__(self) -> str:
        shown = "None" if self.input is None else "<redacted>"
        return (
            f"SetBinding(uid={self.uid!r}, fence={self.fence!r}, "
            f"spec_generation={self.spec_generation!r}, attachment={self.attachment!r}, "
            f"process={self.process!r}, input={shown})"
        )


@dataclass(frozen=True, slots=True)
class LifecycleHook:
    uid: str
    fence: Fence
    hook: HookName


@dataclass(frozen=True, slots=True)
class RemoveBinding:
    uid: str
    fence: Fence


Action = SetBinding | LifecycleHook | RemoveBinding


# --------------------------------------------------------------------------- helpers


def _fail(reason: str) -> NoReturn:
    raise EnvelopeError(reason)


def _echo(value: str) -> str:
    """A bounded, single-line, ASCII-only rendering of an untrusted value."""
    if len(value) > _MAX_ECHO:
        return ascii(value[:_MAX_ECHO]) + "..."
    return ascii(value)


def _reject_constant(name: str) -> object:
    raise ValueError(f"non-standard JSON constant {name}")


def _is_valid_unicode(value: str) -> bool:
    """False for strings carrying lone surrogates (from ``\\udXXX`` escapes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _block(parent: _JSONObject | None, key: str, path: str) -> _JSONObject | None:
    """An optional nested object; absent or null -> None, other non-objects -> error."""
    if parent is None:
        return None
    value = parent.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        _fail(f"{path} must be an object")
    return cast(_JSONObject, value)


def _string(parent: _JSONObject | None, key: str, path: str) -> str | None:
    """An optional string field; absent or null -> None, non-strings -> error."""
    if parent is None:
        return None
    value = parent.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        _fail(f"{path} must be a string")
    if not _is_valid_unicode(value):
        _fail(f"{path} must be valid Unicode")
    return value


def _required_string(parent: _JSONObject | None, key: str, path: str) -> str:
    value = _string(parent, key, path)
    if not value:
        _fail(f"{path} is required")
    return value


def _address(parent: _JSONObject | None, key: str, path: str) -> IPAddress | None:
    """An optional IP address; absent, null or ``""`` -> None; unparseable -> error."""
    text = _string(parent, key, path)
    if not text:
        return None
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        _fail(f"{path} {_echo(text)} is not an IP address")
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        _fail(f"{path} {_echo(text)} must not carry a zone")
    return unmap_ip(ip)


def _network(
    parent: _JSONObject | None, key: str, path: str
) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """An optional CIDR (``addr/len``, host bits allowed); absent, null or ``""`` -> None."""
    text = _string(parent, key, path)
    if not text:
        return None
    _, slash, prefix = text.partition("/")
    if not slash or not prefix.isascii() or not prefix.isdigit() or "%" in text:
        _fail(f"{path} {_echo(text)} is not a CIDR")
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        _fail(f"{path} {_echo(text)} is not a CIDR")


# --------------------------------------------------------------------------- sections


def _decode(body: bytes) -> _JSONObject:
    if len(body) > MAX_BODY_BYTES:
        _fail(f"body exceeds {MAX_BODY_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        _fail("body is not valid UTF-8 JSON")
    try:
        doc: object = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        _fail("body is not valid JSON")
    if not isinstance(doc, dict):
        _fail("body must be a JSON object")
    return cast(_JSONObject, doc)


def _api_version(doc: _JSONObject) -> None:
    if doc.get("apiVersion") != API_VERSION:
        _fail(f"apiVersion must be {API_VERSION!r}")


def _uid(doc: _JSONObject) -> str:
    uid = _required_string(_block(doc, "sandbox", "sandbox"), "uid", "sandbox.uid")
    problem = uid_problem(uid)
    if problem is not None:
        _fail(f"sandbox.uid is invalid: {problem}")
    return uid


def _operation(doc: _JSONObject) -> str:
    op = _required_string(doc, "operation", "operation")
    if op not in _OPERATIONS:
        _fail(f"operation {_echo(op)} is not one of {', '.join(_OPERATIONS)}")
    return op


def _binding_input(doc: _JSONObject) -> str | None:
    """Decided on the raw JSON: only a string or the literal null are accepted."""
    binding = doc.get("binding")
    if binding is None:
        _fail("binding.input is required (binding is missing)")
    if not isinstance(binding, dict):
        _fail("binding must be an object")
    if "input" not in binding:
        _fail("binding.input is required")
    value: object = binding["input"]
    if value is None:
        return None
    if not isinstance(value, str):
        _fail("binding.input must be a string or null")
    if not _is_valid_unicode(value):
        _fail("binding.input must be valid Unicode")
    return value


def _spec_generation(doc: _JSONObject) -> int:
    revision = _block(doc, "revision", "revision")
    if revision is None:
        return 0
    value = revision.get("specGeneration")
    if value is None:
        return 0
    if type(value) is not int or not 0 <= value <= _UINT64_MAX:
        _fail("revision.specGeneration must be an integer in [0, 2^64-1]")
    return value


def _attachment(doc: _JSONObject, *, required: bool) -> Attachment | None:
    """``attachment.network``; mandatory for a string input, optional for null input.

    Every present field is validated either way; with a null input a missing ip
    means "no attachment" and a missing hostVeth is tolerated (it is never used).
    """
    network = _block(_block(doc, "attachment", "attachment"), "network", "attachment.network")
    ip = _address(network, "ip", "attachment.network.ip")
    host_veth = _string(network, "hostVeth", "attachment.network.hostVeth")
    gateway = _address(network, "gateway", "attachment.network.gateway")
    private_cidr = _network(network, "privateCidr", "attachment.network.privateCidr")
    if required:
        if ip is None:
            _fail("attachment.network.ip is required")
        if not host_veth:
            _fail("attachment.network.hostVeth is required")
    if ip is None:
        return None
    return Attachment(ip=ip, host_veth=host_veth or "", gateway=gateway, private_cidr=private_cidr)


def _process(
    doc: _JSONObject, *, required: bool, uid_range: UidRange, own_uid: int | None
) -> ProcessAttachment | None:
    """``attachment.process`` (docs/reference/behaviour.md §17); None when the block is absent.

    Only ``uid`` is read: an integer (JSON number without fraction or exponent, never a
    string or a boolean) inside ``uid_range`` and not egressd's own uid. Like a network
    attachment's ip, a missing uid means "no attachment" for a null input.
    """
    process = _block(_block(doc, "attachment", "attachment"), "process", "attachment.process")
    if process is None:
        return None
    value = process.get("uid")
    if value is None:
        if required:
            _fail("attachment.process.uid is required")
        return None
    if type(value) is not int:
        _fail("attachment.process.uid must be an integer")
    problem = host_uid_problem(value, uid_range, own_uid)
    if problem is not None:
        _fail(f"attachment.process.uid is invalid: {problem}")
    return ProcessAttachment(uid=value)


def _hook(doc: _JSONObject) -> HookName:
    hook = _block(doc, "hook", "hook")
    if hook is None:
        _fail("hook is required")
    name = _string(hook, "name", "hook.name")
    if name is None:
        _fail("hook.name is required")
    try:
        return HookName(name)
    except ValueError:
        known = ", ".join(h.value for h in HookName)
        _fail(f"unknown hook.name {_echo(name)} (expected one of {known})")


def _fence(doc: _JSONObject) -> Fence:
    revision = _block(doc, "revision", "revision")
    return Fence(
        runtime_instance_id=_required_string(revision, "runtimeInstanceId", "revision.runtimeInstanceId"),
        attachment_id=_required_string(revision, "attachmentId", "revision.attachmentId"),
    )


# --------------------------------------------------------------------------- entry point


def _attachments(
    doc: _JSONObject, *, required: bool, uid_range: UidRange, own_uid: int | None
) -> tuple[Attachment | None, ProcessAttachment | None]:
    """A network attachment or a process attachment, never both: one sandbox has one
    dispatch key, and two would make its identity depend on which one a hook checks."""
    attachment = _block(doc, "attachment", "attachment")
    has_process = attachment is not None and attachment.get("process") is not None
    if has_process and attachment is not None and attachment.get("network") is not None:
        _fail("attachment.network and attachment.process are mutually exclusive")
    if has_process:
        return None, _process(doc, required=required, uid_range=uid_range, own_uid=own_uid)
    return _attachment(doc, required=required), None


def parse_action(
    body: bytes, *, uid_range: UidRange = DEFAULT_UID_RANGE, own_uid: int | None = None
) -> Action:
    """Parse one action envelope; raises :class:`EnvelopeError` on any violation.

    ``uid_range`` (``EGRESSD_UID_RANGE``) and ``own_uid`` (egressd's uid) bound the host uid
    of a process attachment.
    """
    doc = _decode(body)
    _api_version(doc)
    uid = _uid(doc)
    op = _operation(doc)
    if op == _OP_SET_BINDING:
        binding_input = _binding_input(doc)
        spec_generation = _spec_generation(doc)
        attachment, process = _attachments(
            doc, required=binding_input is not None, uid_range=uid_range, own_uid=own_uid
        )
        return SetBinding(
            uid=uid,
            fence=_fence(doc),
            spec_generation=spec_generation,
            attachment=attachment,
            input=binding_input,
            process=process,
        )
    if op == _OP_LIFECYCLE_HOOK:
        hook = _hook(doc)
        return LifecycleHook(uid=uid, fence=_fence(doc), hook=hook)
    return RemoveBinding(uid=uid, fence=_fence(doc))
