"""One training process: ``python -m ddpkit.train.worker [train options]``.

``ddpkit train`` starts this on every rank with the already resolved configuration;
it also runs directly under any launcher, e.g.
``torchrun --nproc-per-node 2 -m ddpkit.train.worker --epochs 5``.
The entry is wrapped with torch.distributed.elastic's ``@record``, so a crash lands in
torchrun's error file and its summary names the failing rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ddpkit.errors import DdpkitError
from ddpkit.train.config import Config


def run_worker(cfg: Config) -> int:
    """Join the job's process group, train, always tear down."""
    import torch.distributed as dist

    from ddpkit.runtime import distributed
    from ddpkit.train.trainer import Trainer

    with distributed() as world:
        Trainer(cfg, world).fit()
        # Leave together: a rank that tears down gloo while rank 0 still writes the
        # summary and plot can abort in gloo's destructor.
        dist.barrier()
    return 0


def parse(argv: list[str] | None) -> Config:
    from ddpkit.commands.train import add_train_options, config_from_args

    p = argparse.ArgumentParser(prog="python -m ddpkit.train.worker")
    add_train_options(p)
    p.add_argument("--resolved-config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resolved_config is not None:
        return Config.from_dict(json.loads(args.resolved_config), source="ddpkit train").validate()
    return config_from_args(args)


@record
def main(argv: list[str] | None = None) -> int:
    try:
        return run_worker(parse(argv))
    except DdpkitError as err:
        # Every rank hits the same user error: one line per node is enough.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"ddpkit train: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
