"""The network policy document (§5): parsing, validation and the canonical model.

Everything here is pure: JSON text or decoded JSON in, frozen dataclasses out. Every
rejection is a :class:`PolicyError` whose message names the offending field, so the
HTTP layer can return it verbatim as a 400 reason.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import re
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any, Final, Literal

from egressd.policy.idn import IdnaError, to_alabels
from egressd.policy.reqpath import readings
from egressd.policy.scope import PORT_MAX, PROTOCOLS, PortRange, Scope, rule_scope

IPNetwork = IPv4Network | IPv6Network
PolicyMode = Literal["deny_all", "allow_all", "enforcing"]

MODE_ENFORCE: Final = "enforce"
MODE_AUDIT: Final = "audit"
MAX_ECHO: Final = 80
MAX_DOMAIN_LEN: Final = 253
MAX_LABEL_LEN: Final = 63


def echo(value: str) -> str:
    """User input quoted for an error message: repr()'d, at most MAX_ECHO characters of it."""
    if len(value) <= MAX_ECHO:
        return repr(value)
    return repr(value[:MAX_ECHO]) + "..."


class PolicyError(ValueError):
    """A policy document (or part of one) is invalid; maps to HTTP 400.

    ``field`` names where the problem is (``"egress[2].target"``, ``"defaultAction"``) or is
    None for document-level problems; ``reason`` is the problem alone. ``str()`` is
    ``"<field>: <reason>"`` (or just the reason) on one line.
    """

    def __init__(self, reason: str, field: str | None = None) -> None:
        self.reason = reason
        self.field = field
        super().__init__(f"{field}: {reason}" if field else reason)

    def without_input(self) -> str:
        """``str()`` without the quoted input at the end of the reason (``(got '...')``,
        ``got '...'``, ``invalid CIDR '...'``), naming only the field: for every reply to a
        policy write. A policy is where a token pasted by mistake ends up (as a target, as an
        action), and an error reply travels further than the request (proxy and SDK logs,
        exceptions), so the input is never echoed back (docs/reference/behaviour.md §6, §12)."""
        reason = _QUOTE_TAIL.sub("", self.reason)
        return f"{self.field}: {reason}" if self.field else reason


# What echo() appended to a reason, always at its end (see PolicyError.without_input).
_QUOTE_TAIL = re.compile(r"""(\s*\(got ['"].*|,\s*got ['"].*|(?<=invalid CIDR)\s+['"].*)$""", re.DOTALL)


class Verdict(enum.StrEnum):
    ALLOW = "allow"
    DENY = "deny"


class TargetKind(enum.StrEnum):
    DOMAIN = "domain"
    IP = "ip"
    CIDR = "cidr"


@dataclass(frozen=True, slots=True)
class Rule:
    """One egress rule.

    ``target`` is the normalised text: domains are A-labels (Unicode converted, docs/reference/behaviour.md
    §14.3), lower-cased with one trailing dot removed; this is also what GET /policy returns;
    IP and CIDR targets keep the user's trimmed text (so PATCH/DELETE by target still match).
    ``network`` is the /32 or /128 for an IP, the masked network for a CIDR, None for a domain.
    ``name``, ``protocol`` and ``ports`` (§18) are kept as parsed; ``scope`` is what they open
    or deny (:data:`Scope.WHOLE` when neither protocol nor ports is given).
    """

    action: Verdict
    target: str
    kind: TargetKind
    network: IPv4Network | IPv6Network | None
    name: str | None = None
    protocol: str | None = None
    ports: tuple[PortRange, ...] | None = None
    scope: Scope = Scope.WHOLE
    methods: tuple[str, ...] | None = None
    paths: tuple[str, ...] | None = None

    @property
    def judges_requests(self) -> bool:
        """The rule carries ``methods`` or ``paths`` (§19): it decides HTTP requests, and a deny
        of this kind denies requests, not the name."""
        return self.methods is not None or self.paths is not None

    @property
    def about_http(self) -> bool:
        """The rule speaks of HTTP(S) only (``protocol`` ``http``/``https``, or request rules):
        the name on the wire is what it opens, never bytes without one (§18)."""
        return self.protocol in ("http", "https") or self.judges_requests

    @property
    def scoped(self) -> bool:
        """The rule names a protocol or ports: it opens (or denies) less than its whole target."""
        return not self.scope.is_whole()

    def same_match(self, other: Rule) -> bool:
        """Both rules match the same traffic (whatever their actions and names)."""
        mine = (self.target, self.protocol, self.scope, self.methods, self.paths)
        return mine == (other.target, other.protocol, other.scope, other.methods, other.paths)

    def to_json(self) -> dict[str, Any]:
        """The wire form: ``action`` and ``target``, then the §18 fields the rule carries."""
        out: dict[str, Any] = {"action": self.action.value, "target": self.target}
        if self.name is not None:
            out["name"] = self.name
        if self.protocol is not None:
            out["protocol"] = self.protocol
        if self.ports is not None:
            out["ports"] = [lo if lo == hi else f"{lo}-{hi}" for lo, hi in self.ports]
        if self.methods is not None:
            out["methods"] = list(self.methods)
        if self.paths is not None:
            out["paths"] = list(self.paths)
        return out


