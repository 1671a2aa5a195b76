"""Static structure figures of an egressd tree (issue 24's before/after table).

Usage: .venv/bin/python scripts/structure/static.py [TREE]   (default: this checkout)

Prints: module count and lines, the modules over 600 lines, the package import graph (a
package is ``egressd.X``, a top-level module its own package; imports inside functions
count), its strongly connected components, the number of elementary package cycles, the
two-way pairs, and the modules outside ``egressd.mitm``/``egressd.mitmchild`` that import
the MITM memory (``egressd.mitm.seqmap``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def imported(node: ast.AST) -> list[str]:
    """The egressd modules an import statement names (``from egressd import x`` names egressd.x)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module == "egressd":
            return [f"egressd.{alias.name}" for alias in node.names]
        if node.module.startswith("egressd."):
            return [node.module]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.startswith("egressd.")]
    return []


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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
            found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def elementary_cycles(nodes: list[str], edges: dict[str, set[str]]) -> int:
    """Each cycle counted once, from its lowest node (the graph is a few dozen packages)."""
    order = {v: i for i, v in enumerate(nodes)}
    count = 0

    def walk(start: str, v: str, seen: set[str]) -> None:
        nonlocal count
        for w in edges.get(v, ()):
            if w == start:
                count += 1
            elif w not in seen and order.get(w, -1) > order[start]:
                seen.add(w)
                walk(start, w, seen)
                seen.discard(w)

    for start in nodes:
        walk(start, start, {start})
    return count


def main(tree: Path) -> None:
    mods = module_names(tree / "egressd")
    lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    print(f"modules {len(mods)}  lines {sum(lines.values())}")
    big = sorted(((n, m) for m, n in lines.items() if n > 600), reverse=True)
    print(f"modules over 600 lines: {len(big)}  over 800: {sum(1 for n, _ in big if n > 800)}")
    for n, m in big:
        print(f"  {n:5d} {m}")
    largest = sorted(((n, m) for m, n in lines.items()), reverse=True)[:8]
    print("largest 8:", ", ".join(f"{m.removeprefix('egressd.')} {n}" for n, m in largest))

    edges: dict[str, set[str]] = {}
    memory_users: list[str] = []
    for module, path in mods.items():
        mine = package(module)
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported(node):
                names = [a.name for a in getattr(node, "names", [])]
                memory = "seqmap" in target or (target == "egressd.mitm" and "seqmap" in names)
                if memory and not module.startswith(("egressd.mitm.", "egressd.mitmchild")):
                    memory_users.append(f"{module}:{node.lineno}")
                if package(target) != mine:
                    edges.setdefault(mine, set()).add(package(target))

    nodes = sorted({package(m) for m in mods})
    print(f"packages {len(nodes)}  import edges {sum(len(v) for v in edges.values())}")
    cyclic = [c for c in strongly_connected(nodes, edges) if len(c) > 1]
    print(f"package SCCs with a cycle: {len(cyclic)}")
    for component in cyclic:
        print("  ", " ".join(x.removeprefix("egressd.") for x in component))
    print(f"elementary package cycles: {elementary_cycles(nodes, edges)}")
    pairs = sorted({tuple(sorted((a, b))) for a, bs in edges.items() for b in bs if a in edges.get(b, ())})
    print("two-way pairs:", ", ".join(f"{a}<->{b}" for a, b in pairs) or "none")
    print(f"imports of the MITM memory outside the MITM packages: {len(memory_users)}")
    for where in memory_users:
        print("  ", where)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2])
