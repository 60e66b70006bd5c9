"""ddpkit's asynchronous collectives (a background lane per group, on the default group
and on a subgroup made by ddpkit.comm.new_group), left to the interpreter's exit: no
teardown."""
import torch
import torch.distributed as dist

import ddpkit


def main() -> None:
    dist.init_process_group("gloo")
    pair = ddpkit.comm.new_group([0, 1])
    t = torch.full((100_000,), float(dist.get_rank() + 1))
    handles = [ddpkit.comm.all_reduce(t, algo="ring", async_op=True)]
    if dist.get_rank() in (0, 1):
        handles.append(ddpkit.comm.all_reduce(t.clone(), algo="ring", group=pair,
                                              async_op=True))
    for h in handles:
        h.wait()


if __name__ == "__main__":
    main()
