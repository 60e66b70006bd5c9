"""ddpkit's checkpoints are torch.distributed.checkpoint (DCP) directories.

* torch's tools read them: ``dcp.load`` into a plain model's and a plain optimizer's
  state (torch's ``get_state_dict`` / ``set_state_dict``) in one process, from a
  checkpoint two ZeRO ranks wrote; ``dcp_to_torch_save`` gives one file that loads into
  the unwrapped model;
* checkpoints written before (format 1: ``step_N.pt``, ZeRO's per-rank files; made by
  ``tests/data/format1/make.py`` with that code) keep resuming, bit for bit.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from test_zero import _adamw, _mlp, _train

FORMAT1 = Path(__file__).parent / "data" / "format1"


# ------------------------------------------------------------------ torch's tools read them
def run_sharded_save(world, directory, mode):
    from ddpkit.checkpoint import Checkpointer, collect_state

    ddp, opt, _ = _train(world, mode, "auto", steps=2)
    path = Checkpointer(directory).save(collect_state(model=ddp, optimizer=opt, step=2), 2)
    names = [n for n, _ in ddp.module.named_parameters()]
    state = opt.state_dict() if mode == "none" else None
    return str(path), {k: v.clone() for k, v in ddp.state_dict().items()}, names, state


def test_torch_loads_a_zero_checkpoint_into_a_plain_model_and_optimizer(pools, tmp_path):
    path, weights, names, _ = pools(2).run(run_sharded_save, str(tmp_path / "z"), "gradients")[0]
    _, _, _, reference = pools(2).run(run_sharded_save, str(tmp_path / "p"), "none")[0]
    model = _mlp()
    opt = _adamw(model)
    model_sd, optim_sd = get_state_dict(model, opt)  # torch's names, torch's layout
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)  # one process, the checkpoint of two ranks
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[f"module.{name}"]), name
    # ZeRO's pieces came back whole: the unsharded run's AdamW state, bit for bit.
    mine = opt.state_dict()
    assert mine["state"].keys() == reference["state"].keys() and len(mine["state"]) == len(names)
    for index, values in reference["state"].items():
        for key, value in values.items():
            assert torch.equal(mine["state"][index][key], value), (names[index], key)
    assert [g["weight_decay"] for g in mine["param_groups"]] == [0.05, 0.0]


def test_dcp_to_torch_save_gives_a_file_the_unwrapped_model_loads(pools, tmp_path):
    path, weights, _, _ = pools(2).run(run_sharded_save, str(tmp_path / "z"), "optimizer")[0]
    dcp_to_torch_save(path, tmp_path / "one.pt")
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    model = _mlp()
    model.load_state_dict(one["model"])
    assert all(torch.equal(v, weights[f"module.{k}"]) for k, v in model.state_dict().items())
    assert set(one["optimizer"]["state"]) == {n for n, _ in model.named_parameters()}


# ------------------------------------------------------------------ format 1 keeps resuming
def _maker():
    spec = importlib.util.spec_from_file_location("format1_make", FORMAT1 / "make.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_format1(world, run_dir, shard):
    import ddpkit

    make = _maker()
    wrapped, opt, sampler, data = make.build(shard)
    with ddpkit.Run(Path(run_dir), model=wrapped, optimizer=opt, sampler=sampler) as run:
        resumed_at = run.step
        make.steps(run, wrapped, opt, sampler, data, 5)
    final = ddpkit.checkpoint.unwrap(wrapped).state_dict()
    steps = [info.step for info in run.checkpointer.checkpoints()]
    return resumed_at, {k: v.clone() for k, v in final.items()}, steps


def _train_on_by_hand(model, opt, sampler, data, saved, until):
    """make.py's steps after the checkpoint ``saved`` (a format 1 file's dict) up to step
    ``until``, with plain torch; the weights after them."""
    sampler.set_epoch(saved["sampler"]["epoch"])
    done = saved["sampler"]["position"] // sampler.global_batch_size
    for index, batch in enumerate(sampler.batches()):
        if index < done:
            continue  # trained before the checkpoint
        if index >= until:
            break
        x, y = data.tensors[0][batch.indices], data.tensors[1][batch.indices]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _continued_without_resume(kind, until):
    """The reference: the format 1 checkpoint's state, read from its file by hand, trained
    on to ``until`` here with plain torch (no Run, no resume path). Computed on this CPU,
    so it compares bits with bits of the same machine."""
    make = _maker()
    saved = torch.load(FORMAT1 / kind / "checkpoints" / "step_000000003.pt", weights_only=True)
    model, opt, sampler, data = make.build("single")
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    return _train_on_by_hand(model, opt, sampler, data, saved, until)


def test_a_format1_checkpoint_resumes_bit_for_bit(tmp_path):
    shutil.copytree(FORMAT1 / "plain", tmp_path / "plain")
    resumed_at, final, steps = run_format1(None, tmp_path / "plain", "single")
    expected = _continued_without_resume("plain", 5)
    assert resumed_at == 3 and steps == [3, 5]  # the old file, then a DCP directory
    assert final.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(final[k], expected[k])]
    assert not differ, differ
    assert (tmp_path / "plain" / "checkpoints" / "step_000000005" / ".metadata").exists()
    # The comparison can fail: one step short of the resumed run is another state.
    short = _continued_without_resume("plain", 4)
    assert any(not torch.equal(final[k], short[k]) for k in short)


def run_format1_zero_restored(world, run_dir):
    """Resume the format 1 ZeRO checkpoint (two ranks, shard="optimizer") and compare
    what each rank holds with what that checkpoint's files hold."""
    import ddpkit

    make = _maker()
    wrapped, opt, sampler, _ = make.build("optimizer")
    run = ddpkit.Run(Path(run_dir), model=wrapped, optimizer=opt, sampler=sampler)
    with run:
        step = run.step
        weights = ddpkit.checkpoint.unwrap(wrapped).state_dict()
        _, pieces = wrapped.optimizer_shard_state(opt)
    directory = Path(run_dir) / "checkpoints"
    saved = torch.load(directory / "step_000000003.pt", weights_only=True)
    mine = torch.load(directory / f"step_000000003.rank{world.rank:05d}-of-00002.pt",
                      weights_only=True)["optimizer"]
    same_weights = all(torch.equal(weights[k], v) for k, v in saved["model"].items())
    same_pieces = pieces["pieces"].keys() == mine["pieces"].keys() and all(
        a[:3] == b[:3] and torch.equal(a[3], b[3])
        for name in mine["pieces"] for a, b in zip(pieces["pieces"][name], mine["pieces"][name]))
    steps = {n: float(v["step"]) for n, v in pieces["scalars"].items()}
    return step, same_weights, same_pieces, steps


