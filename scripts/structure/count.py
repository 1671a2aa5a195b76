"""Counts packages / modules / functions per walk from walk.py's raw.json files.

    python3 count.py out-before/raw.json out-after/raw.json [--lists]

Per walk (set_binding, hook, dns) over its reps: STABLE = the functions seen in every rep
(the reported figure), UNION = seen in any rep. The idle windows (no request) give the noise
floor; functions of a walk that also appear in an idle window are reported separately.

package  = egressd.X, the first component under egressd (a subpackage, or a top-level module
           such as egressd.metrics, which is its own "package" of one module)
module   = the full module name
function = (module, qualname, first line): every code object called, incl. nested functions,
           lambdas and generator expressions; "(excl. <lambda>/<genexpr>)" also given
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WALKS = ["set_binding", "hook", "dns"]
ANON = ("<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")


def fset(w: dict) -> set[tuple[str, str, int]]:
    return {(m, q, ln) for m, q, ln, _n, _t in w["calls"]}


def pkg(m: str) -> str:
    parts = m.split(".")
    return ".".join(parts[:2])


def is_dir_pkg(tree: str, p: str) -> bool:
    return (Path(tree) / p.replace(".", "/")).is_dir()


def stats(fs: set, tree: str) -> dict:
    mods = {m for m, _, _ in fs}
    pk = {pkg(m) for m in mods}
    gen = {f for f in fs if f[1].startswith("<generated>")}
    src = {f for f in fs if f not in gen and f[1] != "<module>"}
    named = {f for f in src if f[1].split(".")[-1] not in ANON}
    return {
        "packages": len(pk),
        "subpackages": len({p for p in pk if is_dir_pkg(tree, p)}),
        "modules": len(mods),
        "functions": len(src),
        "functions_named": len(named),
        "generated": len(gen),
        "module_level": sorted(m for m, q, _ in fs if q == "<module>"),
        "pkg_list": sorted(pk),
        "mod_list": sorted(mods),
    }


def analyse(path: str) -> dict:
    raw = json.loads(Path(path).read_text())
    tree = raw["tree"]
    idle = set().union(*(fset(w) for w in raw["windows"]["idle"]))
    res = {"tree": tree, "idle": stats(idle, tree), "idle_funcs": sorted(idle)}
    for walk in WALKS:
        sets = [fset(w) for w in raw["windows"][walk]]
        stable = set.intersection(*sets)
        union = set.union(*sets)
        res[walk] = {
            "stable": stats(stable, tree),
            "union": stats(union, tree),
            "per_rep": [stats(s, tree)["functions"] for s in sets],
            "seconds": [round(w["seconds"], 3) for w in raw["windows"][walk]],
            "stable_in_idle": sorted(stable & idle),
            "unstable": sorted(union - stable),
            "stable_funcs": sorted(stable),
        }
    return res


def main() -> None:
    paths = [a for a in sys.argv[1:] if not a.startswith("--")]
    res = [analyse(p) for p in paths]
    print("walk          tree    packages (subpkgs)  modules  functions (named) +generated   per-rep fns   union fns  in-idle")
    for walk in WALKS:
        for r in res:
            s = r[walk]["stable"]
            u = r[walk]["union"]
            name = "before" if "before" in r["tree"] else "after"
            print(f"{walk:13} {name:7} {s['packages']:8} ({s['subpackages']:2})       {s['modules']:4}     "
                  f"{s['functions']:5} ({s['functions_named']:3}) +{s['generated']:2}        {r[walk]['per_rep']!s:14} {u['functions']:5}   "
                  f"{len(r[walk]['stable_in_idle'])}")
    for r in res:
        print(f"idle windows {r['tree']}: {r['idle']['functions']} functions {r['idle']['mod_list']}")
    if "--lists" in sys.argv:
        for r in res:
            print(f"\n==== {r['tree']}")
            for walk in WALKS:
                s = r[walk]["stable"]
                print(f"-- {walk}: packages {s['pkg_list']}")
                print(f"   modules {s['mod_list']}")
                if s["module_level"]:
                    print(f"   module-level code run: {s['module_level']}")
                print(f"   in idle too: {r[walk]['stable_in_idle']}")
                print(f"   not in every rep: {r[walk]['unstable']}")
    if "--funcs" in sys.argv:
        for r in res:
            print(f"\n==== {r['tree']}")
            for walk in WALKS:
                print(f"-- {walk}")
                for m, q, ln in r[walk]["stable_funcs"]:
                    print(f"   {m}:{q}:{ln}")


if __name__ == "__main__":
    main()
