"""torchrun's command line, read by torchrun's own parser, with ddpkit's defaults.

``ddpkit launch`` accepts every ``torchrun`` command line with torchrun's meaning: the
grammar is ``torch.distributed.run.get_args_parser()`` itself (both spellings of every
flag, ``PET_*`` environment defaults, ``-m``, ``--no-python``, ``--run-path``, ...), so
it cannot drift from the installed torch. Where the user gave a flag (or its ``PET_*``
variable) torchrun's meaning holds. Where they did not, ddpkit's defaults differ in
these places only:

* ``--nproc-per-node``: one process per accelerator, or 2 on CPU (torchrun: 1);
* ``--tee 3`` (torchrun: 0): every line a worker prints is prefixed ``[<role><local
  rank>]:``; not when ``--redirects`` is given (its output goes to files then);
* ``--rdzv-endpoint`` without ``--rdzv-backend`` and without ``--node-rank`` means c10d
  (torchrun: static, under which every node would claim node rank 0).

Mistakes that torchrun reports as a traceback from deep inside (``--nproc-per-node
gpu`` without a GPU, ``--nnodes 4:2``, a malformed ``--rdzv-conf``) become one
:class:`ConfigError` line here, before any process starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import NoReturn

from ddpkit.errors import ConfigError
from ddpkit.help_text import plain

# dest -> ddpkit's value where neither the flag nor its PET_* variable was given.
# None means "decided from the other arguments" (see apply_defaults).
DDPKIT_DEFAULTS = {
    "nproc_per_node": None,
    "tee": None,
    "redirects": "0",
    "rdzv_backend": None,
}
# Flags whose presence changes a decision above; their torchrun defaults are restored
# after parsing.
_WATCHED = ("node_rank", "master_addr")
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")

# The launch options that `ddpkit train` and `ddpkit verify` take, declared once: torchrun's
# flags, under both of torchrun's spellings and with torchrun's meaning (tests check them
# against torchrun's parser, which `ddpkit launch` reads these and every other torchrun
# flag with). Declared here rather than copied from torch's parser at start-up: building
# that parser imports torch, seconds before any command could say a word.
# flag -> argparse settings of train/verify.
LAUNCH_OPTIONS: dict[str, dict] = {
    "--nproc-per-node": dict(
        type=int, default=None, metavar="N",
        help="processes on this node (default: one per GPU, or 2 on CPU)"),
    "--nnodes": dict(default="1", metavar="N|MIN:MAX",
                     help="number of nodes, or MIN:MAX for elastic"),
    "--node-rank": dict(
        type=int, default=None,
        help="this node's rank (static rendezvous) (default: given by the rendezvous)"),
    "--rdzv-endpoint": dict(
        default=None, metavar="HOST:PORT",
        help="HOST:PORT of the rendezvous (multi-node): c10d's on the first node, or the "
             "etcd server (default: none, one node)"),
    "--rdzv-id": dict(default="ddpkit", help="job id shared by all nodes"),
    "--rdzv-backend": dict(
        choices=("c10d", "etcd-v2"), default="c10d",
        help="c10d: the rendezvous store lives on the first node, so the job cannot "
             "outlive it; etcd-v2: --rdzv-endpoint is an etcd server (v2 API, python-etcd "
             "client), any node may be lost"),
    "--rdzv-conf": dict(
        default="", metavar="KEY=VALUE,...",
        help="torchrun's rendezvous settings, e.g. keep_alive_interval=2,"
             "keep_alive_max_attempt=5 (default: none; several nodes: docs/multinode.md "
             "gives ddpkit's detection defaults)"),
    "--max-restarts": dict(type=int, default=0, metavar="K",
                           help="restart all workers up to K times when one fails"),
    "--local-addr": dict(
        default=None,
        help="address other nodes reach this node by (default: the source address of "
             "the route to --rdzv-endpoint)"),
}


def torchrun_spellings(flag: str) -> tuple[str, ...]:
    """torchrun accepts every flag as ``--a-b`` and ``--a_b``."""
    return tuple(dict.fromkeys((flag, "--" + flag[2:].replace("-", "_"))))


def add_launch_options(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()) -> None:
    """LAUNCH_OPTIONS (less ``leave_out``) as a "launch" group of ``parser``."""
    group = parser.add_argument_group("launch (torchrun's options; docs/multinode.md)")
    for flag, settings in LAUNCH_OPTIONS.items():
        if flag not in leave_out:
            group.add_argument(*torchrun_spellings(flag), **settings)


def _one_line_error(message: str) -> NoReturn:
    if message.startswith("unrecognized arguments"):
        message += " (not a torchrun option; `ddpkit launch --help` lists them)"
    elif message.startswith("the following arguments are required"):
        message = "no script given: ddpkit launch [torchrun options] SCRIPT [ARGS ...]"
    raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """torch.distributed.run's parser as ``ddpkit launch``: errors are one ConfigError line."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ddpkit launch"
    parser.description = (
        "Run a script on every rank under torchrun's elastic agent. Accepts every torchrun "
        "command line with its meaning; where a flag is not given ddpkit uses: one process "
        "per GPU (2 on CPU), output prefixed per rank (--tee 3), a free rendezvous port, "
        "c10d when only --rdzv-endpoint is given. See docs/multinode.md.")
    parser.error = _one_line_error  # argparse's usage block + exit 2 would bypass the CLI
    for action in parser._actions:  # torch's help is written for its reST docs
        if action.help:
            action.help = plain(action.help)
    add_engine_option(parser)
    return parser


