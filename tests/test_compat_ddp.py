"""ddpkit.DataParallel as a drop-in for torch's DistributedDataParallel.

Every script in compat_scripts/scripts.py is an ordinary torch DDP program; it runs once
with torch's DistributedDataParallel and once with ddpkit.DataParallel (the one-line
import change), and the final parameters must be torch.equal: on 2 gloo ranks with
ddpkit's defaults; on 3 with torch's bucket layout and backend (``comm="backend",
initial_bucketing="single"``: with three ranks the order of a sum depends on where an
element sits in its bucket, so only the same layout gives the same bits), and with the
defaults within float32 rounding. Misuses raise torch's exception types under both.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from compat_scripts import scripts
from ddpkit.errors import DdpkitError

TORCH_LAYOUT = {"comm": "backend", "initial_bucketing": "single"}


def run_scripts(world, names, options=None):
    out = {}
    ddp = functools.partial(ddpkit.DataParallel, **(options or {}))
    for name in names:
        theirs = scripts.SCRIPTS[name](DistributedDataParallel)
        ours = scripts.SCRIPTS[name](ddp)
        same_keys = sorted(theirs) == sorted(ours)
        diff = max(((theirs[k].double() - ours[k].double()).abs().max().item()
                    for k in theirs if k in ours and theirs[k].numel()), default=0.0)
        equal = same_keys and all(torch.equal(theirs[k], ours[k]) for k in theirs)
        out[name] = (equal, same_keys, diff, ours)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_ddp_scripts_give_bit_identical_parameters(pools, world_size):
    options = TORCH_LAYOUT if world_size > 2 else None
    # every script twice per rank: allow for a loaded machine (seconds when quiet)
    results = pools(world_size).run(run_scripts, sorted(scripts.SCRIPTS), options, timeout=300)
    for name in scripts.SCRIPTS:
        for rank, per_rank in enumerate(results):
            equal, same_keys, diff, _ = per_rank[name]
            assert same_keys, f"{name}: state_dict keys differ between engines"
            assert equal, f"{name} rank {rank}: parameters differ from torch DDP's by {diff}"
        # ...and the two replicas' parameters agree (BatchNorm running statistics do
        # not: each rank updates them with its own last batch, under torch DDP too).
        ours0 = results[0][name][3]
        params = [k for k in ours0 if "running_" not in k and "num_batches" not in k]
        for other in results[1:]:
            assert all(torch.equal(ours0[k], other[name][3][k]) for k in params), (
                f"{name}: replicas differ")


# Adam divides by the root of a running mean of squared gradients: where that is near
# zero, a last-bit difference in the gradient moves the weight by up to the learning rate.
ADAM_AMPLIFIED = {"gpt_tied_weights": 1e-3}


def test_torch_ddp_scripts_at_three_ranks_with_defaults_agree_to_rounding(pools):
    results = pools(3).run(run_scripts, sorted(scripts.SCRIPTS), timeout=300)
    for rank, per_rank in enumerate(results):
        assert sorted(per_rank) == sorted(scripts.SCRIPTS), rank
        for name, (_, same_keys, diff, _) in per_rank.items():
            assert same_keys, f"{name}: state_dict keys differ between engines"
            bound = ADAM_AMPLIFIED.get(name, 1e-6)
            assert diff < bound, f"{name} rank {rank}: differs from torch DDP's by {diff}"


def _one_line_error(fn) -> str:
    try:
        fn()
    except DdpkitError as exc:
        return str(exc)
    return "no error"


def run_bad_arguments(world):
    net = nn.Linear(4, 2)
    return {
        "device_ids=[3]": _one_line_error(lambda: ddpkit.DataParallel(net, device_ids=[3])),
        "device_ids=[0, 1]": _one_line_error(lambda: ddpkit.DataParallel(net, [0, 1])),
        "output_device": _one_line_error(lambda: ddpkit.DataParallel(net, output_device=0)),
        "device_mesh": _one_line_error(lambda: ddpkit.DataParallel(net, device_mesh=object())),
        "mixed_precision": _one_line_error(
            lambda: ddpkit.DataParallel(net, mixed_precision=object())),
        "two groups": _one_line_error(lambda: ddpkit.DataParallel(
            net, process_group=torch.distributed.group.WORLD, group=object())),
    }


def test_torch_arguments_ddpkit_cannot_honour_are_one_line_errors(pools):
    messages = pools(2).run(run_bad_arguments)[0]
    expected_words = {
        "device_ids=[3]": "module is on cpu",
        "device_ids=[0, 1]": "one device per process",
        "output_device": "device_ids",
        "device_mesh": "process_group=",
        "mixed_precision": "autocast",
        "two groups": "same option",
    }
    for case, words in expected_words.items():
        message = messages[case]
        assert words in message, f"{case}: {message}"
        assert "\n" not in message, f"{case}: not one line: {message!r}"


def run_accepted_arguments(world):
    """torch's arguments ddpkit honours: every one of them, positionally and by keyword."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model = ddpkit.DataParallel(
        net, None, None, 0, False, True, None, 1.0, True, False, True, True,
        None, None, None, None, False, None, False, None, comm_hook=None)
    ok = (model.module is net and model.broadcast_buffers is False
          and model.find_unused_parameters and model.device_ids is None)
    keyword = ddpkit.DataParallel(nn.Linear(4, 2), device_ids=None,
                                  forward_sync_buffers=False, init_sync=False,
                                  process_group=torch.distributed.group.WORLD)
    on_its_device = ddpkit.DataParallel(nn.Linear(4, 2), device_ids=[torch.device("cpu")])
    return ok and keyword.broadcast_buffers is False and on_its_device.device_ids is not None


