"""torch's DistributedDataParallel and collectives with ddpkit behind them
(ddpkit/parallel/compat/torch_swap.py, ddpkit/comm/torch_route.py), on the gloo pools: what
``ddpkit launch`` and ``DDPKIT_ENGINE=ddpkit`` give a program."""

from __future__ import annotations

import copy
import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpkit.comm import torch_route
from ddpkit.parallel import DataParallel
from ddpkit.parallel.compat import torch_swap
from ddpkit.parallel.compat.torch_swap import TORCH_DDP


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3))


def _train(model: nn.Module, rank: int, steps: int = 4) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


def run_swapped_engine(world):
    """A model built with torch's name after the swap, next to one built with torch's
    class captured before it."""
    captured = torch.nn.parallel.DistributedDataParallel  # torch's, as frameworks import it
    torch_swap.patch_torch()
    try:
        named = torch.nn.parallel.DistributedDataParallel(_net())
        also = torch.nn.parallel.distributed.DistributedDataParallel(_net())
        reference = TORCH_DDP(_net())
        out = {
            "both_names": type(named) is type(also) is torch_swap.DistributedDataParallel,
            "ddpkit_engine": isinstance(named, DataParallel),
            "isinstance_captured": isinstance(named, captured),
            "isinstance_now": isinstance(named, torch.nn.parallel.DistributedDataParallel),
            "torch_instance_under_new_name": isinstance(
                reference, torch.nn.parallel.DistributedDataParallel),
            "plain_ddpkit_is_not_torchs": not isinstance(DataParallel(_net()), captured),
            "issubclass": issubclass(torch_swap.DistributedDataParallel, captured),
            # torch's private methods would run torch's reducer code on ddpkit's engine
            "private_absent": not hasattr(named, "_pre_forward"),
            "private_refused": _refusal(
                lambda: torch_swap.DistributedDataParallel._post_forward),
            "unwrap": named.module.__class__.__name__,
        }
        ours, theirs = _train(named, world.rank), _train(reference, world.rank)
        out["bit_identical"] = all(torch.equal(a, b) for a, b in zip(ours, theirs))
        copied = copy.deepcopy(named)
        loaded = pickle.loads(pickle.dumps(named))
        out["copies"] = [type(copied) is type(named), type(loaded) is type(named),
                         all(torch.equal(a, b) for a, b in zip(
                             copied.state_dict().values(), named.state_dict().values()))]
        out["keys"] = list(named.state_dict())[:1]
    finally:
        torch_swap.unpatch_torch()
    out["restored"] = (torch.nn.parallel.DistributedDataParallel is TORCH_DDP
                       and dist.all_reduce is torch_route.original("all_reduce"))
    return out


def _raises(fn) -> bool:
    try:
        fn()
    except (RuntimeError, ValueError):
        return True
    return False


def _refusal(fn) -> str:
    try:
        fn()
    except AttributeError as err:
        return str(err)
    return "no error"


def test_torch_names_give_ddpkit_engine_that_is_also_torchs_class(pools):
    for out in pools(2).run(run_swapped_engine):
        assert out["both_names"] and out["ddpkit_engine"], out
        assert out["isinstance_captured"] and out["isinstance_now"], out
        assert out["torch_instance_under_new_name"] and out["issubclass"], out
        assert out["plain_ddpkit_is_not_torchs"], out
        assert out["private_absent"], out
        assert "_post_forward is not part of ddpkit's engine" in out["private_refused"], out
        assert out["unwrap"] == "Sequential" and out["keys"] == ["module.0.weight"], out
        assert out["bit_identical"], "ddpkit's engine under torch's name vs torch's DDP"
        assert out["copies"] == [True, True, True], out
        assert out["restored"], out


def test_a_module_off_the_cpu_keeps_torchs_engine(monkeypatch):
    """Not measured on accelerators yet: the constructor hands such a module to torch's
    class (a meta-device module stands in for a GPU one here)."""
    made = []

    class TorchClass:
        def __init__(self, module, *args, **kwargs):
            made.append((module, args, kwargs))

    monkeypatch.setattr(torch_swap, "TORCH_DDP", TorchClass)
    module = nn.Linear(2, 2, device="meta")
    model = torch_swap.DistributedDataParallel(module, device_ids=None, bucket_cap_mb=5)
    assert isinstance(model, TorchClass) and made == [(module, (), {"device_ids": None,
                                                                      "bucket_cap_mb": 5})]
    cpu_model_ids = torch_swap.DistributedDataParallel.__new__(
        torch_swap.DistributedDataParallel, nn.Linear(2, 2), ["cuda:0"])
    assert isinstance(cpu_model_ids, TorchClass)