@dataclass(frozen=True, slots=True)
class NetworkPolicy:
    """A policy document, or an *effective* policy (always-rules merged in front).

    ``audit`` (input key ``"mode": "audit"``): denials are logged and counted as would-deny
    but the traffic passes. ``always_deny``/``always_allow`` count the operator always-rules
    at the head of ``egress`` (non-zero only in an effective policy): always-deny rules stay
    enforced in audit mode, and rule labels name them apart from the user's rules.
    """

    default_action: Verdict
    egress: tuple[Rule, ...]
    audit: bool = False
    always_deny: int = 0
    always_allow: int = 0

    def to_json(self) -> dict[str, Any]:
        """The wire form; ``egress`` is always a list (never null); ``mode`` only when auditing
        (so an enforcing policy reads back exactly as before, and a read-back audit policy
        written again stays in audit)."""
        out: dict[str, Any] = {
            "defaultAction": self.default_action.value,
            "egress": [r.to_json() for r in self.egress],
        }
        if self.audit:
            out["mode"] = MODE_AUDIT
        return out


DENY_ALL: Final = NetworkPolicy(Verdict.DENY, ())


def json_type(obj: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "boolean"
    if isinstance(obj, int | float):
        return "number"
    if isinstance(obj, str):
        return "string"
    if isinstance(obj, list):
        return "array"
    if isinstance(obj, dict):
        return "object"
    return type(obj).__name__


def _parse_verdict(value: object, field: str) -> Verdict:
    """``defaultAction`` / rule ``action``: absent or null or blank -> deny."""
    if value is None:
        return Verdict.DENY
    if not isinstance(value, str):
        raise PolicyError(f"must be a string, got {json_type(value)}", field)
    text = value.strip().lower()
    if not text:
        return Verdict.DENY
    try:
        return Verdict(text)
    except ValueError:
        raise PolicyError(f"must be 'allow' or 'deny', got {echo(value)}", field) from None


def parse_mode(value: object) -> bool:
    """The policy's ``mode``: True for ``"audit"``; absent, null, blank or ``"enforce"`` -> False.

    Trimmed and lower-cased like ``defaultAction``. Anything else is a 400: an unreadable
    mode must never silently become audit (fail closed), nor silently enforce a document
    whose author meant something else.
    """
    if value is None:
        return False
    if not isinstance(value, str):
        raise PolicyError(f"must be a string, got {json_type(value)}", "mode")
    text = value.strip().lower()
    if text in ("", MODE_ENFORCE):
        return False
    if text == MODE_AUDIT:
        return True
    raise PolicyError(f"must be 'enforce' or 'audit', got {echo(value)}", "mode")


def _reject_scope(address: IPv4Address | IPv6Address, text: str, field: str) -> None:
    if isinstance(address, IPv6Address) and address.scope_id is not None:
        raise PolicyError(f"IPv6 zone/scope ids are not supported (got {echo(text)})", field)


def _parse_cidr(text: str, field: str) -> IPNetwork:
    addr, _, plen = text.partition("/")
    try:
        address = ipaddress.ip_address(addr)
    except ValueError:
        raise PolicyError(
            f"'/' is only allowed in an address/prefix CIDR (got {echo(text)})", field
        ) from None
    _reject_scope(address, text, field)
    if not (plen.isascii() and plen.isdigit()):
        raise PolicyError(f"CIDR prefix length must be a decimal number (got {echo(text)})", field)
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise PolicyError(f"invalid CIDR {echo(text)}", field) from None


def _validate_domain(name: str, original: str, field: str) -> None:
    if not name:
        raise PolicyError(f"not a valid domain (got {echo(original)})", field)
    if any(c.isspace() for c in name):
        raise PolicyError(f"whitespace is not allowed inside a domain (got {echo(original)})", field)
    if "/" in name:
        raise PolicyError(f"'/' is only allowed in an address/prefix CIDR (got {echo(original)})", field)
    if name == "*":
        raise PolicyError("a bare '*' is not a target; use defaultAction 'allow' instead", field)
    if "*" in name[1:] or (name.startswith("*") and not name.startswith("*.")):
        raise PolicyError(f"'*' is only allowed as a leading '*.' (got {echo(original)})", field)
    if all(c.isdigit() or c == "." for c in name):
        raise PolicyError(f"not a valid IP address or domain (got {echo(original)})", field)
    if len(name) > MAX_DOMAIN_LEN:
        raise PolicyError(f"domain longer than {MAX_DOMAIN_LEN} characters (got {echo(original)})", field)
    for label in name.split("."):
        if not label:
            raise PolicyError(f"domain has an empty label (got {echo(original)})", field)
        if len(label) > MAX_LABEL_LEN:
            raise PolicyError(
                f"domain label longer than {MAX_LABEL_LEN} characters (got {echo(original)})", field
            )


Target = tuple[str, TargetKind, IPNetwork | None]
# A policy's targets repeat, across its updates and across subjects (the same names and
# addresses); converting addresses and IDNA names is most of a policy's parse. Only targets
# that parsed are remembered (a refusal names its field), only short ones, and the memo is
# emptied when full: bounded whatever the inputs.
_TARGETS: dict[str, Target] = {}
_TARGETS_MAX: Final = 4096
_TARGET_MEMO_LEN: Final = 300


def parse_target(text: str, field: str = "target") -> Target:
    """Classify and normalise one rule target: ``(normalised text, kind, network)``.

    IP literal -> IP (a /32 or /128); ``addr/len`` -> CIDR (host bits masked); otherwise a
    domain: Unicode labels become A-labels (IDNA 2008 / UTS-46, so ``évil.com`` matches the
    ``xn--vil-9la.com`` queries carry; invalid -> 400), then lower-cased with one trailing dot
    removed. Raises PolicyError naming ``field``.
    """
    known = _TARGETS.get(text)
    if known is not None:
        return known
    out = _parse_target(text, field)
    if len(text) <= _TARGET_MEMO_LEN:
        if len(_TARGETS) >= _TARGETS_MAX:
            _TARGETS.clear()
        _TARGETS[text] = out
    return out


def _parse_target(text: str, field: str) -> Target:
    trimmed = text.strip()
    if not trimmed:
        raise PolicyError("must not be empty", field)
    try:
        address = ipaddress.ip_address(trimmed)
    except ValueError:
        pass
    else:
        _reject_scope(address, trimmed, field)
        return trimmed, TargetKind.IP, ipaddress.ip_network(address)
    if "/" in trimmed:
        return trimmed, TargetKind.CIDR, _parse_cidr(trimmed, field)
    try:
        name = to_alabels(trimmed).lower()
    except IdnaError as exc:
        raise PolicyError(f"{exc} (got {echo(trimmed)})", field) from None
    if name.endswith("."):
        name = name[:-1]
    _validate_domain(name, trimmed, field)
    return name, TargetKind.DOMAIN, None


def parse_rule(obj: object, where: str) -> Rule:
    """One ``{"action": ..., "target": ...}`` object; ``where`` prefixes field names (``egress[2]``)."""
    if not isinstance(obj, dict):
        raise PolicyError(f"rule must be an object, got {json_type(obj)}", where)
    action = _parse_verdict(obj.get("action"), f"{where}.action")
    raw_target = obj.get("target")
    if raw_target is None:
        raise PolicyError("is required", f"{where}.target")
    if not isinstance(raw_target, str):
        raise PolicyError(f"must be a string, got {json_type(raw_target)}", f"{where}.target")
    target, kind, network = parse_target(raw_target, f"{where}.target")
    name = _parse_name(obj.get("name"), f"{where}.name")
    protocol = _parse_protocol(obj.get("protocol"), f"{where}.protocol")
    ports = _parse_ports(obj.get("ports"), f"{where}.ports")
    methods = _parse_methods(obj.get("methods"), f"{where}.methods")
    paths = _parse_paths(obj.get("paths"), f"{where}.paths")
    if methods is None and paths is None:
        if protocol is None and ports is None:
            return Rule(action, target, kind, network, name)
        return Rule(action, target, kind, network, name, protocol, ports, rule_scope(protocol, ports))
    field = f"{where}.methods" if methods is not None else f"{where}.paths"
    if kind is not TargetKind.DOMAIN:
        raise PolicyError("methods and paths need a domain target", field)
    if protocol not in (None, "http", "https"):
        raise PolicyError("methods and paths need protocol 'http' or 'https'", f"{where}.protocol")
    # Absent protocol: https (§19), kept absent so GET /policy returns what was written.
    scope = rule_scope(protocol or "https", ports)
    return Rule(action, target, kind, network, name, protocol, ports, scope, methods, paths)


MAX_REQUEST_ITEMS: Final = 64
MAX_PATH_PATTERN: Final = 1024
_METHOD = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~]{1,32}")


