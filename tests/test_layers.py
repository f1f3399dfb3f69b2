"""The package's layers (docs/architecture.md): every import in ladle/, at module level or inside a
function, points from a layer to the same or a lower one, never across to a peer package of its
own layer, and no files import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ladle"

# Bottom to top; the names in one layer are peers that import nothing of each other.
LAYERS = [
    ("ladle", "errors"),
    ("units", "device", "watchdog"),
    ("distributed", "doctor"),
    ("faults",),
    ("config",),
    ("data", "models"),
    ("parallel",),
    ("checkpoint",),
    ("train",),
    ("rl", "preference"),
    ("plan", "ops"),
    ("launch",),
    ("recipes",),
    ("bench",),
    ("cli",),
    ("__main__",),
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[1] == "configs":  # a config's own Python (a demo's environment), imported by path
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict, missing: list | None = None) -> set[str]:
    """The ladle modules `path` imports, wherever in the file (a name imported from a package
    that is a module of it counts as that module). Imports of ladle modules that do not exist
    (a lazy import left behind by a move) are appended to `missing`."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = bases = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets, bases = [f"{base}.{a.name}" for a in node.names], [base]
        else:
            continue
        for b in bases:
            if (b == "ladle" or b.startswith("ladle.")) and b not in known and missing is not None:
                missing.append(f"{name} (line {node.lineno}): {b}")
        for t in targets:
            if t == "ladle" or t.startswith("ladle."):
                got = resolve(t)
                if got and got != name:
                    found.add(got)
    return found


def top(module: str) -> str:
    """The layer table's name of a module: its folder (or file) under ladle/."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_import_names_a_module_that_exists():
    known, missing = modules(), []
    for name, path in known.items():
        imports(name, path, known, missing)
    assert missing == []


def test_every_module_has_a_layer(graph):
    assert sorted({top(m) for m in graph} - set(LAYER)) == []


def test_imports_point_down_the_layers(graph):
    bad = []
    for a, targets in graph.items():
        for b in targets:
            ta, tb = top(a), top(b)
            if ta != tb and LAYER[tb] >= LAYER[ta]:
                kind = "a peer" if LAYER[tb] == LAYER[ta] else "a higher layer"
                bad.append(f"{a} imports {b} ({kind}: {ta} -> {tb})")
    assert bad == []


def test_no_import_circle(graph):
    # Tarjan's strongly connected components: any with more than one file is a circle
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_the_checks_see_lazy_imports(tmp_path):
    # an import inside a function counts as much as one at the top of the file
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from ladle.plan import oom_report\n    import ladle.cli\n")
    known = {"ladle.x.m": f, "ladle.plan": Path("p"), "ladle.cli": Path("c")}
    assert imports("ladle.x.m", f, known) == {"ladle.plan", "ladle.cli"}
