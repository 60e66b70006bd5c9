"""The compatibility table of docs/ddp-engine.md against the installed torch's class.

Walks torch's DistributedDataParallel: every constructor argument
(``inspect.signature``), every method and property the class defines, every public
attribute of a built instance must have a row; a row saying "same" must hold for
``ddpkit.DataParallel`` (the argument at the same position, the method, the attribute);
a row for a name torch no longer has fails too. A torch release that adds a public name
fails here until the table (and, if needed, DataParallel) says what ddpkit does with it.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATUSES = ("same", "same, clearer message", "not supported", "different")
_ROW = re.compile(r"^\| `(\w+)` \| (argument|method|property|attribute) \| ([^|]+) \|(.*)\|$")


def table() -> dict[tuple[str, str], tuple[str, str]]:
    """(name, kind) -> (status, notes), from the table's rows."""
    with open(os.path.join(ROOT, "docs", "ddp-engine.md")) as f:
        text = f.read()
    section = text[text.index("### Compatibility table"):]
    section = section[:section.index("\n#", 1)] if "\n#" in section[1:] else section
    rows = {}
    for line in section.splitlines():
        match = _ROW.match(line.strip())
        if match:
            name, kind, status, notes = match.groups()
            assert (name, kind) not in rows, f"two rows for {name} ({kind})"
            rows[name, kind] = (status.strip(), notes.strip())
    return rows


def _arguments(cls) -> list[str]:
    return [n for n in inspect.signature(cls.__init__).parameters if n != "self"]


def torch_class_names() -> set[tuple[str, str]]:
    names = {(n, "argument") for n in _arguments(DistributedDataParallel)}
    for name, value in vars(DistributedDataParallel).items():
        if not name.startswith("_"):
            names.add((name, "property" if isinstance(value, property) else "method"))
    return names


@pytest.mark.unit
def test_every_row_has_a_known_status_and_unsupported_rows_say_why():
    rows = table()
    assert len(rows) > 40, "the table was not found or not parsed"
    for (name, kind), (status, notes) in rows.items():
        assert status in STATUSES, f"{name}: unknown status {status!r}"
        if status in ("not supported", "different"):
            assert notes, f"{name} ({kind}) is {status} without a reason"


@pytest.mark.unit
def test_every_argument_method_and_property_of_torchs_class_has_a_row():
    rows = table()
    missing = sorted(torch_class_names() - set(rows))
    assert not missing, f"torch's DistributedDataParallel has names the table lacks: {missing}"


@pytest.mark.unit
def test_same_rows_hold_for_ddpkit_class():
    theirs, ours = _arguments(DistributedDataParallel), _arguments(ddpkit.DataParallel)
    for (name, kind), (status, _) in table().items():
        if not status.startswith("same"):
            continue
        if kind == "argument":
            assert name in ours and ours.index(name) == theirs.index(name), (
                f"argument {name} is not at torch's position {theirs.index(name)}")
        elif kind == "property":
            assert isinstance(getattr(ddpkit.DataParallel, name, None), property), name
        elif kind == "method":
            assert callable(getattr(ddpkit.DataParallel, name, None)), name


def run_instance_attributes(world):
    theirs = DistributedDataParallel(nn.Linear(2, 2))
    ours = ddpkit.DataParallel(nn.Linear(2, 2))
    return (sorted(k for k in vars(theirs) if not k.startswith("_")),
            sorted(k for k in dir(ours) if not k.startswith("_")))


def test_instance_attributes_of_torchs_model_have_rows_and_same_ones_exist(pools):
    torch_attributes, ours = pools(2).run(run_instance_attributes)[0]
    rows = table()
    missing = sorted(n for n in torch_attributes if (n, "attribute") not in rows)
    assert not missing, f"torch's DDP instance has attributes the table lacks: {missing}"
    stale = sorted(n for (n, kind) in rows if kind == "attribute" and n not in torch_attributes)
    assert not stale, f"the table lists attributes torch's instance does not have: {stale}"
    for name in torch_attributes:
        status = rows[name, "attribute"][0]
        if status.startswith("same"):
            assert name in ours, f"DataParallel lacks the attribute {name} (table: {status})"


@pytest.mark.unit
def test_no_row_for_a_name_torch_does_not_have():
    class_rows = {key for key in table() if key[1] != "attribute"}
    stale = sorted(class_rows - torch_class_names())
    assert not stale, f"the table lists names torch's class does not have: {stale}"
