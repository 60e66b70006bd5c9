"""ddpkit.vocabulary: one table per vocabulary, read without torch by the launcher,
resolved to the real objects by the workers; adding a model or a dataset is one entry."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ddpkit import vocabulary
from ddpkit.errors import ConfigError


def test_the_launcher_reads_every_table_without_importing_torch():
    code = textwrap.dedent("""
        import json, sys
        import ddpkit.commands.train, ddpkit.train.config
        from ddpkit import vocabulary as v
        tables = (v.DATASETS, v.MODELS, v.OPTIMIZERS, v.SCHEDULES, v.PRECISIONS, v.ENGINES,
                  v.COMM_CHOICES, v.SHARD_CHOICES)
        print(json.dumps({"torch": "torch" in sys.modules, "sizes": [len(t) for t in tables]}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout)
    assert seen["torch"] is False
    assert seen["sizes"] == [3, 3, 2, 2, 3, 2, 4, 4]


def test_every_name_resolves_to_what_implements_it():
    from ddpkit.data.datasets import DatasetSpec
    from ddpkit.parallel.engine import transport

    for name in vocabulary.DATASETS:
        assert isinstance(vocabulary.DATASETS.resolve(name), DatasetSpec), name
    for name in vocabulary.MODELS:
        build = vocabulary.MODELS.resolve(name)
        shape = (1, 28, 28) if name == "net" else (1, 8, 8)
        model = build(shape, 10, (16,))
        assert model(torch.zeros(3, *shape)).shape == (3, 10), name
    cfg = type("Optim", (), {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0})()
    for name in vocabulary.OPTIMIZERS:
        assert isinstance(vocabulary.OPTIMIZERS.resolve(name)([torch.zeros(2, requires_grad=True)],
                                                           cfg), torch.optim.Optimizer), name
    for name in vocabulary.SCHEDULES:
        assert vocabulary.SCHEDULES.resolve(name)(0.5, 0, 0, 10) == 0.5, name  # the base at start
    assert [vocabulary.PRECISIONS.resolve(n) for n in vocabulary.PRECISIONS] == [
        torch.float32, torch.bfloat16, torch.float16]
    assert vocabulary.ENGINES.resolve("torch") is torch.nn.parallel.DistributedDataParallel
    assert [vocabulary.COMM_CHOICES.resolve(n) for n in vocabulary.COMM_CHOICES] == [
        transport.choose, transport.BackendTransport, transport.RingTransport,
        transport.ShmTransport]


def test_an_unknown_name_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match=r"^unknown model 'resnet'; choose one of mlp, net, toy$"):
        vocabulary.MODELS.resolve("resnet")
    with pytest.raises(ConfigError, match=r"^--optimizer 'lamb' is not one of sgd, adamw$"):
        vocabulary.OPTIMIZERS.resolve("lamb", "--optimizer")
    with pytest.raises(ConfigError, match="already registered"):
        vocabulary.MODELS.add("mlp", "x:y")


def test_a_model_and_a_dataset_added_as_one_entry_each_train(tmp_path):
    """The table alone: one entry per name, then `ddpkit train`'s worker trains them."""
    (tmp_path / "my_entries.py").write_text(textwrap.dedent('''
        import torch
        from ddpkit.data.datasets import ArrayDataset, DatasetSpec

        def _load(_dir, _size):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(96, 1, 2, 2, generator=g)
            y = (x.flatten(1).sum(1) > 0).long()
            return (ArrayDataset(x[:64], y[:64], 2, "halves-train"),
                    ArrayDataset(x[64:], y[64:], 2, "halves-test"))

        HALVES = DatasetSpec((1, 2, 2), 2, _load)

        def build_linear(input_shape, num_classes, hidden):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, num_classes),
                                       torch.nn.LogSoftmax(dim=1))
    '''))
    script = textwrap.dedent(f'''
        import sys
        from ddpkit import vocabulary
        vocabulary.MODELS.add("linear", "my_entries:build_linear")
        vocabulary.DATASETS.add("halves", "my_entries:HALVES")
        from ddpkit.train.worker import main
        sys.exit(main(["--model", "linear", "--data", "halves", "--epochs", "2",
                       "--batch-size", "16", "--out-dir", {str(tmp_path / "runs")!r}]))
    ''')
    launcher = ("RANK", "WORLD", "LOCAL_", "MASTER")  # a single process, whoever runs pytest
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert "halves" in run.name and "linear" in run.name
    state = torch.load(run / "model.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in state.items()} == {"1.weight": (2, 4), "1.bias": (2,)}
    epochs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([e for e in epochs if "epoch" in e]) >= 2
