"""A habit the code keeps: a function that takes an object typed ``Any`` does not write
that object's underscore attributes. ``Any`` is how a helper avoids importing the class
it serves (a cycle); writing ``obj._x`` from there is one class's private state kept by
another module, out of sight of the class that owns it. The owner gives such state a
public home instead (an attribute or method of its own, or the helper keeps it).

The check reads every module's source (AST): parameters annotated ``Any`` (or a
module-level alias of it, ``Trainer = Any``), what a function or class stores from them
(``t = trainer``, ``self.trainer = trainer``), and assignments or ``setattr`` calls on
those whose attribute starts with an underscore."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpkit

PACKAGE = Path(ddpkit.__file__).parent

# module: why its writes stand. Each entry must still find a write, so none goes stale.
ALLOWED = {
    # The join hook is DataParallel's own engine: it sets the join state DataParallel
    # reads in forward (the module is typed Any to keep engine/ free of ddp.py).
    "ddpkit/parallel/engine/join_state.py": "DataParallel's join state, set by its engine",
}


def _any_aliases(tree: ast.Module) -> set[str]:
    names = {"Any"}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name) and _is_any(node.value, names):
            names.add(node.targets[0].id)
    return names


def _is_any(node: ast.AST | None, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):
        return node.attr == "Any"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in names  # a string annotation
    return False


def _any_params(fn: ast.FunctionDef | ast.AsyncFunctionDef, names: set[str]) -> set[str]:
    a = fn.args
    every = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
    return {p.arg for p in every if _is_any(p.annotation, names)}


def _holder(node: ast.AST) -> str | None:
    """``t`` for ``t``, ``self.trainer`` for ``self.trainer``; None otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "self":
        return f"self.{node.attr}"
    return None


def _stores(body: ast.AST) -> list[tuple[str, ast.AST]]:
    """(holder, value) of every plain assignment under ``body``."""
    found = []
    for node in ast.walk(body):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts)
                         if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                         and len(target.elts) == len(node.value.elts) else [(target, node.value)])
                found += [(h, v) for t, v in pairs if (h := _holder(t))]
    return found


def _private_writes(body: ast.AST, held: set[str]) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(body):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and t.attr.startswith("_") \
                        and _holder(t.value) in held:
                    out.append((node.lineno, f"{_holder(t.value)}.{t.attr}"))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" \
                and len(node.args) >= 2 and _holder(node.args[0]) in held \
                and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_"):
            out.append((node.lineno, f"setattr({_holder(node.args[0])}, "
                                     f"{node.args[1].value!r})"))
    return out


def _grow(held: set[str], body: ast.AST) -> set[str]:
    """``held`` with every name or self attribute assigned from one of them."""
    while True:
        more = {h for h, v in _stores(body) if _holder(v) in held} - held
        if not more:
            return held
        held = held | more


def private_writes(source: str) -> list[str]:
    tree = ast.parse(source)
    names = _any_aliases(tree)
    found: set[tuple[int, str]] = set()
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for fn in (n for n in ast.walk(tree) if isinstance(n, functions)):
        held = _any_params(fn, names)
        if held:
            found.update(_private_writes(fn, _grow(held, fn)))
    # A class that keeps an Any-typed argument (self.trainer = trainer) and writes its
    # underscore attributes in another method.
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        kept: set[str] = set()
        for fn in (n for n in cls.body if isinstance(n, functions)):
            params = _any_params(fn, names)
            kept |= {h for h in _grow(params, fn) if h.startswith("self.")} if params else set()
        if kept:
            found.update(_private_writes(cls, _grow(kept, cls)))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def all_private_writes() -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        writes = private_writes(path.read_text())
        if writes:
            found[str(path.relative_to(PACKAGE.parent))] = writes
    return found


def test_no_module_writes_private_attributes_of_an_any():
    found = all_private_writes()
    assert {m: w for m, w in found.items() if m not in ALLOWED} == {}
    assert sorted(m for m in ALLOWED if m not in found) == [], "an allowance no longer needed"


def test_the_check_sees_each_form():
    """The check can fail: direct, through a local alias, through setattr, and through
    an argument a class keeps; a typed parameter and a public attribute pass."""
    source = '''
from typing import Any
Trainer = Any

def direct(trainer: Trainer, other: Other, x: Any):
    trainer._lock = 1
    other._fine = 2
    x.public = 3

def aliased(t: "Trainer"):
    u = t
    u._clock, n = (1, 2)
    setattr(t, "_sums", 0)

class Keeps:
    def __init__(self, trainer: Any):
        self.trainer = trainer

    def load(self):
        t = self.trainer
        t._resumed = 1
        self.trainer._count += 1
        self._own = 2
'''
    assert private_writes(source) == [
        "line 6: trainer._lock", "line 12: u._clock", "line 13: setattr(t, '_sums')",
        "line 21: t._resumed", "line 22: self.trainer._count"]
