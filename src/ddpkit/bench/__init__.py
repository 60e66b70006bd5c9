"""Benchmark harnesses (application layer): ``collectives`` and ``shm``, run by
``ddpkit bench``. They measure the library from outside; the library never imports them."""
