"""The torch release ddpkit's reliance on torch internals was checked against.

Where ddpkit depends on more than torch's documented API - gloo's teardown, autograd's
stashed context, DDP's constructor signature, which flat-tensor collective names exist -
the behaviour was checked on this release. A different torch may need those places
checked again; ``ddpkit env`` prints this beside the installed torch.
"""

TORCH_CHECKED = "2.13"
