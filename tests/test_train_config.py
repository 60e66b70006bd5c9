"""Config precedence (command line > TOML > defaults) and bad input caught before launch."""

import pytest

from ddpkit import cli
from ddpkit.errors import ConfigError
from ddpkit.train.config import Config, resolve
from ddpkit.train.report import new_run_dir


def test_defaults_file_then_command_line(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nepochs = 3\nbatch_size = 64\n[optim]\nlr = 0.5\n'
                    '[model]\nhidden = [32, 16]\n')
    cfg = resolve({"epochs": 7}, toml)
    assert cfg.train.epochs == 7  # command line beats the file
    assert cfg.train.batch_size == 64 and cfg.optim.lr == 0.5  # file beats defaults
    assert cfg.model.hidden == [32, 16]
    assert cfg.data.name == Config().data.name == "digits"  # defaults fill the rest
    assert Config.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("text,match", [
    ("[trian]\nepochs = 1\n", r"unknown section \[trian\]"),
    ("[train]\nepoch = 1\n", "unknown key train.epoch"),
    ("[train]\nepochs = \"ten\"\n", "train.epochs must be an integer"),
    ("[train]\nprogress = 1\n", "must be true or false"),
    ("[optim]\nlr = -1.0\n", "--lr must be > 0"),
    ("[train]\nengine = \"mpi\"\n", "--engine 'mpi' is not one of ddpkit, torch"),
    ("[data]\nname = \"cifar\"\n", "--data 'cifar' is not one of"),
    ("[train\n", "not valid TOML"),
])
def test_bad_config_file_values(tmp_path, text, match):
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match=match):
        resolve({}, toml)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        resolve({}, tmp_path / "nope.toml")


@pytest.mark.parametrize("argv,match", [
    (["--batch-size", "127", "--nproc-per-node", "2"],
     "global batch size 127 is not divisible by world size 2"),
    (["--batch-size", "128", "--nproc-per-node", "3"], "not divisible by world size 3"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--data", "mnist"], "needs --data-dir"),
    (["--model", "net"], "needs 1x28x28 images"),
])
def test_train_rejects_bad_input_in_one_line_before_launching(capsys, tmp_path, argv, match):
    code = cli.main(["train", "--out-dir", str(tmp_path / "runs"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("ddpkit train: error: ") and "\n" not in err
    assert match in err


def test_unwritable_out_dir(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["train", "--out-dir", str(blocker)]) == 2
    assert "--out-dir" in capsys.readouterr().err


def test_run_dirs_are_never_reused(tmp_path):
    dirs = {new_run_dir(tmp_path, "digits-mlp") for _ in range(5)}
    assert len(dirs) == 5 and all(d.is_dir() and d.parent == tmp_path for d in dirs)
