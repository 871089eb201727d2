"""Parameter gradients computed later than the backward that produced them.

A backward that holds what a parameter's gradient needs can hand the product to a
:class:`DeferredGrads` instead of returning it (:mod:`.vocab_parallel`'s table gradient):
the layers below it then run their backward, and their gradients are communicated,
earlier. :meth:`DeferredGrads.flush` computes what was deferred and adds it to each
parameter's ``.grad``, as autograd would have. Whoever reads or clears those ``.grad``
flushes first; the sharded tables do it in ``finish_pending``, which both training
engines call before the optimizer step (the contract their overlapped table gradients
already have).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch


class DeferredGrads:
    """Gradients owed to parameters: ``(parameter, product)`` pairs, in the order deferred."""

    def __init__(self) -> None:
        self._owed: List[Tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []

    def defer(self, param: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        """Owe ``param`` the gradient ``compute()`` returns (its shape and dtype). The
        closure keeps what it reads alive until :meth:`flush`."""
        if not param.is_leaf:
            raise ValueError("a deferred gradient goes into a leaf's .grad; this tensor is not a leaf")
        self._owed.append((param, compute))

    def __len__(self) -> int:
        return len(self._owed)

    @torch.no_grad()
    def flush(self) -> None:
        """Compute every owed gradient and add it to its parameter's ``.grad``."""
        owed, self._owed = self._owed, []
        for param, compute in owed:
            grad = compute()
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
