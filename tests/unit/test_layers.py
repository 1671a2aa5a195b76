"""The layers of egressd's packages, enforced on the import graph (issue 24 item 3).

From the bottom: **models** (pure data and rules: addresses, the change feed, policies,
subjects, vaults, and the counters every layer updates), **engines** (what learns, narrows and
checks subjects), **adapters** (the kernel and its rulesets, the DNS proxy, the MITM, the HTTP
surfaces, configuration), **profiles** (the fleet and the sidecar: composition roots), and the
**entry point**. A package may import its own layer and the layers below it, never a layer
above; and no two packages import each other, directly or round a longer loop (no package
cycle at all, whatever the layers).

A package is ``egressd.<name>`` (a top-level module is its own package). Every package must be
placed in :data:`LAYERS`: a new one fails the test until it is. :data:`UPWARD_ALLOWED` names
the imports that still go up, each with its reason; it only ever shrinks (an entry that no
longer occurs fails the test).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from tests.unit.test_architecture import (
    ROOT,
    imported_package,
    imports,
    module_name,
    package_of,
    source_files,
)

LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    (
        "models",
        frozenset(
            {
                "egressd",
                "egressd.addr",
                "egressd.options",
                "egressd.feed",
                "egressd.policy",
                "egressd.subject",
                "egressd.vault",
                "egressd.metrics",
                "egressd.metriclabels",
                "egressd.terminal",
            }
        ),
    ),
    ("engines", frozenset({"egressd.actionhandler", "egressd.engine"})),
    (
        "adapters",
        frozenset(
            {
                "egressd.kernel",
                "egressd.fleetnft",
                "egressd.sidecarnft",
                "egressd.nftsyntax",
                "egressd.dnsproxy",
                "egressd.events",
                "egressd.mitm",
                "egressd.mitmchild",  # the MITM child's side, when mitm/ is split in two
                "egressd.web",
                "egressd.commonconfig",
                "egressd.hygiene",
                "egressd.lifecycle",
                "egressd.logsetup",
                "egressd.cli",
            }
        ),
    ),
    ("profiles", frozenset({"egressd.fleet", "egressd.sidecar"})),
    # The configuration loader composes every subsystem's options, the profiles' included.
    ("entry point", frozenset({"egressd.main", "egressd.__main__", "egressd.config"})),
)

#: (importer, imported) package pairs that still go up a layer, with the reason. Only shrinks.
UPWARD_ALLOWED: Mapping[tuple[str, str], str] = {
    # Empty since issue 24 item 1: the fleet's engine runs over the kernel side it is handed
    # (egressd.engine.plansteps, implemented in egressd.fleetnft).
}

Graph = Mapping[str, Mapping[str, list[str]]]


def layer_of() -> dict[str, int]:
    return {package: i for i, (_, packages) in enumerate(LAYERS) for package in packages}


def import_graph(paths: Iterable[Path], root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """importer package -> imported package -> where (``path:line module.name``)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        mine = package_of(module_name(path)) if path.is_relative_to(root.parent) else path.stem
        graph[mine]  # a package that imports nothing is still a node
        for line, module, name in imports(path):
            theirs = imported_package(module, name)
            if theirs != mine:
                graph[mine][theirs].append(f"{path.name}:{line} {module}.{name}")
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    nodes = set(graph) | {w for targets in graph.values() for w in targets}
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(found)


def unplaced(graph: Graph, layers: Mapping[str, int]) -> set[str]:
    nodes = set(graph) | {w for targets in graph.values() for w in targets}
    return {n for n in nodes if n not in layers}


def upward(graph: Graph, layers: Mapping[str, int]) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> where, for every import of a higher layer."""
    return {
        (a, b): where
        for a, targets in graph.items()
        for b, where in targets.items()
        if a in layers and b in layers and layers[b] > layers[a]
    }


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, list[str]]]:
    return import_graph(source_files())


def test_no_package_cycle(graph: Graph) -> None:
    found = cycles(graph)
    detail = {
        " <-> ".join(c): {f"{a} -> {b}": graph[a][b][:3] for a in c for b in c if b in graph.get(a, {})}
        for c in found
    }
    assert found == [], f"move the small thing that makes each edge to the lower package: {detail}"


def test_every_package_has_a_layer(graph: Graph) -> None:
    assert unplaced(graph, layer_of()) == set(), "place the new package in LAYERS"


def test_no_package_imports_a_higher_layer(graph: Graph) -> None:
    names = [name for name, _ in LAYERS]
    layers = layer_of()
    up = {
        f"{a} ({names[layers[a]]}) -> {b} ({names[layers[b]]})": where[:3]
        for (a, b), where in upward(graph, layers).items()
        if (a, b) not in UPWARD_ALLOWED
    }
    assert up == {}


def test_the_upward_allow_list_only_names_upward_imports(graph: Graph) -> None:
    """An allowed upward import that is gone leaves the list: it only ever shrinks."""
    assert set(UPWARD_ALLOWED) - set(upward(graph, layer_of())) == set()


def test_the_layers_are_disjoint() -> None:
    seen: dict[str, str] = {}
    for name, packages in LAYERS:
        for package in packages:
            assert package not in seen, f"{package} in {seen[package]} and {name}"
            seen[package] = name


# --------------------------------------------------------------------------- the checker itself


def _tree(tmp_path: Path, files: dict[str, str]) -> list[Path]:
    root = tmp_path / "egressd"
    paths = []
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        paths.append(path)
    return paths


def test_the_checker_finds_a_cycle_round_three_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _tree(
        tmp_path,
        {
            "a/x.py": "from egressd.b.y import B\n",
            "b/y.py": "from egressd.c import z\n",
            "c/z.py": "import egressd.a.x\n",
            "d.py": "from egressd import a\n",
        },
    )
    monkeypatch.setattr("tests.unit.test_architecture.ROOT", tmp_path / "egressd")
    graph = import_graph(paths, tmp_path / "egressd")
    assert cycles(graph) == [["egressd.a", "egressd.b", "egressd.c"]]
    assert set(graph["egressd.d"]) == {"egressd.a"}
    # Cut one edge: no cycle is left.
    del graph["egressd.c"]["egressd.a"]
    assert cycles(graph) == []


def test_the_checker_finds_an_upward_import_and_an_unplaced_package() -> None:
    graph = {"egressd.policy": {"egressd.kernel": ["x.py:1"]}, "egressd.kernel": {"egressd.new": ["y.py:2"]}}
    layers = layer_of()
    assert upward(graph, layers) == {("egressd.policy", "egressd.kernel"): ["x.py:1"]}
    assert unplaced(graph, layers) == {"egressd.new"}
    assert upward({"egressd.fleet": {"egressd.policy": []}}, layers) == {}, "down is fine"
