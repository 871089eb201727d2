"""Element-wise optimizer steps for table shards, outside the training framework's optimizer.

Why a separate optimizer: a framework optimizer that partitions its parameters over
ranks (DeepSpeed ZeRO) must see the same parameters on every rank, and a table shard
differs per rank (its rows are already partitioned). The shards are therefore stepped
here, with the update rule and hyper-parameters of the framework's optimizer, read
from its ``param_groups`` at every step so that its learning-rate scheduler applies.

Why row subsets: Adam, AdamW and SGD are element-wise. One step applied to a row
subset A and then to its complement, with the same step number (bias correction per
step, not per call), gives exactly the table one step over all rows gives. That is
what lets the rows the next batch reads be updated first and the others later
(the relaxed embedding dependency): :meth:`ShardOptimizer.begin_step` advances the
step number once, :meth:`ShardOptimizer.apply` may then be called on any partition
of the rows.

State for checkpoints is world-size independent: :meth:`full_state_dict` gathers the
moments to full tables (collective), :meth:`load_full_state_dict` keeps this rank's rows.
Nothing here depends on a training framework; only on torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from embrace_fairseq.core.sharded_embedding import table_of
from embrace_fairseq.core.errors import UserError

KINDS = ("adam", "adamw", "sgd")


class UnsupportedOptimizerError(UserError, ValueError):
    """The framework optimizer's update rule is not one the shard optimizer reproduces."""


@dataclass
class HyperParams:
    """One step's hyper-parameters (read from the framework optimizer's param group)."""

    lr: float
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    @classmethod
    def from_param_group(cls, group: Mapping[str, Any]) -> "HyperParams":
        return cls(
            lr=float(group["lr"]),
            betas=tuple(float(b) for b in group.get("betas", (0.9, 0.999))),
            eps=float(group.get("eps", 1e-8)),
            weight_decay=float(group.get("weight_decay", 0.0) or 0.0),
            momentum=float(group.get("momentum", 0.0) or 0.0),
            dampening=float(group.get("dampening", 0.0) or 0.0),
            nesterov=bool(group.get("nesterov", False)),
        )


def kind_of(optimizer: Any) -> str:
    """The update rule of a torch or DeepSpeed optimizer: "adam", "adamw" or "sgd".

    Raises :class:`UnsupportedOptimizerError` for anything else (or for Adam variants
    whose rule differs: amsgrad, maximize, decoupled weight decay flags we do not know).
    """
    name = type(optimizer).__name__
    groups = getattr(optimizer, "param_groups", None) or [{}]
    g = groups[0]
    if g.get("amsgrad") or g.get("maximize"):
        raise UnsupportedOptimizerError(f"{name} with amsgrad/maximize is not supported for table shards")
    if isinstance(optimizer, torch.optim.AdamW) or name == "AdamW":
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adamw" if g.get("decoupled_weight_decay") else "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    if name in ("FusedAdam", "DeepSpeedCPUAdam"):
        return "adamw" if getattr(optimizer, "adam_w_mode", True) else "adam"
    raise UnsupportedOptimizerError(
        f"optimizer {name} is not supported for sharded tables under this mode; use Adam, AdamW or SGD"
    )


