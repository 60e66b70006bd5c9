"""Step time, page faults and peak RSS of a DDP step with 64 MiB gradients, under the
heap setting ddpkit gives CPU ranks (ddpkit/launcher/worker_heap.py) or glibc's defaults.

Run it under a launcher, the setting on and off:

    DDPKIT_SYSTEM_MALLOC=1 ddpkit launch --nproc-per-node 2 benchmarks/heap_setting_memory.py
    ddpkit launch --nproc-per-node 2 benchmarks/heap_setting_memory.py          # variables
    torchrun --standalone --nproc-per-node 2 benchmarks/heap_setting_memory.py   # mallopt

Rank 0 prints one line: the median step, the faults of the last step, and its resident
memory now and at its peak.
"""

import os
import resource
import time

import torch
import torch.distributed as dist
from torch import nn

import ddpkit


def resident_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = ddpkit.DataParallel(nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, faults = [], 0
    for _ in range(12):
        x = torch.randn(32, 4096)
        start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if dist.get_rank() == 0:
        steady = sorted(times[2:])
        setting = sorted(k for k in os.environ if k.startswith("MALLOC_")) or "none in env"
        print(f"MALLOC_ variables: {setting}; median step {steady[len(steady) // 2] * 1e3:.0f} ms, "
              f"faults in the last step {faults}, resident {resident_mib()} MiB, peak "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10} MiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
