"""examples/30_sync_sgd_mnist.py: the distributed tutorial's synchronous SGD trains on digits."""

import importlib.util
import os

from conftest import ROOT


def _run_example(world, epochs):
    path = os.path.join(ROOT, "examples", "30_sync_sgd_mnist.py")
    spec = importlib.util.spec_from_file_location("sync_sgd_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    train_set, bsz = module.partition_dataset(None)
    losses = module.run(world.rank, world.world_size, None, epochs)
    return losses, bsz, len(train_set.dataset)


def test_sync_sgd_example_partitions_and_learns(pools):
    results = pools(2).run(_run_example, 3)
    for losses, bsz, shard in results:
        assert bsz == 64 and shard == 719  # 1438 digits split in two, global batch 128
        assert losses[-1] < 0.5 * losses[0]
    assert results[0][0] != results[1][0], "each rank reports the loss of its own shard"
