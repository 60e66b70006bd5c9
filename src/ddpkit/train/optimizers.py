"""The optimizers ``ddpkit train --optimizer`` names (:data:`ddpkit.vocabulary.OPTIMIZERS`):
each builds one from the parameters and the config's optimizer section."""

from __future__ import annotations

import torch


def sgd(params, optim_cfg) -> torch.optim.Optimizer:
    """SGD with momentum and (coupled) weight decay."""
    return torch.optim.SGD(params, lr=optim_cfg.lr, momentum=optim_cfg.momentum,
                           weight_decay=optim_cfg.weight_decay)


def adamw(params, optim_cfg) -> torch.optim.Optimizer:
    """AdamW: decoupled weight decay."""
    return torch.optim.AdamW(params, lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay)