class ShardOptimizer:
    """Adam / AdamW / SGD over table shards, with row-subset steps.

    Args:
        params: the shard parameters (each a ``ShardedEmbedding.weight``).
        kind: "adam", "adamw" or "sgd" (see :func:`kind_of`).

    Low-precision shards (fp16/bf16) keep an fp32 master copy and fp32 moments, as
    mixed-precision optimizers do; the shard is refreshed from the master after each
    update, and the master from the shard wherever the shard was written since (loaded
    weights, a weights-only checkpoint, a reset optimizer): :meth:`begin_step`.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], kind: str) -> None:
        if kind not in KINDS:
            raise UnsupportedOptimizerError(f"kind must be one of {KINDS}, got {kind!r}")
        self.params: List[torch.nn.Parameter] = list(params)
        self.kind = kind
        self.step_count = 0
        self._hp: Optional[HyperParams] = None
        self.state: List[Dict[str, torch.Tensor]] = [self._init_state(p) for p in self.params]

    def _init_state(self, p: torch.nn.Parameter) -> Dict[str, torch.Tensor]:
        st: Dict[str, torch.Tensor] = {}
        if p.dtype in (torch.float16, torch.bfloat16):
            st["master"] = p.detach().float().clone()
        f32 = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if self.kind in ("adam", "adamw"):
            st["exp_avg"] = f32
            st["exp_avg_sq"] = f32.clone()
        else:
            st["momentum_buffer"] = f32
        return st

    # ------------------------------------------------------------------ stepping
    def begin_step(self, hp: HyperParams) -> None:
        """Start optimizer step ``step_count + 1`` with these hyper-parameters (after
        taking into the fp32 masters any shard element written since the last update)."""
        self.refresh_masters()
        self.step_count += 1
        self._hp = hp

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Where a low-precision shard no longer equals its master rounded to the shard's
        dtype, the shard was written outside this optimizer: the master takes its value.
        Elements this optimizer wrote last keep their fp32 master (no rounding)."""
        for p, st in zip(self.params, self.state):
            master = st.get("master")
            if master is None:
                continue
            stale = master.to(p.dtype) != p.data
            # on a GPU the masked copy runs unconditionally (the same result, no host sync
            # per step); on CPU the test is free and usually spares the copy
            if p.device.type != "cpu" or bool(stale.any()):
                master.copy_(torch.where(stale, p.data.float(), master))

    @torch.no_grad()
    def apply(self, rows: Optional[Sequence[Optional[torch.Tensor]]] = None, grad_scale: float = 1.0,
              grads: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        """Update the given local rows (per parameter; ``None`` = all rows) with the
        current step's hyper-parameters. The gradient is ``.grad`` (or ``grads``, per
        parameter), multiplied by ``grad_scale`` first (loss-scale removal and clipping).
        Call for disjoint row sets whose union is every row exactly once per step."""
        if self._hp is None:
            raise RuntimeError("ShardOptimizer.apply() before begin_step()")
        for i, p in enumerate(self.params):
            idx = None if rows is None else rows[i]
            if idx is not None and idx.numel() == 0:
                continue
            self._update(p, self.state[i], idx, grad_scale, p.grad if grads is None else grads[i])

    def step(self, hp: HyperParams, grad_scale: float = 1.0) -> None:
        """One full step over all rows."""
        self.begin_step(hp)
        self.apply(None, grad_scale)

    def _update(self, p: torch.nn.Parameter, st: Dict[str, torch.Tensor], idx: Optional[torch.Tensor], scale: float,
                grad: Optional[torch.Tensor]) -> None:
        hp, t = self._hp, self.step_count
        assert hp is not None
        if grad is None:
            grad = torch.zeros_like(p)
        master = st.get("master")
        w = master if master is not None else p.data

        def sel(x: torch.Tensor) -> torch.Tensor:
            return x if idx is None else x.index_select(0, idx)

        g = sel(grad).float()
        if scale != 1.0:
            g = g * scale
        x = sel(w)
        if self.kind == "sgd":
            if hp.weight_decay:
                g = g.add(x, alpha=hp.weight_decay)
            if hp.momentum:
                buf = sel(st["momentum_buffer"])
                if t == 1:
                    buf = g.clone()
                else:
                    buf = buf.mul(hp.momentum).add_(g, alpha=1 - hp.dampening)
                self._put(st["momentum_buffer"], idx, buf)
                g = g.add(buf, alpha=hp.momentum) if hp.nesterov else buf
            x = x.add(g, alpha=-hp.lr)
        else:
            beta1, beta2 = hp.betas
            if self.kind == "adamw":
                x = x.mul(1 - hp.lr * hp.weight_decay)
            elif hp.weight_decay:
                g = g.add(x, alpha=hp.weight_decay)
            m = sel(st["exp_avg"]).lerp(g, 1 - beta1)
            v = sel(st["exp_avg_sq"]).mul(beta2).addcmul_(g, g, value=1 - beta2)
            self._put(st["exp_avg"], idx, m)
            self._put(st["exp_avg_sq"], idx, v)
            bias1 = 1 - beta1**t
            bias2 = 1 - beta2**t
            denom = (v.sqrt() / math.sqrt(bias2)).add_(hp.eps)
            x = x.addcdiv(m, denom, value=-hp.lr / bias1)
        self._put(w, idx, x.to(w.dtype))
        if master is not None:
            self._put(p.data, idx, x.to(p.dtype))

    @staticmethod
    def _put(dst: torch.Tensor, idx: Optional[torch.Tensor], value: torch.Tensor) -> None:
        if idx is None:
            dst.copy_(value)
        else:
            dst.index_copy_(0, idx, value)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> Dict[str, Any]:
        """Step count and every moment as a full table. Collective (gathers shards)."""
        out: List[Dict[str, torch.Tensor]] = []
        for p, st in zip(self.params, self.state):
            emb = table_of(p)
            entry = {}
            for key in sorted(st):
                entry[key] = emb.gather_shard_state(st[key]) if emb is not None else st[key].clone()
            out.append(entry)
        return {"kind": self.kind, "step": self.step_count, "state": out}

    @torch.no_grad()
    def load_full_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Keep this rank's rows of a :meth:`full_state_dict` (any world size saved it)."""
        if sd.get("kind") != self.kind:
            raise ValueError(f"shard optimizer state is for {sd.get('kind')!r}, this run uses {self.kind!r}")
        if len(sd["state"]) != len(self.params):
            raise ValueError(f"shard optimizer state has {len(sd['state'])} tables, the model {len(self.params)}")
        self.step_count = int(sd["step"])
        for p, st, saved in zip(self.params, self.state, sd["state"]):
            emb = table_of(p)
            for key, value in saved.items():
                if key not in st:
                    continue
                if emb is not None and value.shape[0] == emb.num_embeddings != st[key].shape[0]:
                    value = emb.shard_of(value)
                st[key].copy_(value)
