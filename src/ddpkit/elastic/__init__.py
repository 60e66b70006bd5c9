"""Who is in a job that spans hosts: the rendezvous, and membership as hosts come and go.

``rendezvous.py`` sets up torchrun's rendezvous (stores that listen only where they
must, a first node that answers); ``membership.py`` is the agent's rule for an elastic
job (``--nnodes MIN:MAX``): which hosts are alive, when a lost host is declared dead and
a new one admitted, on top of torch's dynamic rendezvous; ``host_lease.py`` stops a
host's workers once it has lost contact with the others for too long;
``host_change.py`` is the workers' side (where training stands, one line when the hosts
changed); ``writer_fence.py`` lets only the newest generation of workers write a run's
checkpoints, even while an old one is not quite dead.
"""
