"""The MITM's two processes, kept apart in the source tree.

* ``egressd.mitm`` is the daemon's side: it never imports mitmproxy nor the child's package.
* ``egressd.mitmchild`` is the child process: of the daemon's package it imports only what
  both sides share (:mod:`egressd.mitm.protocol`, :mod:`egressd.mitm.seqmap`).
* The child's egressd addons (:func:`egressd.mitmchild.runner.egress_addons`) are one per
  concern and no two handle the same mitmproxy event, so their order in the chain cannot
  change what a hook sees.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mitmproxy import hooks

from egressd.mitmchild.runner import egress_addons
from egressd.mitmchild.vaults import VaultLookup

ROOT = Path(__file__).resolve().parents[3] / "egressd"
SHARED = {"egressd.mitm.protocol", "egressd.mitm.seqmap"}


def _imports(package: str) -> dict[str, set[str]]:
    """{module file: every module it imports (absolute)}."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).glob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        out[path.name] = found
    assert out, package
    return out


def test_the_daemon_side_imports_neither_mitmproxy_nor_the_child() -> None:
    bad = {
        (name, mod)
        for name, mods in _imports("mitm").items()
        for mod in mods
        if mod.split(".")[0] == "mitmproxy" or mod.startswith("egressd.mitmchild")
    }
    assert not bad


def test_the_child_imports_only_the_shared_modules_of_the_daemon_side() -> None:
    # ``from egressd.mitm import seqmap`` lists both ``egressd.mitm`` and ``egressd.mitm.seqmap``.
    bad = {
        (name, mod)
        for name, mods in _imports("mitmchild").items()
        for mod in mods
        if mod.startswith("egressd.mitm.") and not any(mod == s or mod.startswith(f"{s}.") for s in SHARED)
    }
    assert not bad


def test_each_mitmproxy_event_is_handled_by_one_egressd_addon_at_most() -> None:
    events = set(hooks.all_hooks)  # filled as mitmproxy's modules load (the addons import them)
    assert {"requestheaders", "tls_clienthello", "next_layer", "websocket_message"} <= events
    seen: dict[str, str] = {}
    for addon in egress_addons(VaultLookup()):
        for event in events:
            if event in ("load", "configure") or not callable(getattr(addon, event, None)):
                continue
            assert event not in seen, f"{event}: {seen[event]} and {type(addon).__name__}"
            seen[event] = type(addon).__name__
    assert {"requestheaders", "request", "responseheaders", "response", "tls_clienthello", "running"} <= set(seen)
