"""DataParallel(comm=...): which transport "auto" picks, and every choice trains correctly.

* the decision (pure): CPU ranks on one host -> shm, anything on CUDA -> the backend
  (NCCL), and the other layouts;
* W = 2, 3, 4 and every choice: replicas bit-identical across ranks and equal to one
  process on the whole batch (float64, far below verify's tolerance); comm="backend"
  torch.equal to torch DDP; under "auto"/"shm" the buckets live in the shared segment,
  the gradients are views into them and every bucket is summed in place there, all of
  them at the end of backward (the sum runs inline: launched early it overlaps nothing);
* ``verify`` passes with each choice; ``--comm`` is one config field, a bad value is one
  line with exit code 2.
"""

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.parallel.engine import transport
from ddpkit.parallel.engine.transport import choose

COMMS = ("auto", "backend", "ring", "shm")


# -- the decision ---------------------------------------------------------------------------

def test_auto_picks_shm_for_cpu_ranks_on_one_host():
    assert choose("auto", ["cpu"], 4) == "shm"
    assert choose("auto", ["cpu"], 2, same_host=False, max_local=2) == "shm"  # hierarchical


def test_auto_picks_the_backend_for_cuda_and_other_layouts():
    assert choose("auto", ["cuda"], 4) == "backend"  # NCCL
    assert choose("auto", ["cuda"], 8, same_host=True, shm_ok=True) == "backend"
    assert choose("auto", ["cpu", "cuda"], 4) == "backend"
    assert choose("auto", ["cpu"], 1) == "backend"  # nothing to move
    assert choose("auto", ["cpu"], 4, shm_ok=False) == "backend"
    assert choose("auto", ["cpu"], 4, same_host=False, max_local=1) == "backend"


def test_explicit_choices_are_kept_and_bad_ones_refused():
    for comm in ("backend", "ring", "shm"):
        assert choose(comm, ["cpu"], 4) == comm
    with pytest.raises(ConfigError, match="comm must be one of auto, backend, ring, shm"):
        choose("nccl", ["cpu"], 2)


def test_cuda_module_decides_without_any_exchange(monkeypatch):
    def no_exchange(group=None):
        raise AssertionError("a CUDA module must not exchange host layouts")

    monkeypatch.setattr(transport.auto, "layout", no_exchange)
    monkeypatch.setattr(transport.dist, "get_world_size", lambda group=None: 4)
    assert transport.resolve_comm("auto", ["cuda"], None) == "backend"
    assert transport.resolve_comm("shm", ["cpu"], None) == "shm"


# -- training with every choice ---------------------------------------------------------------

def _mlp():
    # one bucket > 64 KiB (summed in place in the segment) and small ones (one barrier)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                         nn.Linear(64, 5))


def _batch(step, n, dtype):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, 32, generator=g).to(dtype), torch.randint(0, 5, (n,), generator=g)


def _count_calls(obj, name):
    calls, original = [], getattr(obj, name)

    def counted(*args):
        calls.append(1)
        return original(*args)

    setattr(obj, name, counted)
    return calls


def _launches_before_the_last_gradient(ddp):
    """Bucket all-reduces the transport was asked for while some gradient of the
    backward had not arrived yet."""
    early, original = [], ddp.transport.all_reduce

    def recorded(buffer):
        if not all(ddp.reducer.ready):
            early.append(1)
        return original(buffer)

    ddp.transport.all_reduce = recorded
    return early


def run_every_comm(world, steps=3, per_rank=3):
    from ddpkit.parallel import DataParallel

    W, r = world.world_size, world.rank
    torch.manual_seed(21)
    base = _mlp().double()
    reference = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(step, per_rank * W, torch.float64)
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    ref = [p.detach().clone() for p in reference.parameters()]

    out = {}
    for comm in COMMS:
        model = copy.deepcopy(base)
        ddp = DataParallel(model, comm=comm, bucket_cap_mb=0.002)
        info = {"transport": ddp.comm}
        through_slots = _count_calls(ddp.transport.comm, "_reduce_through_slots") \
            if ddp.comm == "shm" else []
        early = _launches_before_the_last_gradient(ddp)
        mine = slice(r * per_rank, (r + 1) * per_rank)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            x, y = _batch(step, per_rank * W, torch.float64)
            opt.zero_grad()
            F.cross_entropy(ddp(x[mine]), y[mine]).backward()
            opt.step()
        if ddp.comm == "shm":
            buffers = [b.buffer for b in ddp.reducer.buckets]
            info["buckets_shared"] = all(ddp.transport.holds(b) for b in buffers)
            info["grads_in_buckets"] = all(
                any(b.data_ptr() <= p.grad.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
                    for b in buffers) for p in model.parameters())
            info["through_slots"] = len(through_slots)
            info["early_launches"] = len(early)
            info["sizes"] = [b.numel() * b.element_size() for b in buffers]
        params = [p.detach().clone() for p in model.parameters()]
        info["vs_one_process"] = max(float((a - b).abs().max()) for a, b in zip(params, ref))
        info["params"] = params
        out[comm] = info
    return out