def _string_items(value: object, field: str, what: str) -> list[tuple[str, str]]:
    if not isinstance(value, list):
        raise PolicyError(f"must be an array of {what}, got {json_type(value)}", field)
    if not value:
        raise PolicyError(f"must not be empty (leave it out for every {what[:-1]})", field)
    if len(value) > MAX_REQUEST_ITEMS:
        raise PolicyError(f"more than {MAX_REQUEST_ITEMS} entries", field)
    out: list[tuple[str, str]] = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise PolicyError(f"must be a string, got {json_type(item)}", f"{field}[{i}]")
        out.append((f"{field}[{i}]", item))
    return out


def _parse_methods(value: object, field: str) -> tuple[str, ...] | None:
    """HTTP method names (tokens), upper-cased; null = every method."""
    if value is None:
        return None
    out: list[str] = []
    for where, item in _string_items(value, field, "methods"):
        method = item.strip()
        if not _METHOD.fullmatch(method):
            raise PolicyError(f"must be an HTTP method name (got {echo(item)})", where)
        if method.upper() not in out:
            out.append(method.upper())
    return tuple(out)


def _parse_paths(value: object, field: str) -> tuple[str, ...] | None:
    """Path patterns: ``/`` first, a trailing ``*`` for a prefix, no query, no whitespace or
    control characters, and no path trick (a pattern no canonical request could match); null =
    every path."""
    if value is None:
        return None
    out: list[str] = []
    for where, item in _string_items(value, field, "paths"):
        if not item.startswith("/"):
            raise PolicyError(f"must start with '/' (got {echo(item)})", where)
        if len(item) > MAX_PATH_PATTERN:
            raise PolicyError(f"longer than {MAX_PATH_PATTERN} characters", where)
        if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in item) or "?" in item or "#" in item:
            raise PolicyError(f"must be a path without spaces, controls, query or fragment (got {echo(item)})", where)
        if "*" in item[:-1]:
            raise PolicyError(f"'*' is only allowed at the end (got {echo(item)})", where)
        if readings(item.rstrip("*")) is None or "%" in item:
            raise PolicyError(f"must be a plain decoded path without '..', '\\' or '%' (got {echo(item)})", where)
        if item not in out:
            out.append(item)
    return tuple(out)


