"""Stand-in for megatron.bridge.training.pretrain (Bridge 0.6.2's event order; see ../../../README.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron.bridge.training.callbacks import CallbackContext, normalize_callbacks, should_fire


@dataclass
class TrainState:
    step: int = 0
    consumed_train_samples: int = 0


@dataclass
class GlobalState:
    cfg: Any = None
    train_state: TrainState = field(default_factory=TrainState)
    tensorboard_logger: Any = None
    wandb_logger: Any = None


def pretrain(config, forward_step_func, callbacks=None, tensorboard_logger=None) -> GlobalState:
    """(``tensorboard_logger`` stands in for the writer Bridge makes from ``cfg.logger.tensorboard_dir``.)"""
    import torch

    state = GlobalState(cfg=config, tensorboard_logger=tensorboard_logger)
    manager = normalize_callbacks(callbacks)
    model = [config.model.provide()]                       # setup(): model, then optimizer
    optimizer = torch.optim.Adam(model[0].parameters(), lr=1e-3)
    if should_fire(manager, "on_train_start"):
        manager.fire("on_train_start", CallbackContext(state=state, model=model, user_state=manager.user_state,
                                                       optimizer=optimizer))
    while state.train_state.step < config.train.train_iters:
        if should_fire(manager, "on_train_step_start"):
            manager.fire("on_train_step_start", CallbackContext(state=state, model=model, user_state=manager.user_state,
                                                                optimizer=optimizer))
        optimizer.zero_grad(set_to_none=True)
        loss = forward_step_func(model[0])
        loss.backward()
        optimizer.step()
        if should_fire(manager, "on_train_step_end"):
            manager.fire("on_train_step_end", CallbackContext(state=state, model=model, user_state=manager.user_state,
                                                              optimizer=optimizer, loss_dict={"lm loss": loss.detach()},
                                                              grad_norm=None, skipped_iter=False))
        state.train_state.step += 1
    if should_fire(manager, "on_train_end"):
        manager.fire("on_train_end", CallbackContext(state=state, model=model, user_state=manager.user_state,
                                                     optimizer=optimizer))
    return state
