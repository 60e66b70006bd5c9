"""decide_on_rank0: rank 0's decision or rank 0's error reaches every rank."""

import pytest

from ddpkit.errors import ConfigError


def _decide(world, fail: bool):
    from ddpkit.loop.rank0 import decide_on_rank0

    calls = []

    def decide():
        calls.append(world.rank)
        if fail:
            raise ConfigError(f"refused on rank {world.rank}")
        return f"chosen on rank {world.rank}"

    try:
        value = decide_on_rank0(decide, is_main=world.rank == 0, world_size=world.world_size)
    except ConfigError as err:
        return ("error", str(err), calls)
    return ("value", value, calls)


@pytest.mark.parametrize("fail", [False, True])
def test_every_rank_gets_rank0s_decision_or_its_error(pools, fail):
    results = pools(2).run(_decide, fail)
    kind, text = ("error", "refused on rank 0") if fail else ("value", "chosen on rank 0")
    assert [r[:2] for r in results] == [(kind, text), (kind, text)]
    assert [r[2] for r in results] == [[0], []]  # only rank 0 decides
