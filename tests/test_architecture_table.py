"""docs/architecture.md's "Where to edit" table is true: every file a row names exists
(and every ``file:name`` defines that name), and where a row says what one change takes
("one field", "one row", "one line", a name in a list), that is what it takes, checked by
making the change in the test through the places the row names and nothing else."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import types
from pathlib import Path

import pytest

import ddpkit
from ddpkit.errors import CommError, ConfigError

PACKAGE = Path(ddpkit.__file__).parent
ROOT = PACKAGE.parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# A row's backticked file: a path, a glob or a <placeholder>, maybe with ``:name``.
FILE = re.compile(r"^([\w<>*./-]+\.(?:py|md))(?::(\w+))?$")


def table() -> dict[str, tuple[str, str]]:
    """{what to add or change: (edit, and)} from the table's rows."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Where to edit"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines()[4:]:
        if line.startswith("| "):
            what, edit, also = (cell.strip() for cell in line.strip("|").split(" | "))
            rows[what] = (edit, also)
    return rows


def named_files(cells: str) -> list[tuple[Path, str | None]]:
    """The (path, name) pairs a row names; a bare file name lies beside the file named
    before it (``checkpoint/step_write.py`` ... ``dcp_load.py``)."""
    found, where = [], PACKAGE
    for token in re.findall(r"`([^`]+)`", cells):
        m = FILE.match(token)
        if not m:
            continue
        path, name = m.group(1), m.group(2)
        if path.startswith(("tests/", "docs/")) or path == "README.md":
            full = ROOT / path
        elif "/" in path:
            full = PACKAGE / path
        else:  # beside the file named before it, else at the package's top
            full = where / path if (where / path).exists() else PACKAGE / path
        where = full.parent
        found.append((full, name))
    return found


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def test_the_table_is_there():
    rows = table()
    assert len(rows) >= 10 and "a dataset" in rows and "a CLI command" in rows


@pytest.mark.parametrize("what", sorted(table()))
def test_every_file_a_row_names_exists(what):
    edit, also = table()[what]
    files = named_files(f"{edit} {also}")
    assert files or "tests/" in also, f"row {what!r} names no file"
    for path, name in files:
        pattern = re.sub(r"<\w+>", "*", str(path.relative_to(ROOT)))
        matches = sorted(ROOT.glob(pattern))
        assert matches, f"row {what!r}: {pattern} does not exist"
        if name:
            assert _defines(matches[0], name), f"row {what!r}: {pattern} has no {name}"


def test_the_file_check_can_fail():
    assert named_files("`checkpoint/step_write.py` and `dcp_load.py`") == [
        (PACKAGE / "checkpoint" / "step_write.py", None),
        (PACKAGE / "checkpoint" / "dcp_load.py", None)]
    assert not _defines(PACKAGE / "train" / "build.py", "no_such_builder")


# --------------------------------------------------------------------------- claims
# Each row that says what one change takes, with the check that it is so. A row that
# starts claiming "one ..." without an entry here fails test_every_claim_is_checked.
CHECKED = {
    "a training option (`ddpkit train --foo`)": "one field",
    "a dataset": "one entry in `DATASETS`",
    "a model of `ddpkit train`": "one entry in `MODELS`",
    "a way `DataParallel` moves its buckets (`comm=`)": "one entry in `COMM_CHOICES`",
    "another choice of an option (optimizer, learning-rate schedule, precision)":
        "one entry in its table",
    "a collective algorithm": "one `register_algorithm(...)` line",
    "a CLI command": "its name in `cli.py`'s `COMMANDS`",
}


def test_every_claim_is_checked():
    rows = table()
    claims = {what for what, (edit, _) in rows.items()
              if re.search(r"\bone (field|row|entry|\S+ line)\b", edit)}
    assert claims <= set(CHECKED), f"rows claiming one change, unchecked: {claims - set(CHECKED)}"
    for what, words in CHECKED.items():
        assert words in rows[what][0], f"row {what!r} no longer says {words!r}"


def test_a_training_option_is_one_field():
    """Every flag-declared field is a `ddpkit train` option, with nothing else written."""
    from ddpkit import cli
    from ddpkit.train.config import flag_fields

    parser = cli.build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    options = {s for action in train._actions for s in action.option_strings}
    fields = {f.metadata["flag"] for _, f in flag_fields()}
    assert fields and fields <= options, sorted(fields - options)


