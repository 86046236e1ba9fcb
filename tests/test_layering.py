"""The import contract: packages import only downward (DESIGN.md, "Layers of the library").

Reads every module under src/pagedkv with ``ast`` (nothing is imported), resolves relative
imports, and fails naming the module and the upward import. Packages on one rank (``ops``,
``batch`` and ``memory``) may not import each other. A new package must be given a rank here first.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedkv"

# Top first. Each entry is one rank; a package may import its own rank's *own* package and
# anything in a lower rank.
RANKS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"sim"},
    {"engine"},
    {"modeling"},
    {"ops", "batch", "memory"},
    {"launch"},  # the Triton direct launch that ops' and batch's kernels share
    {"blocks"},
    {"plan"},
    {"models"},
    {"kvspec"},
    {"errors", "__init__"},
]


def _rank(package: str) -> int:
    for i, names in enumerate(RANKS):
        if package in names:
            return i
    raise AssertionError(f"package pagedkv.{package} has no rank in tests/test_layering.py")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for each pagedkv import in the file."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + (1 if path.name == "__init__.py" else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
    return [(line, m) for line, m in found if m == "pagedkv" or m.startswith("pagedkv.")]


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_rank():
    for child in SRC.iterdir():
        if child.name.startswith((".", "_")) and child.name not in ("__init__.py", "__main__.py"):
            continue
        if child.is_dir() or child.suffix == ".py":
            _rank(child.stem)


def test_imports_point_down_only():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        own = _package("pagedkv." + ".".join(path.relative_to(SRC).with_suffix("").parts))
        for line, module in _imports(path):
            target = _package(module)
            if target == own or module == "pagedkv":
                continue
            if _rank(target) <= _rank(own):
                bad.append(f"{path.relative_to(SRC.parent)}:{line} imports {module}")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)