def add_engine_option(parser: argparse.ArgumentParser) -> None:
    """ddpkit's one option of its own: what torch's DistributedDataParallel and CPU
    collectives are in the workers (DDPKIT_ENGINE, which sets its default)."""
    from ddpkit.launcher.engine_choice import engine_from_env
    from ddpkit.vocabulary import ENGINES

    parser.add_argument(
        "--engine", choices=ENGINES, default=engine_from_env() or "ddpkit",
        help="ddpkit: in every worker torch's DistributedDataParallel is ddpkit's engine (for "
             "CPU modules) and torch.distributed's CPU collectives are ddpkit's; torch: "
             "torch's own (default: $DDPKIT_ENGINE, else ddpkit; docs/frameworks.md)")


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse a torchrun command line; apply ddpkit's defaults; validate. Records the flags
    given explicitly in ``args.ddpkit_given``."""
    parser = build_parser()
    torch_defaults = {a.dest: a.default for a in parser._actions}
    unset = {dest: None for dest in (*DDPKIT_DEFAULTS, *_WATCHED)
             if f"PET_{dest.upper()}" not in os.environ}
    parser.set_defaults(**unset)
    args = parser.parse_args(argv)
    given = {dest for dest in unset if getattr(args, dest) is not None}
    given |= {dest for dest in (*DDPKIT_DEFAULTS, *_WATCHED) if dest not in unset}  # PET_*
    args.ddpkit_given = frozenset(given)
    for dest in _WATCHED:
        if getattr(args, dest) is None:
            setattr(args, dest, torch_defaults[dest])
    apply_defaults(args)
    validate(args)
    return args


def apply_defaults(args: argparse.Namespace) -> None:
    given = args.ddpkit_given
    if "nproc_per_node" not in given:
        args.nproc_per_node = str(default_nproc())
    if "tee" not in given:
        args.tee = "0" if "redirects" in given else "3"
    for dest in ("redirects",):
        if dest not in given:
            setattr(args, dest, DDPKIT_DEFAULTS[dest])
    if "rdzv_backend" not in given:
        static = not args.rdzv_endpoint or "node_rank" in given
        args.rdzv_backend = "static" if static else "c10d"


def cpu_only_torch() -> bool:
    """True when the installed torch is a build without any accelerator (its version.py
    names no CUDA, ROCm or XPU, and this is not macOS with MPS): then the device count is
    known without importing torch, which costs the launcher more than a second."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec("torch")
    if sys.platform == "darwin" or spec is None or not spec.submodule_search_locations:
        return False
    version_py = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(version_py) as fh:
            values: dict = {}
            exec(compile(fh.read(), version_py, "exec"), values)  # torch's own constants
    except (OSError, SyntaxError, ImportError):
        return False
    return all(values.get(k, "missing") is None for k in ("cuda", "hip", "xpu"))


def default_nproc() -> int:
    if cpu_only_torch():
        return 2
    import torch

    if torch.accelerator.is_available():
        return torch.accelerator.device_count()
    return 2


