"""docs/reference/configuration.md and deploy/systemd/egressd.env.example are generated from the
option declarations (scripts/gen-config-docs.py, issue 24 item 4): this fails when either is
stale, i.e. a declaration changed and the script was not run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from egressd.config import OPTIONS

ROOT = Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen-config-docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_files_are_current() -> None:
    for path, text in generator().outputs().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run .venv/bin/python scripts/gen-config-docs.py"
        )


def test_the_reference_lists_every_option_once() -> None:
    reference = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    for opt in OPTIONS:
        assert reference.count(f"| `{opt.env}` |") == 1, opt.env


def test_the_env_example_names_no_sidecar_option_and_only_known_variables() -> None:
    """The unit runs the fleet: a sidecar option set there would refuse the start."""
    known = {o.env: o for o in OPTIONS}
    for line in (ROOT / "deploy" / "systemd" / "egressd.env.example").read_text().splitlines():
        name = line.lstrip("#").partition("=")[0]
        if "=" not in line or " " in name:
            continue
        if name == "EGRESSD_NETNS":  # the unit's ExecStart reads it, egressd does not
            continue
        assert name in known, line
        assert known[name].profile != "sidecar" and known[name].public, line


def test_the_check_mode_passes_on_a_current_tree() -> None:
    assert generator().main(["--check"]) == 0
