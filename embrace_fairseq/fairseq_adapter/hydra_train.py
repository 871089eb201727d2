"""``embrace-hydra-train``: ``fairseq-hydra-train`` with EmbRace loaded first.

fairseq's hydra entry (the one its RoBERTa, XLM-R and wav2vec recipes use) imports
``common.user_dir`` only inside ``fairseq_cli.train.main``, after it has decided how many
ranks there are. The plugin's torchrun fixes (:mod:`.compat`) come too late there: under
torchrun on CPU, or with one GPU per process, fairseq takes the default world size of 1 and
every process trains alone as rank 0. This command imports the plugin, then runs fairseq's
own hydra entry with the same arguments::

    torchrun --nproc_per_node 2 $(which embrace-hydra-train) \\
        --config-dir .../examples/roberta/config/pretraining --config-name base \\
        task.data=DATA model._name=embrace_roberta common.cpu=true \\
        distributed_training.distributed_backend=gloo

``common.user_dir`` may still be given; it is imported once. ``fairseq-hydra-train`` with the
user dir under torchrun stops with an error saying so (:func:`.compat.refuse_late_import`)
instead of training each rank alone.
"""
from __future__ import annotations

import os

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.guards import one_line_errors


class HydraConfigError(UserError, ValueError):
    """The hydra configuration does not compose: a config not found, an override hydra
    cannot parse or apply."""


@one_line_errors.command
def main() -> None:
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (the fixes and the architectures, before fairseq reads the config)
    from fairseq_cli.hydra_train import cli_main
    from hydra.errors import CompactHydraException

    # hydra prints the errors of the job itself and exits 1: let them through, so that a
    # user error is one line and status 2 as in every EmbRace command
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        cli_main()
    except CompactHydraException as exc:  # the errors hydra itself reports without a traceback
        raise HydraConfigError(str(exc)) from None


if __name__ == "__main__":
    main()
