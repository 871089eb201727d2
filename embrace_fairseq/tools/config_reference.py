"""The configuration reference (``docs/CONFIG.md``), generated from the code.

``python -m embrace_fairseq.tools.config_reference > docs/CONFIG.md`` prints it;
``--check docs/CONFIG.md`` exits 1 when the committed page differs from what the code
gives now (the test does the same).

Two sources, read at run time so that a new option needs no edit here:

* every ``--embrace-*`` flag of the fairseq architectures the plugin registers, as
  fairseq builds their parsers (``add_args`` of an argparse model, the fields of a
  dataclass model), with its choices, default, help and the models that take it;
* every key of the DeepSpeed ``"embrace"`` section: the fields of
  :class:`~embrace_fairseq.deepspeed_adapter.config.EmbraceConfig`, their defaults,
  the values the parser accepts, and their description from the class docstring.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Type

FLAG_PREFIX = "--embrace-"
NO_DESCRIPTION = "(no description in the code yet)"


@dataclass(frozen=True)
class Flag:
    """One ``--embrace-*`` flag as the models' parsers declare it."""
    name: str
    choices: Tuple[str, ...]
    default: Any
    switch: bool            # store_true: present or absent
    metavar: Optional[str]
    help: str
    models: Tuple[str, ...]


@dataclass(frozen=True)
class Key:
    """One key of the ``"embrace"`` section."""
    name: str
    default: Any
    values: str
    description: str


