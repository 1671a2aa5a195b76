"""docs/reference/egressctl.md and docs/reference/metrics.md are generated (scripts/docs/, issue 27
item 3) from egressctl's parser and from the metrics registry: these fail when either file is
stale, i.e. a command, an argument, a help text or a metric changed and the generator was not run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATORS = {
    "egressctl": ROOT / "scripts" / "docs" / "gen_egressctl_reference.py",
    "metrics": ROOT / "scripts" / "docs" / "gen_metrics_reference.py",
}


def generator(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"gen_{name}_reference", GENERATORS[name])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_the_generated_reference_is_current(name: str) -> None:
    module = generator(name)
    assert module.REFERENCE.read_text() == module.render(), (
        f"{module.REFERENCE.relative_to(ROOT)} is stale: run "
        f".venv/bin/python {GENERATORS[name].relative_to(ROOT)}"
    )
    assert module.main(["--check"]) == 0


def test_the_egressctl_reference_names_every_command() -> None:
    from egressd.cli.egressctl import COMMANDS

    text = (ROOT / "docs" / "reference" / "egressctl.md").read_text()
    for cmd in COMMANDS:
        assert f"## egressctl {cmd.name}\n" in text, cmd.name
        for child in cmd.children:
            assert f"### egressctl {cmd.name} {child.name}\n" in text, (cmd.name, child.name)


def test_the_egressctl_reference_does_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    module = generator("egressctl")
    expected = module.render()
    monkeypatch.setenv("EGRESSCTL_ADDR", "10.9.9.9:1")
    monkeypatch.setenv("COLUMNS", "40")
    assert module.render() == expected


def test_the_metrics_reference_lists_every_family_once() -> None:
    from egressd.metrics import EgressMetrics

    text = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    families = [f for c in EgressMetrics().registry._collector_to_names for f in c.describe()]  # type: ignore[attr-defined]
    assert families
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        assert text.count(f"| `{name}` | {family.type} |") == 1, name