class _Subclass(torch_swap.DistributedDataParallel):
    """A framework's or a user's subclass of torch's name (Lightning has one)."""

    def __init__(self, module, **kwargs):
        super().__init__(module, **kwargs)
        self.tag = "own __init__ ran"

    def own_method(self) -> str:
        return f"own method over {type(self).__mro__[2].__module__}"


def run_subclass_off_the_cpu(world, off_cpu: bool):
    """``_Subclass`` built where the device check says the module is off the CPU (faked:
    the check is the only part a CPU machine cannot reach), and trained four steps."""
    real = torch_swap._on_cpu
    if off_cpu:
        torch_swap._on_cpu = lambda module, device_ids: False
    try:
        model = _Subclass(_net())
    finally:
        torch_swap._on_cpu = real
    engines = [k for k in type(model).__mro__ if k in (DataParallel, TORCH_DDP)]
    final = _train(model, world.rank)
    return {"engines": engines, "subclass": isinstance(model, _Subclass),
            "torch_name": isinstance(model, torch.nn.parallel.DistributedDataParallel),
            "tag": model.tag, "method": model.own_method(), "final": final}


def test_a_subclass_off_the_cpu_gets_torchs_engine_like_the_class(pools):
    on_cpu, off_cpu = (pools(2).run(run_subclass_off_the_cpu, off) for off in (False, True))
    for rank in range(2):
        assert on_cpu[rank]["engines"] == [DataParallel, TORCH_DDP]  # ddpkit's engine first
        out = off_cpu[rank]
        assert out["engines"] == [TORCH_DDP], out["engines"]  # torch's alone
        assert out["subclass"] and out["torch_name"]
        assert out["tag"] == "own __init__ ran"
        assert out["method"] == "own method over torch.nn.parallel.distributed"
        # torch's engine averaged the gradients: the ranks (different data) agree
        assert all(torch.equal(a, b) for a, b in zip(out["final"], off_cpu[0]["final"]))