MAX_RULE_NAME: Final = 256
MAX_PORT_ITEMS: Final = 64
_RANGE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")


def _parse_name(value: object, field: str) -> str | None:
    """A rule's ``name``: free text shown in explanations (null = none)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise PolicyError(f"must be a string, got {json_type(value)}", field)
    if len(value) > MAX_RULE_NAME:
        raise PolicyError(f"longer than {MAX_RULE_NAME} characters", field)
    return value


def _parse_protocol(value: object, field: str) -> str | None:
    """``tcp``, ``udp``, ``http`` or ``https`` (trimmed, any case); null = any protocol."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise PolicyError(f"must be a string, got {json_type(value)}", field)
    text = value.strip().lower()
    if text not in PROTOCOLS:
        raise PolicyError(f"must be one of {', '.join(PROTOCOLS)} (got {echo(value)})", field)
    return text


def _parse_ports(value: object, field: str) -> tuple[PortRange, ...] | None:
    """A non-empty list of ports (integers 1..65535) and ranges (``"a-b"``, a <= b); null = any.

    A range's string form may also be one port (``"443"``). Kept in the order given (duplicates
    too), so GET /policy returns what was written."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise PolicyError(f"must be an array of ports, got {json_type(value)}", field)
    if not value:
        raise PolicyError("must not be empty (leave 'ports' out for every port)", field)
    if len(value) > MAX_PORT_ITEMS:
        raise PolicyError(f"more than {MAX_PORT_ITEMS} entries", field)
    return tuple(_parse_port(item, f"{field}[{i}]") for i, item in enumerate(value))


def _parse_port(item: object, field: str) -> PortRange:
    if isinstance(item, bool) or not isinstance(item, int | str):
        raise PolicyError(f"must be a port number or a \"low-high\" string, got {json_type(item)}", field)
    if isinstance(item, int):
        lo = hi = item
    else:
        m = _RANGE.fullmatch(item.strip())
        if m is None:
            raise PolicyError(f"must be a port number or a \"low-high\" range (got {echo(item)})", field)
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
    if not (1 <= lo <= PORT_MAX and 1 <= hi <= PORT_MAX):
        raise PolicyError(f"ports are 1..{PORT_MAX} (got {echo(str(item))})", field)
    if lo > hi:
        raise PolicyError(f"range low end is above its high end (got {echo(str(item))})", field)
    return (lo, hi)


def parse_policy_obj(obj: object) -> NetworkPolicy:
    """An already-decoded policy document; None means deny-all."""
    if obj is None:
        return DENY_ALL
    if not isinstance(obj, dict):
        raise PolicyError(f"policy must be a JSON object, got {json_type(obj)}")
    default_action = _parse_verdict(obj.get("defaultAction"), "defaultAction")
    audit = parse_mode(obj.get("mode"))
    egress = obj.get("egress")
    if egress is None:
        egress = []
    if not isinstance(egress, list):
        raise PolicyError(f"must be an array, got {json_type(egress)}", "egress")
    rules = tuple(parse_rule(item, f"egress[{i}]") for i, item in enumerate(egress))
    if default_action is Verdict.DENY and not rules and not audit:
        return DENY_ALL
    return NetworkPolicy(default_action, rules, audit)


def parse_policy(raw: str | bytes | None) -> NetworkPolicy:
    """Raw JSON text. None, blank, ``null`` and ``{}`` all mean deny-all.

    Error messages never echo the text itself.
    """
    if raw is None:
        return DENY_ALL
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise PolicyError(f"policy is not valid UTF-8 (bad byte at offset {e.start})") from None
    if not raw.strip():
        return DENY_ALL
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PolicyError(f"policy is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise PolicyError("policy is not valid JSON: nested too deeply") from None
    return parse_policy_obj(obj)


def policy_mode(policy: NetworkPolicy | None) -> PolicyMode:
    """``deny_all`` (no policy, or deny + no rules), ``allow_all`` (allow + no rules), else ``enforcing``."""
    if policy is None:
        return "deny_all"
    if not policy.egress:
        return "allow_all" if policy.default_action is Verdict.ALLOW else "deny_all"
    return "enforcing"
