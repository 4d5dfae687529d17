"""No import cycles among our own modules (adaptspec, and adaptspec_vllm in plugins/vllm), nor
among their packages.

Read from the source with `ast`, nothing imported: every `import` and `from ... import`, at
module level and inside functions alike (an import in a function is still a dependency, only a
later one). Imports of anything else (vllm, torch, the standard library) are left out: only our
modules can close a cycle among our modules. `from package import name` depends on the module
`package.name` where there is one, else on the package itself.

At package level a module stands for its package (a folder; `adaptspec.serve` is in `adaptspec`,
`adaptspec.tools.bench.run` in `adaptspec.tools.bench`). Only packages apart from each other
count: a package's own modules may use its subpackages and be used by them (`adaptspec.cli`
dispatches to the tools, which use the core), but two packages side by side, like the benchmark
and the model builders, depend one way at most.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"adaptspec": ROOT / "adaptspec", "adaptspec_vllm": ROOT / "plugins" / "vllm"}


def _modules() -> dict[str, Path]:
    out = {}
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _ours(name: str) -> str | None:
    """The module of ours that importing `name` runs (its longest prefix that is one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod: str) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[mod].read_text(), str(MODULES[mod]))):
        if isinstance(node, ast.Import):
            out.update(filter(None, (_ours(a.name) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = mod if _is_package(mod) else mod.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{source}" if source else base
            for alias in node.names:
                target = f"{source}.{alias.name}"
                found = target if target in MODULES else _ours(source)
                if found:
                    out.add(found)
    out.discard(mod)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _describe(cycles: list[list[str]], graph: dict[str, set[str]]) -> str:
    return "\n".join(" | ".join(f"{a} -> {', '.join(sorted(graph[a] & set(comp)))}"
                                for a in comp) for comp in cycles)


def _package(mod: str) -> str:
    return mod if _is_package(mod) else mod.rpartition(".")[0]


def _within(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


MODULE_GRAPH = {mod: _imports(mod) for mod in MODULES}


def test_the_graph_sees_our_imports() -> None:
    # a few edges known to exist, so that an empty graph cannot pass for a clean one
    assert "adaptspec.policy" in MODULE_GRAPH["adaptspec.serve"]
    assert "adaptspec.serve" in MODULE_GRAPH["adaptspec.tools.bench.servers"]
    assert "adaptspec.proposers.base" in MODULE_GRAPH["adaptspec.proposers.ngram"]
    assert "adaptspec.serve" in MODULE_GRAPH["adaptspec_vllm.run_engine"]  # inside a package
    assert "adaptspec.tools.models" in MODULE_GRAPH["adaptspec.tools.bench.run"]  # in a function


def test_no_module_imports_itself_through_others() -> None:
    cycles = _cycles(MODULE_GRAPH)
    assert not cycles, "import cycles among modules:\n" + _describe(cycles, MODULE_GRAPH)


def test_no_two_packages_depend_on_each_other() -> None:
    graph: dict[str, set[str]] = {}
    for mod, targets in MODULE_GRAPH.items():
        a = _package(mod)
        graph.setdefault(a, set()).update(
            b for b in map(_package, targets) if not _within(a, b))
    cycles = _cycles(graph)
    assert not cycles, "import cycles among packages:\n" + _describe(cycles, graph)
