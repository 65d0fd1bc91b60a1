"""The import graph runs one way (docs/ARCHITECTURE.md, "Layers"): a module imports only from its own package or
from a lower layer, lazily imported names included (only `if TYPE_CHECKING:` imports, which never run, are exempt)."""
from __future__ import annotations

import ast
from pathlib import Path

import moestream

ROOT = Path(moestream.__file__).parent
LAYERS = [
    {"errors"},
    {"config"},
    {"kernels"},
    {"weights", "tokenizer", "plot", "demo_model"},
    {"bpe"},
    {"memory"},
    {"experts"},
    {"models"},
    {"engine"},
]
TOP = len(LAYERS)  # front ends and tools: everything not named above


def layer(unit: str) -> int:
    return next((i for i, units in enumerate(LAYERS) if unit in units), TOP)


def unit_of(module: str) -> str:
    """moestream.experts.cache -> experts; moestream.info -> info; moestream -> the package root (front end)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
    return [(n, m) for n, m in found if m == "moestream" or m.startswith("moestream.")]


def violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        src = unit_of(".".join(rel.parts))
        for lineno, target in imports(path):
            dst = unit_of(target)
            if target == "moestream" or dst == src:  # the package root (its version) loads before any module anyway
                continue
            if layer(src) == TOP or layer(dst) < layer(src):
                if layer(src) == TOP or layer(dst) != TOP:
                    continue
            bad.append(f"{rel}.py:{lineno}: {src} (layer {layer(src)}) imports {target} (layer {layer(dst)})")
    return bad


def test_imports_run_one_way():
    assert violations() == []


def test_checker_sees_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "moestream"
    (pkg / "experts").mkdir(parents=True)
    (pkg / "experts" / "x.py").write_text("def f():\n    from moestream.engine.engine import plan\n")
    (pkg / "engine").mkdir()
    (pkg / "engine" / "y.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from moestream.server.app import App\nfrom moestream.experts.x import f\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert violations() == ["moestream/experts/x.py:2: experts (layer 6) imports moestream.engine.engine (layer 8)"]
