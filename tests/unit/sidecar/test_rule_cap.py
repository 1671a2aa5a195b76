"""OPENSANDBOX_EGRESS_MAX_RULES (docs/reference/behaviour.md §14.5, docs/reference/http-api.md): parsing, counting and the
sidecar's initial policy. The HTTP and SET_BINDING refusals are in test_proxy_route.py
(fleet, 400) and test_sidecar_http.py (sidecar, 413)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from egressd.config import ConfigError, parse_config, parse_sidecar_config
from egressd.policy import parse_policy, rule_cap_problem
from egressd.sidecar.run import SidecarStartupError, run_sidecar


def _policy(n: int) -> str:
    rules = [{"action": "allow", "target": f"h{i}.test"} for i in range(n)]
    return json.dumps({"defaultAction": "deny", "egress": rules})


def test_default_env_and_flag() -> None:
    assert parse_config({}).common.max_rules == 4096
    assert parse_config({"OPENSANDBOX_EGRESS_MAX_RULES": "0"}).common.max_rules == 0
    assert parse_config({"OPENSANDBOX_EGRESS_MAX_RULES": "7"}, ["--max-rules", "9"]).common.max_rules == 9
    for bad in ("-1", "many"):
        with pytest.raises(ConfigError, match="OPENSANDBOX_EGRESS_MAX_RULES"):
            parse_config({"OPENSANDBOX_EGRESS_MAX_RULES": bad})


@pytest.mark.parametrize(
    ("count", "cap", "over"), [(4096, 4096, False), (4097, 4096, True), (9000, 0, False)]
)
def test_the_reason_names_the_limit(count: int, cap: int, over: bool) -> None:
    problem = rule_cap_problem(parse_policy(_policy(count)), cap)
    if not over:
        assert problem is None
    else:
        assert problem == f"policy has {count} rules, more than OPENSANDBOX_EGRESS_MAX_RULES={cap}"


def test_sidecar_refuses_an_initial_policy_over_the_cap_before_any_kernel_work(tmp_path: Path) -> None:
    for source, env in (
        ("OPENSANDBOX_EGRESS_RULES", {"OPENSANDBOX_EGRESS_RULES": _policy(3)}),
        ("policy file", {"OPENSANDBOX_EGRESS_POLICY_FILE": str(tmp_path / "p.json")}),
    ):
        (tmp_path / "p.json").write_text(_policy(3))
        cfg = parse_sidecar_config(
            {**env, "OPENSANDBOX_EGRESS_MAX_RULES": "2", "EGRESSD_ALWAYS_RULES_DIR": str(tmp_path / "none")}
        )
        with pytest.raises(SidecarStartupError) as info:
            asyncio.run(run_sidecar(cfg))
        assert "policy has 3 rules, more than OPENSANDBOX_EGRESS_MAX_RULES=2" in str(info.value), source
        assert "\n" not in str(info.value)
