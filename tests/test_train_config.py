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


def test_an_invalid_config_cannot_be_built_and_a_built_one_cannot_change():
    import dataclasses

    cfg = Config()
    with pytest.raises(ConfigError, match="^--batch-size must be >= 1, got 0$"):
        dataclasses.replace(cfg.train, batch_size=0)
    with pytest.raises(ConfigError, match="^--keep must be >= 1"):
        Config.from_dict({"checkpoint": {"keep": 0}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.epochs = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = cfg.train  # type: ignore[misc]


def test_a_value_one_source_needs_may_come_from_a_later_one(tmp_path):
    """The config is checked once, built from every source: a file's --slices is
    valid with the command line's --exact."""
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nslices = 4\nbatch_size = 64\n")
    cfg = resolve({"exact": True}, toml)
    assert cfg.train.exact and cfg.slice_count() == 4
    with pytest.raises(ConfigError, match="^--slices is exact mode's: add --exact$"):
        resolve({}, toml)


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


# Flags valid only together with another one.
NEEDS = {"--slices": ["--exact"]}


def _flag_value(f):
    """A value for a field's flag that differs from the field's default."""
    meta = f.metadata["argparse"]
    if "choices" in meta:
        default = f.default
        return next(c for c in meta["choices"] if c != default)
    kind = str(f.type)
    if kind.startswith("bool"):
        return None  # the bare flag
    if kind.startswith("list"):
        return ["7", "5"]
    if kind.startswith("int"):
        return str((f.default if isinstance(f.default, int) else 0) + 2)
    if kind.startswith("float"):
        return "0.25"
    if f.metadata["flag"] == "--log-with":  # names of metric writers
        return "csv"
    if f.metadata["flag"] in ("--data", "--model"):  # a built-in name or a user's factory
        return "mypackage.module:factory"
    if f.metadata["flag"] == "--comm":  # checked in validate(), not by argparse choices
        return "ring"
    return "somewhere"


def test_every_flag_field_reaches_its_config_field():
    """Each config field carrying a flag is on the command line and a value given there
    lands in that very field: an option is one field, never a flag silently ignored."""
    import argparse
    import dataclasses

    from ddpkit.train.config import flag_fields
    from ddpkit.train.options import add_run_options, add_train_options, config_from_args

    fields = flag_fields()
    assert len(fields) >= 15
    for section, f in fields:
        p = argparse.ArgumentParser()
        add_train_options(p)
        add_run_options(p)
        value = _flag_value(f)
        argv = [f.metadata["flag"]] + ([] if value is None else
                                      value if isinstance(value, list) else [value])
        argv += NEEDS.get(f.metadata["flag"], [])
        cfg = config_from_args(p.parse_args(argv))
        got = getattr(getattr(cfg, section), f.name)
        default = getattr(getattr(Config(), section), f.name)
        assert got != default, f"{f.metadata['flag']} did not change {section}.{f.name}"
        if value is not None:
            kind = str(f.type).split(" ")[0]
            cast = {"int": int, "float": float}.get(kind, str)
            want = [int(v) for v in value] if isinstance(value, list) else cast(value)
            assert got == want, (f.metadata["flag"], got, want)
    flags = {f.metadata["flag"] for _, f in fields}
    assert len(flags) == len(fields), "two fields share a flag"
    assert all(dataclasses.is_dataclass(getattr(Config(), s)) for s, _ in fields)


def test_each_dataset_spec_matches_what_its_loader_returns():
    """The table the CLI checks models against before launching is the data itself."""
    from ddpkit.vocabulary import DATASETS

    for name in DATASETS:
        spec = DATASETS.resolve(name)
        if name == "mnist":
            with pytest.raises(ConfigError, match="--data-dir"):
                spec.load(None, 0)
            continue
        train, test = spec.load(None, 64)
        x, y = train[0]
        assert tuple(x.shape) == spec.input_shape, name
        assert train.num_classes == spec.num_classes, name
        assert int(max(train.y.max(), test.y.max())) < spec.num_classes, name


@pytest.mark.parametrize(("argv", "message"), [
    (["--exact", "--grad-accum", "2"],
     "--grad-accum does not combine with --exact: exact mode accumulates over slices; "
     "use a --batch-size N times larger and --slices (the same samples per step, "
     "summed exactly)"),
    (["--slices", "4"], "--slices is exact mode's: add --exact"),
    (["--exact", "--slices", "5"],
     "5 slices do not divide the global batch of 128; use a divisor of it (e.g. 8)"),
    (["--exact", "--engine", "torch"], "--exact is ddpkit's engine's: leave out --engine torch"),
    (["--exact", "--shard", "optimizer"],
     "--shard 'optimizer' does not combine with --exact (exact mode sums whole gradients on "
     "every rank): leave out --shard"),
])
def test_exact_mode_mistakes_are_one_line(argv, message):
    import argparse

    from ddpkit.train.options import add_train_options, config_from_args

    p = argparse.ArgumentParser()
    add_train_options(p)
    with pytest.raises(ConfigError) as err:
        config_from_args(p.parse_args(argv))
    assert str(err.value) == message


def test_settings_saved_under_the_old_name_of_slices_still_load(tmp_path):
    """Runs and checkpoints written when exact mode's unit was "virtual shards" keep
    resuming: the saved key maps to ``slices`` (config files, saved run settings, a
    checkpoint's identity and its exact-mode state)."""
    import json

    from ddpkit.slice_count import saved_slice_count
    from ddpkit.train.resume import refuse_changed_config

    old_file = tmp_path / "old.toml"
    old_file.write_text("[train]\nexact = true\nvirtual_shards = 6\nbatch_size = 96\n")
    cfg = resolve({}, old_file)
    assert cfg.train.slices == 6 and cfg.slice_count() == 6

    old_identity = cfg.identity()
    old_identity["train"]["virtual_shards"] = old_identity["train"].pop("slices")
    refuse_changed_config(json.dumps(old_identity), cfg, "old checkpoint")  # no error
    old_identity["train"]["virtual_shards"] = 12
    with pytest.raises(Exception, match=r"train\.slices: 12 -> 6"):
        refuse_changed_config(old_identity, cfg, "old checkpoint")

    assert saved_slice_count({"virtual_shards": 8, "step": 3, "seed": 1}) == 8
    assert saved_slice_count({"slices": 4, "step": 3, "seed": 1}) == 4


EXACT_RUN = {"exact": True, "batch_size": 96, "data": "synthetic", "optimizer": "adamw",
             "lr": 0.01, "lr_schedule": "cosine", "epochs": 2}
# What an exact run's bits depend on, one change of each (flag destination, new value,
# the field the refusal names, its old and new value as the line shows them).
EXACT_BITS = [
    ("precision", "bf16", "train.precision", "'fp32'", "'bf16'"),
    ("slices", 6, "train.slices", "12", "6"),
    ("threads", 2, "train.threads", "1", "2"),
    ("seed", 7, "train.seed", "1234", "7"),
    ("batch_size", 48, "train.batch_size", "96", "48"),
    ("epochs", 3, "train.epochs", "2", "3"),  # a cosine schedule runs to the last step
    ("optimizer", "sgd", "optim.name", "'adamw'", "'sgd'"),
    ("lr", 0.02, "optim.lr", "0.01", "0.02"),
    ("weight_decay", 0.1, "optim.weight_decay", "0.0", "0.1"),
    ("momentum", 0.5, "optim.momentum", "0.9", "0.5"),
    ("lr_schedule", "constant", "optim.lr_schedule", "'cosine'", "'constant'"),
    ("warmup_steps", 3, "optim.warmup_steps", "0", "3"),
    ("clip_grad_norm", 1.0, "optim.clip_grad_norm", "None", "1.0"),
    ("hidden", [64], "model.hidden", "[128]", "[64]"),
    ("model", "net", "model.name", "'mlp'", "'net'"),
    ("synthetic_size", 512, "data.synthetic_size", "8192", "512"),
    ("data", "digits", "data.name", "'synthetic'", "'digits'"),
]


@pytest.mark.parametrize(("dest", "value", "field", "old", "new"), EXACT_BITS,
                         ids=[case[0] for case in EXACT_BITS])
def test_an_exact_resume_that_changes_what_its_bits_depend_on_is_refused(
        dest, value, field, old, new):
    import json

    from ddpkit.checkpoint import CheckpointError
    from ddpkit.train.resume import refuse_changed_config

    saved = json.dumps(resolve(EXACT_RUN).identity())
    refuse_changed_config(saved, resolve(EXACT_RUN), "step_000000004")  # the same: resumes
    changed = resolve({**EXACT_RUN, dest: value})
    with pytest.raises(CheckpointError) as err:
        refuse_changed_config(saved, changed, "step_000000004")
    line = str(err.value)
    assert line.startswith("step_000000004 was written with other settings (")
    assert line.endswith("); leave those options out to resume, or start a new run")
    listed = line[line.index("(") + 1:line.rindex("); leave")].split("; ")
    assert f"{field}: {old} -> {new}" in listed, listed
    assert "\n" not in line


def test_what_an_exact_resume_may_change_and_checkpoints_from_before_precision_counted():
    import json

    from ddpkit.train.resume import refuse_changed_config

    saved = resolve(EXACT_RUN).identity()
    for dest, value in (("out_dir", "elsewhere"), ("log_sample_ids", True),
                        ("checkpoint_every_steps", 3), ("keep", 1)):
        refuse_changed_config(json.dumps(saved), resolve({**EXACT_RUN, dest: value}), "c")
    constant = {**EXACT_RUN, "lr_schedule": "constant"}  # more epochs: the same steps first
    refuse_changed_config(resolve(constant).identity(), resolve({**constant, "epochs": 5}), "c")
    # Written before the precision and the epochs were part of an exact run's identity:
    # nothing to compare them with (not refused for lack of the key).
    for key in ("precision", "epochs"):
        del saved["train"][key]
    refuse_changed_config(json.dumps(saved), resolve({**EXACT_RUN, "epochs": 3}), "c")