def test_torch_constructor_arguments_are_accepted(pools):
    assert pools(2).run(run_accepted_arguments) == [True, True]


def run_checkpoint_between_engines(world, tmp):
    torch.manual_seed(0)
    theirs = DistributedDataParallel(scripts.TinyGPT())
    torch.manual_seed(1)
    ours = ddpkit.DataParallel(scripts.TinyGPT())
    path = f"{tmp}/torch-{world.rank}.pt"
    torch.save(theirs.state_dict(), path)
    ours.load_state_dict(torch.load(path))
    loaded = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    # ...and back: ddpkit's checkpoint into a fresh torch DDP model.
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(1.0)
    path = f"{tmp}/ddpkit-{world.rank}.pt"
    torch.save(ours.state_dict(), path)
    theirs.load_state_dict(torch.load(path))
    back = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    keys_match = list(ours.state_dict()) == list(theirs.state_dict())
    return loaded, back, keys_match, next(iter(ours.state_dict()))


def test_checkpoints_load_across_engines(pools, tmp_path):
    for loaded, back, keys_match, first_key in pools(2).run(
            run_checkpoint_between_engines, str(tmp_path)):
        assert keys_match and first_key.startswith("module."), first_key
        assert loaded, "torch DDP's state_dict did not load into ddpkit.DataParallel"
        assert back, "ddpkit's state_dict did not load into torch DDP"


def test_a_differing_run_is_detected(pools):
    """The comparison can fail: another initialization under ddpkit is caught."""
    assert pools(2).run(run_scripts_with_other_seed, "accumulate_no_sync") == [False, False]


def run_scripts_with_other_seed(world, name):
    theirs = scripts.SCRIPTS[name](DistributedDataParallel)
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(),
                        nn.Linear(32, 4))
    ours = ddpkit.DataParallel(net).state_dict()
    return all(torch.equal(theirs[k], ours[k]) for k in theirs)


def run_compiled(world):
    theirs = scripts.compiled(DistributedDataParallel)
    ours = scripts.compiled(ddpkit.DataParallel)
    diff = max((theirs[k] - ours[k]).abs().max().item() for k in theirs)
    return sorted(theirs) == sorted(ours), diff, ours


