"""ddpkit.runtime.lifetime: ddpkit keeps no process group alive, closes what it built on a group
when the group dies, and lets go of groups torch's own function defaults captured.

In-process groups of one (HashStore); tests/test_clean_exit.py checks whole programs.
"""

from __future__ import annotations

import os
import sys
import threading
import types
import weakref

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.runtime import lifetime


def thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended while we looked
            pass
    return names


def group_threads() -> int:
    return sum(n.startswith(("pt_gloo_runloop", "gloo_tcp_loop")) for n in thread_names())


def test_per_group_entries_go_with_their_group(clean_env):
    dropped = []
    cache = lifetime.PerGroup(on_drop=dropped.append)
    with ddpkit.distributed():
        sub = dist.new_group([0])
        cache.set(None, "default")
        cache.set(sub, "sub")
        assert cache.get(None) == "default" and cache.get(sub) == "sub"
        assert sorted(cache.values()) == ["default", "sub"]
        world = weakref.ref(dist.group.WORLD)
        del sub
    assert world() is None, "something still holds the destroyed default group"
    assert sorted(dropped) == ["default", "sub"]
    assert cache.values() == []


def test_per_group_pop_hands_the_entry_over_without_dropping_it(clean_env):
    dropped = []
    cache = lifetime.PerGroup(on_drop=dropped.append)
    with ddpkit.distributed():
        cache.set(None, "default")
        assert cache.pop(None) == "default"
        assert cache.pop(None, "gone") == "gone" and None not in cache
    assert dropped == [], "a popped entry belongs to the caller: on_drop must not run"


def test_groups_and_lanes_are_gone_after_shutdown(clean_env):
    before = group_threads()
    with ddpkit.distributed():
        t = torch.ones(8)
        ddpkit.comm.all_reduce(t, algo="ring", async_op=True).wait()  # starts a lane
        assert "ddpkit-comm-lane" in {th.name for th in threading.enumerate()}
        assert group_threads() > before
    assert group_threads() == before
    assert "ddpkit-comm-lane" not in {th.name for th in threading.enumerate()}


def test_a_group_captured_by_a_torch_default_argument_is_let_go(clean_env):
    # What torch.distributed.nn.functional does when imported after init: ``group=WORLD``
    # evaluated once, at import.
    name = "torch.distributed._captures_world_for_test"
    with ddpkit.distributed():
        module = types.ModuleType(name)
        exec("import torch.distributed as dist\n"
             "def all_reduce(t, group=dist.group.WORLD):\n    return group\n", module.__dict__)
        sys.modules[name] = module
        world = weakref.ref(dist.group.WORLD)
    try:
        assert world() is None, "the captured default group outlived shutdown"
        assert module.all_reduce(None) is None  # None: the default group, to torch's API
    finally:
        del sys.modules[name]


def test_no_python_tls_takes_autograd_context_out_inside_backward():
    seen = []
    p = torch.nn.Parameter(torch.ones(3))

    def hook(_):
        seen.append(torch._C._is_key_in_tls("context"))
        with lifetime.no_python_tls():
            seen.append(torch._C._is_key_in_tls("context"))
        seen.append(torch._C._is_key_in_tls("context"))

    p.register_post_accumulate_grad_hook(hook)
    (p * 2).sum().backward()
    assert seen == [True, False, True]
    with lifetime.no_python_tls():  # outside backward there is nothing to take out
        assert not torch._C._is_key_in_tls("context")