def test_a_dataset_is_one_entry(monkeypatch):
    """A dataset added as the row says, one entry of ddpkit.vocabulary.DATASETS: the
    config accepts it, the pre-flight check and the run read its spec."""
    import numpy as np

    from ddpkit import vocabulary
    from ddpkit.data import datasets
    from ddpkit.train import build, config, prelaunch

    def load(_dir, _size):
        x = np.zeros((4, 1, 5, 5), dtype=np.float32)
        return (datasets.ArrayDataset(x, np.arange(4) % 3, 3, "tiny"),
                datasets.ArrayDataset(x[:2], np.arange(2) % 3, 3, "tiny-test"))

    with pytest.raises(ConfigError, match="--data 'tiny' is not one of"):
        config.DataConfig(name="tiny")
    monkeypatch.setattr(datasets, "TINY_FOR_TEST", datasets.DatasetSpec((1, 5, 5), 3, load),
                        raising=False)
    vocabulary.DATASETS.add("tiny", "ddpkit.data.datasets:TINY_FOR_TEST")
    try:
        train, test = build.load_data(config.DataConfig(name="tiny"))
        assert (len(train), len(test), train.input_shape) == (4, 2, (1, 5, 5))
        cfg = config.Config.from_dict({"data": {"name": "tiny"}, "model": {"name": "net"}})
        with pytest.raises(ConfigError, match="1x28x28"):
            prelaunch.check_data(cfg)  # the fits-the-data check read the new entry's shape
        prelaunch.check_data(cfg.replaced(({"model": {"name": "mlp"}}, "test")))
    finally:
        vocabulary.DATASETS.remove("tiny")


def test_a_model_is_one_entry(monkeypatch):
    """A model added as one entry of ddpkit.vocabulary.MODELS is what builtin_model builds
    by that name (no if-chain, no copied list)."""
    import torch

    from ddpkit import vocabulary
    from ddpkit.train import models

    def build_wide(input_shape, num_classes, hidden):
        return torch.nn.Linear(input_shape[-1], num_classes * hidden[0])

    monkeypatch.setattr(models, "build_wide_for_test", build_wide, raising=False)
    vocabulary.MODELS.add("wide_for_test", "ddpkit.train.models:build_wide_for_test")
    try:
        built = models.builtin_model("wide_for_test", (1, 3), 4, hidden=(2,))
    finally:
        vocabulary.MODELS.remove("wide_for_test")
    assert isinstance(built, torch.nn.Linear)
    assert (built.in_features, built.out_features) == (3, 8)


def test_an_optimizer_schedule_or_precision_is_one_entry():
    """The options' choices come from the tables: a name added there is offered."""
    from ddpkit import vocabulary
    from ddpkit.train import config

    vocabulary.OPTIMIZERS.add("plain_sgd_for_test", "ddpkit.train.optimizers:sgd")
    try:
        assert config.OptimConfig(name="plain_sgd_for_test").name == "plain_sgd_for_test"
    finally:
        vocabulary.OPTIMIZERS.remove("plain_sgd_for_test")
    with pytest.raises(ConfigError, match="plain_sgd_for_test"):
        config.OptimConfig(name="plain_sgd_for_test")


def test_a_collective_algorithm_is_one_register_line():
    """One register_algorithm call makes an algorithm what ``algo=`` resolves to."""
    from ddpkit.comm import registry

    class Doubling:
        def all_reduce(self, tensor, op, group):
            tensor.mul_(2)

    impl = Doubling()
    registry.register_algorithm("doubling_for_test", impl)
    try:
        assert "doubling_for_test" in registry.algorithms()
        assert registry.resolve_algo("doubling_for_test", None, None) == (
            "doubling_for_test", impl)
    finally:
        registry.unregister_algorithm("doubling_for_test")
    with pytest.raises(CommError, match="unknown algorithm"):
        registry.get_algorithm("doubling_for_test")


def test_a_cli_command_is_its_module_and_its_name(monkeypatch):
    """A module in ddpkit.commands with register(subparsers), named in COMMANDS, is a
    command, and the commands are those COMMANDS names."""
    from ddpkit import cli

    commands = cli.build_parser()._subparsers._group_actions[0].choices
    assert list(commands) == list(cli.COMMANDS)

    module = types.ModuleType("ddpkit.commands.hello")

    def register(sub):
        p = sub.add_parser("hello", help="say hello")
        p.set_defaults(func=lambda args: 0)

    module.register = register
    monkeypatch.setitem(sys.modules, "ddpkit.commands.hello", module)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "hello"))
    assert cli.main(["hello"]) == 0


def test_the_dataset_row_spells_the_spec_as_it_is():
    from ddpkit.data.datasets import DatasetSpec

    spelled = re.search(r"`DatasetSpec\(([^)]*)\)`", table()["a dataset"][0]).group(1)
    assert spelled.split(", ") == [f.name for f in dataclasses.fields(DatasetSpec)]
