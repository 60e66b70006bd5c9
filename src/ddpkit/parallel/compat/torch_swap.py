"""torch's ``DistributedDataParallel`` name made ddpkit's engine, for programs that never
write ``DistributedDataParallel(...)`` themselves (HF Trainer, Accelerate, Lightning).

:func:`patch_torch` puts this module's :class:`DistributedDataParallel` behind
``torch.nn.parallel.DistributedDataParallel`` and
``torch.nn.parallel.distributed.DistributedDataParallel`` and routes
``torch.distributed``'s CPU collectives through ddpkit's (:mod:`ddpkit.comm.torch_route`).
``ddpkit launch`` does it in every worker before the program's first line; elsewhere
``DDPKIT_ENGINE=ddpkit`` or one call does (:mod:`ddpkit.launcher.engine_choice`,
docs/frameworks.md).

The class is ddpkit's ``DataParallel`` and a subclass of torch's class, so
``isinstance(model, DistributedDataParallel)`` holds with the name looked up now or
captured before the swap (``from torch.nn.parallel import DistributedDataParallel`` in
torch or a framework), and the frameworks' unwrap helpers find ``.module``. Its surface is
exactly ``DataParallel``'s: torch's private methods, which would run torch's reducer code
on ddpkit's engine, raise ``AttributeError`` (as they do on ``ddpkit.DataParallel``), and
torch's ``__init__``, ``__setstate__`` and ``train`` are not reached through ``super()``.
A module that is not on the CPU keeps torch's own engine: constructing the class then
returns a torch ``DistributedDataParallel``, and ``isinstance`` treats torch's instances
as instances of this class too.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import distributed as torch_distributed

from ddpkit.comm import torch_route
from ddpkit.parallel.ddp import DataParallel

TORCH_DDP = torch_distributed.DistributedDataParallel
# torch's class attributes that stay reachable: torch.compile asks the class (under
# whatever name it imported) for the torch DDP module whose forward is running.
_KEPT = ("_active_ddp_module", "_get_active_ddp_module")
_DESCRIPTORS = (classmethod, staticmethod, property)


class _NotOurs:
    """A torch DDP private method that ddpkit's engine does not have."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        raise AttributeError(
            f"torch DistributedDataParallel's {self.name} is not part of ddpkit's engine "
            "(torch's DistributedDataParallel is ddpkit's here); run with "
            "`ddpkit launch --engine torch` or DDPKIT_ENGINE=torch to use torch's")


def _module_first_namespace() -> dict[str, Any]:
    """What stands between DataParallel and torch's class in the method order: nn.Module's
    version of every name torch's class defines, or :class:`_NotOurs`."""
    namespace: dict[str, Any] = {"__module__": __name__}
    for name, value in vars(TORCH_DDP).items():
        if name in _KEPT or not (callable(value) or isinstance(value, _DESCRIPTORS)):
            continue
        if name.startswith("__") and name not in ("__init__", "__setstate__", "__getstate__"):
            continue
        namespace[name] = vars(nn.Module)[name] if name in vars(nn.Module) else _NotOurs()
    return namespace


_ModuleFirst = type("_ModuleFirst", (nn.Module,), _module_first_namespace())


class _LikeTorchs(type(DataParallel)):
    """``isinstance``/``issubclass`` against the swapped class answer as against torch's
    own class, so torch's instances (a CUDA module's) pass a check under either name."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if cls is DistributedDataParallel:
            return TORCH_DDP in type(obj).__mro__
        return super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub: type) -> bool:
        # by the method order, not abc's: abc asks torch's class's subclasses, this one
        # among them, which would ask torch's class again
        if cls is DistributedDataParallel:
            return TORCH_DDP in getattr(sub, "__mro__", ())
        return super().__subclasscheck__(sub)


def _on_cpu(module: nn.Module, device_ids: Any) -> bool:
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.device.type != "cpu" for t in tensors):
        return False
    return device_ids is None or all(torch.device(d).type == "cpu" for d in device_ids
                                     if not isinstance(d, int))


class _TorchEngineTwin(_LikeTorchs):
    """The metaclass of a subclass's twin: its method order is the subclass's without
    ddpkit's engine classes, so the subclass's own methods (and their ``super()``) run
    over torch's engine."""

    def mro(cls) -> list[type]:
        ours = set(DistributedDataParallel.__mro__) - set(TORCH_DDP.__mro__)
        return [cls, *(k for k in cls.__bases__[0].__mro__ if k not in ours)]


_twins: dict[type, type] = {}


def _torch_engine_twin(cls: type) -> type:
    """A subclass of ``cls`` that is torch's engine underneath (made once per class)."""
    if cls not in _twins:
        _twins[cls] = _TorchEngineTwin(cls.__name__, (cls,), {"__module__": cls.__module__,
                                                              "__qualname__": cls.__qualname__})
    return _twins[cls]


class DistributedDataParallel(DataParallel, _ModuleFirst, TORCH_DDP, metaclass=_LikeTorchs):
    """ddpkit's DataParallel under torch's name (see the module docstring)."""

    def __new__(cls, module: nn.Module | None = None, *args: Any, **kwargs: Any):
        if module is not None and not isinstance(cls, _TorchEngineTwin):
            device_ids = args[0] if args else kwargs.get("device_ids")
            if not _on_cpu(module, device_ids):
                # not measured on accelerators yet: torch's engine there, for a
                # subclass (a framework's, a user's) as for the class itself
                if cls is DistributedDataParallel:
                    return TORCH_DDP(module, *args, **kwargs)
                # an instance of cls: Python then runs its __init__ over torch's
                return object.__new__(_torch_engine_twin(cls))
        return super().__new__(cls)


DistributedDataParallel.__signature__ = inspect.signature(DataParallel)


def patch_torch(*, collectives: bool = True) -> None:
    """Make torch's ``DistributedDataParallel`` ddpkit's engine and, with ``collectives``,
    route torch.distributed's CPU collectives through ddpkit's (idempotent). Call it
    before importing a framework that imports the class by name (Lightning does): one
    that did so already keeps torch's engine, and a warning names it."""
    torch.nn.parallel.DistributedDataParallel = DistributedDataParallel
    torch_distributed.DistributedDataParallel = DistributedDataParallel
    if collectives:
        torch_route.route()
    late = _holders_of_torch_class()
    if late:
        warnings.warn(
            f"{', '.join(late)} imported torch's DistributedDataParallel before "
            "ddpkit.patch_torch() and keep(s) torch's engine; call ddpkit.patch_torch() "
            "before importing them (or start with DDPKIT_ENGINE=ddpkit)", stacklevel=2)


def unpatch_torch() -> None:
    """Give torch's names back torch's class and collectives."""
    torch.nn.parallel.DistributedDataParallel = TORCH_DDP
    torch_distributed.DistributedDataParallel = TORCH_DDP
    torch_route.restore()


def patched() -> bool:
    return torch.nn.parallel.DistributedDataParallel is DistributedDataParallel


def _holders_of_torch_class() -> list[str]:
    """Modules outside torch and ddpkit holding torch's class under a global name (they
    construct torch's engine)."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] in ("torch", "ddpkit"):
            continue
        try:
            values = list(vars(module).values())
        except TypeError:
            continue
        if any(v is TORCH_DDP for v in values):
            found.append(name)
    return sorted(found)
