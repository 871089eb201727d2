"""fairseq adapter: glue that lets fairseq's own trainer and tools run EmbRace models.

Importing it (``--user-dir user_dir`` does) applies the compatibility fixes in
:mod:`.compat` and registers the EmbRace architectures. No algorithm lives here.
"""
# Fixes first: stock fairseq on CPU/torchrun and torch.load(weights_only=True) (see compat.py).
from embrace_fairseq.fairseq_adapter import compat

compat.apply()

from embrace_fairseq.guards import one_line_errors

one_line_errors.install()  # a user's mistake (a refused flag, a bad checkpoint) ends fairseq's commands with one line
compat.refuse_late_import()  # fairseq-hydra-train under torchrun: its ranks are set up by now, each alone

from embrace_fairseq.fairseq_adapter import checkpoint_io, fp16_masters, scheduled_ddp, trainer_glue, vocab_parallel_criteria
from embrace_fairseq.fairseq_adapter import (  # noqa: F401  (registers embrace_transformer*, embrace_transformer_lm*)
    models,
)
from embrace_fairseq.fairseq_adapter import roberta  # noqa: F401,E402  (registers embrace_roberta*, embrace_xlm)
from embrace_fairseq.fairseq_adapter import bart  # noqa: F401,E402  (registers embrace_bart*, embrace_mbart*)

trainer_glue.apply()
fp16_masters.apply()  # --fp16: fp32 master copies per parameter, the shards' marked
vocab_parallel_criteria.apply()  # cross_entropy / label_smoothed_cross_entropy over the vocab-parallel output
checkpoint_io.apply()  # atomic checkpoint writes, clear error on a corrupted one
scheduled_ddp.apply()  # the 2D schedule reduces EmbRace models' dense gradients under fairseq-train