def _clean(text: str) -> str:
    """Docstring or help text as one markdown line: Sphinx roles as code spans."""
    text = re.sub(r":(?:mod|class|func|meth|data|attr):`(~?)([^`]+)`",
                  lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    text = text.replace("``", "`")
    return " ".join(text.split()).replace("|", "\\|")


def _model_parser(name: str, cls: type) -> argparse.ArgumentParser:
    from fairseq.dataclass.utils import gen_parser_from_dataclass
    from fairseq.models import MODEL_DATACLASS_REGISTRY

    parser = argparse.ArgumentParser(add_help=False, conflict_handler="resolve")
    if name in MODEL_DATACLASS_REGISTRY:
        gen_parser_from_dataclass(parser, MODEL_DATACLASS_REGISTRY[name]())
    elif hasattr(cls, "add_args"):
        cls.add_args(parser)
    return parser


def registered_models() -> Dict[str, type]:
    """The fairseq models the plugin registers (``embrace_*``), by name."""
    import embrace_fairseq.fairseq_adapter  # noqa: F401  (registers them)
    from fairseq.models import MODEL_REGISTRY

    return {k: v for k, v in sorted(MODEL_REGISTRY.items()) if k.startswith("embrace_")}


def flags_of(parsers: Mapping[str, argparse.ArgumentParser]) -> List[Flag]:
    """Every ``--embrace-*`` flag of ``parsers`` ({model: parser}), merged across models."""
    seen: Dict[str, Tuple[argparse.Action, List[str]]] = {}
    for model, parser in parsers.items():
        for action in parser._actions:
            for opt in action.option_strings:
                if opt.startswith(FLAG_PREFIX):
                    seen.setdefault(opt, (action, []))[1].append(model)
    out = []
    for opt, (action, models) in sorted(seen.items()):
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        choices = tuple(str(c) for c in action.choices) if action.choices else ()
        default = getattr(action.default, "value", action.default)  # a ChoiceEnum member: its value
        out.append(Flag(opt, choices, default, switch, action.metavar if isinstance(action.metavar, str) else None,
                        _clean(action.help or NO_DESCRIPTION), tuple(models)))
    return out


def fairseq_flags() -> List[Flag]:
    """The ``--embrace-*`` flags of every registered EmbRace architecture."""
    return flags_of({name: _model_parser(name, cls) for name, cls in registered_models().items()})


def _docstring_entries(doc: str) -> Dict[str, str]:
    """``name: text`` entries of a class docstring (``a, b: text`` names two), continuation
    lines joined."""
    entries: Dict[str, str] = {}
    current: List[str] = []
    text: List[str] = []

    def close() -> None:
        for name in current:
            entries[name] = _clean(" ".join(text))

    for line in inspect.cleandoc(doc).splitlines():
        m = re.match(r"^(\w+(?:, \w+)*): (.*)$", line)
        if m:
            close()
            current, text = [n.strip() for n in m.group(1).split(",")], [m.group(2)]
        elif current and line.startswith(" "):
            text.append(line.strip())
        elif current and line.strip():
            close()
            current, text = [], []
    close()
    return entries


def _values(name: str, annotation: Any) -> str:
    """What the parser of the section accepts for ``name`` (read from its own tables)."""
    from embrace_fairseq.core.node_topology import EXCHANGES
    from embrace_fairseq.core.shard_plan import LAYOUTS
    from embrace_fairseq.deepspeed_adapter import config as C

    choices = {"output": (C.OUTPUT_MODES, False), "exchange": (EXCHANGES, True), "shard_layout": (LAYOUTS, True)}
    if name in choices:
        options, nullable = choices[name]
        shown = ", ".join(json.dumps(o) for o in options)
        return shown + (", null" if nullable else "")
    if name in C._BOOLS:
        return "true, false"
    if name in C._POSITIVE_INTS:
        return "a positive integer"
    if name in C._POSITIVE_NUMBERS:
        return "a positive number, null"
    if name == "ranks_per_node":
        return "a positive integer, null"
    if name == "trace":
        return "a path prefix, null"
    return str(annotation).replace("typing.", "")


def deepspeed_keys(config_cls: Optional[Type] = None) -> List[Key]:
    """Every key of the ``"embrace"`` section, in the order the dataclass declares them."""
    if config_cls is None:
        from embrace_fairseq.deepspeed_adapter.config import EmbraceConfig as config_cls
    described = _docstring_entries(config_cls.__doc__ or "")
    out = []
    for f in dataclasses.fields(config_cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        text = described.get(f.name, NO_DESCRIPTION).replace("`None`", "`null`")  # as the JSON spells it
        out.append(Key(f.name, default, _values(f.name, f.type), text))
    return out


def _json(value: Any) -> str:
    return json.dumps(value)


def _flag_default(flag: Flag) -> str:
    if flag.switch:
        return "off"
    return "none" if flag.default is None else str(flag.default)


def render(flags: Iterable[Flag], keys: Iterable[Key]) -> str:
    """The page, as markdown."""
    flags, keys = list(flags), list(keys)
    every_model = {m for f in flags for m in f.models}
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by `python -m embrace_fairseq.tools.config_reference > docs/CONFIG.md`; "
        "`tests/tools/test_doc_config_reference.py` checks that it matches the code -->",
        "",
        "Every option EmbRace adds to fairseq and to DeepSpeed, read from the code. Everything else is",
        "fairseq's or DeepSpeed's own. How the options fit together: [FAIRSEQ.md](FAIRSEQ.md),",
        "[DEEPSPEED.md](DEEPSPEED.md).",
        "",
        "## fairseq flags (`--user-dir user_dir`)",
        "",
        f"{len(flags)} flags, on the EmbRace models that list them (all: {', '.join(sorted(every_model))}).",
        "Under `embrace-hydra-train` each is",
        "a `+model.embrace_*` override (`--embrace-output gather` is `+model.embrace_output=gather`).",
        "`embrace-ds-train` takes the same flags; where the `\"embrace\"` section sets the same option",
        "(`output`, `shard_layout`, `exchange`, `ranks_per_node`), a flag and a key that disagree stop",
        "start-up.",
        "",
        "| flag | values | default | models | what it does |",
        "|---|---|---|---|---|",
    ]
    for f in flags:
        models = "all" if set(f.models) == every_model else ", ".join(f"`{m}`" for m in f.models)
        values = ", ".join(f"`{c}`" for c in f.choices) if f.choices else (
            "a switch" if f.switch else f"`{f.metavar}`" if f.metavar else "a value")
        lines.append(f"| `{f.name}` | {values} | `{_flag_default(f)}` | {models} | {f.help} |")
    lines += [
        "",
        "## DeepSpeed: the `\"embrace\"` section",
        "",
        f"{len(keys)} keys, all optional, in the DeepSpeed JSON config beside DeepSpeed's own:",
        "",
        "```json",
        '{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},',
        ' "embrace": {"next_forward": true, "trace": "traces/run"}}',
        "```",
        "",
        "An unknown key or a value outside its range stops start-up with `EmbraceConfigError`",
        "naming it; the section is removed before the rest of the config reaches DeepSpeed.",
        "",
        "| key | values | default | what it does |",
        "|---|---|---|---|",
    ]
    for k in keys:
        lines.append(f"| `{k.name}` | {k.values} | `{_json(k.default)}` | {k.description} |")
    return "\n".join(lines) + "\n"


def reference() -> str:
    """The page for the code as it is now."""
    return render(fairseq_flags(), deepspeed_keys())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", metavar="PAGE", default=None,
                    help="compare PAGE with the generated text; exit 1 when they differ")
    args = ap.parse_args(argv)
    import logging
    logging.disable(logging.WARNING)  # fairseq's and DeepSpeed's import notices
    text = reference()
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{args.check} differs from the code: python -m embrace_fairseq.tools.config_reference "
                      f"> {args.check}", file=sys.stderr)
                return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
