"""The line between the application and the library (docs/architecture.md, "Layers"):
no module outside the application imports it, whichever package it lives in. The
before-stop hook's import_layers.py checks a fixed list of library packages; this test
covers every module, so a new library package (ddpkit.loop, ddpkit.plan, ...) is held to
the rule the day it is added."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpkit

PACKAGE = Path(ddpkit.__file__).parent
APPLICATION = ("ddpkit.cli", "ddpkit.commands", "ddpkit.train", "ddpkit.bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.update(f"{base}.{a.name}" for a in node.names)
            found.add(base)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", "")) in ("import_module", "__import__") and node.args \
                and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))
    return found


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if _in(module, APPLICATION) or module == "ddpkit":
            continue
        bad += [f"{module} -> {t}" for t in sorted(_imports(path, module)) if _in(t, APPLICATION)]
    return bad


def test_no_library_module_imports_the_application():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check can fail: a library module importing the trainer is reported."""
    fake = tmp_path / "ddpkit"
    (fake / "loop").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "loop" / "__init__.py").write_text("from ..train import trainer\n")
    (fake / "loop" / "run.py").write_text("import importlib\n"
                                          "importlib.import_module('ddpkit.commands.train')\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert upward_imports() == ["ddpkit.loop -> ddpkit.train",
                                "ddpkit.loop -> ddpkit.train.trainer",
                                "ddpkit.loop.run -> ddpkit.commands.train"]
