"""The layers (docs/architecture.md, "Layers"): no module outside the application imports
it, whichever package it lives in, and the foundation imports neither the library nor a
foundation package above its own. The before-stop hook's import_layers.py checks a fixed
list of library packages; this test covers every module, and every module must belong to
a layer, so a new package (ddpkit.loop, ddpkit.plan, ...) is held to the rules the day it
is added."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpkit

PACKAGE = Path(ddpkit.__file__).parent
APPLICATION = ("ddpkit.cli", "ddpkit.commands", "ddpkit.train", "ddpkit.bench")
LIBRARY = ("ddpkit.loop", "ddpkit.parallel", "ddpkit.comm", "ddpkit.data", "ddpkit.checkpoint",
           "ddpkit.fault", "ddpkit.plan")
# The foundation from the bottom up: a module may import its own level and those before it.
FOUNDATION = (
    ("ddpkit.errors", "ddpkit.log", "ddpkit.help_text", "ddpkit.slice_count", "ddpkit.exit_codes",
     "ddpkit.vocabulary"),
    ("ddpkit.runtime",),
    ("ddpkit.files",),
    ("ddpkit.elastic",),
    ("ddpkit.launcher",),
)


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


def _foundation_level(name: str) -> int | None:
    for level, packages in enumerate(FOUNDATION):
        if _in(name, packages):
            return level
    return None


def unplaced_modules() -> list[str]:
    """Modules of no layer: each package and top-level module must be placed in one."""
    return [module for path in sorted(PACKAGE.rglob("*.py"))
            if (module := _module_name(path)) != "ddpkit"
            and not _in(module, APPLICATION + LIBRARY)
            and _foundation_level(module) is None]


def foundation_breaches() -> list[str]:
    """Foundation modules importing the library, the application, or a foundation
    package above their own level."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        level = _foundation_level(module)
        if level is None:
            continue
        for target in sorted(_imports(path, module)):
            if target == "ddpkit" or not target.startswith("ddpkit."):
                continue
            target_level = _foundation_level(target)
            if target_level is None or target_level > level:
                bad.append(f"{module} -> {target}")
    return bad


def test_every_module_belongs_to_a_layer():
    assert unplaced_modules() == []


def test_the_foundation_imports_only_its_own_level_and_below():
    assert foundation_breaches() == []


def test_the_foundation_check_sees_a_breach(tmp_path, monkeypatch):
    """The checks can fail: a runtime module importing the launcher, the durable files
    importing the library, and a new top-level module that no layer claims."""
    fake = tmp_path / "ddpkit"
    for package in ("runtime", "files", "launcher"):
        (fake / package).mkdir(parents=True)
        (fake / package / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "runtime" / "world.py").write_text("from ddpkit.errors import ConfigError\n"
                                               "from ..launcher import launch\n")
    (fake / "files" / "durable.py").write_text("from ddpkit.runtime import lifetime\n"
                                               "import ddpkit.checkpoint.store\n")
    (fake / "launcher" / "launch.py").write_text("from ddpkit.elastic import membership\n")
    (fake / "gadgets.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert foundation_breaches() == ["ddpkit.files.durable -> ddpkit.checkpoint.store",
                                     "ddpkit.runtime.world -> ddpkit.launcher",
                                     "ddpkit.runtime.world -> ddpkit.launcher.launch"]
    assert unplaced_modules() == ["ddpkit.gadgets"]
