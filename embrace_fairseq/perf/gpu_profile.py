"""A measured training step of each released model on one GPU, set against the regimes.

The regimes (:mod:`.simulator.regimes`) assume a sustained rate per GPU (30 TFLOP/s on a
V100, 120 on an A100) and count a real model's step with the simulator's arithmetic
(:mod:`.simulator.real_models`: 6 FLOPs per parameter per token, attention scores, the
output layer). This tool checks both on the GPU at hand: it builds each released model
with stock fairseq at its real dimensions and tokens per GPU (:data:`SPECS`), trains it a
few steps in bf16 autocast with AdamW (fused on a GPU), and reports

* the step's FLOPs as PyTorch counts them (``torch.utils.flop_counter``) against the
  simulator's count for the same model (is the arithmetic right?);
* forward + backward time and the rate it sustains, as a share of the GPU's own measured
  bf16 matrix-product rate and of its datasheet peak; the regimes' rates as the same share
  of their GPUs' datasheet peaks (:data:`DATASHEET_PEAK_TFLOPS`), so the two can be read
  side by side (a share measured on one GPU, not a V100's or an A100's own rate);
* the optimizer step's time beside the bytes the simulator charges it (32 per parameter,
  at the regime's memory rate), and the peak memory;
* each regime's assumed forward + backward for the model against the measured one
  (:func:`compare_to_regimes`).

    python -m embrace_fairseq.perf.gpu_profile --out results/gpu/h200/compute_profile.json
    python -m embrace_fairseq.perf.gpu_profile --tiny --device cpu --out /tmp/p.json   # the machinery, anywhere
    python -m embrace_fairseq.perf.gpu_profile --table results/gpu/h200/compute_profile.json

``--tiny`` shrinks every model to one layer a side of width 32 and a 500-row table (its
counts are then not the released models', and no simulator count is set against them).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

import torch

from embrace_fairseq.guards import one_line_errors

#: dense bf16/fp16 tensor-core peaks from NVIDIA's datasheets (no sparsity), TFLOP/s
DATASHEET_PEAK_TFLOPS: Dict[str, float] = {"V100": 125.0, "A100": 312.0, "H100": 989.0, "H200": 989.0}
#: the GPU each regime stands for
REGIME_GPU: Dict[str, str] = {"v100-25g": "V100", "a100-100g": "A100"}


@dataclass(frozen=True)
class ModelSpec:
    """A released model as stock fairseq builds it, and one GPU's batch in its training."""

    real_model: str  # the name in :data:`.simulator.real_models.REAL_MODELS`
    arch: str
    vocab: int
    objective: str  # "masked_lm" | "translation" | "lm" | "adaptive_lm"
    sequences: int
    length: int  # tokens per sequence (per side for translation)
    overrides: Dict[str, Any] = field(default_factory=dict)
    masked_share: float = 0.15

    @property
    def tokens(self) -> int:
        return self.sequences * self.length


#: the batches are the simulator's tokens per GPU (:mod:`.simulator.real_models`)
SPECS: Dict[str, ModelSpec] = {s.real_model: s for s in (
    ModelSpec("xlmr_base", "roberta_base", 250_002, "masked_lm", 16, 512),
    # pre-norm, as the released checkpoint (fairseq's mbart_large arch alone is post-norm)
    ModelSpec("mbart_large", "mbart_large", 250_027, "translation", 32, 32,
              dict(encoder_normalize_before=True, decoder_normalize_before=True)),
    ModelSpec("m2m100_418m", "transformer_wmt_en_de_big", 128_112, "translation", 32, 32,
              dict(encoder_layers=12, decoder_layers=12, encoder_normalize_before=True,
                   decoder_normalize_before=True, share_all_embeddings=True)),
    ModelSpec("transformer_base_wmt_en_de", "transformer_wmt_en_de", 32_768, "translation", 125, 28,
              dict(share_all_embeddings=True)),
    # the paper's LM: a full-width token table and the adaptive softmax, untied (the
    # wiki103 arch alone ties an adaptive input to it)
    ModelSpec("transformer_lm_wikitext103_267k", "transformer_lm_wiki103", 267_744, "adaptive_lm", 6, 512,
              dict(adaptive_input=False, tie_adaptive_weights=False, tie_adaptive_proj=False)),
    ModelSpec("gpt2_small", "transformer_lm_gpt", 50_257, "lm", 8, 1024,
              dict(share_decoder_input_output_embed=True, decoder_learned_pos=True)),
)}

