"""Export an EmbRace checkpoint as a checkpoint of the stock fairseq architecture.

``python -m embrace_fairseq.tools.export_stock CHECKPOINT OUT`` (or ``embrace-export-stock``)
writes ``OUT``: the same weights (full tables: EmbRace checkpoints already hold them) under
the stock architecture (``embrace_<stock>`` -> ``<stock>``: ``transformer*``,
``transformer_lm*``, ``roberta*`` / ``xlm``, ``bart*`` / ``mbart*``), with the stock model
configuration (the EmbRace flags removed), no ``user_dir``, and each tied output weight
under its stock key as well (:data:`TIED_OUTPUTS`). Stock fairseq and its hub interface
load it with no ``--user-dir`` and give the same outputs. A checkpoint of a stock model
loaded into the EmbRace one and saved again exports to the same tensors, bit for bit.

The file holds only what torch's ``weights_only=True`` loader accepts (dicts, lists,
tensors, numbers, strings): the model arguments, an ``argparse.Namespace`` in fairseq's
own checkpoints of legacy architectures, are stored as a dict (fairseq builds legacy
models from a dict configuration too), and the training state (optimizer state,
meters) is left out, so stock fairseq loads it under torch >= 2.6 without
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``. Before writing, the stock model is built from the
exported configuration and loads the weights with ``strict=True``.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from embrace_fairseq.core.errors import UserError
from embrace_fairseq.guards import one_line_errors

logger = logging.getLogger(__name__)

PREFIX = "embrace_"
#: model-configuration keys that exist only on EmbRace architectures
FLAG_PREFIX = "embrace_"  # the model options the EmbRace architectures add
#: training state a model file for inference does not need (and whose numpy meters
#: ``weights_only`` refuses)
TRAINING_STATE = ("last_optimizer_state",)


class ExportError(UserError, ValueError):
    """The checkpoint is not one this command exports."""


def stock_name(name: Optional[str]) -> Optional[str]:
    """``embrace_transformer_iwslt_de_en`` -> ``transformer_iwslt_de_en`` (stock names pass)."""
    if name and name.startswith(PREFIX):
        return name[len(PREFIX):]
    return name


def _model_cfg_dict(model_cfg: Any) -> Dict[str, Any]:
    if isinstance(model_cfg, argparse.Namespace):
        return dict(vars(model_cfg))
    if isinstance(model_cfg, dict):
        return dict(model_cfg)
    raise ExportError(f"unexpected model configuration of type {type(model_cfg).__name__}")


def stock_model_cfg(model_cfg: Any) -> Dict[str, Any]:
    """The stock architecture's model configuration (a plain dict) for an EmbRace one."""
    out = _model_cfg_dict(model_cfg)
    name = out.get("_name") or out.get("arch")
    if not name or not str(name).startswith(PREFIX):
        raise ExportError(f"not an EmbRace architecture: {name!r} (expected embrace_<stock architecture>, "
                          "e.g. embrace_transformer, embrace_transformer_lm, embrace_roberta_base, embrace_bart_large)")
    for key in [k for k in out if k.startswith(FLAG_PREFIX)]:
        out.pop(key)  # every --embrace-* flag: stock fairseq knows none of them
    for key in ("_name", "arch"):
        if key in out:
            out[key] = stock_name(out[key])
    return out


def _decoder_ties(cfg: Dict[str, Any]) -> bool:
    tied = cfg.get("share_decoder_input_output_embed") or cfg.get("share_all_embeddings")
    return bool(tied) and cfg.get("adaptive_softmax_cutoff") is None


#: (stock key of an output weight tied to a table, the table's key, whether the model
#: configuration ties them). The EmbRace models list both keys, as the stock ones do;
#: checkpoints written before they did hold only the table's, and get the second here.
#: ``transformer*``, ``transformer_lm*`` and ``bart*`` (a transformer) share the first.
TIED_OUTPUTS: List[Tuple[str, str, Callable[[Dict[str, Any]], bool]]] = [
    ("decoder.output_projection.weight", "decoder.embed_tokens.weight", _decoder_ties),
    ("encoder.lm_head.weight", "encoder.sentence_encoder.embed_tokens.weight",
     lambda cfg: not cfg.get("untie_weights_roberta", False)),
]


def _tied_output_key(state: Dict[str, Any], model_cfg: Dict[str, Any]) -> None:
    """Put each tied output weight under its stock key too (the same tensor)."""
    weights = state["model"]
    for key, table, ties in TIED_OUTPUTS:
        if key not in weights and table in weights and ties(model_cfg):
            weights[key] = weights[table]