def check_nproc(nproc: int) -> None:
    if not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"--nproc-per-node must be a positive integer, got {nproc!r}")
    if cpu_only_torch():
        return
    import torch

    if torch.accelerator.is_available():
        found = torch.accelerator.device_count()
        kind = torch.accelerator.current_accelerator().type.upper()
        if nproc > found:
            raise ConfigError(
                f"--nproc-per-node {nproc} requires at least {nproc} {kind}s, found {found}"
            )


def check_nproc_word(value: str) -> None:
    """``--nproc-per-node`` as torchrun reads it: N, or a device word torch resolves."""
    import torch

    try:
        number = int(value)
    except ValueError:
        number = None
    if number is not None:
        check_nproc(number)
        return
    custom = torch._C._get_privateuse1_backend_name()
    if value not in (*_NPROC_WORDS, custom):
        raise ConfigError(f"--nproc-per-node {value!r} is not a positive integer or one of "
                          f"{', '.join(_NPROC_WORDS)}")
    if value == "gpu" and not torch.cuda.is_available():
        raise ConfigError("--nproc-per-node gpu: this machine has no usable CUDA GPU "
                          "(torch.cuda.is_available() is False); give a number of "
                          "processes, or `auto` (one per accelerator, else one per CPU)")
    if value == "xpu" and not torch.xpu.is_available():
        raise ConfigError("--nproc-per-node xpu: this machine has no usable XPU; give a "
                          "number of processes, or `auto`")


def nnodes_range(nnodes: str) -> tuple[int, int]:
    """(min, max) of ``--nnodes N`` or ``MIN:MAX``; ConfigError when malformed."""
    parts = nnodes.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low = high = 0
    if not 0 < low <= high:
        raise ConfigError(f"--nnodes {nnodes!r} is not N or MIN:MAX with 0 < MIN <= MAX "
                          "(e.g. 2, or 1:4 for an elastic job)")
    return low, high


def validate(args: argparse.Namespace) -> None:
    """What torchrun would only find out with a traceback, or after starting workers."""
    from torch.distributed.elastic.multiprocessing import Std
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    check_nproc_word(args.nproc_per_node)
    _, max_nodes = nnodes_range(args.nnodes)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.monitor_interval <= 0:
        raise ConfigError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    for flag, value in (("--redirects", args.redirects), ("--tee", args.tee)):
        try:
            Std.from_str(value)
        except ValueError:
            raise ConfigError(f"{flag} {value!r} is not 0-3 or LOCAL_RANK:0-3,... (0 none, "
                              "1 stdout, 2 stderr, 3 both)") from None
    if args.local_ranks_filter:
        ranks = args.local_ranks_filter.split(",")
        if not all(r.strip().isdigit() for r in ranks):
            raise ConfigError(f"--local-ranks-filter {args.local_ranks_filter!r} is not a "
                              "comma-separated list of local ranks (e.g. 0,1)")
    if args.rdzv_backend in ("etcd", "etcd-v2"):
        import importlib.util

        if importlib.util.find_spec("etcd") is None:
            raise ConfigError(f"--rdzv-backend {args.rdzv_backend} needs the python-etcd "
                              "client: pip install python-etcd")
    try:
        _parse_rendezvous_config(args.rdzv_conf)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {args.rdzv_conf!r} is not KEY=VALUE,KEY=VALUE "
                          "(e.g. timeout=900,is_host=1)") from None
    if (max_nodes > 1 and not args.standalone and args.rdzv_backend == "static"
            and not args.rdzv_endpoint and "master_addr" not in args.ddpkit_given
            and args.master_port is None):
        # torchrun would wait at 127.0.0.1:29500 on every node.
        raise ConfigError(
            f"--nnodes {args.nnodes} needs the first node's address: --rdzv-endpoint "
            "HOST:PORT (c10d rendezvous), or --master-addr HOST --master-port PORT "
            "--node-rank R (static)")
    check_program(args)


def check_program(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.run_path or not (args.module or args.no_python):
        if not os.path.isfile(script):
            raise ConfigError(f"script {script!r} does not exist; give the path of a Python file")
    elif args.module and args.no_python:
        raise ConfigError("--module and --no-python: give one (-m runs `python -m SCRIPT`, "
                          "--no-python runs SCRIPT as an executable)")
    elif args.no_python and shutil.which(script) is None:
        raise ConfigError(f"--no-python: {script!r} is not an executable file or a "
                          "command on PATH")
