"""``OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS`` (docs/reference/behaviour.md §16, §6): parsed into patterns,
handed to mitmproxy's own ``ignore_hosts`` option, and held against every vault write."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mitmproxy import options

from egressd.actionhandler.inputs import InputError, VaultAction, parse_binding_input
from egressd.config import ConfigError, parse_config
from egressd.mitm.supervisor import MitmOptions, mitmdump_argv
from egressd.policy import parse_policy_obj
from egressd.vault.keys import KeyStore
from egressd.vault.sealed import build_wrapper, seal
from egressd.vault.store import VaultStore
from egressd.vault.types import VaultLimits, compile_ignore_hosts

POLICY = parse_policy_obj(
    {"defaultAction": "deny", "egress": [{"action": "allow", "target": "*.example.com"}]}
)


def vault(*hosts: str) -> dict[str, object]:
    return {
        "credentials": [{"name": "k", "source": {"type": "inline", "value": "v"}}],
        "bindings": [
            {"name": "b", "match": {"hosts": list(hosts)}, "auth": {"type": "bearer", "credential": "k"}}
        ],
    }


def test_parsed_from_a_comma_separated_list() -> None:
    assert parse_config({}).mitm.ignore_hosts == ()
    cfg = parse_config(
        {"OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS": r" ^a\.example\.com$ ,, .*\.internal:443$ "}
    )
    assert cfg.mitm.ignore_hosts == (r"^a\.example\.com$", r".*\.internal:443$")
    flag = parse_config({}, ["--mitmproxy-ignore-hosts", r"^b\.example\.com$"])
    assert flag.mitm.ignore_hosts == (r"^b\.example\.com$",)
    patterns = cfg.vault.limits(cfg.mitm.ignore_hosts).ignore_hosts
    assert [p.pattern for p in patterns] == list(cfg.mitm.ignore_hosts)
    assert all(p.flags & re.IGNORECASE for p in patterns)


def test_an_invalid_pattern_refuses_start_in_one_line() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({"OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS": r"ok\.com,(unclosed"})
    text = str(exc.value)
    assert text.startswith("OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS: invalid pattern '(unclosed'")
    assert "\n" not in text


def test_a_binding_host_the_mitm_never_decrypts_is_refused() -> None:
    limits = VaultLimits(ignore_hosts=compile_ignore_hosts([r"^A\.example\.com$", r"^c\.example\.com:443$"]))
    for hosts in (("a.example.com",), ("c.example.com",), ("x.example.com", "a.example.com")):
        status, body = VaultStore(limits=limits).put(vault(*hosts), POLICY)
        assert status == 400 and "ignore_hosts" in str(body), (hosts, body)
    # A wildcard binding is probed as probe.<suffix>: accepted, and its ignored hosts are
    # then relayed by the MITM (the kernel test covers that).
    assert VaultStore(limits=limits).put(vault("*.example.com"), POLICY)[0] == 201
    assert VaultStore().put(vault("a.example.com"), POLICY)[0] == 201, "no list, no refusal"
    # A PATCH and a fork carry the same check.
    store = VaultStore(limits=limits)
    assert store.put(vault("b.example.com"), POLICY)[0] == 201
    patch = {
        "bindings": {
            "add": [
                {
                    "name": "c",
                    "match": {"hosts": ["a.example.com"]},
                    "auth": {"type": "bearer", "credential": "k"},
                }
            ]
        }
    }
    assert store.patch(patch, POLICY)[0] == 400
    assert store.fork().put(vault("a.example.com"), POLICY)[0] == 400


def test_a_sealed_vault_in_the_binding_input_is_held_to_the_list(tmp_path: Path) -> None:
    """The fleet's SET_BINDING path: ``Config.vault_limits`` reaches the sealed-vault check."""
    cfg = parse_config({"OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS": r"^a\.example\.com$"})
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    (keys_dir / "k1.key").write_bytes(bytes(range(32)))
    policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "*.example.com"}]}

    def text(*hosts: str) -> str:
        return json.dumps(
            build_wrapper(policy, seal(json.dumps(vault(*hosts)).encode(), "u-1", "k1", bytes(range(32))))
        )

    keys = KeyStore(keys_dir)
    with pytest.raises(InputError, match="ignore_hosts"):
        parse_binding_input(text("a.example.com"), uid="u-1", keys=keys, limits=cfg.vault.limits(cfg.mitm.ignore_hosts))
    assert (
        parse_binding_input(text("b.example.com"), uid="u-1", keys=keys, limits=cfg.vault.limits(cfg.mitm.ignore_hosts)).vault
        is VaultAction.SET
    )


def test_handed_to_mitmproxy_one_set_per_pattern(tmp_path: Path) -> None:
    opts = MitmOptions(
        port=18081,
        confdir=tmp_path,
        active_socket=tmp_path / "a.sock",
        upstream_trust_dir=tmp_path,
        ignore_hosts=(r"^a\.example\.com$", "x=y,z"),
    )
    argv = mitmdump_argv(opts)
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert [s for s in sets if s.startswith("ignore_hosts=")] == [
        r"ignore_hosts=^a\.example\.com$",
        "ignore_hosts=x=y,z",
    ]
    # mitmproxy appends repeated sequence options (this is how the runner applies them).
    o = options.Options()
    o.set(*[s for s in sets if s.startswith("ignore_hosts=")])
    assert o.ignore_hosts == [r"^a\.example\.com$", "x=y,z"]
    assert not any(
        s.startswith("ignore_hosts=") for s in mitmdump_argv(MitmOptions(18081, tmp_path, tmp_path, tmp_path))
    )