TINY = dict(encoder_layers=1, decoder_layers=1, encoder_embed_dim=32, decoder_embed_dim=32,
            encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64, encoder_attention_heads=2,
            decoder_attention_heads=2, decoder_input_dim=32, decoder_output_dim=32)
#: the adaptive LM's clusters within the tiny table (its released ones end at row 60,000)
TINY_ADAPTIVE = dict(adaptive_softmax_cutoff="100,300", adaptive_input_cutoff="100,300")


def tiny_spec(spec: ModelSpec) -> ModelSpec:
    """``spec`` at one layer a side of width 32, a 500-row table and short sequences."""
    return ModelSpec(spec.real_model, spec.arch, 500, spec.objective, min(spec.sequences, 4), min(spec.length, 16),
                     {**spec.overrides, **TINY, **(TINY_ADAPTIVE if spec.objective == "adaptive_lm" else {})},
                     spec.masked_share)


def _dictionary(rows: int):
    from fairseq.data import Dictionary

    d = Dictionary()  # 4 specials; the rest stand for the released vocabulary's pieces
    for i in range(rows - len(d)):
        d.add_symbol(f"p{i}")
    assert len(d) == rows, (len(d), rows)
    return d


def build(spec: ModelSpec) -> SimpleNamespace:
    """The model, its fairseq criterion and the task they read (dictionaries, sizes)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    d = _dictionary(spec.vocab)
    task = SimpleNamespace(source_dictionary=d, target_dictionary=d, dictionary=d,
                           max_positions=lambda: spec.length)
    model_cls = ARCH_MODEL_REGISTRY[spec.arch]
    # fairseq's arch functions fill only what is unset: the model's flags are absent unless
    # given, as options.parse_args_and_arch adds them (argument_default=SUPPRESS)
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    model_cls.add_args(parser)
    args = parser.parse_args([])
    for k, v in spec.overrides.items():
        setattr(args, k, v)
    args.arch = spec.arch
    args.tokens_per_sample = spec.length
    args.max_source_positions = args.max_target_positions = max(1024, spec.length)
    ARCH_CONFIG_REGISTRY[spec.arch](args)
    model = model_cls.build_model(args, task)
    return SimpleNamespace(model=model, criterion=_criterion(spec, task), task=task, args=args)


def _criterion(spec: ModelSpec, task: Any):
    from embrace_fairseq.perf.bench.workloads import fairseq_criterion

    return fairseq_criterion({"adaptive_lm": "adaptive_loss"}.get(spec.objective, spec.objective), task)


def _zipf_ids(n: int, rows: int, generator: torch.Generator, s: float = 1.0) -> torch.Tensor:
    """Ids drawn as text draws them (rank r with probability ~ r^-s), past the 4 specials;
    the adaptive softmax's cost depends on which of its clusters the targets fall in."""
    ranks = torch.arange(1, rows - 4 + 1, dtype=torch.float64)
    return torch.multinomial(ranks.pow(-s), n, replacement=True, generator=generator) + 4


def sample(spec: ModelSpec, task: Any, device: torch.device, seed: int = 1) -> Dict[str, Any]:
    """One GPU's batch of ``spec``: the fairseq sample its criterion reads."""
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    shape = (spec.sequences, spec.length)
    ids = _zipf_ids(spec.tokens, spec.vocab, g).view(shape)
    lengths = torch.full((spec.sequences,), spec.length, dtype=torch.long)
    if spec.objective == "masked_lm":
        ids[:, 0] = d.bos()
        chosen = torch.rand(shape, generator=g) < spec.masked_share
        chosen[:, 0] = False
        target = torch.where(chosen, ids, torch.full_like(ids, d.pad()))
        src = torch.where(chosen, torch.full_like(ids, d.unk()), ids)  # stands for <mask>
        out = {"net_input": {"src_tokens": src}, "target": target, "ntokens": int(chosen.sum())}
    elif spec.objective == "translation":
        tgt = _zipf_ids(spec.tokens, spec.vocab, g).view(shape)
        prev = torch.cat([torch.full((spec.sequences, 1), d.eos()), tgt[:, :-1]], dim=1)
        out = {"net_input": {"src_tokens": ids, "src_lengths": lengths, "prev_output_tokens": prev},
               "target": tgt, "ntokens": spec.tokens}
    else:
        out = {"net_input": {"src_tokens": ids[:, :-1].contiguous(), "src_lengths": lengths - 1},
               "target": ids[:, 1:].contiguous(), "ntokens": spec.tokens - spec.sequences}
    out["nsentences"] = spec.sequences
    return _to(out, device)


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x.to(device) if torch.is_tensor(x) else x


