"""The exit codes a ddpkit process ends with, beside 0 and 2 (a user error), in one place
so that the launcher, which never imports torch, and the workers read the same numbers.
Where one exists, the code is sysexits.h's for the same situation."""

EXIT_DIVERGED = 65  # EX_DATAERR: the numbers went bad, not the machine
EXIT_HOST_LOST = 69  # EX_UNAVAILABLE: this host lost the job (or the job lost its store)
EXIT_DISK_FULL = 74  # EX_IOERR: a restart cannot fix it, freeing space can
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by a preemption signal, try again
EXIT_PEER_LOST = 76  # a worker that only lost a peer to a change of hosts
EXIT_HANG = 124  # the hang watchdog's, as timeout(1) ends a command that ran too long
