"""A fairseq ``--user-dir`` for fault tests: the EmbRace plugin plus one injected fault.

``EMBRACE_TEST_INF_AT=K EMBRACE_TEST_INF_RANK=R``: at update K, rank R writes inf into
its shard gradient just before fairseq takes the gradient norm (after the exchange,
as a numerical overflow in the embedding backward would leave it).

``EMBRACE_TEST_STALL_AT=K``: every rank stops before update K and waits there, saying so on
stderr, until it is killed: a kill at a known update (a tiny model takes a few
milliseconds an update, faster than a test can watch its log).
"""
import os
import sys
import time

import torch
from fairseq.trainer import Trainer

import embrace_fairseq.fairseq_adapter  # noqa: F401  (the plugin: compat fixes, architectures)
from embrace_fairseq.core.sharded_embedding import is_sharded_param

_AT = int(os.environ.get("EMBRACE_TEST_INF_AT", "-1"))
_RANK = int(os.environ.get("EMBRACE_TEST_INF_RANK", "-1"))
_original = Trainer.clip_grad_norm


def clip_grad_norm(self, clip_norm):
    if self.get_num_updates() + 1 == _AT and self.data_parallel_rank == _RANK:
        for p in self.model.parameters():
            if is_sharded_param(p) and p.grad is not None:
                with torch.no_grad():
                    p.grad.view(-1)[0] = float("inf")
                print(f"injected inf into the shard gradient on rank {_RANK} at update {_AT}", file=sys.stderr, flush=True)
                break
    return _original(self, clip_norm)


Trainer.clip_grad_norm = clip_grad_norm


_STALL_AT = int(os.environ.get("EMBRACE_TEST_STALL_AT", "-1"))
_original_train_step = Trainer.train_step


def train_step(self, samples, raise_oom=False):
    if self.get_num_updates() + 1 == _STALL_AT:
        print(f"stalled before update {_STALL_AT} on rank {self.data_parallel_rank}", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    return _original_train_step(self, samples, raise_oom)


Trainer.train_step = train_step