def run_routed_collectives(world):
    r = world.rank
    torch_route.route()
    try:
        before = torch_route.counts()
        out = {}
        x = torch.arange(256, dtype=torch.float32) * (r + 1)
        want = x.clone()
        torch_route.original("all_reduce")(want)
        dist.all_reduce(x)
        out["all_reduce"] = torch.equal(x, want)
        m = torch.full((5,), float(r + 3), dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        out["max"] = m.tolist()
        b = torch.full((4,), float(r), requires_grad=True)  # a leaf that needs grad
        dist.broadcast(b, src=1)
        out["broadcast"] = b.tolist()
        red = torch.full((3,), r + 1, dtype=torch.int64)
        dist.reduce(red, dst=0)
        out["reduce"] = red.tolist()
        dist.barrier()
        objects = [{"from": r}]
        dist.broadcast_object_list(objects, src=0)  # torch's own code calls broadcast
        out["object"] = objects[0]
        routed = {k: v - before.get(k, 0) for k, v in torch_route.counts().items()}
        out["routed"] = routed
        # left to torch: async, ops it does not route (AVG; MAX on complex, which torch refuses),
        # a barrier with a timeout, and ddpkit's own calls
        after = torch_route.counts()
        avg = torch.full((3,), float(r))
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        out["avg"] = avg.tolist()
        work = dist.all_reduce(torch.ones(3), async_op=True)
        work.wait()
        out["async_is_torch_work"] = type(work).__name__
        out["complex_max_refused_by_torch"] = _raises(lambda: dist.all_reduce(
            torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX))
        dist.barrier(timeout=timedelta(seconds=30))
        namespace = {"__name__": "ddpkit.something", "dist": dist, "torch": torch}
        exec("def inner():\n    dist.all_reduce(torch.ones(2))\n", namespace)
        namespace["inner"]()
        out["not_routed"] = {k: v - after.get(k, 0) for k, v in torch_route.counts().items()
                             if v - after.get(k, 0)}
    finally:
        torch_route.restore()
    return out


def test_torchs_collectives_go_through_ddpkit_where_proven_and_to_torch_otherwise(pools):
    results = pools(2).run(run_routed_collectives)
    for r, out in enumerate(results):
        assert out["all_reduce"], out
        assert out["max"] == [4.0] * 5 and out["broadcast"] == [1.0] * 4, out
        assert out["reduce"] == ([3] * 3 if r == 0 else [r + 1] * 3), out
        assert out["object"] == {"from": 0}, out
        # broadcast_object_list: two broadcasts (the sizes, then the bytes)
        assert out["routed"] == {"all_reduce": 2, "broadcast": 3, "reduce": 1,
                                 "barrier": 1}, out
        assert out["async_is_torch_work"] != "CommHandle" and out["not_routed"] == {}, out
        assert out["avg"] == [0.5] * 3, out
        assert out["complex_max_refused_by_torch"], out


@pytest.mark.parametrize("op", [dist.ReduceOp.AVG, dist.ReduceOp.BAND])
def test_ops_that_are_not_routed_go_to_torch(op):
    assert torch_route._reduction(op, torch.float32, "all_reduce") is None
    assert torch_route._reduction(dist.ReduceOp.SUM, torch.int16, "all_reduce") is None
    assert torch_route._reduction(dist.ReduceOp.MAX, torch.complex64, "all_reduce") is None
    assert torch_route._reduction(dist.ReduceOp.SUM, torch.bfloat16, "all_reduce") == "sum"


def run_routed_all_gather(world):
    r, w = world.rank, world.world_size
    torch_route.route()
    try:
        out = {}
        before = torch_route.counts().get("all_gather", 0)
        mine = torch.arange(6, dtype=torch.float64).view(2, 3) + 10 * r
        gathered = [torch.empty(2, 3, dtype=torch.float64) for _ in range(w)]
        dist.all_gather(gathered, mine)
        out["values"] = [t.tolist() for t in gathered]
        # outputs that need grad, and a conjugate view as the input
        leaves = [torch.zeros(2, requires_grad=True) for _ in range(w)]
        dist.all_gather(leaves, torch.full((2,), float(r)))
        out["leaves"] = [t.tolist() for t in leaves]
        z = torch.tensor([1 + 2j, 3 - 1j]) * (r + 1)
        zs = [torch.empty(2, dtype=torch.complex64) for _ in range(w)]
        dist.all_gather(zs, z.conj())
        out["conj"] = all(torch.equal(zs[i], (torch.tensor([1 + 2j, 3 - 1j]) * (i + 1)).conj())
                          for i in range(w))
        objects = [None] * w
        dist.all_gather_object(objects, {"rank": r})  # torch's code calls all_gather
        out["objects"] = objects
        out["routed"] = torch_route.counts().get("all_gather", 0) - before
        # left to torch: a list of the wrong length (torch refuses it), async calls, and
        # ddpkit's own object collectives (inside torch's all_gather_object)
        after = torch_route.counts().get("all_gather", 0)
        out["short_list_refused_by_torch"] = _raises(
            lambda: dist.all_gather([torch.empty(2)], torch.ones(2)))
        dist.all_gather([torch.empty(1) for _ in range(w)], torch.ones(1),
                        async_op=True).wait()
        namespace = {"__name__": "ddpkit.something", "dist": dist, "w": w}
        exec("def inner():\n    dist.all_gather_object([None] * w, 1)\n", namespace)
        namespace["inner"]()
        out["not_routed"] = torch_route.counts().get("all_gather", 0) - after
    finally:
        torch_route.restore()
    return out


def test_torchs_all_gather_goes_through_ddpkit_where_proven_and_to_torch_otherwise(pools):
    for out in pools(2).run(run_routed_all_gather):
        assert out["values"] == [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
                                 [[10.0, 11.0, 12.0], [13.0, 14.0, 15.0]]], out
        assert out["leaves"] == [[0.0, 0.0], [1.0, 1.0]] and out["conj"], out
        assert out["objects"] == [{"rank": 0}, {"rank": 1}], out
        # three lists, then all_gather_object's two (the sizes, then the bytes)
        assert out["routed"] == 5 and out["not_routed"] == 0, out
        assert out["short_list_refused_by_torch"], out
