"""``embrace-ds-train``: ``fairseq-train`` with the EmbRace DeepSpeed engine.

fairseq's own ``fairseq_cli.train.main`` runs, with the EmbRace architectures loaded and
:class:`~embrace_fairseq.deepspeed_adapter.trainer.DeepSpeedTrainer` in place of fairseq's
``Trainer``: every fairseq-train flag means what it means there (log format and
interval, progress bars, ``--tensorboard-logdir``, validation, ``--best-checkpoint-metric``,
``--patience``, ``--keep-*``, ``--max-epoch``, ``--max-update``, ``--stop-time-hours``,
``--reset-*``...). What this adds before any rank starts:

* ``--deepspeed-config JSON`` (required), with an optional ``"embrace"`` section;
* fairseq's optimizer and clipping flags become DeepSpeed config (:mod:`.fairseq_options`);
  the learning rate follows fairseq's ``--lr-scheduler`` unless the JSON has a
  ``"scheduler"``; the JSON's optimizer learning rate and ``gradient_clipping`` become
  ``--lr`` / ``--clip-norm`` when those are not given;
* ``--update-freq N`` is DeepSpeed's ``"gradient_accumulation_steps"`` (the JSON's value
  when the flag is not given; both given and different stops start-up);
* on CPU, ``--cpu`` and the gloo backend.

A flag given explicitly that disagrees with the JSON stops start-up with a
:class:`~embrace_fairseq.deepspeed_adapter.fairseq_options.FairseqOptionConflict`.
Launch with ``deepspeed --num_gpus N $(which embrace-ds-train) ...`` or ``torchrun``.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any, Dict, List, Optional

import torch

from embrace_fairseq.guards import one_line_errors

logger = logging.getLogger("embrace_fairseq.deepspeed_adapter.train")


def get_parser():
    """fairseq's training parser with the launcher's own options."""
    from fairseq import options

    parser = options.get_training_parser()
    add_deepspeed_args(parser)
    return parser


def add_deepspeed_args(parser: Any) -> None:
    group = parser.add_argument_group("EmbRace DeepSpeed")
    group.add_argument("--deepspeed-config", required=True, metavar="JSON",
                       help="DeepSpeed config, optionally with an \"embrace\" section")
    # fairseq's parser already accepts the --local_rank the deepspeed launcher passes


def apply_table_keys(args: Any, argv: List[str], config: Any) -> None:
    """The JSON's table keys (``"embrace.shard_layout"``, ``"exchange"``,
    ``"ranks_per_node"``, ``"plan"``) become the ``--embrace-*`` table flags in ``args`` (the model's
    tables are built with them); an explicit flag that says otherwise stops with
    :class:`FairseqOptionConflict`."""
    for key, flag in (("shard_layout", "--embrace-shard-layout"), ("exchange", "--embrace-exchange"),
                      ("ranks_per_node", "--embrace-ranks-per-node"), ("plan", "--embrace-plan")):
        value = getattr(config, key)
        if value is None:
            continue
        attr = flag[2:].replace("-", "_")
        current = getattr(args, attr, None)
        given = any(a == flag or a.startswith(flag + "=") for a in argv)
        if given and current != value:
            from embrace_fairseq.deepspeed_adapter.fairseq_options import FairseqOptionConflict

            raise FairseqOptionConflict(
                f"{flag} {current!r} disagrees with the DeepSpeed config's embrace.{key} = {value!r}; give one "
                "of them, or the same value")
        setattr(args, attr, value)


def _output_mode(args: Any, argv: List[str], section: Optional[Dict[str, Any]]) -> None:
    """``"output"`` of the ``"embrace"`` section is ``--embrace-output``; both given and
    different stops start-up."""
    if not section or "output" not in section:
        return
    flag = "--embrace-output"
    given = any(a == flag or a.startswith(flag + "=") for a in argv)
    current = str(getattr(args, "embrace_output", "auto"))
    if given and current != section["output"]:
        raise ValueError(f'{flag} {current} disagrees with "embrace.output": "{section["output"]}" in the DeepSpeed config')
    args.embrace_output = section["output"]


def _given(argv: List[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def apply_update_freq(ds_config: Dict[str, Any], args: Any, argv: List[str]) -> None:
    """``--update-freq`` and ``"gradient_accumulation_steps"`` say the same thing; the
    JSON's value stands when the flag is not given."""
    from embrace_fairseq.deepspeed_adapter.fairseq_options import FairseqOptionConflict

    freqs = [int(f) for f in args.update_freq]
    if len(set(freqs)) > 1:
        raise FairseqOptionConflict(f"--update-freq {args.update_freq}: DeepSpeed's gradient accumulation is one "
                                    "number for the whole run")
    json_gas = ds_config.get("gradient_accumulation_steps")
    if _given(argv, "--update-freq"):
        if json_gas not in (None, "auto") and int(json_gas) != freqs[0]:
            raise FairseqOptionConflict(f"--update-freq {freqs[0]} disagrees with the DeepSpeed config's "
                                        f"gradient_accumulation_steps = {json_gas}; give one of them, or the same value")
        gas = freqs[0]
    else:
        gas = int(json_gas) if json_gas not in (None, "auto") else freqs[0]
    ds_config["gradient_accumulation_steps"] = gas
    args.update_freq = [gas]
    # batches are fairseq's (--max-tokens / --batch-size); DeepSpeed's sizes are nominal
    ds_config.pop("train_batch_size", None)
    ds_config.setdefault("train_micro_batch_size_per_gpu", 1)