#: stock models whose code reads model arguments their configuration dataclass does not hold
#: (``BARTModel.upgrade_state_dict_named`` reads ``args.task``): fairseq builds them right only
#: from an ``argparse.Namespace``, which is what its own checkpoints of them hold, so their
#: export keeps one. Loading it needs ``argparse.Namespace`` allowed, as every stock BART
#: checkpoint does under torch >= 2.6 (``--user-dir``, or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``).
NAMESPACE_MODELS = ("bart",)


def _needs_namespace(model_cfg: Dict[str, Any]) -> bool:
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY

    model = ARCH_MODEL_REGISTRY.get(model_cfg.get("arch") or model_cfg.get("_name"))
    return model is not None and any(MODEL_REGISTRY.get(name) is model for name in NAMESPACE_MODELS)


def export_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """The stock checkpoint dict for an EmbRace checkpoint dict (no I/O)."""
    if state.get("cfg") is None:
        raise ExportError("the checkpoint has no 'cfg' (written by a fairseq older than 0.10?)")
    out = {k: v for k, v in state.items() if k not in TRAINING_STATE}
    out["args"] = None
    cfg = copy.copy(state["cfg"])
    cfg["model"] = stock_model_cfg(cfg["model"])
    cfg["common"] = dict(cfg["common"], user_dir=None)
    if isinstance(cfg.get("task"), argparse.Namespace):
        # a task without a dataclass (translation_from_pretrained_bart) keeps its arguments
        # as a Namespace, which weights_only refuses; fairseq sets such a task up from a dict too
        cfg["task"] = dict(vars(cfg["task"]))
    out["cfg"] = cfg
    out["extra_state"] = {k: v for k, v in (state.get("extra_state") or {}).items() if k != "metrics"}
    out["model"] = dict(state["model"])
    _tied_output_key(out, cfg["model"])
    if _needs_namespace(cfg["model"]):
        cfg["model"] = argparse.Namespace(**cfg["model"])
    return out


def check_loads_as_stock(state: Dict[str, Any]) -> None:
    """Build the stock model from the exported configuration, as fairseq's loader does,
    and load the weights strictly. Raises on any missing or unexpected key."""
    from fairseq import tasks
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(state["cfg"], flags={"allow_objects": True})  # as fairseq's loader (NAMESPACE_MODELS)
    task = tasks.setup_task(cfg.task, from_checkpoint=True)
    model = task.build_model(cfg.model, from_checkpoint=True)
    if type(model).__module__.startswith("embrace_fairseq"):
        raise ExportError(f"the exported configuration still builds {type(model).__name__}")
    model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)


def export(src: str, dst: str, check: bool = True) -> Dict[str, Any]:
    """Read the EmbRace checkpoint ``src``, write the stock one ``dst``; returns the exported dict."""
    if not os.path.isfile(src):
        raise ExportError(f"no checkpoint file {src}" + (" (a folder: name a checkpoint_*.pt in it)"
                                                           if os.path.isdir(src) else ""))
    importlib.import_module("embrace_fairseq.fairseq_adapter")  # registers the architectures for the check
    from embrace_fairseq.fairseq_adapter.compat import fairseq_checkpoint_globals
    from embrace_fairseq.guards.atomic_io import atomic_save, verify
    from embrace_fairseq.guards.safe_load import load

    verify(src)  # a damaged file stops here, named
    state = load(src, fairseq_checkpoint_globals(), map_location="cpu")
    out = export_state(state)
    if check:
        check_loads_as_stock(out)
    atomic_save(out, dst)
    model_cfg = _model_cfg_dict(out["cfg"]["model"])
    name = model_cfg.get("arch") or model_cfg.get("_name")
    logger.info("wrote %s (%s, %d tensors)", dst, name, len(out["model"]))
    return out


@one_line_errors.command  # a bad checkpoint or a missing file: one line, status 2
def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m embrace_fairseq.tools.export_stock",
        description="Write a stock fairseq checkpoint (transformer*, transformer_lm*, roberta*/xlm, bart*/mbart*) "
                    "of an EmbRace one; stock fairseq loads it without --user-dir.")
    parser.add_argument("checkpoint", help="EmbRace checkpoint (e.g. checkpoints/deen/checkpoint_best.pt)")
    parser.add_argument("out", help="file to write (e.g. export/model.pt)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip building the stock model and loading the weights before writing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = export(args.checkpoint, args.out, check=not args.no_check)
    if isinstance(out["cfg"]["model"], argparse.Namespace):  # the BART family (NAMESPACE_MODELS)
        print(f"wrote {args.out}: a stock BART-family checkpoint; like fairseq's own, it loads where "
              "argparse.Namespace is allowed (with --user-dir user_dir, or TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1)")
    else:
        print(f"wrote {args.out}: load it with stock fairseq, no --user-dir "
              "(fairseq-generate --path, TransformerModel / TransformerLanguageModel / RobertaModel"
              ".from_pretrained)")


if __name__ == "__main__":
    main()