def run_pickle_names(world):
    """The classes and functions of ddpkit a pickled DataParallel names (found while
    loading it: each is a path torch.load must find), and whether the copy trains."""
    import io
    import pickle

    import ddpkit
    from ddpkit.parallel.hooks import allreduce_hook

    named = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("ddpkit"):
                named.add(f"{module}.{name}")
            return super().find_class(module, name)

    torch.manual_seed(0)
    model = ddpkit.DataParallel(nn.Linear(4, 2), comm_hook=allreduce_hook)
    loaded = Recording(io.BytesIO(pickle.dumps(model))).load()
    loaded(torch.ones(3, 4)).sum().backward()
    trained = all(p.grad is not None for p in loaded.parameters())
    return sorted(named), trained, loaded.reducer.comm_hook is allreduce_hook


def test_a_pickle_names_only_dataparallel_and_the_hook_it_was_given(pools):
    """torch.save(model) stores class paths: only DataParallel's (ddpkit.parallel.ddp) and
    the given hook's, so the engine's own modules can move without breaking a pickle."""
    for named, trained, hooked in pools(2).run(run_pickle_names):
        assert named == ["ddpkit.parallel.ddp.DataParallel",
                         "ddpkit.parallel.hooks.allreduce_hook"], named
        assert trained and hooked


def test_torch_compile_of_the_wrapped_model_trains_like_torch_ddp(pools):
    """torch.compile(DataParallel(net)) compiles net's forward and runs the engine eagerly.

    Not bit-identical: in torch 2.13 compiling torch's DDP graph-breaks inside its forward
    and runs the module eagerly, while ddpkit's wrapped module runs inductor's fused
    kernels, which round differently (measured: 1.5e-8 after 3 steps).
    """
    results = pools(2).run(run_compiled, timeout=300)
    for same_keys, diff, _ in results:
        assert same_keys
        assert diff < 1e-6, f"compiled ddpkit model differs from torch DDP's by {diff}"
    ours0, ours1 = results[0][2], results[1][2]
    assert all(torch.equal(ours0[k], ours1[k]) for k in ours0), "compiled replicas differ"


