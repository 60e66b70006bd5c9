"""DataParallel(shard="optimizer" | "gradients" | "parameters"): ZeRO-1/2/3 against the
unsharded engine.

* ordinary torch code (AdamW with parameter groups chosen by name from
  ``model.named_parameters()``, ``loss.backward()``, ``opt.step()``, ``no_sync``
  accumulation) gives weights torch.equal to ``shard="none"``
  with the same comm, at W = 2 and 3, on shared memory and on the backend, with buckets
  large enough for the shm reduce-scatter's own path and small ones;
* the optimizer holds 1/W of the state; ``model.parameters()`` are this rank's pieces
  of the module's parameters, named after them;
* ``clip_grad_norm_`` over shards equals torch's on the full gradients;
* ``state_dict()`` is the full module's; ``load_state_dict`` of it takes effect;
* a checkpoint of a sharded run (one file per rank) resumes at another world size with
  the same weights as an unsharded run resumed the same way;
* mistakes are one ConfigError line;
* an optimizer state written in the per-bucket format still loads.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.errors import ConfigError

MODES = ("none", "optimizer", "gradients", "parameters")


def _mlp():
    # 64*700 floats = 175 KiB: above the shm one-barrier size, so the reduce-scatter runs
    # its own chunked path; the biases and the last layer make small buckets too
    return nn.Sequential(nn.Linear(64, 700), nn.ReLU(), nn.Linear(700, 40), nn.ReLU(),
                         nn.Linear(40, 5))


def _batch(step, rank, n=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 64, generator=g), torch.randint(0, 5, (n,), generator=g)


def _adamw(ddp):
    # torch's usual parameter groups, chosen by name: no weight decay on biases
    named = list(ddp.named_parameters())
    return torch.optim.AdamW([
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.05},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
        lr=0.01)


def _train(world, mode, comm, steps=3, accumulate=False, clip=None, bucket_cap_mb=0.1):
    from ddpkit.parallel import DataParallel

    torch.manual_seed(7)
    model = _mlp()
    ddp = DataParallel(model, shard=mode, comm=comm, bucket_cap_mb=bucket_cap_mb)
    opt = _adamw(ddp)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        if accumulate:
            with ddp.no_sync():
                x, y = _batch(100 + step, world.rank)
                F.cross_entropy(ddp(x), y).backward()
        x, y = _batch(step, world.rank)
        F.cross_entropy(ddp(x), y).backward()
        if clip is not None:
            norms.append(float(ddp.clip_grad_norm_(clip)))
        opt.step()
    return ddp, opt, norms


def run_modes(world, comm, accumulate, clip):
    out = {}
    for mode in MODES:
        ddp, opt, norms = _train(world, mode, comm, accumulate=accumulate, clip=clip)
        state = ddp.state_dict()
        out[mode] = {
            "keys": list(state),
            "state": [v.clone() for v in state.values()],
            "state_bytes": ddp.optimizer_state_bytes(opt),
            "param_numel": sum(p.numel() for p in ddp.parameters()),
            "module_numel": sum(p.numel() for p in ddp.module.parameters()),
            "names": [n for n, _ in ddp.named_parameters()],
            "spans": ddp.shard_spans(),
            "sizes": {n: p.numel() for n, p in ddp.module.named_parameters()},
            "norms": norms,
            "transport": ddp.comm,
        }
    return out


@pytest.mark.parametrize("world_size,comm", [(2, "auto"), (3, "auto"), (2, "backend"),
                                             (3, "backend")])
def test_sharded_training_is_bit_identical_to_unsharded(pools, world_size, comm):
    results = pools(world_size).run(run_modes, comm, True, None)
    for rank, r in enumerate(results):
        if comm == "auto":
            assert r["none"]["transport"] == "shm"
        for mode in ("optimizer", "gradients", "parameters"):
            assert r[mode]["keys"] == r["none"]["keys"]  # torch's names, full tensors
            assert all(torch.equal(a, b) for a, b in zip(r[mode]["state"], r["none"]["state"])), \
                f"W={world_size} comm={comm} rank {rank}: shard={mode} differs from none"
            # this rank's shard of the weights and of AdamW's state, not all of it
            total = r[mode]["module_numel"]
            assert r[mode]["param_numel"] < total / world_size + 64
            assert r[mode]["state_bytes"] < r["none"]["state_bytes"] / world_size + 1024
            # named after the module parameters they are cut from
            assert r[mode]["names"] and set(r[mode]["names"]) <= set(r["none"]["names"])
        assert all(torch.equal(a, b) for a, b in zip(r["none"]["state"],
                                                     results[0]["none"]["state"]))
    assert sum(r["gradients"]["param_numel"] for r in results) == results[0]["none"]["param_numel"]
    # shard_spans: the ranks' pieces of each parameter tile it, without gap or overlap
    assert all(r["none"]["spans"] == {} for r in results)
    for mode in ("optimizer", "gradients", "parameters"):
        for name, size in results[0][mode]["sizes"].items():
            cut = sorted(r[mode]["spans"][name] for r in results if name in r[mode]["spans"])
            assert cut[0][0] == 0 and cut[-1][1] == size, (mode, name, cut)
            assert all(a[1] == b[0] for a, b in zip(cut, cut[1:])), (mode, name, cut)


def test_clip_grad_norm_over_shards_matches_torch(pools):
    results = pools(2).run(run_modes, "auto", False, 0.05)
    for r in results:
        # the module holds the full gradients under "optimizer": torch's own clip, same bits
        assert all(torch.equal(a, b) for a, b in zip(r["optimizer"]["state"], r["none"]["state"]))
        assert r["optimizer"]["norms"] == r["none"]["norms"]
        # over shards the norm is summed in another grouping: equal within rounding
        for mode in ("gradients", "parameters"):
            assert len(r[mode]["norms"]) == len(r["none"]["norms"]) > 0, mode
            assert len(r[mode]["state"]) == len(r["none"]["state"]) > 0, mode
            for a, b in zip(r[mode]["norms"], r["none"]["norms"]):
                assert abs(a - b) <= 1e-5 * b
            for a, b in zip(r[mode]["state"], r["none"]["state"]):
                assert float((a - b).abs().max()) < 1e-5
        assert r["parameters"]["norms"] == r["gradients"]["norms"]
        assert min(r["none"]["norms"]) > 0.05  # the clip did act


def run_state_dict_round_trip(world, mode):
    from ddpkit.parallel import DataParallel

    ddp, opt, _ = _train(world, mode, "auto", steps=2)
    saved = {k: v.clone() for k, v in ddp.state_dict().items()}
    torch.manual_seed(99)  # other initial weights, replaced by the load
    other = DataParallel(_mlp(), shard=mode, bucket_cap_mb=0.1)
    other.load_state_dict(saved)
    x, _ = _batch(5, 0)
    with torch.no_grad():
        same_output = torch.equal(other(x), ddp(x))
    # a step after the load starts from the loaded weights on both
    for model in (ddp, other):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _batch(6, world.rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    same_step = all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(),
                                                       other.state_dict().values()))
    return same_output, same_step, len(saved)


@pytest.mark.parametrize("mode", ["gradients", "parameters"])
def test_state_dict_is_the_full_module_and_loads_back(pools, mode):
    assert pools(2).run(run_state_dict_round_trip, mode) == [(True, True, 6)] * 2


# -- checkpoints: DCP, one file per rank, resumed at another world size ----------------------

def run_save(world, directory, mode):
    from ddpkit.checkpoint import Checkpointer, collect_state

    ddp, opt, _ = _train(world, mode, "auto", steps=2)
    ckpt = Checkpointer(directory)
    path = ckpt.save(collect_state(model=ddp, optimizer=opt, step=2), 2)
    return sorted(p.name for p in path.iterdir()), _rank_chunks(path)


def _rank_chunks(path):
    """For each moment of each parameter: how many chunks DCP's metadata holds, and in
    how many files (ranks) they lie."""
    from ddpkit.checkpoint.dcp_files import read_metadata

    md = read_metadata(path)
    files = {}
    for index, info in md.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    return {k: (len(v.chunks), len(files[k])) for k, v in md.state_dict_metadata.items()
            if k.startswith("optimizer.state.") and k.endswith(".exp_avg")}


def run_resume(world, directory, mode):
    from ddpkit.checkpoint import Checkpointer, restore_state
    from ddpkit.parallel import DataParallel

    torch.manual_seed(5)
    ddp = DataParallel(_mlp(), shard=mode, bucket_cap_mb=0.1)
    opt = _adamw(ddp)
    restore_state(Checkpointer(directory).load_latest(), model=ddp, optimizer=opt)
    for step in range(2, 4):
        opt.zero_grad()
        x, y = _batch(step, world.rank)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [v.clone() for v in ddp.state_dict().values()]


@pytest.mark.parametrize("saved_at,resumed_at,saved,resumed", [
    (2, 3, "gradients", "optimizer"), (3, 2, "gradients", "optimizer"),
    (2, 3, "parameters", "parameters"), (3, 2, "optimizer", "parameters")])
def test_sharded_checkpoint_resumes_at_another_world_size(pools, tmp_path, saved_at,
                                                          resumed_at, saved, resumed):
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    pools(saved_at).run(run_save, str(plain), "none")
    files, chunks = pools(saved_at).run(run_save, str(sharded), saved)[0]
    assert files == [".metadata", *[f"__{r}_0.distcp" for r in range(saved_at)],
                     "manifest.json", "run.pt"]
    # Each rank wrote the pieces it owns, at their offsets: a parameter cut between
    # ranks has chunks in several files.
    assert max(n_files for _, n_files in chunks.values()) > 1, chunks
    expected = pools(resumed_at).run(run_resume, str(plain), "none")
    got = pools(resumed_at).run(run_resume, str(sharded), resumed)
    for a, b in zip(got, expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def run_corrupt_shard_falls_back(world, directory):
    from pathlib import Path

    from ddpkit.checkpoint import Checkpointer, collect_state

    ddp, opt, _ = _train(world, "optimizer", "auto", steps=1)
    ckpt = Checkpointer(directory)
    ckpt.save(collect_state(model=ddp, optimizer=opt, step=1), 1)
    ckpt.save(collect_state(model=ddp, optimizer=opt, step=2), 2)
    world_barrier()
    if world.rank == 0:
        shard = Path(directory) / "step_000000002" / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    world_barrier()
    state = ckpt.load_latest()
    return state["step"]


def world_barrier():
    import torch.distributed as dist

    dist.barrier()


def test_a_corrupt_rank_file_falls_back_to_the_previous_checkpoint(pools, tmp_path):
    assert pools(2).run(run_corrupt_shard_falls_back, str(tmp_path)) == [1, 1]


# -- mistakes ------------------------------------------------------------------------------

def run_mistakes(world):
    from ddpkit.parallel import DataParallel, hooks

    errors = {}
    for name, kwargs in (("bad", {"shard": "params"}),
                         ("hook", {"shard": "optimizer", "comm_hook": hooks.allreduce_hook})):
        try:
            DataParallel(_mlp(), **kwargs)
        except ConfigError as err:
            errors[name] = str(err)
    try:
        DataParallel(_mlp(), shard="optimizer" if world.rank == 0 else "none")
    except ConfigError as err:
        errors["differs"] = str(err)
    return errors


def test_mistakes_are_one_line(pools):
    for errors in pools(2).run(run_mistakes):
        assert ("shard must be one of none, optimizer, gradients, parameters, got 'params'"
                in errors["bad"])
        assert "comm hook needs shard='none'" in errors["hook"]
        assert "rank 0: 'optimizer', rank 1: 'none'" in errors["differs"]


def test_torch_engine_refuses_shard():
    from ddpkit.parallel import data_parallel

    with pytest.raises(ConfigError, match="ddpkit engine option"):
        data_parallel(copy.deepcopy(_mlp()), engine="torch", shard="gradients")


# -- ddpkit.Run: a user's loop over a sharded model --------------------------------------

def run_loop(world, directory, mode, steps):
    from ddpkit.loop import Run
    from ddpkit.parallel import DataParallel

    torch.manual_seed(5)
    ddp = DataParallel(_mlp(), shard=mode, bucket_cap_mb=0.1)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    with Run(directory, model=ddp, optimizer=opt, log_every=1) as run:
        started = run.step
        while run.step < steps:
            opt.zero_grad()
            x, y = _batch(run.step, world.rank)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            run.step_done(loss=loss)
        run.save("manual")
    return started, [v.clone() for v in ddp.state_dict().values()]


@pytest.mark.parametrize("mode", ["optimizer", "gradients", "parameters"])
def test_run_resumes_a_sharded_loop_at_another_world_size(pools, tmp_path, mode):
    import json

    plain, sharded = str(tmp_path / "plain"), str(tmp_path / "sharded")
    pools(2).run(run_loop, plain, "none", 2)
    pools(2).run(run_loop, sharded, mode, 2)
    expected = pools(3).run(run_loop, plain, "none", 4)
    got = pools(3).run(run_loop, sharded, mode, 4)
    for (start_a, a), (start_b, b) in zip(got, expected):
        assert start_a == start_b == 2  # resumed, not restarted
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    text = (tmp_path / "sharded" / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert [len(r["rank_peak_rss_mib"]) for r in records] == [2, 2, 3, 3]


def run_resume_into_other_kind(world, directory, mode):
    from ddpkit.checkpoint import CheckpointError

    try:
        run_resume(world, directory, mode)
    except CheckpointError as err:
        return str(err)
    return None


def test_unsharded_and_sharded_checkpoints_continue_either_way(pools, tmp_path):
    plain, sharded = str(tmp_path / "plain"), str(tmp_path / "sharded")
    pools(2).run(run_save, plain, "none")
    pools(2).run(run_save, sharded, "optimizer")
    expected = pools(2).run(run_resume, plain, "none")
    got = pools(2).run(run_resume, plain, "gradients")
    for a, b in zip(got, expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    into_plain = pools(2).run(run_resume_into_other_kind, sharded, "none")
    assert into_plain == [None, None]  # DCP reads the pieces back into whole tensors
    for a, b in zip(pools(2).run(run_resume, sharded, "none"), expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- the optimizer-state format written before one parameter per piece --------------------

def run_per_bucket_format_loads(world):
    from ddpkit.parallel import DataParallel

    ddp, opt, _ = _train(world, "gradients", "auto", steps=2)
    common, part = ddp.optimizer_shard_state(opt)
    names, bucket_of = ddp.reducer.names, ddp.reducer.bucket_of
    # format 1 kept the values that do not run along a shard (AdamW's step) per bucket
    old_common = {**common, "format": "ddpkit-sharded-optimizer/1"}
    old_part = {**part, "scalars": {bucket_of[names.index(name)]: values
                                    for name, values in part["scalars"].items()}}
    loaded = {}
    for label, (c, p) in (("new", (common, part)), ("old", (old_common, old_part))):
        torch.manual_seed(99)
        other = DataParallel(_mlp(), shard="gradients", bucket_cap_mb=0.1)
        other_opt = _adamw(other)
        other.load_optimizer_shards(other_opt, c, [p])
        loaded[label] = other_opt.state_dict()["state"]
    same = loaded["new"].keys() == loaded["old"].keys() == opt.state_dict()["state"].keys()
    for index, state in loaded["new"].items():
        for key, value in state.items():
            same = same and torch.equal(value, loaded["old"][index][key])
    return same, len(loaded["new"])


def test_a_per_bucket_optimizer_state_still_loads(pools):
    for same, stepped in pools(2).run(run_per_bucket_format_loads):
        assert same and stepped >= 2


# -- a rank that owns no element ------------------------------------------------------------

def run_tiny(world, mode, directory, steps):
    from ddpkit.checkpoint import Checkpointer, collect_state, restore_state
    from ddpkit.parallel import DataParallel

    torch.manual_seed(1)
    # 6 floats: the cut is cache-line aligned (16 floats), so one rank owns all of them
    ddp = DataParallel(nn.Linear(2, 2), shard=mode)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.1)
    ckpt = Checkpointer(directory)
    start = 0
    if ckpt.load_latest() is not None:
        start = restore_state(ckpt.load_latest(), model=ddp, optimizer=opt)["step"]
    for step in range(start, steps):
        g = torch.Generator().manual_seed(10 * step + world.rank)
        opt.zero_grad()
        ddp(torch.randn(4, 2, generator=g)).square().sum().backward()
        opt.step()
    ckpt.save(collect_state(model=ddp, optimizer=opt, step=steps), steps)
    return sum(p.numel() for p in ddp.parameters()), [v.clone() for v in
                                                       ddp.state_dict().values()]


def test_a_rank_that_owns_nothing_still_trains_saves_and_resumes(pools, tmp_path):
    plain, sharded = str(tmp_path / "plain"), str(tmp_path / "sharded")
    pools(3).run(run_tiny, "none", plain, 2)
    owned = pools(3).run(run_tiny, "gradients", sharded, 2)
    assert sorted(n for n, _ in owned) == [0, 0, 6]
    expected = pools(2).run(run_tiny, "none", plain, 4)
    got = pools(2).run(run_tiny, "parameters", sharded, 4)
    for (_, a), (_, b) in zip(got, expected):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