class _Timer:
    """Elapsed seconds of a region: CUDA events on a GPU (the device's time), else the clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "_Timer":
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.seconds = time.perf_counter() - self.t0

    def elapsed(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.seconds


def _forward_backward(built: SimpleNamespace, batch: Dict[str, Any], autocast: bool, device: torch.device) -> float:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, sample_size, _ = built.criterion(built.model, batch)
    (loss / sample_size).backward()
    return float(loss.detach()) / float(sample_size)


def counted_flops(built: SimpleNamespace, batch: Dict[str, Any], device: torch.device, autocast: bool) -> int:
    """Forward + backward FLOPs of one step as PyTorch's flop counter counts them (matrix
    products and attention; element-wise work is not counted, as the simulator's is not)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _forward_backward(built, batch, autocast, device)
    built.model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def _median_interval(xs: Sequence[float]) -> Dict[str, float]:
    """Median with a distribution-free 95 % interval (order statistics of the binomial)."""
    s = sorted(xs)  # milliseconds
    n = len(s)
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = max(0, int(math.floor(n / 2 - half))), min(n - 1, int(math.ceil(n / 2 + half)) - 1)
    return {"median": statistics.median(s), "low": s[lo], "high": s[hi], "n": n, "confidence": 0.95}


def profile_model(spec: ModelSpec, device: torch.device, steps: int = 10, warmup: int = 3,
                  autocast: Optional[bool] = None) -> Dict[str, Any]:
    """Build ``spec``, count its step's FLOPs, time ``steps`` training steps after ``warmup``."""
    autocast = device.type == "cuda" if autocast is None else autocast
    torch.manual_seed(1)
    built = build(spec)
    model = built.model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch = sample(spec, built.task, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    flops = counted_flops(built, batch, device, autocast)
    fwd_bwd, optim, losses = [], [], []
    for i in range(warmup + steps):
        with _Timer(device) as t_fb:
            losses.append(_forward_backward(built, batch, autocast, device))
        with _Timer(device) as t_opt:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if i >= warmup:
            fwd_bwd.append(t_fb.elapsed() * 1e3)
            optim.append(t_opt.elapsed() * 1e3)
    fb = _median_interval(fwd_bwd)
    out = {
        "real_model": spec.real_model, "arch": spec.arch, "vocab": spec.vocab, "objective": spec.objective,
        "batch": [spec.sequences, spec.length], "tokens": spec.tokens, "parameters": params,
        "counted_flops": flops, "forward_backward_ms": fb, "optimizer_ms": _median_interval(optim),
        "sustained_tflops": flops / fb["median"] / 1e9, "losses": losses, "autocast_bf16": autocast,
        "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30) if device.type == "cuda" else None,
    }
    del built, model, opt, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def simulator_terms(real_model: str) -> Dict[str, float]:
    """The simulator's training FLOPs (forward + backward) and optimizer bytes of a step."""
    from embrace_fairseq.perf.simulator.real_models import REAL_MODELS

    p = REAL_MODELS[real_model].build(1.0, 1.0, 2)  # at 1 FLOP/s and 1 B/s, seconds are counts
    return {"train_flops": p.forward_s + p.backward_s, "optimizer_bytes": p.optimizer_s}


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """The device's bf16 matrix-product rate on random n x n operands, the attainable top."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    with _Timer(device) as t:
        for _ in range(reps):
            a @ b
    return 2 * n ** 3 * reps / t.elapsed() / 1e12


def _gpu_family(name: str) -> Optional[str]:
    return next((k for k in DATASHEET_PEAK_TFLOPS if k in name.upper()), None)


def regime_shares() -> Dict[str, Dict[str, float]]:
    """Each regime's sustained rate as a share of its GPU's datasheet peak."""
    from embrace_fairseq.perf.simulator.regimes import REGIMES

    return {name: {"gpu": REGIME_GPU[name], "sustained_tflops": r.sustained_flops / 1e12,
                   "share_of_peak": r.sustained_flops / 1e12 / DATASHEET_PEAK_TFLOPS[REGIME_GPU[name]],
                   "memory_gbytes_per_s": r.memory_bytes_per_s / 1e9}
            for name, r in REGIMES.items()}


def compare_to_regimes(result: Dict[str, Any]) -> Dict[str, Any]:
    """Each released model's forward + backward as each regime assumes it (the simulator's
    FLOPs at the regime's rate) against the step measured here (in place; returns ``result``).

    A GPU slower in every resource than the one measured (a V100 or an A100 against an
    H200), running the same code on the same batch, cannot take less time: where the
    measured step is longer than the assumed one (``measured_over_assumed`` above 1), the
    regime takes the model's compute as shorter than any such GPU can make it, and so
    overstates the share of the step that communication takes by at least that factor."""
    for m in result["models"]:
        if "simulator_flops" not in m:
            continue
        m["regimes"] = {}
        for name, r in result["regimes"].items():
            assumed = m["simulator_flops"] / (r["sustained_tflops"] * 1e12) * 1e3
            m["regimes"][name] = {"assumed_forward_backward_ms": assumed,
                                  "measured_over_assumed": m["forward_backward_ms"]["median"] / assumed}
    return result


def markdown_table(result: Dict[str, Any]) -> str:
    """The profile as the docs show it (one row per released model)."""
    names = list(result["regimes"])
    head = ["released model", "tokens per GPU", "counted / simulator's FLOPs", "forward + backward (ms)",
            "TFLOP/s", "share of the matrix-product rate"]
    head += [f"{n}: assumed (ms), measured / assumed" for n in names]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in result["models"]:
        fb = m["forward_backward_ms"]
        cells = [m["real_model"], f"{m['tokens']:,}", f"{m.get('counted_over_simulator', float('nan')):.2f}x",
                 f"{fb['median']:.1f} [{fb['low']:.1f}, {fb['high']:.1f}]",
                 f"{m['sustained_tflops']:.1f}", f"{m['share_of_matmul'] * 100:.1f} %"]
        for n in names:
            r = m.get("regimes", {}).get(n)
            cells.append(f"{r['assumed_forward_backward_ms']:.1f}, {r['measured_over_assumed']:.2f}x" if r else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def run(names: Sequence[str], device: torch.device, tiny: bool, steps: int, warmup: int) -> Dict[str, Any]:
    from embrace_fairseq.perf.provenance import source_state

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    top = matmul_tflops(device, n=8192 if device.type == "cuda" else 256)
    family = _gpu_family(gpu) if gpu else None
    peak = DATASHEET_PEAK_TFLOPS.get(family) if family else None
    result: Dict[str, Any] = {
        **source_state(), "device": gpu or "cpu", "torch": torch.__version__, "tiny": tiny,
        "matmul_bf16_tflops": top, "datasheet_peak_tflops": peak, "regimes": regime_shares(), "models": [],
    }
    for name in names:
        spec = tiny_spec(SPECS[name]) if tiny else SPECS[name]
        m = profile_model(spec, device, steps=steps, warmup=warmup)
        m["share_of_matmul"] = m["sustained_tflops"] / top
        m["share_of_peak"] = m["sustained_tflops"] / peak if peak else None
        if not tiny:
            sim = simulator_terms(name)
            m["simulator_flops"] = sim["train_flops"]
            m["counted_over_simulator"] = m["counted_flops"] / sim["train_flops"]
            m["simulator_optimizer_bytes"] = sim["optimizer_bytes"]
        result["models"].append(m)
        print(f"{name}: {m['counted_flops'] / 1e12:.2f} TFLOP counted"
              + (f" ({m['counted_over_simulator']:.2f}x the simulator's)" if not tiny else "")
              + f", forward+backward {m['forward_backward_ms']['median']:.1f} ms, "
              f"{m['sustained_tflops']:.1f} TFLOP/s ({m['share_of_matmul']:.0%} of the matrix-product rate), "
              f"optimizer {m['optimizer_ms']['median']:.1f} ms", flush=True)
    return compare_to_regimes(result)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="the JSON to write")
    p.add_argument("--table", type=Path, metavar="JSON",
                   help="print a profile's table (with its comparison to the regimes) and exit")
    p.add_argument("--models", nargs="+", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="one small layer a side: the machinery, not the models")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    if a.table is not None:
        print(markdown_table(compare_to_regimes(json.loads(a.table.read_text()))))
        return 0
    if a.out is None:
        p.error("--out is required (or --table JSON)")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{one_line_errors.PREFIX}--device cuda but no GPU is visible; use --device cpu --tiny", file=sys.stderr)
        return one_line_errors.USER_ERROR_EXIT
    result = run(a.models, device, a.tiny, a.steps, a.warmup)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
