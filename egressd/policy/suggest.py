"""``egressctl suggest``: a policy that would have admitted a subject's recent denials
(docs/reference/behaviour.md §19). Pure: a policy and denial records in, a policy document out.

The suggestion is the subject's policy with allow rules added in front, as narrow as the
denials allow: a denied request opens its method and exact path, a denied connection its port,
a denied DNS name only HTTPS (any allow rule answers the name). Denials by the operator's
always-deny rules are left out: no tenant rule can admit them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from egressd.policy.evaluate import normalise_name
from egressd.policy.model import NetworkPolicy, PolicyError, parse_target
from egressd.policy.model import TargetKind as _Kind

SUGGESTED = "suggested from denials"


@dataclass(frozen=True, slots=True)
class Denied:
    """One recent denial: the name it was for, and where known the port, the transport
    (``tcp``/``udp``), the method and the path (no query). ``hard``: an always-deny rule."""

    host: str
    port: int | None = None
    transport: str | None = None
    method: str | None = None
    path: str | None = None
    hard: bool = False


def _host(text: str) -> str | None:
    try:
        target, kind, _ = parse_target(normalise_name(text))
    except PolicyError:
        return None
    return target if kind is _Kind.DOMAIN else None


def _web(port: int) -> tuple[str, list[int] | None]:
    """The rule protocol for a request on ``port`` and the ports to name (None: the default)."""
    if port == 80:
        return "http", None
    return "https", (None if port == 443 else [port])


def suggested_rules(denials: list[Denied]) -> list[dict[str, Any]]:
    """Allow rules admitting ``denials``, grouped by name in the order the names were first denied."""
    hosts: dict[str, list[Denied]] = {}
    for d in denials:
        host = _host(d.host)
        if host is not None and not d.hard:
            hosts.setdefault(host, []).append(d)
    rules: list[dict[str, Any]] = []
    for host, seen in hosts.items():
        requests: dict[tuple[str, int], list[str]] = {}
        ports: dict[str, set[int]] = {}
        for d in seen:
            if d.method is not None and d.path is not None and d.port is not None:
                paths = requests.setdefault((d.method.upper(), d.port), [])
                path = d.path.split("?", 1)[0] or "/"
                if path not in paths:
                    paths.append(path)
            elif d.port is not None:
                ports.setdefault(d.transport or "tcp", set()).add(d.port)
        for (method, port), paths in requests.items():
            protocol, named = _web(port)
            rule: dict[str, Any] = {"action": "allow", "target": host, "name": SUGGESTED, "protocol": protocol}
            if named is not None:
                rule["ports"] = named
            rule.update(methods=[method], paths=sorted(paths))
            rules.append(rule)
        for transport, numbers in sorted(ports.items()):
            rules.append({"action": "allow", "target": host, "name": SUGGESTED, "protocol": transport,
                          "ports": sorted(numbers)})  # fmt: skip
        if not requests and not ports:
            rules.append({"action": "allow", "target": host, "name": SUGGESTED, "protocol": "https"})
    return rules


def suggest(policy: NetworkPolicy, denials: list[Denied]) -> dict[str, Any]:
    """``policy`` (the tenant's, as a SET_BINDING input takes it) with :func:`suggested_rules` in front."""
    out = policy.to_json()
    out["egress"] = [*suggested_rules(denials), *out["egress"]]
    return out
