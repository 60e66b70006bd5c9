"""``Run(init_from=DIR)`` / ``ddpkit train --init-from DIR``: a ddpkit run starts from a
torch.distributed.checkpoint that torch wrote.

Two writers, as the field writes them: torch DDP and FSDP2 (``fully_shard`` on gloo
CPU), two ranks each, AdamW for two steps, then ``dcp.save({"model": ..., "optimizer":
...})`` of ``get_state_dict(model, optimizer)``. ddpkit starts from each at three ranks,
``shard="none"`` and ``"gradients"``: every rank's weights and AdamW moments equal
the checkpoint's (as torch's own ``dcp_to_torch_save`` reads them), and it trains on.
A checkpoint of another model is one line naming what differs.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict

from test_zero import _batch, _mlp


def _small(hidden: int = 70):
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 5))


def save_with_torch(world, directory, writer):
    """What a torch program does: train two steps, save with DCP."""
    torch.manual_seed(3)
    model = _small()
    if writer == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world.world_size,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        opt.zero_grad()
        x, y = _batch(step, world.rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=directory)


def start_from(world, directory, run_dir, mode):
    import ddpkit

    torch.manual_seed(99)  # other weights than the checkpoint's
    ddp = ddpkit.DataParallel(_small(), shard=mode)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    with ddpkit.Run(run_dir, model=ddp, optimizer=opt, init_from=directory) as run:
        weights = {k: v.clone() for k, v in ddp.module.state_dict().items()}
        if mode == "none":
            names = [n for n, _ in ddp.module.named_parameters()]
            moments = {names[i]: (0, s["exp_avg"].reshape(-1).clone())
                       for i, s in opt.state_dict()["state"].items()}
        else:
            _, mine = ddp.optimizer_shard_state(opt)
            moments = {n: (a, t.clone()) for n, entries in mine["pieces"].items()
                       for a, _, key, t in entries if key == "exp_avg"}
        opt.zero_grad()
        x, y = _batch(7, world.rank)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        run.step_done()
    trained = any(not torch.equal(v, weights[k]) for k, v in ddp.module.state_dict().items())
    return weights, moments, run.initialized_from["optimizer"], trained


@pytest.mark.parametrize("writer", ["ddp", "fsdp2"])
def test_a_run_starts_from_a_torch_dcp_checkpoint_at_another_world_size(pools, tmp_path,
                                                                          writer):
    directory = str(tmp_path / writer)
    pools(2).run(save_with_torch, directory, writer)
    dcp_to_torch_save(directory, tmp_path / "one.pt")
    saved = torch.load(tmp_path / "one.pt", weights_only=True)
    for mode in ("none", "gradients"):
        results = pools(3).run(start_from, directory, str(tmp_path / f"run-{mode}"), mode)
        for weights, moments, optimizer_prefix, trained in results:
            assert optimizer_prefix == "optimizer." and trained
            assert weights.keys() == saved["model"].keys()
            assert all(torch.equal(v, saved["model"][k]) for k, v in weights.items())
            assert moments  # every rank got AdamW's moments of what it holds
            for name, (start, flat) in moments.items():
                whole = saved["optimizer"]["state"][name]["exp_avg"].reshape(-1)
                assert torch.equal(flat, whole[start:start + flat.numel()]), (mode, name)


def init_other_model(world, directory, run_dir):
    import ddpkit
    from ddpkit.checkpoint import CheckpointError

    ddp = ddpkit.DataParallel(_small(hidden=80))
    try:
        with ddpkit.Run(run_dir, model=ddp, init_from=directory):
            pass
    except CheckpointError as err:
        return str(err)
    return None


def test_a_checkpoint_of_another_model_is_one_line_naming_what_differs(pools, tmp_path):
    directory = str(tmp_path / "ddp")
    pools(2).run(save_with_torch, directory, "ddp")
    errors = pools(2).run(init_other_model, directory, str(tmp_path / "run"))
    assert errors[0] == errors[1] and "\n" not in errors[0]
    assert f"--init-from {directory} does not match this model (Sequential)" in errors[0]
    assert "0.weight (70, 64) vs model (80, 64)" in errors[0]
    assert "2.weight (5, 70) vs model (5, 80)" in errors[0]


def test_init_from_a_directory_that_is_not_a_checkpoint(tmp_path):
    import ddpkit
    from ddpkit.checkpoint import CheckpointError

    run = ddpkit.Run(tmp_path / "run", model=_mlp(), init_from=tmp_path / "nothing")
    with pytest.raises(CheckpointError, match=r"--init-from .*nothing: no such directory"):
        run.__enter__()
    (tmp_path / "empty").mkdir()
    run = ddpkit.Run(tmp_path / "run2", model=_mlp(), init_from=tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"no \.metadata there, so not a torch"):
        run.__enter__()
    assert not list((tmp_path / "run2" / "checkpoints").glob("step_*"))  # nothing trained


# ------------------------------------------------------------------ through the CLI
INIT_TRAIN = ["--data", "synthetic", "--synthetic-size", "256", "--batch-size", "32",
              "--epochs", "2", "--hidden", "32", "--threads", "1", "--no-progress"]
INIT_JOB = [*INIT_TRAIN, "--nproc-per-node", "2"]


def _train_in_pool(pools, argv: list[str], run_dir) -> None:
    """An uninterrupted run of the job on 2 pooled ranks (no launch: the same bits as a
    launched one, tests/train_reference.py)."""
    from train_reference import train_in_pool

    steps = pools(2).run(train_in_pool, list(argv), str(run_dir), timeout=300)
    assert len(set(steps)) == 1 and steps[0] > 0, steps


@pytest.mark.e2e
def test_a_rerun_of_an_init_from_command_after_a_preemption_continues_its_own_run(pools,
                                                                                 tmp_path):
    """A scheduler reruns the same ``--init-from`` command line after a preemption: the
    run continues from its own checkpoint, never from the init weights again. Between
    the two, the init directory is replaced by another run's weights, so a rerun that
    took them again would end elsewhere than the uninterrupted run. The preempted run and
    its rerun are launches; the runs they are compared with train on the pooled ranks."""
    import signal

    from ddpkit.fault import EXIT_PREEMPTED
    from test_train_fault import (
        _assert_same_params,
        _env,
        _final_params,
        _finish,
        _start,
        _wait_for,
    )

    init, other = tmp_path / "init", tmp_path / "other"
    for run, seed in ((init, "1"), (other, "2")):
        _train_in_pool(pools, [*INIT_TRAIN, "--epochs", "1", "--seed", seed], run)
    options = [*INIT_TRAIN, "--init-from", str(init), "--checkpoint-every-steps", "4"]
    command = [*options, "--nproc-per-node", "2"]
    whole = tmp_path / "whole"
    _train_in_pool(pools, options, whole)

    run = tmp_path / "run"
    proc = _start(*command, "--run-dir", str(run), env=_env(DDPKIT_TEST_SLEEP_AT_STEP="5:*:120"))
    _wait_for("checkpoints/step_000000004/manifest.json", proc, run)
    proc.send_signal(signal.SIGTERM)
    code, text = _finish(proc, timeout=120)
    assert code == EXIT_PREEMPTED, text[-3000:]

    shutil.rmtree(init)
    shutil.copytree(other, init)  # other weights under the same --init-from path
    code, text = _finish(_start(*command, "--run-dir", str(run), env=_env()))
    assert code == 0, text[-3000:]
    assert f"--run-dir {run} holds this run, stopped at step 5: continuing it" in text, text
    assert "resumed at step 5" in text, text[-3000:]
    _assert_same_params(run, whole)
    # The comparison can fail: the same command from the replaced weights ends elsewhere.
    fresh = tmp_path / "fresh"
    _train_in_pool(pools, options, fresh)
    ends, other_end = _final_params(whole), _final_params(fresh)
    assert any(not torch.equal(ends[k], other_end[k]) for k in ends)


@pytest.mark.parametrize("layout", ["torchtitan", "app"])
def test_a_checkpoint_under_other_top_level_names_is_found(tmp_path, layout):
    """torchtitan's step folder (``model.``, ``optimizer.``) and a program that nests
    both under an application key (``app.model.``, ``app.optim.``): the names are found
    by matching the model's parameters, in one process."""
    import ddpkit

    torch.manual_seed(3)
    source = _small()
    opt = torch.optim.AdamW(source.parameters(), lr=0.01)
    F.cross_entropy(source(torch.randn(4, 64)), torch.tensor([0, 1, 2, 3])).backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(source, opt)
    state = ({"model": model_sd, "optimizer": optim_sd} if layout == "torchtitan"
             else {"app": {"model": model_sd, "optim": optim_sd}})
    directory = tmp_path / ("checkpoint/step-1000" if layout == "torchtitan" else "app")
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)

    torch.manual_seed(99)  # other weights than the checkpoint's
    model = _small()
    mine = torch.optim.AdamW(model.parameters(), lr=0.01)
    with ddpkit.Run(tmp_path / "run", model=model, optimizer=mine, init_from=directory) as run:
        prefixes = run.initialized_from
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
    moments = [s["exp_avg"] for s in mine.state_dict()["state"].values()]
    assert moments and all(torch.equal(a, opt.state_dict()["state"][i]["exp_avg"])
                           for i, a in enumerate(moments))
    assert prefixes["optimizer"] == ("optimizer." if layout == "torchtitan" else "app.optim.")
