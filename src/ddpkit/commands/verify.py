"""``ddpkit verify [train options]``: do W processes take the same steps as one?

Runs a few training steps on W ranks (launched like ``ddpkit train``), replays the same
global batches in one plain process, and prints the largest parameter difference with
PASS/FAIL against a dtype-aware tolerance. Exit code 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ddpkit.commands.launch import options_from_args
from ddpkit.launcher.torchrun_args import add_launch_options
from ddpkit.train.options import (
    NOT_FOR_VERIFY,
    add_train_options,
    add_verify_options,
    config_from_args,
)

WORKER_MODULE = "ddpkit.train.equivalence"

DESCRIPTION = """\
Do W processes train exactly like one? Takes --steps training steps on W ranks (launched
like ddpkit train, with the same training options), replays the same global batches in
one plain PyTorch process from the same initial weights, and prints the largest
parameter difference and PASS or FAIL against a tolerance that scales with the dtype's
epsilon. Exit status 0 on PASS, 1 on FAIL.
"""


def register(sub) -> None:
    p = sub.add_parser("verify", help="check W processes train exactly like 1 process",
                       description=DESCRIPTION)
    add_train_options(p, exclude=tuple(NOT_FOR_VERIFY))
    p.not_taken = NOT_FOR_VERIFY  # a one-line answer instead of "unrecognized arguments"
    add_verify_options(p)
    add_launch_options(p, leave_out=("--max-restarts",))  # a verification is not resumed
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ddpkit.errors import ConfigError
    from ddpkit.launcher.launch import launch
    from ddpkit.runtime.world import World
    from ddpkit.train.equivalence import VerifyResult, check_plain_steps, run_from_args
    from ddpkit.train.prelaunch import check_data, check_world_size, quiet_omp_warning

    # Only who started this process matters here, not its devices (which need torch).
    if World.from_env(require_master_addr=False, accelerator="cpu",
                      device_count=0).source != "single":
        from ddpkit.runtime.process_exit import exit_process

        # One worker of a job some launcher started; it ends as every worker does.
        exit_process(run_from_args(args))
    cfg = config_from_args(args)
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    opts = options_from_args(args)
    check_world_size(cfg, opts)
    check_data(cfg)
    check_plain_steps(cfg)
    opts.module = True
    opts.plain_terminal = True  # a person reads this terminal (ddpkit.launcher.launch)
    quiet_omp_warning(opts)
    with tempfile.TemporaryDirectory(prefix="ddpkit-verify-") as tmp:
        result_file = Path(tmp, "result.json")
        code = launch(WORKER_MODULE, [
            "--resolved-config", json.dumps(cfg.to_dict()), "--steps", str(args.steps),
            "--dtype", args.dtype, "--result-file", str(result_file),
        ], opts)
        if code != 0:
            return code
        if not result_file.exists():  # another node's agent ran rank 0
            print("ddpkit verify: rank 0 ran on another node; its report is there")
            return 0
        result = VerifyResult(**json.loads(result_file.read_text()))
    print(result.render())
    return 0 if result.passed else 1
