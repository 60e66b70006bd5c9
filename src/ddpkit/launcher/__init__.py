"""How ddpkit starts the processes of a job, and what each process it starts is given.

``launch.py`` is ``ddpkit launch`` (and the launcher of ``ddpkit train``): torchrun's
elastic agent, with the command line read by torchrun's own parser
(``torchrun_args.py``) and ddpkit's defaults; ``console.py`` owns the launcher's
terminal (every rank's output prefixed, rank 0's progress drawn); ``failure_report.py``
names the rank whose failure caused a failed launch; ``script_runner.py`` runs a user's
program on each rank exactly as ``python script.py`` would; ``engine_choice.py`` reads
``DDPKIT_ENGINE`` at every interpreter's start (``ddpkit-engine.pth``) and makes torch's
DDP ddpkit's when asked; ``worker_heap.py`` is the heap setting every CPU worker gets;
``slurm_script.py`` writes the sbatch scripts of ``ddpkit slurm``. Nothing here is
imported at a package's import: this file stays empty so that the ``.pth`` line and the
launcher import only the module they name.
"""