def test_a_format1_zero_checkpoint_with_rank_files_resumes_exactly(pools, tmp_path):
    shutil.copytree(FORMAT1 / "zero", tmp_path / "zero")
    for step, same_weights, same_pieces, steps in pools(2).run(run_format1_zero_restored,
                                                              str(tmp_path / "zero")):
        assert step == 3 and same_weights and same_pieces
        assert steps and set(steps.values()) == {3.0}


def test_model_weights_of_a_checkpoint_read_without_a_model(tmp_path):
    from ddpkit.checkpoint import Checkpointer, collect_state, read_model_state

    model = _mlp()
    F.relu(model(torch.randn(2, 64))).sum().backward()
    path = Checkpointer(tmp_path).save(collect_state(model=model, step=1), 1)
    read = read_model_state(path)
    assert read.keys() == model.state_dict().keys()
    assert all(torch.equal(read[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------ tied weights
class _Tied(torch.nn.Module):
    """Input and output embeddings tied, as GPT-style models are (examples/50_own_loop.py)."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(7, 4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(self.tok(idx))


def _tied_steps(run_dir, until):
    """A one-process Run over the tied model; its step, weights and optimizer state."""
    import ddpkit
    from ddpkit.data import ShardSampler

    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = torch.randint(0, 7, (32,))
    with ddpkit.Run(Path(run_dir), model=model, optimizer=opt,
                    sampler=ShardSampler(data, global_batch_size=8, seed=1)) as run:
        resumed_at = run.step
        for _ in run.epochs(1):
            for batch in run.batches():
                if run.step >= until:  # a resumed run is compared where it stands
                    break
                opt.zero_grad()
                F.cross_entropy(model(data[batch.indices]), data[batch.indices]).backward()
                opt.step()
                run.step_done()
                if run.step == until:
                    run.save("periodic")
    return resumed_at, model, opt


def test_a_tied_weight_is_keyed_as_torch_keys_it_and_resumes(tmp_path):
    _, model, opt = _tied_steps(tmp_path / "run", 2)
    newest = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    saved = dcp.FileSystemReader(newest).read_metadata().state_dict_metadata
    _, torch_names = get_state_dict(model, opt)
    ours = {k.split(".")[2] + "." + k.split(".")[3] for k in saved
            if k.startswith("optimizer.state.")}
    assert ours == set(torch_names["state"]) == {"tok.weight"}  # the first name, as torch's
    resumed_at, again, opt_again = _tied_steps(tmp_path / "run", 2)
    assert resumed_at == 2
    assert torch.equal(again.tok.weight, model.tok.weight) and again.head.weight is again.tok.weight
    state, state_again = opt.state_dict()["state"], opt_again.state_dict()["state"]
    assert all(torch.equal(state[0][k], state_again[0][k]) for k in ("exp_avg", "exp_avg_sq"))


# ------------------------------------------------------------------ ZeRO resumes exactly
def run_make_job(world, run_dir, shard, save_at, until):
    """make.py's job at two ranks: resume what ``run_dir`` holds, optionally save at
    ``save_at``, and stop at ``until``; new model, optimizer and sampler objects."""
    import ddpkit

    make = _maker()
    wrapped, opt, sampler, data = make.build(shard)
    with ddpkit.Run(Path(run_dir), model=wrapped, optimizer=opt, sampler=sampler) as run:
        resumed_at = run.step
        if save_at is not None:
            make.steps(run, wrapped, opt, sampler, data, save_at)
            run.save("periodic")
        if run.step < until:
            make.steps(run, wrapped, opt, sampler, data, until)
        try:  # ZeRO-1/2 after opt.step(): other ranks' chunks not gathered yet
            ddpkit.checkpoint.unwrap(wrapped).state_dict()
            refused = False
        except ddpkit.errors.UsageError:
            refused = True
        final = {k: v.clone() for k, v in wrapped.state_dict().items()}  # gathers
    return resumed_at, final, refused


def run_format1_zero_continued_by_hand(world, until):
    """The reference for the format 1 ZeRO checkpoint: its weights and its ranks' optimizer
    pieces, read from the files by hand and joined into plain AdamW state, trained on to
    ``until`` here at two ranks without sharding (the same bits as ZeRO-1, see
    test_zero.py) and without Run: no resume path is involved."""
    make = _maker()
    directory = FORMAT1 / "zero" / "checkpoints"
    saved = torch.load(directory / "step_000000003.pt", weights_only=True)
    wrapped, opt, sampler, data = make.build("none")
    model = wrapped.module
    model.load_state_dict(saved["model"])
    joined: dict[str, dict[str, list]] = {}
    steps: dict[str, torch.Tensor] = {}
    for rank in range(2):
        part = torch.load(directory / f"step_000000003.rank{rank:05d}-of-00002.pt",
                          weights_only=True)["optimizer"]
        for name, pieces in part["pieces"].items():
            for start, _, key, value in pieces:
                joined.setdefault(name, {}).setdefault(key, []).append((start, value))
        steps.update({name: v["step"] for name, v in part["scalars"].items()})
    for name, param in model.named_parameters():
        state = {key: torch.cat([v for _, v in sorted(parts, key=lambda p: p[0])])
                 .view_as(param).clone() for key, parts in joined[name].items()}
        opt.state[param] = {"step": steps[name].clone(), **state}
    return _train_on_by_hand(wrapped, opt, sampler, data, saved, until)


@pytest.mark.parametrize("shard", ["none", "optimizer", "gradients", "parameters"])
def test_a_zero_run_resumed_at_the_same_world_size_ends_bit_for_bit(pools, tmp_path, shard):
    whole = pools(2).run(run_make_job, str(tmp_path / "whole"), shard, 3, 5)
    pools(2).run(run_make_job, str(tmp_path / "cut"), shard, 3, 3)
    resumed = pools(2).run(run_make_job, str(tmp_path / "cut"), shard, None, 5)
    for (_, expected, refused), (resumed_at, final, _) in zip(whole, resumed):
        assert refused == (shard != "none")  # a read of the module would mix two steps
        assert resumed_at == 3 and final.keys() == expected.keys()
        differ = [k for k in expected if not torch.equal(final[k], expected[k])]
        assert not differ, (shard, differ, [float((final[k] - expected[k]).abs().max())
                                            for k in differ])
    if shard == "optimizer":  # make.py's format 1 checkpoint, resumed, ends there too
        shutil.copytree(FORMAT1 / "zero", tmp_path / "format1")
        old = pools(2).run(run_make_job, str(tmp_path / "format1"), shard, None, 5)
        # Its steps 1-3 ran on another CPU: the reference continues its state here.
        by_hand = pools(2).run(run_format1_zero_continued_by_hand, 5)[0]
        assert old[0][0] == 3 and old[0][1].keys() == by_hand.keys()
        assert all(torch.equal(old[0][1][k], v) for k, v in by_hand.items())
        short = pools(2).run(run_format1_zero_continued_by_hand, 4)[0]
        assert any(not torch.equal(old[0][1][k], v) for k, v in short.items())
