"""Per-rank body of the Python drop-in test: every registered ``embrace_*`` architecture
built beside its stock one from the same arguments, and the stock model's parameter
paths, ties and state-dict keys looked for on the EmbRace model.

Nothing here lists a parameter name: the expected names and groups are read off the
stock model each time, so a stock attribute fairseq adds is covered as it appears.
"""
from __future__ import annotations

import argparse
import copy
import functools
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

PREFIX = "embrace_"
OUTPUT_MODES = ("gather", "vocab-parallel", "auto")
SYMBOLS = 25  # + 4 specials: a 29-row table, divisible by neither 2 nor 3 ranks

TINY_ENCODER = ["--encoder-layers", "1", "--encoder-embed-dim", "8", "--encoder-ffn-embed-dim", "8",
                "--encoder-attention-heads", "1"]
TINY_DECODER = ["--decoder-layers", "1", "--decoder-embed-dim", "8", "--decoder-ffn-embed-dim", "8",
                "--decoder-attention-heads", "1"]
SHORT = ["--max-source-positions", "16", "--max-target-positions", "16"]  # small positional tables
#: kind of stock model -> (task, tiny-model flags, tie variants)
KINDS = {
    "translation": ("translation", [*TINY_ENCODER, *TINY_DECODER, *SHORT],
                    ([], ["--share-decoder-input-output-embed"], ["--share-all-embeddings"])),
    "bart": ("translation", [*TINY_ENCODER, *TINY_DECODER, *SHORT], ([],)),  # BART always shares all embeddings
    "lm": ("language_modeling", [*TINY_DECODER, "--decoder-input-dim", "8", "--decoder-output-dim", "8",
                                 "--tokens-per-sample", "16", "--max-target-positions", "16"],
           ([], ["--share-decoder-input-output-embed"])),
    "roberta": ("masked_lm", [*TINY_ENCODER, "--tokens-per-sample", "16"], ([], ["--untie-weights-roberta"])),
}


def embrace_architectures() -> List[str]:
    """Every registered EmbRace architecture."""
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (registers them)
    from fairseq.models import ARCH_MODEL_REGISTRY

    return sorted(a for a in ARCH_MODEL_REGISTRY if a.startswith(PREFIX))


def kind_of(arch: str) -> str:
    """Which family the stock architecture of ``arch`` belongs to (from its model class)."""
    from fairseq.models import ARCH_MODEL_REGISTRY, FairseqEncoderDecoderModel, FairseqLanguageModel
    from fairseq.models.bart import BARTModel
    from fairseq.models.roberta import RobertaModel

    stock = ARCH_MODEL_REGISTRY[arch[len(PREFIX):]]
    for cls, kind in ((RobertaModel, "roberta"), (BARTModel, "bart"), (FairseqLanguageModel, "lm"),
                      (FairseqEncoderDecoderModel, "translation")):
        if issubclass(stock, cls):
            return kind
    raise AssertionError(f"{arch}: no drop-in case for its stock model {stock.__name__}")


def cases(archs: Sequence[str], modes: Sequence[str] = OUTPUT_MODES,
          rotate: Optional[int] = None) -> List[Tuple[str, Tuple[str, ...], str]]:
    """(architecture, tie flags, output mode) for every architecture, tie variant and mode;
    with ``rotate``, one mode per architecture and tie variant, taken in turn (starting
    ``rotate`` modes on), so consecutive cases of a family cover every mode."""
    pairs = [(arch, tuple(ties)) for arch in archs for ties in KINDS[kind_of(arch)][2]]
    if rotate is None:
        return [(arch, ties, mode) for arch, ties in pairs for mode in modes]
    return [(arch, ties, modes[(i + rotate) % len(modes)]) for i, (arch, ties) in enumerate(pairs)]


class Dictionaries:
    """What a model's ``build_model`` reads from its task: the dictionaries (one shared)."""

    def __init__(self) -> None:
        from fairseq.data import Dictionary

        d = Dictionary()
        for i in range(SYMBOLS):
            d.add_symbol(f"w{i}")
        self.source_dictionary = self.target_dictionary = d


