"""The fleet ruleset generator's output, byte for byte, for a fixed set of inputs.

``golden_ruleset.sha256`` holds, per case of :func:`corpus`, the SHA-256 of what the generator
produced when the file was last regenerated: the libnftables scripts as text and every netlink
batch as its ``repr`` (every field of every op) and its ``describe()`` (the full texts are
~0.9 MB, too much to keep in the tree). Restructuring the generator must leave every digest
unchanged. To see what changed, write the full texts at both commits and diff them
(``.venv/bin/python -m tests.unit.fleetnft.test_ruleset_golden --full OUT``); a deliberate
change of the ruleset regenerates the digests (the same command without arguments) and the
diff of the full texts is reviewed.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from ipaddress import ip_address, ip_network
from pathlib import Path

from egressd.fleetnft.audit import audit_counter_subject
from egressd.fleetnft.contents import (
    contents_swap,
    dyn_add,
    dyn_replace,
    policy_contents,
    policy_swap,
    refuses_more,
    sandbox_nets_refresh,
    static_contents,
)
from egressd.fleetnft.header import header_script, worker_ports
from egressd.fleetnft.hostuid import (
    UidSubjectNft,
    uid_audit_ops,
    uid_key_deletes,
    uid_subject_create,
    uid_subject_keys,
)
from egressd.fleetnft.subject import (
    audit_objects,
    dispatch_deletes,
    dispatch_entries,
    flush_subject_sets,
    gateway_release,
    lazy_objects,
    range_objects,
    removal_batch,
    rules_per_subject,
    subject_create,
    subject_keys,
    subject_objects,
    subject_objects_script,
    subject_resync,
    subject_rules,
)
from egressd.fleetnft.table import SubjectNft, TableConfig, dropped_counter_subject, subject_set
from egressd.kernel.ops import NetlinkBatch
from egressd.nftsyntax import intercepted_ports
from egressd.policy import DENY_ALL, NetworkPolicy, parse_policy
from egressd.policy.scope import Scope
from egressd.subject.hostuid import UidPorts, UidRange
from egressd.subject.leases import Grant
from egressd.subject.scopes import LeaseScope
from tests.unit.golden import changed_cases, digests, main

GOLDEN = Path(__file__).with_name("golden_ruleset.sha256")

BASE = TableConfig(table="T")
CONFIGS: dict[str, TableConfig] = {
    "default": BASE,
    "mitm": replace(BASE, mitm=True),
    "mitm_workers_extra": replace(
        BASE, mitm=True, mitm_port=19000, mitm_workers=3, mitm_extra_ports=(8080, 8443)
    ),
    "doh_all": replace(BASE, block_doh_443=True),
    "doh_all_mitm": replace(BASE, block_doh_443=True, mitm=True),
    "doh_list_mitm": replace(
        BASE,
        block_doh_443=True,
        mitm=True,
        doh_blocklist=(ip_network("1.1.1.0/24"), ip_network("1.1.1.1/32"), ip_network("2606:4700::/32")),
    ),
    "doh_list_v6_only": replace(BASE, block_doh_443=True, doh_blocklist=(ip_network("2606:4700::/32"),)),
    "doh_list_off": replace(BASE, doh_blocklist=(ip_network("8.8.8.8/32"),)),
    "reject_exempt_ifaces": replace(
        BASE,
        deny_reject=True,
        nameserver_exempt=(ip_address("10.96.0.10"), ip_address("fd00::53")),
        sandbox_ifaces=("br0", "veth*"),
    ),
    "uids_own_uid": replace(
        BASE,
        table="opensandbox-fleet",
        dns_port=5353,
        http_port=8080,
        own_uid=20005,
        uids=UidPorts(UidRange(20000, 20999), base=30000, max_subjects=16),
        max_leases=0,
        mitm=True,
    ),
    "own_uid_outside": replace(BASE, own_uid=0, renew_by_replace=True, max_leases=7),
}

SUBJ4 = SubjectNft("s_a_1", ip_address("10.0.0.5"), ip_address("10.0.0.1"))
SUBJ6 = SubjectNft("s_b_2", ip_address("fd00::5"), ip_address("fd00::1"), worker=0)
SUBJ_W2 = SubjectNft("s_c_3", ip_address("10.0.1.7"), ip_address("10.0.1.1"), worker=2)
UID = UidSubjectNft("u_1000_0", 20010, 3)

POLICIES: dict[str, NetworkPolicy] = {
    "deny_all": DENY_ALL,
    "example": parse_policy(
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"example.com"},'
        '{"action":"allow","target":"8.8.8.8"},{"action":"deny","target":"1.2.3.4"},'
        '{"action":"allow","target":"2001:db8::/32"},{"action":"deny","target":"2001:db8::1"}]}'
    ),
    "allow_but": parse_policy('{"defaultAction":"allow","egress":[{"action":"deny","target":"1.2.3.4"}]}'),
    "audit": parse_policy(
        '{"defaultAction":"deny","mode":"audit","egress":[{"action":"deny","target":"1.2.3.4"},'
        '{"action":"allow","target":"1.2.3.0/24"},{"action":"allow","target":"8.8.8.8"}]}'
    ),
    "audit_allow": parse_policy(
        '{"defaultAction":"allow","mode":"audit","egress":[{"action":"deny","target":"fd00::/8"}]}'
    ),
    # Port-scoped rules (docs/reference/behaviour.md §18), overlapping ones cut into disjoint elements.
    "ports": parse_policy(
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"10.0.0.0/8","protocol":"tcp",'
        '"ports":["5432-5433"]},{"action":"allow","target":"10.1.0.0/16","ports":["5000-6000"]},'
        '{"action":"deny","target":"10.1.2.3","protocol":"udp","ports":[53]},'
        '{"action":"allow","target":"2001:db8::/32","protocol":"https"}]}'
    ),
}

TCP_443 = LeaseScope(False, Scope(tcp=((443, 443),)))
LEASES = (
    Grant(ip_address("93.184.216.34"), 300),
    Grant(ip_address("2606:2800::1"), 60),
    Grant(ip_address("1.1.1.1"), 1),
    # Port-scoped leases (docs/reference/behaviour.md §18): a new one, and one whose scope grew.
    Grant(ip_address("93.184.216.35"), 90, TCP_443),
    Grant(ip_address("2606:2800::2"), 90, LeaseScope(False, Scope(tcp=((80, 80), (443, 443)))), TCP_443.ports),
)


def _batch(batch: NetlinkBatch) -> str:
    return f"{batch!r}\n{batch.describe()}"


def _subject_cases(name: str, cfg: TableConfig) -> Iterator[tuple[str, str]]:
    subjects = [SUBJ4, SUBJ6] + ([SUBJ_W2] if cfg.mitm_workers > 2 else [])
    for subj in subjects:
        key = f"{name}/{subj.nft_id}"
        yield f"{key}/objects_script", subject_objects_script(cfg, subj)
        yield f"{key}/dispatch_entries", dispatch_entries(cfg, subj)
        yield f"{key}/create", _batch(subject_create(cfg, subj))
        yield f"{key}/keys", _batch(subject_keys(cfg, subj))
        for gw in (None, subj.gateway):
            ops = dispatch_deletes(cfg, subj.ip, release_gateway=gw)
            yield f"{key}/dispatch_deletes/{gw}", _batch(NetlinkBatch(cfg.table, tuple(ops)))
    contents = policy_swap(cfg.table, "s_a_1", POLICIES["audit"], audit_objects=True)
    for audit, ranges in itertools.product((False, True), (False, True)):
        # Without range objects under the keys the subject had before they were lazy.
        key = f"{name}/audit={audit}" + ("/ranges=True" if ranges else "")
        yield f"{key}/rules", _batch(subject_rules(cfg, "s_a_1", audit=audit, ranges=ranges))
        yield f"{key}/rules_per_subject", str(rules_per_subject(cfg, audit=audit, ranges=ranges))
        yield f"{key}/objects", _batch(subject_objects(cfg, "s_a_1", audit=audit, ranges=ranges))
        batch = subject_resync(cfg, "s_a_1", [SUBJ4, SUBJ4], contents, audit=audit, ranges=ranges)
        yield f"{key}/resync", _batch(batch)
        yield f"{key}/flush", _batch(flush_subject_sets(cfg.table, "s_a_1", audit=audit, ranges=ranges))
        for ip in (None, SUBJ4.ip):
            batch = removal_batch(cfg, "s_a_1", ip, release_gateway=SUBJ4.gateway, audit=audit, ranges=ranges)
            yield f"{key}/removal/{ip}", _batch(batch)
    yield f"{name}/audit_objects", _batch(audit_objects(cfg, "s_a_1"))
    yield f"{name}/audit_objects/ranges=True", _batch(audit_objects(cfg, "s_a_1", ranges=True))
    yield f"{name}/range_objects", _batch(range_objects(cfg, "s_a_1"))
    yield f"{name}/range_objects/audit=True", _batch(range_objects(cfg, "s_a_1", audit=True))
    both = lazy_objects(cfg, "s_a_1", audit=False, ranges=False, make_audit=True, make_ranges=True)
    yield f"{name}/lazy_objects/both", _batch(both)


def _uid_cases(name: str, cfg: TableConfig) -> Iterator[tuple[str, str]]:
    yield f"{name}/uid_create", _batch(uid_subject_create(cfg, UID))
    yield f"{name}/uid_keys", _batch(uid_subject_keys(cfg, UID))
    ops = uid_key_deletes(cfg, UID.host_uid, UID.slot)
    yield f"{name}/uid_key_deletes", _batch(NetlinkBatch(cfg.table, tuple(ops)))


def _table_cases() -> Iterator[tuple[str, str]]:
    for name, cfg in CONFIGS.items():
        yield f"{name}/header", header_script(cfg, delete_existing=False)
        yield f"{name}/header_delete", header_script(cfg, delete_existing=True)
        yield f"{name}/worker_ports", worker_ports(cfg)
        yield f"{name}/mitm_ports", intercepted_ports(cfg.mitm_extra_ports)
        yield from _subject_cases(name, cfg)
        yield from _uid_cases(name, cfg)


def _content_cases() -> Iterator[tuple[str, str]]:
    held = static_contents(POLICIES["example"])
    for name, policy in POLICIES.items():
        yield f"contents/{name}", repr(policy_contents(policy))
        yield f"static/{name}", repr(static_contents(policy))
        for audit_objs in (False, True):
            if policy.audit and not audit_objs:
                continue
            for known_empty in (False, True):
                batch = policy_swap("T", "s_a_1", policy, audit_objects=audit_objs, known_empty=known_empty)
                yield f"swap/{name}/{audit_objs}/{known_empty}", _batch(batch)
            batch = policy_swap("T", "s_a_1", policy, audit_objects=audit_objs, held=held)
            yield f"swap_held/{name}/{audit_objs}", _batch(batch)
            batch = contents_swap(
                "T", "s_a_1", static_contents(policy), audit_objects=audit_objs, range_objects=False
            )
            yield f"contents_swap/{name}/{audit_objs}", _batch(batch)
        for other, new in POLICIES.items():
            yield (
                f"refuses_more/{name}/{other}",
                str(refuses_more(static_contents(policy), static_contents(new))),
            )


def _misc_cases() -> Iterator[tuple[str, str]]:
    for replace_ in (False, True):
        yield f"dyn_add/{replace_}", _batch(dyn_add("T", "s_a_1", LEASES, replace=replace_))
    yield "dyn_add/empty", _batch(dyn_add("T", "s_a_1", ()))
    yield "dyn_replace", _batch(dyn_replace("T", "s_a_1", LEASES, ranges=False))
    yield "dyn_replace/empty", _batch(dyn_replace("T", "s_a_1", (), ranges=False))
    yield "dyn_replace/ranges=True", _batch(dyn_replace("T", "s_a_1", LEASES, ranges=True))
    nets = [ip_network("10.0.0.0/25"), ip_network("10.0.0.128/25"), ip_network("fd00::/64")]
    yield "sandbox_nets_refresh", repr(sandbox_nets_refresh(nets))
    yield "sandbox_nets_refresh/empty", repr(sandbox_nets_refresh([]))
    yield "gateway_release", repr(gateway_release(ip_address("fd00::1")))
    for audit in (False, True):
        yield f"uid_audit_ops/{audit}", repr(uid_audit_ops(20010, audit=audit))
    names: list[Callable[[], object]] = [
        lambda: subject_set("s_a_1", "dyn", "v6"),
        lambda: audit_counter_subject("subj_s_a_1_audit_default"),
        lambda: audit_counter_subject("subj_s_a_1_audit_deny"),
        lambda: audit_counter_subject("subj_s_a_1_dropped"),
        lambda: dropped_counter_subject("subj_s_a_1_dropped"),
        lambda: dropped_counter_subject("subj__dropped"),
        lambda: dropped_counter_subject("unattributed_dropped"),
    ]
    yield "names", "\n".join(repr(f()) for f in names)


def corpus() -> dict[str, str]:
    out: dict[str, str] = {}
    for key, text in (*_table_cases(), *_content_cases(), *_misc_cases()):
        assert key not in out, key
        out[key] = text
    return out


def test_the_generated_ruleset_matches_the_golden_digests() -> None:
    changed = changed_cases(GOLDEN, corpus())
    assert not changed, f"{len(changed)} generated cases differ from {GOLDEN.name}: {changed[:20]}"


def test_the_digests_see_a_one_byte_change_and_a_missing_case(tmp_path: Path) -> None:
    cases = {"a": "add table inet T\n", "b": "add chain inet T c\n"}
    golden = tmp_path / "digests"
    golden.write_text(digests(cases))
    assert changed_cases(golden, cases) == []
    assert changed_cases(golden, {**cases, "b": "add chain inet T  c\n"}) == ["b"]
    assert changed_cases(golden, {"a": cases["a"]}) == ["b"]


if __name__ == "__main__":
    main(GOLDEN, corpus, sys.argv[1:])