def run_comm_hook_misuse(world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = ddpkit.DataParallel(nn.Linear(4, 2))
    not_callable = _one_line_error(lambda: model.register_comm_hook(None, "allreduce"))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    twice = _one_line_error(lambda: model.register_comm_hook(None, default_hooks.allreduce_hook))
    return not_callable, twice


def test_register_comm_hook_misuse_is_one_line(pools):
    not_callable, twice = pools(2).run(run_comm_hook_misuse)[0]
    assert "must be callable" in not_callable
    assert "only be called once" in twice


def _bf16_hook_under_another_name(state, bucket):
    """torch's bf16_compress_hook itself, called through a function of another name."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def run_bf16_compress_hook(world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    try:
        DistributedDataParallel(nn.Linear(4, 2)).register_comm_hook(
            None, default_hooks.bf16_compress_hook)
        torch_refusal = None
    except TypeError as exc:
        torch_refusal = str(exc)
    theirs = scripts._with_hook(DistributedDataParallel,
                                lambda: (None, _bf16_hook_under_another_name))
    ours = scripts._with_hook(ddpkit.DataParallel,
                              lambda: (None, default_hooks.bf16_compress_hook))
    ours_renamed = scripts._with_hook(ddpkit.DataParallel,
                                      lambda: (None, _bf16_hook_under_another_name))
    fp32 = scripts._with_hook(ddpkit.DataParallel, lambda: (None, default_hooks.allreduce_hook))
    return (torch_refusal,
            all(torch.equal(theirs[k], ours[k]) for k in theirs),
            all(torch.equal(ours[k], ours_renamed[k]) for k in ours),
            any(not torch.equal(ours[k], fp32[k]) for k in ours))


def test_bf16_compress_hook_runs_and_agrees_with_torch_ddp_running_the_same_hook(pools):
    """torch DDP refuses ``register_comm_hook(state, bf16_compress_hook)`` on a build
    without CUDA 11+/NCCL 2.10+ (this CPU build), whatever the backend: the check is on
    the hook's *name* (torch/nn/parallel/distributed.py, _check_comm_hook). gloo reduces
    bfloat16 fine, and the same hook called under another name runs under torch DDP on
    gloo: ddpkit runs torch's hook as registered and ends bit-identical to that run."""
    for refusal, same_as_torch, name_irrelevant, compressed in pools(2).run(
            run_bf16_compress_hook):
        if torch.cuda.is_available():  # a CUDA build with NCCL >= 2.10 accepts it
            assert refusal is None, refusal
        else:
            assert refusal is not None and "BF16" in refusal, refusal
        assert same_as_torch, "ddpkit with bf16_compress_hook differs from torch DDP's run"
        assert name_irrelevant
        assert compressed, "bf16 hook gave float32 all-reduce's result: did it compress?"


def run_join_with_a_plain_optimizer(world):
    from torch.distributed.algorithms.join import Join

    errors = []
    for DDP in (DistributedDataParallel, ddpkit.DataParallel):
        model = DDP(nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            with Join([model, opt]):
                model(torch.ones(1, 4)).sum().backward()
            errors.append(None)
        except Exception as exc:  # what torch's Join raises, compared between engines
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def test_join_with_a_plain_optimizer_is_refused_by_torch_join_under_both_engines(pools):
    """torch's Join takes Joinable objects only (a model, a ZeroRedundancyOptimizer);
    a plain optimizer is refused by Join itself, the same way under both engines."""
    for theirs, ours in pools(2).run(run_join_with_a_plain_optimizer):
        assert theirs is not None and "join_hook" in theirs, theirs
        assert ours == theirs


def _raised(fn, *args) -> tuple[list[str], str] | None:
    """(the builtin exception types what ``fn(*args)`` raised is an instance of, most
    specific first; its message), or None."""
    try:
        fn(*args)
    except Exception as exc:  # the types are what is compared between engines
        return ([t.__name__ for t in type(exc).__mro__ if t.__module__ == "builtins"],
                str(exc))
    return None


def _unused_without_flag(DDP):
    model = DDP(scripts._Branchy())
    for step in range(2):  # torch raises at the second forward, ddpkit at the first backward
        x, y = scripts._batch(step)
        torch.nn.functional.cross_entropy(model(x, use_b=False), y).backward()


def _hook_twice(DDP):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DDP(nn.Linear(4, 2))
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model.register_comm_hook(None, default_hooks.allreduce_hook)


def _static_graph_after_training(DDP):
    model = DDP(nn.Linear(4, 2))
    model(torch.ones(1, 4)).sum().backward()
    model._set_static_graph()


def _pickle_on_a_subgroup(DDP, group):
    import pickle

    pickle.dumps(DDP(nn.Linear(4, 2), process_group=group))


def _join_throws_on_early_termination(DDP):
    import torch.distributed as dist

    # The ranks raise at different points of the protocol (by design: the program is
    # meant to end), so their collectives no longer pair up: the case gets a group of its
    # own, and the cases after it start on groups that never saw the mismatch.
    group = dist.new_group(list(range(dist.get_world_size())))
    model = DDP(nn.Linear(4, 2), process_group=group)
    with model.join(throw_on_early_termination=True):
        for _ in range(1 + (torch.distributed.get_rank() > 0)):
            model(torch.ones(1, 4)).sum().backward()


def run_misuses(world):
    """Each misuse under torch's class and ddpkit's: what each raised."""
    import torch.distributed as dist

    subgroup = dist.new_group(list(range(world.world_size)))
    frozen = nn.Linear(4, 2).requires_grad_(False)
    cases = {
        "no parameters": lambda DDP: DDP(nn.Module()),
        "no parameter requires grad": lambda DDP: DDP(frozen),
        "device_ids on a CPU module": lambda DDP: DDP(nn.Linear(4, 2), device_ids=[0]),
        "uninitialized (lazy) parameters": lambda DDP: DDP(nn.LazyLinear(2)),
        "SyncBatchNorm on CPU": lambda DDP: DDP(nn.Sequential(nn.Linear(4, 4),
                                                             nn.SyncBatchNorm(4))),
        "comm hook not callable": lambda DDP: DDP(nn.Linear(4, 2)).register_comm_hook(None, 3),
        "comm hook twice": _hook_twice,
        "unused parameter without find_unused_parameters": _unused_without_flag,
        "_set_static_graph after training": _static_graph_after_training,
        "logging sample rate 0":
            lambda DDP: DDP(nn.Linear(4, 2))._set_ddp_runtime_logging_sample_rate(0),
        "pickle a model on a subgroup": lambda DDP: _pickle_on_a_subgroup(DDP, subgroup),
        "join throw_on_early_termination": _join_throws_on_early_termination,
    }
    return {case: (_raised(make, DistributedDataParallel), _raised(make, ddpkit.DataParallel))
            for case, make in cases.items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_misuse_raises_torchs_exception_type_with_ddpkits_message(pools, world_size):
    for rank, per_case in enumerate(pools(world_size).run(run_misuses)):
        for case, (theirs, ours) in per_case.items():
            assert theirs is not None, f"{case}: torch DDP raised nothing on rank {rank}"
            assert ours is not None, f"{case}: ddpkit raised nothing on rank {rank}"
            # what torch raised, ddpkit's error is too (a program's except clause catches it)
            assert theirs[0][0] in ours[0], f"{case}: torch raised {theirs}, ddpkit {ours}"
            assert "\n" not in ours[1], f"{case}: not one line: {ours[1]!r}"


def _surface(DDP) -> dict:
    """What a script sees of a wrapped model besides training: compared between engines."""
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    model = DDP(inner)
    facts = {"module is the wrapped model": model.module is inner,
             "state_dict keys": list(model.state_dict()),
             "named_parameters": [n for n, _ in model.named_parameters()],
             "named_buffers": [n for n, _ in model.named_buffers()],
             "named_children": [n for n, _ in model.named_children()],
             "load_state_dict": str(DDP(copy_of(inner)).load_state_dict(model.state_dict()))}
    returned = [model.eval() is model, model.training, inner[2].training,
                model.train() is model, inner[2].training, model.train(False) is model,
                model.to(torch.float32) is model, model.cpu() is model, model.float() is model]
    facts["train/eval/to return the wrapper and reach the module"] = returned
    model.train()
    with torch.no_grad():
        facts["no_grad forward output requires grad"] = model(torch.ones(2, 4)).requires_grad
    seen = []
    model.register_forward_hook(lambda *_: seen.append("wrapper"))
    inner.register_forward_hook(lambda *_: seen.append("module"))
    model(torch.ones(2, 4)).sum().backward()
    facts["forward hooks"] = seen
    facts["grads after zero_grad"] = (model.zero_grad(), [p.grad for p in model.parameters()])
    try:
        model.weight  # noqa: B018 (a module's attribute is reached through .module)
        facts["wrapper attribute of the module"] = "no error"
    except AttributeError:
        facts["wrapper attribute of the module"] = "AttributeError"
    state = model.state_dict()
    consume_prefix_in_state_dict_if_present(state, "module.")
    facts["unwrapped state dict loads into the plain model"] = str(
        copy_of(inner).load_state_dict(state))
    facts["attributes"] = [
        model.require_forward_param_sync, model.require_backward_grad_sync,
        model.find_unused_parameters, model.gradient_as_bucket_view, model.static_graph,
        model.dim, model.broadcast_bucket_size, model.bucket_bytes_cap, model.device_ids,
        model.output_device, model.device_type, str(model.device),
        model.is_multi_device_module, len(model.modules_buffers), model.parameters_to_ignore,
        model.will_sync_module_buffers(), model.process_group is torch.distributed.group.WORLD]
    return facts


def copy_of(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def run_surface(world):
    return _surface(DistributedDataParallel), _surface(ddpkit.DataParallel)


def test_what_a_script_sees_besides_training_is_torchs(pools):
    for theirs, ours in pools(2).run(run_surface):
        for fact, value in theirs.items():
            assert ours[fact] == value, f"{fact}: torch {value!r}, ddpkit {ours[fact]!r}"