@functools.lru_cache(maxsize=None)
def parsed_args(arch: str, ties: Tuple[str, ...]) -> argparse.Namespace:
    """``arch``'s arguments as fairseq's parser makes them (its preset applied)."""
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (registers the architectures)
    from fairseq import options

    task, tiny, _ = KINDS[kind_of(arch)]
    return options.parse_args_and_arch(options.get_training_parser(), [
        "unused-data-dir", "--task", task, "--arch", arch, *tiny, *ties, "--cpu"])


def build_pair(arch: str, ties: Sequence[str], mode: str) -> Tuple[nn.Module, nn.Module]:
    """(stock model, EmbRace model) from one model configuration: ``arch``'s parsed
    arguments with ``--embrace-output mode`` (a model with a configuration dataclass gets
    it from them as ``fairseq.models.build_model`` makes it); each model class builds
    from its own copy, same seed."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    args = copy.deepcopy(parsed_args(arch, tuple(ties)))
    args.embrace_output = mode
    dc = getattr(ARCH_MODEL_REGISTRY[arch], "__dataclass", None)
    model_cfg = dc.from_namespace(args) if dc is not None else args
    models = []
    for name in (arch[len(PREFIX):], arch):
        torch.manual_seed(3)
        models.append(ARCH_MODEL_REGISTRY[name].build_model(copy.deepcopy(model_cfg), Dictionaries()))
    return models[0], models[1]


def resolve(model: nn.Module, dotted: str) -> Any:
    """``model.a.b.c`` for ``"a.b.c"``, as a script reaches it."""
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def tie_groups(named: Sequence[Tuple[str, Any]]) -> List[List[str]]:
    """The names that hold one object, grouped (sorted, for comparing)."""
    groups: Dict[int, List[str]] = defaultdict(list)
    for name, obj in named:
        groups[id(obj)].append(name)
    return sorted(sorted(g) for g in groups.values())


def check_pair(stock: nn.Module, ours: nn.Module) -> List[str]:
    """What a script would find different on ``ours`` (empty: nothing). Collective on a
    world of several ranks (full tables are gathered); every rank runs it alike."""
    from embrace_fairseq.core.sharded_embedding import consolidate, is_sharded_param, table_of

    problems: List[str] = []
    stock_named = list(stock.named_parameters(remove_duplicate=False))
    resolved, sharded = [], False
    for name, p in stock_named:
        try:
            obj = resolve(ours, name)
        except AttributeError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if not isinstance(obj, nn.Parameter):
            problems.append(f"{name}: a {type(obj).__name__}, not a parameter")
            continue
        resolved.append((name, obj))
        table = table_of(obj) if is_sharded_param(obj) else None
        if table is not None and table.is_sharded:
            # a shard answers as what it is: this rank's rows, marked; the full table is
            # one call on the module that holds it under this name
            sharded = True
            rows = len(table.vocab_ids())
            if tuple(obj.shape) != (rows, p.shape[1]):
                problems.append(f"{name}: shard of shape {tuple(obj.shape)}, this rank owns {rows} rows")
            full = resolve(ours, name.rpartition(".")[0]).full_weight()
        else:
            full = obj
        if full.shape != p.shape:
            problems.append(f"{name}: full shape {tuple(full.shape)}, stock {tuple(p.shape)}")
        elif not torch.equal(full, p):
            problems.append(f"{name}: other values than the stock model's")
    # None-valued entries too (an nn.Linear(bias=False)'s bias): a script reads them as None
    for mod_name, mod in stock.named_modules():
        for key, value in mod._parameters.items():
            name = f"{mod_name}.{key}" if mod_name else key
            if value is None and resolve_or(ours, name, "missing") is not None:
                problems.append(f"{name}: stock None, here {resolve_or(ours, name, 'missing')!r:.60}")
    if len(resolved) == len(stock_named) and tie_groups(resolved) != tie_groups(stock_named):
        problems.append(f"ties: {tie_groups(resolved)} where stock has {tie_groups(stock_named)}")
    ours_names = [n for n, _ in ours.named_parameters()]
    stock_names = [n for n, _ in stock.named_parameters()]
    if ours_names != stock_names:
        problems.append(f"named_parameters(): {_diff(ours_names, stock_names)}")
    if sharded:
        problems += _unconsolidated_state_dict_refused(ours)
    consolidate(ours)  # a state dict of sharded tables needs them gathered (collective)
    ours_keys, stock_keys = list(ours.state_dict()), list(stock.state_dict())
    if ours_keys != stock_keys:
        problems.append(f"state_dict(): {_diff(ours_keys, stock_keys)}")
    return problems + _check_loads(stock, ours)


def _unconsolidated_state_dict_refused(ours: nn.Module) -> List[str]:
    """``state_dict()`` of sharded tables not gathered stops, naming both calls."""
    try:
        ours.state_dict()
    except RuntimeError as exc:
        if "consolidate(model)" in str(exc) and "full_weight()" in str(exc):
            return []
        return [f"state_dict() before consolidate: the error names neither call: {exc}"]
    return ["state_dict() before consolidate did not stop"]


def _check_loads(stock: nn.Module, ours: nn.Module) -> List[str]:
    """Stock weights (moved off the shared draw) load strictly into ``ours``, also
    without the tied output weight's second key (a checkpoint written before it was
    listed), and ``ours``'s state dict loads strictly into the stock model."""
    from embrace_fairseq.core.sharded_embedding import consolidate

    problems = []
    with torch.no_grad():
        for p in stock.parameters():  # each tied parameter once
            p.add_(0.5)
    state = stock.state_dict()
    tables = _table_paths(ours)
    twins = {name for group in tie_groups(list(stock.named_parameters(remove_duplicate=False))) if len(group) > 1
             for name in group if name.rpartition(".")[0] not in tables}
    for what, sd in (("stock state dict", state), ("without its tied output keys", {
            k: v for k, v in state.items() if k not in twins})):
        try:
            ours.load_state_dict(sd, strict=True)
        except RuntimeError as exc:
            problems.append(f"load of the {what}: {str(exc)[:300]}")
            continue
        consolidate(ours)
        differ = [k for k, v in ours.state_dict().items() if not torch.equal(v, state[k])]
        if differ:
            problems.append(f"after the load of the {what}, other values under {differ}")
    fresh = copy.deepcopy(stock)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    try:
        fresh.load_state_dict(ours.state_dict(), strict=True)
    except RuntimeError as exc:
        problems.append(f"stock load of this state dict: {str(exc)[:300]}")
    else:
        if any(not torch.equal(v, state[k]) for k, v in fresh.state_dict().items()):
            problems.append("the stock model loaded other values from this state dict")
    return problems


def _table_paths(model: nn.Module) -> set:
    """Module paths of the token tables themselves (not the layers tied to them)."""
    from embrace_fairseq.core.sharded_embedding import ShardedEmbedding

    return {n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, (ShardedEmbedding, nn.Embedding))}


def resolve_or(model: nn.Module, dotted: str, default: Any) -> Any:
    try:
        return resolve(model, dotted)
    except AttributeError:
        return default


def _diff(ours: List[str], stock: List[str]) -> str:
    if set(ours) == set(stock):
        return "same names in another order"
    return f"only here {sorted(set(ours) - set(stock))}, only stock {sorted(set(stock) - set(ours))}"


def check_cases(rank: int, world: int, case_list: Sequence[Tuple[str, Tuple[str, ...], str]]) -> Dict[str, List[str]]:
    """{case: problems} for every case, on this rank (``run_ranks`` body; also runs
    in-process for a world of one)."""
    out = {}
    for arch, ties, mode in case_list:
        stock, ours = build_pair(arch, ties, mode)
        out[f"{arch} {' '.join(ties) or 'untied'} {mode}"] = check_pair(stock, ours)
    return out
