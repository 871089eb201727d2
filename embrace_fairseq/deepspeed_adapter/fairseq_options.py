"""fairseq's optimizer, LR-schedule and clipping flags as DeepSpeed configuration.

When the DeepSpeed JSON has no "optimizer" (or "scheduler"), fairseq's flags define it:

* ``--optimizer adam``: fairseq's Adam decays weights decoupled from the gradient
  (AdamW), so it maps to DeepSpeed's ``AdamW`` with ``--lr``, ``--adam-betas``,
  ``--adam-eps``, ``--weight-decay`` (torch's implementation on CPU);
* ``--optimizer sgd``: ``torch.optim.SGD`` with ``--lr``, ``--momentum``,
  ``--weight-decay`` (a client optimizer: DeepSpeed's config has no SGD);
* ``--lr-scheduler inverse_sqrt`` / ``fixed`` with ``--warmup-updates`` and
  ``--warmup-init-lr``: fairseq's formulas as a ``LambdaLR`` of the update count
  (DeepSpeed steps it once per applied update, as fairseq's ``step_update``);
* ``--clip-norm``: ``gradient_clipping``.

A flag given explicitly on the command line whose value disagrees with the JSON stops
start-up with :class:`FairseqOptionConflict`, naming both.
"""
from __future__ import annotations

import ast
import copy
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from embrace_fairseq.deepspeed_adapter.config import EmbraceConfigError


class FairseqOptionConflict(EmbraceConfigError):
    """A fairseq flag and the DeepSpeed JSON say different things."""


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _lr(args: Any) -> float:
    lr = args.lr
    return float(lr[0] if isinstance(lr, (list, tuple)) else lr)


def _betas(args: Any) -> Tuple[float, float]:
    b = getattr(args, "adam_betas", (0.9, 0.999))
    if isinstance(b, str):
        b = ast.literal_eval(b)
    return float(b[0]), float(b[1])


def lr_lambda(kind: str, lr: float, warmup_updates: int, warmup_init_lr: float) -> Callable[[int], float]:
    """Multiplier of the peak ``lr`` after ``u`` updates, as fairseq's schedulers set it."""
    if kind == "inverse_sqrt":
        if warmup_updates <= 0:
            raise EmbraceConfigError("--lr-scheduler inverse_sqrt needs --warmup-updates > 0")
        init = warmup_init_lr if warmup_init_lr >= 0 else 0.0
        step = (lr - init) / warmup_updates
        decay = lr * warmup_updates**0.5

        def inverse_sqrt(u: int) -> float:
            return ((init + u * step) if u < warmup_updates else decay * u**-0.5) / lr

        return inverse_sqrt
    if kind == "fixed":
        return lambda u: min(1.0, (u + 1) / warmup_updates) if warmup_updates > 0 else 1.0
    raise EmbraceConfigError(f"--lr-scheduler {kind}: only inverse_sqrt and fixed map to DeepSpeed here")


def _check(json_value: Any, flag_value: Any, flag: str, key: str, argv: Sequence[str]) -> None:
    if not _given(argv, flag):
        return
    same = (list(json_value) == list(flag_value)) if isinstance(flag_value, (list, tuple)) else json_value == flag_value
    if not same:
        raise FairseqOptionConflict(f"{flag} {flag_value!r} disagrees with the DeepSpeed config's {key} = {json_value!r}; "
                                    "give one of them, or the same value")


def apply_fairseq_options(
    ds: Dict[str, Any], args: Any, argv: List[str]
) -> Tuple[Dict[str, Any], Optional[Callable], Optional[Callable]]:
    """(DeepSpeed config, client optimizer factory or None, client LR scheduler factory or None)."""
    ds = copy.deepcopy(ds)
    make_optimizer = make_scheduler = None
    opt = ds.get("optimizer")
    name = getattr(args, "optimizer", None)
    if opt is None and name is not None:
        if name == "adam":
            # torch's AdamW, not DeepSpeed's FusedAdam: that one is compiled on first use on
            # every machine, and DeepSpeed 0.19.8's build stops where TORCH_CUDA_ARCH_LIST
            # names an arch-specific target such as 9.0a (Hopper images set it so)
            ds["optimizer"] = {"type": "AdamW", "params": {
                "lr": _lr(args), "betas": list(_betas(args)), "eps": float(args.adam_eps),
                "weight_decay": float(args.weight_decay), "torch_adam": True}}
        elif name == "sgd":
            lr, momentum, wd = _lr(args), float(args.momentum), float(args.weight_decay)
            make_optimizer = lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd)  # noqa: E731
            ds["zero_allow_untested_optimizer"] = True
        else:
            raise EmbraceConfigError(f"--optimizer {name}: only adam and sgd map to DeepSpeed; or set \"optimizer\" in the JSON")
    elif opt is not None and name is not None:
        params = opt.get("params", {})
        want = {"adam": ("adam", "adamw"), "sgd": ("sgd",)}.get(name, (name,))
        if str(opt.get("type", "")).lower() not in want:
            raise FairseqOptionConflict(f"--optimizer {name} disagrees with the DeepSpeed config's optimizer.type = {opt.get('type')!r}")
        if "lr" in params:
            _check(float(params["lr"]), _lr(args), "--lr", "optimizer.params.lr", argv)
        if "betas" in params:
            _check([float(b) for b in params["betas"]], list(_betas(args)), "--adam-betas", "optimizer.params.betas", argv)
        if "eps" in params:
            _check(float(params["eps"]), float(getattr(args, "adam_eps", params["eps"])), "--adam-eps", "optimizer.params.eps", argv)
        if "weight_decay" in params:
            _check(float(params["weight_decay"]), float(getattr(args, "weight_decay", 0.0)), "--weight-decay",
                   "optimizer.params.weight_decay", argv)
    sched = getattr(args, "lr_scheduler", None)
    if ds.get("scheduler") is None and sched is not None and (_given(argv, "--lr-scheduler") or _given(argv, "--warmup-updates")):
        fn = lr_lambda(sched, _lr(args), int(getattr(args, "warmup_updates", 0) or 0),
                       float(getattr(args, "warmup_init_lr", -1) if getattr(args, "warmup_init_lr", None) is not None else -1))
        make_scheduler = lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, fn)  # noqa: E731
    elif ds.get("scheduler") is not None and _given(argv, "--lr-scheduler"):
        raise FairseqOptionConflict(f"--lr-scheduler {sched} and the DeepSpeed config's \"scheduler\" both set the schedule; "
                                    "give one of them")
    clip = float(getattr(args, "clip_norm", 0.0) or 0.0)
    if "gradient_clipping" not in ds:
        ds["gradient_clipping"] = clip
    else:
        _check(float(ds["gradient_clipping"]), clip, "--clip-norm", "gradient_clipping", argv)
    return ds, make_optimizer, make_scheduler