def run_backend_against_torch(world):
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit.parallel import DataParallel

    torch.manual_seed(4)
    base = _mlp()
    ours_model, torch_model = copy.deepcopy(base), copy.deepcopy(base)
    # torch's first-iteration layout (one bucket) so the gloo sums see the same buffers
    ours = DataParallel(ours_model, comm="backend", initial_bucketing="single")
    theirs = DistributedDataParallel(torch_model)
    for model in (ours, theirs):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(3):
            x, y = _batch(step, 4 * world.world_size, torch.float32)
            opt.zero_grad()
            shard = slice(world.rank, None, world.world_size)
            F.cross_entropy(model(x[shard]), y[shard]).backward()
            opt.step()
    return all(torch.equal(a, b) for a, b in zip(ours_model.parameters(), torch_model.parameters()))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_comm_keeps_replicas_identical_and_equals_one_process(pools, world_size):
    results = pools(world_size).run(run_every_comm)
    for comm in COMMS:
        mine = [r[comm] for r in results]
        expected = {"auto": "shm"}.get(comm, comm)
        assert all(m["transport"] == expected for m in mine), (comm, [m["transport"] for m in mine])
        for rank, m in enumerate(mine):
            assert m["vs_one_process"] < 1e-12, f"W={world_size} {comm} rank {rank}: {m}"
            assert all(torch.equal(a, b) for a, b in zip(m["params"], mine[0]["params"])), \
                f"W={world_size} comm={comm}: rank {rank}'s replica differs from rank 0's"
            if expected == "shm":
                assert m["buckets_shared"] and m["grads_in_buckets"], m
                assert m["through_slots"] == 0, "a bucket was copied through the slots"
                # the shm sum runs inline: launched early it would overlap nothing
                assert m["early_launches"] == 0, "a shm bucket was summed mid-backward"
                assert max(m["sizes"]) > 64 * 1024 and min(m["sizes"]) <= 64 * 1024


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_backend_comm_is_bit_identical_to_torch_ddp(pools, world_size):
    assert pools(world_size).run(run_backend_against_torch) == [True] * world_size


def run_fallback_when_the_segment_cannot_be_made(world):
    from ddpkit.comm.shm.communicator import ShmCommunicator
    from ddpkit.errors import CommError
    from ddpkit.parallel import DataParallel

    def refuse(self, tag, size, clean=False):
        raise CommError("no space left (test)")

    saved = ShmCommunicator._shared
    ShmCommunicator._shared = refuse
    try:
        auto = DataParallel(_mlp())
        try:
            DataParallel(_mlp(), comm="shm")
            explicit = None
        except ConfigError as exc:
            explicit = str(exc)
    finally:
        ShmCommunicator._shared = saved
    x, y = _batch(0, 4, torch.float32)
    F.cross_entropy(auto(x), y).backward()
    return auto.comm, explicit


def test_auto_falls_back_to_the_backend_and_explicit_shm_says_why(pools):
    for comm, explicit in pools(2).run(run_fallback_when_the_segment_cannot_be_made):
        assert comm == "backend"
        assert explicit is not None and "comm='shm'" in explicit and "no space left" in explicit


def test_comm_and_comm_hook_conflict_is_refused(pools):
    assert pools(2).run(run_conflicts) == [True, True]


def run_conflicts(world):
    from ddpkit.parallel import DataParallel
    from ddpkit.parallel.hooks import allreduce_hook

    for kwargs in ({"comm": "bogus"}, {"comm": "shm", "comm_hook": allreduce_hook},
                   {"comm": allreduce_hook, "comm_hook": allreduce_hook}):
        with pytest.raises(ConfigError):
            DataParallel(nn.Linear(4, 2), **kwargs)
    hooked = DataParallel(nn.Linear(4, 2), comm=allreduce_hook)
    return hooked.reducer.comm_hook is allreduce_hook and hooked.comm == "backend"


