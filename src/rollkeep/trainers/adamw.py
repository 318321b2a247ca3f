"""AdamW for parameters on the CPU, without `torch.optim`.

Why: every method of a `torch.optim.Optimizer` (its constructor included) imports
`torch._dynamo` on first use, about 1 s of CPU on a laptop, paid on the critical path of
every start and restart, for a compiler this trainer never uses. This class is the same
arithmetic as `torch.optim.AdamW` on the CPU (torch picks its single-tensor path there:
`foreach` and `fused` default to off for CPU tensors), operation for operation, so its
updates and state are bit-identical to torch's (`tests/trainers/test_adamw.py` checks
that against `torch.optim.AdamW` itself). Its state has torch's layout and names (per
parameter a 0-d float32 `step` on the CPU, `exp_avg`, `exp_avg_sq`), so checkpoints
written with either load into the other.

Parameters on another device (a GPU) get `torch.optim.AdamW` itself (`make_adamw`): there
torch runs its foreach or fused kernels, which this loop would not reproduce bit for bit.

Only what the trainer uses is here: one param group, no amsgrad, no maximize, no closure,
no sparse gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["AdamW", "make_adamw"]


class AdamW:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter), as `torch.optim.AdamW` computes
    it on the CPU. Per parameter p with gradient g, at step t (counted from 1):

        p      *= 1 - lr * weight_decay              (skipped when weight_decay == 0)
        m       = lerp(m, g, 1 - beta1)
        v       = v * beta2 + (1 - beta2) * g * g
        denom   = sqrt(v) / sqrt(1 - beta2 ** t) + eps
        p      -= lr / (1 - beta1 ** t) * m / denom

    `param_groups` and `state` have torch's shapes (a list with one dict holding "params"
    and the hyper-parameters; a dict parameter -> {"step", "exp_avg", "exp_avg_sq"}), so
    code written for a torch optimizer reads them unchanged."""

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("AdamW got an empty parameter list")
        for p in params:
            if p.device.type != "cpu":
                raise ValueError(f"rollkeep's AdamW is for CPU parameters; got one on {p.device}")
        # The keys and values torch.optim.AdamW records for this arithmetic (trainer.json
        # lists them; `load` takes the hyper-parameters from the config, not the file).
        self.defaults: dict[str, Any] = {
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": True,
        }
        self.param_groups: list[dict[str, Any]] = [{"params": params, **self.defaults}]
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.requires_grad_(False)
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (torch's `_single_tensor_adam`
        with amsgrad, maximize, capturable and differentiable off)."""
        group = self.param_groups[0]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state.get(param)
            if not state:  # lazy initialisation, as torch does it
                state = self.state[param] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }
            step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
            step_t += 1
            if weight_decay != 0:
                param.mul_(1 - lr * weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = step_t.item()
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2**0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: state keyed by parameter index, groups listing indices."""
        params = self.param_groups[0]["params"]
        index = {id(p): i for i, p in enumerate(params)}
        return {
            "state": {index[id(p)]: dict(s) for p, s in self.state.items()},
            "param_groups": [{**{k: v for k, v in self.param_groups[0].items() if k != "params"},
                              "params": list(range(len(params)))}],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """torch's `Optimizer.load_state_dict` for one group: the saved group's
        hyper-parameters, moments cast to their parameter's dtype and device, `step` kept
        as saved."""
        groups = state_dict["param_groups"]
        params = self.param_groups[0]["params"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(params):
            raise ValueError("the loaded state dict has a different number of parameters")
        state: dict[Tensor, dict[str, Tensor]] = {}
        for i, values in state_dict["state"].items():
            p = params[int(i)]
            state[p] = {
                k: v if k == "step" else v.to(dtype=p.dtype, device=p.device)
                for k, v in values.items()
            }
        self.param_groups = [{**{k: v for k, v in groups[0].items() if k != "params"},
                              "params": params}]
        self.state = state


def make_adamw(
    params: list[Tensor], *, lr: float, betas: tuple[float, float], weight_decay: float
) -> Any:
    """rollkeep's `AdamW` for CPU parameters, `torch.optim.AdamW` for any other device."""
    if all(p.device.type == "cpu" for p in params):
        return AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