def apply_json_values(ds_config: Dict[str, Any], args: Any, argv: List[str]) -> None:
    """The JSON's optimizer learning rate and clipping as fairseq's ``--lr`` /
    ``--clip-norm`` (fairseq's LR scheduler and logs read them) when not given."""
    params = (ds_config.get("optimizer") or {}).get("params") or {}
    if "lr" in params and not _given(argv, "--lr"):
        args.lr = [float(params["lr"])]
    if "gradient_clipping" in ds_config and not _given(argv, "--clip-norm"):
        args.clip_norm = float(ds_config["gradient_clipping"] or 0.0)


def apply_buffer_dtype(ds_config: Dict[str, Any]) -> None:
    """Under fp16/bf16, buffers take the parameters' dtype, as under fairseq's own ``--fp16``
    (``model.half()``), unless the JSON's ``"data_types"`` says otherwise. DeepSpeed 0.19
    casts the parameters only, and fairseq's modules assume buffers that follow the model:
    the sinusoidal positions (a float buffer) added to half token embeddings make the
    first layer's input float, and its half weights stop the step ("expected mat1 and mat2
    to have the same dtype")."""
    low = next((k for k in ("fp16", "bf16", "bfloat16") if (ds_config.get(k) or {}).get("enabled")), None)
    if low is None:
        return
    data_types = ds_config.setdefault("data_types", {})
    data_types.setdefault("buffer_dtype", "fp16" if low == "fp16" else "bf16")


def prepare(argv: Optional[List[str]] = None) -> Any:
    """Parse fairseq's flags and the DeepSpeed config; returns (cfg, DeepSpeedSetup).
    Bad input stops here, before any rank starts."""
    importlib.import_module("embrace_fairseq.fairseq_adapter")  # compat fixes + EmbRace architectures
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from embrace_fairseq.deepspeed_adapter.config import load_json_config, split_config
    from embrace_fairseq.deepspeed_adapter.fairseq_options import apply_fairseq_options
    from embrace_fairseq.deepspeed_adapter.trainer import DeepSpeedSetup

    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = options.parse_args_and_arch(get_parser(), input_args=argv)
    cpu = bool(args.cpu) or not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        args.cpu = True
        if not _given(raw_argv, "--distributed-backend"):
            args.distributed_backend = "gloo"
    raw = load_json_config(args.deepspeed_config)
    section = raw.pop("embrace", None) if isinstance(raw, dict) else None
    _, embrace_cfg = split_config({"embrace": section})  # a bad section stops here
    _output_mode(args, raw_argv, section)
    apply_table_keys(args, raw_argv, embrace_cfg)
    # fairseq's own --lr-scheduler sets the rate on DeepSpeed's optimizer (trainer.py)
    scheduler_flags = [a for a in raw_argv if a.split("=")[0] in ("--lr-scheduler", "--warmup-updates")]
    argv_for_mapping = [a for a in raw_argv if a not in scheduler_flags] if raw.get("scheduler") is None else raw_argv
    ds_config, make_optimizer, _ = apply_fairseq_options(raw, args, argv_for_mapping)
    apply_update_freq(ds_config, args, raw_argv)
    apply_json_values(ds_config, args, raw_argv)
    apply_buffer_dtype(ds_config)
    if section is not None:
        ds_config["embrace"] = section
    from embrace_fairseq.deepspeed_adapter.config import check_supported

    ds_only, embrace_only = split_config(ds_config)
    check_supported(ds_only, embrace_only)  # e.g. relaxed with --update-freq > 1
    cfg = convert_namespace_to_omegaconf(args)
    return cfg, DeepSpeedSetup(ds_config=ds_config, make_optimizer=make_optimizer, cpu=cpu)


def run(cfg: Any, deepspeed: Any = None) -> None:
    """``fairseq_cli.train.main`` with the DeepSpeed trainer (runs on every rank)."""
    import fairseq_cli.train as fairseq_train

    from embrace_fairseq.deepspeed_adapter.trainer import DeepSpeedTrainer

    made: List[Any] = []

    def make_trainer(*args: Any, **kwargs: Any) -> Any:
        trainer = DeepSpeedTrainer(*args, deepspeed=deepspeed, **kwargs)
        made.append(trainer)
        return trainer

    original = fairseq_train.Trainer
    fairseq_train.Trainer = make_trainer
    try:
        fairseq_train.main(cfg)
    finally:
        fairseq_train.Trainer = original
    for trainer in made:
        hook = trainer.engine.embrace
        if hook.config.trace is not None:
            logger.info("rank %d communication: %s", trainer.data_parallel_rank, hook.summary())
            hook.close()


def _quiet_tensorboardx_notice() -> None:
    # Importing fairseq's tasks logs "Please install tensorboardX" (its text-to-speech task
    # wants it; training here never does). The filter must be in place before that import.
    logging.getLogger("fairseq.tasks.text_to_speech").addFilter(
        lambda record: "tensorboardX" not in record.getMessage())


def _read_config_early(argv: Optional[List[str]]) -> None:
    """A missing or malformed ``--deepspeed-config`` stops the command before fairseq is
    imported (seconds, on every rank); :func:`prepare` reads it again with the flags."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--deepspeed-config")
    path = early.parse_known_args(sys.argv[1:] if argv is None else argv)[0].deepspeed_config
    if path is not None:
        from embrace_fairseq.deepspeed_adapter.config import load_json_config

        load_json_config(path)


@one_line_errors.command  # a bad config, file or flag ends the command with one line, on every rank
def main(argv: Optional[List[str]] = None) -> None:
    _read_config_early(argv)
    _quiet_tensorboardx_notice()
    importlib.import_module("fairseq_cli.train")  # first: it sets up logging as fairseq-train does
    from fairseq.distributed import utils as distributed_utils

    cfg, setup = prepare(argv)
    distributed_utils.call_main(cfg, run, deepspeed=setup)


if __name__ == "__main__":
    main()