# -- verify and the command line ------------------------------------------------------------

def _verify(world, cfg_dict):
    from ddpkit.train.config import Config
    from ddpkit.train.equivalence import verify

    result = verify(Config.from_dict(cfg_dict), world, steps=6, dtype="float32")
    return None if result is None else result.__dict__


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_verify_passes_with_every_comm(pools, world_size):
    from ddpkit.train.config import resolve

    for comm in COMMS:
        cfg = resolve({"comm": comm, "threads": 1, "batch_size": 120}).to_dict()
        result = pools(world_size).run(_verify, cfg)[0]
        assert result["passed"], (comm, result)
        assert result["max_rank_diff"] == 0.0


def test_comm_is_a_config_field_with_its_flag():
    from ddpkit.train.config import resolve

    assert resolve({}).train.comm == "auto"
    assert resolve({"comm": "shm"}).train.comm == "shm"
    with pytest.raises(ConfigError, match="--comm 'nccl' is not one of auto, backend, ring, shm"):
        resolve({"comm": "nccl"})


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["train", "verify"])
def test_bad_comm_is_one_line_exit_2(command):
    proc = subprocess.run([sys.executable, "-m", "ddpkit.cli", command, "--comm", "nccl"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == [f"ddpkit {command}: error: --comm 'nccl' is not one of auto, backend, "
                     "ring, shm"], lines


# -- every mode is one reducer and one transport, each the whole interface ------------------

def _protocol_members(protocol) -> dict[str, object]:
    """The members a Protocol names (its own and its Protocol bases'): name -> the
    Protocol's function (None for a data member)."""
    members: dict[str, object] = {}
    for base in reversed(protocol.__mro__):
        if not getattr(base, "_is_protocol", False) or base.__name__ == "Protocol":
            continue
        members.update(dict.fromkeys(getattr(base, "__annotations__", {})))
        for name, value in vars(base).items():
            if not name.startswith("_"):
                members[name] = value if callable(value) else None
    return members


def _missing(obj, protocol) -> list[str]:
    """What ``obj`` lacks of ``protocol``: absent members, and methods whose parameters
    are not the Protocol's."""
    import inspect

    missing = []
    for name, declared in _protocol_members(protocol).items():
        if not hasattr(obj, name):
            missing.append(name)
        elif declared is not None:
            want = list(inspect.signature(declared).parameters)[1:]
            got = list(inspect.signature(getattr(obj, name)).parameters)
            if got != want:
                missing.append(f"{name}{tuple(got)} != {tuple(want)}")
    return missing


def _interfaces(world):
    import ddpkit
    from ddpkit.parallel.engine.interfaces import Reducer, ShardingTransport, Transport

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))

    models = {f"comm={c}": ddpkit.DataParallel(net(), comm=c) for c in COMMS}
    models["shard=gradients"] = ddpkit.DataParallel(net(), shard="gradients")
    models["copy"] = copy.deepcopy(models["comm=auto"])  # a lazy transport
    try:
        models["exact"] = ddpkit.DataParallel(net(), exact=True, slices=2)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(1)
    out = {}
    for name, model in models.items():
        wants = [(model.reducer, Reducer),
                 (model.transport, ShardingTransport if "shard" in name else Transport)]
        out[name] = {"missing": [f"{type(o).__name__}.{m}" for o, p in wants
                                 for m in _missing(o, p)],
                     "apart": model.reducer is not model.transport,
                     "comm": model.comm}
    return out


def test_every_mode_is_a_whole_reducer_and_a_whole_transport(pools):
    for res in pools(2).run(_interfaces):
        for name, found in res.items():
            assert found["missing"] == [] and found["apart"], (name, found)
        assert res["exact"]["comm"] == res["comm=auto"]["comm"] == "shm"


def test_the_member_check_sees_a_missing_member():
    from ddpkit.parallel.engine.interfaces import Transport

    class Partial:
        name, reduces_inline = "x", True

        def allocate(self, numel, dtype, device): ...

        def all_reduce(self, buffer, extra): ...

    assert _missing(Partial(), Transport) == [
        "all_reduce('buffer', 'extra') != ('buffer',)", "broadcast", "sum_", "close"]
