"""Benchmark harnesses (application layer), run by ``ddpkit bench``: ``collective_timing``
(``ddpkit bench collectives``: the bus-bandwidth sweep) and ``shm`` (``ddpkit bench shm``).
They measure the library from outside; the library never imports them."""
