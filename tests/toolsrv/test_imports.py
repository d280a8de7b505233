"""The packages depend downward only (DESIGN): cli -> fs -> session -> agent -> {backend,
toolclient} -> ninep; toolsrv -> ninep; the wire types between the two sides (olliewire)
below both. toolsrv never imports olliefs, and the daemon learns about tools only through
its toolsrv connection, so no module of the daemon imports toolsrv either."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import toolsrv

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("olliefs", "toolsrv", "ninep", "olliewire")

# Each part of olliefs (a subpackage, or a module at its top) by layer: a part imports
# parts of lower layers only. The command and the daemon's assembly share the top layer,
# the shared base (paths, errors, live logs, heap, mounts, the caller's rights) the bottom
# one, where its modules may import each other.
LAYERS: dict[str, int] = {
    "olliefs": 1,  # (the package's own __init__)
    "olliefs.errors": 1,
    "olliefs.settings": 1,
    "olliefs.live": 1,
    "olliefs.memory": 1,
    "olliefs.mounts": 1,
    "olliefs.caller": 1,
    "olliefs.backend": 2,
    "olliefs.toolclient": 2,
    "olliefs.replay": 2,  # the offline LLM server: reached from the command and tests only
    "olliefs.agent": 3,
    "olliefs.session": 4,
    "olliefs.fs": 5,
    "olliefs.cli": 6,
    "olliefs.daemon": 6,
    "olliefs.doctor": 6,
    "olliefs.__main__": 6,
    "olliefs.mcpserve": 6,  # sessions served over MCP, through the mounted tree only
    "olliefs.testing": 7,  # the tests' harness, which starts a toolsrv of its own
}
SHARED = {1, 6}  # the layers whose parts may import each other
OUTSIDE = {
    # What each package outside olliefs may import of the project.
    "toolsrv": {"ninep", "olliewire"},
    "ninep": set(),  # generic 9P2000: it also serves the FUSE tree's export
    "olliewire": set(),
}


def part(module: str) -> str | None:
    """The part of the project ``module`` belongs to (None: not the project's)."""
    names = module.split(".")
    if names[0] not in PACKAGES:
        return None
    return ".".join(names[:2]) if names[0] == "olliefs" and len(names) > 1 else names[0]


def imports(path: Path, module: str) -> Iterator[str]:
    """Every module ``path`` imports, anywhere in it (in functions, under TYPE_CHECKING:
    a lazy or a typing-only import ties the layers all the same)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for a in node.names:  # a module of the package, or a name in it
                sub = f"{target}.{a.name}"
                yield sub if is_module(sub) else target


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    """part -> the other parts it imports."""
    edges: dict[str, set[str]] = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            src = part(module)
            assert src is not None
            edges.setdefault(src, set())
            for target in imports(path, module):
                dst = part(target)
                if dst is not None and dst != src:
                    edges[src].add(dst)
    return edges


def allowed(src: str, dst: str) -> bool:
    if src in OUTSIDE:
        return dst in OUTSIDE[src]
    if dst in OUTSIDE:  # (olliefs)
        return dst != "toolsrv" or src == "olliefs.testing"
    a, b = LAYERS[src], LAYERS[dst]
    return a > b or (a == b and a in SHARED)


def test_every_part_has_a_layer() -> None:
    unplaced = set(graph()) - set(LAYERS) - set(OUTSIDE)
    assert not unplaced, f"place these in LAYERS (DESIGN's picture): {sorted(unplaced)}"


def test_packages_depend_downward_only() -> None:
    edges = graph()
    assert {"olliefs.agent", "olliefs.fs", "toolsrv", "ninep", "olliewire"} <= set(edges)
    assert "olliewire" in edges["toolsrv"] and "olliewire" in edges["olliefs.toolclient"]
    wrong = sorted(
        f"{src} imports {dst}"
        for src, dsts in edges.items()
        if src in LAYERS or src in OUTSIDE
        for dst in dsts
        if not allowed(src, dst)
    )
    assert wrong == []


def test_toolsrv_imports_nothing_of_olliefs() -> None:
    """The same at run time: importing every module of toolsrv loads no olliefs module."""
    mods = sorted(m.name for m in pkgutil.walk_packages(toolsrv.__path__, "toolsrv."))
    assert {"toolsrv.__main__", "toolsrv.server", "toolsrv.exec.run"} <= set(mods)
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'olliefs')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, check=True, text=True, timeout=60
    )
    assert json.loads(out.stdout) == []
