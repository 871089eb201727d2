"""The output stretch: the part of a step in which the link can carry no dense gradient.

A dense parameter's gradient of step ``t`` exists once the backward reaches its layer,
and it must be all-reduced before step ``t + 1``'s forward reads the layer. The last
dense layer the forward reads is the top of the stack (its final norm); the first
dense gradient the backward makes is that layer's. Between the two the step runs the
output layer's forward, the loss, and the output layer's backward: whatever order the
collectives take, no dense byte can be on the link then. The table's own gradient is
needed by no dense layer (EmbRace defers it: ``core/deferred_grad.py``), so the stretch
counts the output layer's input gradient only:

    stretch = (loss end - last dense layer's forward end)
            + (first dense gradient - backward start) - the table gradient's product

measured on the stock model in one process (:class:`StretchProbe`), as a share of its
step, so that a run applies it to its own floor
(:func:`.calibration.dependency_limit_steps`).

Dense layers are the leaf modules that hold a parameter other than a token table
(``Linear``, ``LayerNorm``): a bias that a container adds after the output product (RoBERTa's
head) is ready at once in the backward but is a few kB; the layers under it wait for the
output layer's backward.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _dense_leaves(model: nn.Module, tables: Sequence[str]) -> List[nn.Module]:
    table_params = {id(p) for n, p in model.named_parameters() if n in tables}
    return [m for m in model.modules()
            if not any(True for _ in m.children())
            and any(id(p) not in table_params and p.requires_grad for p in m.parameters(recurse=False))]


class _OutputProducts(TorchFunctionMode):
    """Records ``(rows of the input, vocab, dim)`` of every ``F.linear`` that reads a table."""

    def __init__(self, table_params: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.tables = {id(p) for p in table_params}
        self.shapes: List[Tuple[int, int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is not None and id(weight) in self.tables:
                x = args[0]
                self.shapes.append((x.numel() // x.shape[-1], weight.shape[0], weight.shape[1]))
        return func(*args, **kwargs)


def output_products(model: nn.Module, tables: Sequence[str], forward: Callable[[], object]) -> List[Tuple[int, int, int]]:
    """Run ``forward`` (an untimed step's forward and loss) and return the shapes of the
    output products against the tables, whose weight gradients the stretch leaves out."""
    params = [p for n, p in model.named_parameters() if n in tables]
    with _OutputProducts(params) as mode:
        forward()
    return mode.shapes


def table_grad_seconds(shapes: Sequence[Tuple[int, int, int]], dtype: torch.dtype = torch.float32,
                       repeats: int = 3) -> float:
    """Seconds of the weight-gradient products ``grad_logits^T @ input`` of ``shapes``
    (median of ``repeats`` after one untimed)."""
    total = 0.0
    for rows, vocab, dim in shapes:
        g, x = torch.randn(rows, vocab, dtype=dtype), torch.randn(rows, dim, dtype=dtype)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            g.t().mm(x)
            if i:
                times.append(time.perf_counter() - t0)
        total += statistics.median(times)
    return total


class StretchProbe:
    """Times the output stretch of each step of a stock model (hooks on its dense leaves
    and parameters). Per step: the caller marks :meth:`loss_done` after the loss and
    :meth:`backward_started` before ``backward()``, then reads :meth:`take`."""

    def __init__(self, model: nn.Module, tables: Sequence[str]) -> None:
        leaves = _dense_leaves(model, tables)
        if not leaves:
            raise ValueError("no dense layer outside the tables: no output stretch to time")
        self._handles = [m.register_forward_hook(self._forward_end) for m in leaves]
        self._handles += [p.register_post_accumulate_grad_hook(self._grad_ready)
                          for m in leaves for p in m.parameters(recurse=False) if p.requires_grad]
        self._reset()

    def _reset(self) -> None:
        self._last_forward: Optional[float] = None
        self._loss_end: Optional[float] = None
        self._backward_start: Optional[float] = None
        self._first_grad: Optional[float] = None

    def _forward_end(self, module, inputs, output) -> None:
        if self._loss_end is None:
            self._last_forward = time.perf_counter()

    def _grad_ready(self, param) -> None:
        if self._first_grad is None:
            self._first_grad = time.perf_counter()

    def loss_done(self) -> None:
        self._loss_end = time.perf_counter()

    def backward_started(self) -> None:
        self._backward_start = time.perf_counter()

    def take(self) -> Dict[str, float]:
        """This step's ``forward_s`` (last dense layer to the loss) and ``backward_s``
        (backward start to the first dense gradient); the probe is ready for the next step."""
        marks = (self._last_forward, self._loss_end, self._backward_start, self._first_grad)
        if None in marks:
            raise RuntimeError("the step did not pass every mark (a dense layer's forward, loss_done, "
                               "backward_started, a dense gradient)")
        out = {"forward_s": marks[1] - marks[0], "backward_s": marks[3] - marks[2]}
        self._reset()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def summarize(steps: Sequence[Dict[str, float]], table_grad_s: float, step_s: float) -> Dict[str, float]:
    """The medians of the probe's steps, the stretch (their sum less the table gradient's
    product, at least 0) and its ``share`` of the stock step ``step_s``.

    >>> s = summarize([{"forward_s": 0.2, "backward_s": 0.4}] * 3, table_grad_s=0.1, step_s=2.0)
    >>> round(s["stretch_s"], 3), round(s["share"], 3)
    (0.5, 0.25)
    """
    fwd = statistics.median(s["forward_s"] for s in steps)
    bwd = statistics.median(s["backward_s"] for s in steps)
    stretch = max(0.0, fwd + bwd - table_grad_s)
    return {"forward_s": fwd, "backward_s": bwd, "table_grad_s": table_grad_s, "stretch_s": stretch,
            "step_s": step_s, "share": stretch / step_s if step_s > 0 else 0.0}


def profile_steps(model: nn.Module, tables: Sequence[str], loss_of: Callable[[int], torch.Tensor],
                  optimizer: torch.optim.Optimizer, steps: int) -> Dict[str, Dict[str, float]]:
    """Time ``steps`` steps of a stock model after one untimed (which records the output
    products): ``loss_of(i)`` runs step ``i``'s forward and loss. Returns the median
    ``compute_s`` (forward, backward, optimizer) and the ``stretch`` (:func:`summarize`)
    as a share of their sum."""
    fwd: List[float] = []
    bwd: List[float] = []
    opt: List[float] = []
    marks: List[Dict[str, float]] = []
    products: List[Tuple[int, int, int]] = []
    probe = StretchProbe(model, tables)
    try:
        for i in range(steps + 1):
            optimizer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if i == 0:  # untimed: the output products' shapes (a function mode slows every op)
                out: List[torch.Tensor] = []
                products = output_products(model, tables, lambda: out.append(loss_of(0)))
                loss = out[0]
            else:
                loss = loss_of(i)
            probe.loss_done()
            t1 = time.perf_counter()
            probe.backward_started()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            m = probe.take()
            if i:
                fwd.append(t1 - t0), bwd.append(t2 - t1), opt.append(t3 - t2)
                marks.append(m)
    finally:
        probe.close()
    compute = {"forward": statistics.median(fwd), "backward": statistics.median(bwd),
               "optimizer": statistics.median(opt)}
    return {"compute_s": compute, "stretch": summarize(marks, table_grad_seconds(products), sum(compute.values()))}
