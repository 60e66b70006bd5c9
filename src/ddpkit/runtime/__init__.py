"""A process's runtime in a job: where it stands and how its process group lives and ends.

``world.py`` reads the process's place (ranks, sizes, devices) from whichever launcher
started it, and ``topology.py`` tables that mapping for a planned job;
``process_group.py`` is ``ddpkit.init``/``shutdown``/``distributed``, the one idempotent
start and the one teardown of the process group; ``lifetime.py`` makes sure nothing
ddpkit built outlives its group and no group outlives the program; ``process_exit.py``
ends a process that succeeded without the interpreter's slow finalization;
``launcher_link.py`` ties a worker's life to its launcher's (a worker dies with it, a
final failure is not restarted); ``spawn.py`` is ``ddpkit.spawn`` for N local processes;
``torch_target.py`` names the torch release ddpkit's reliance on torch internals was
checked on. Library packages build on these; nothing here imports the library.
"""
