"""Training checks of ``scripts/gpu_check.py`` (one GPU): fairseq fp16 EmbRace vs stock,
a memory-efficient fp16 resume, DeepSpeed fp16/bf16 ZeRO-1 EmbRace vs stock, fp16 ZeRO-1
skipping a step with a non-finite shard gradient. Every run is
a world of one on NCCL with the exchange forced on (``EMBRACE_FORCE_EXCHANGE=1``, set by
the driver), so the EmbRace paths run their collectives on the GPU. With ``--cpu-smoke``
they are planned only: the commands are recorded, nothing is trained."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
TINY_MT = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
           "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4",
           "--decoder-attention-heads", "4", "--share-all-embeddings", "--dropout", "0", "--attention-dropout", "0",
           "--optimizer", "adam", "--lr", "0.001", "--seed", "3", "--max-tokens", "2048", "--num-workers", "0",
           "--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints", "--ddp-backend", "legacy_ddp",
           "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
# fp16/bf16 losses of two equivalent runs drift apart a little; a real bug gives far more
LOSS_TOL = {"fp16": 0.02, "bf16": 0.05}


def _venv(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _world_of_one(port: int) -> List[str]:
    """fairseq flags that make one process a distributed job (so the exchange runs on NCCL)."""
    return ["--distributed-world-size", "1", "--distributed-rank", "0", "--distributed-no-spawn",
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-backend", "nccl"]


def _corpus(out: Path) -> Path:
    from fairseq_corpus import make_translation_corpus

    dest = out / "corpus"
    if (dest / "dict.src.txt").exists():
        return dest
    return make_translation_corpus(out / "corpus_work", n_train=2000, n_valid=50, vocab_size=400)


def _train(data: Path, arch: str, save_dir: Path, extra: Sequence[str], plan: List[List[str]], cpu: bool,
           timeout: float = 150) -> Dict[int, float]:
    from gpu_check_workers import free_port

    cmd = [_venv("fairseq-train"), str(data), "--task", "translation", "--arch", arch, "--user-dir",
           str(ROOT / "user_dir"), *TINY_MT, "--save-dir", str(save_dir), *_world_of_one(free_port()), *extra]
    plan.append(cmd)
    if cpu:
        return {}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    text = out.stdout + out.stderr
    (save_dir.parent / f"{save_dir.name}.log").write_text(text)
    if out.returncode != 0:
        raise RuntimeError(f"{arch} failed:\n{text[-3000:]}")
    from fairseq_corpus import parse_json_records

    return {int(float(r["num_updates"])): float(r["loss"]) for r in parse_json_records(text)
            if r["_tag"] == "train_inner" and "loss" in r and "num_updates" in r}


def _rel(a: Dict[int, float], b: Dict[int, float]) -> float:
    common = sorted(set(a) & set(b))
    if not common:
        raise AssertionError("no common updates to compare")
    return max(abs(a[u] - b[u]) / max(abs(b[u]), 1e-6) for u in common)


def fairseq_vs_stock(out: Path, cpu: bool) -> Dict[str, Any]:
    data = _corpus(out) if not cpu else Path("<corpus>")
    plan: List[List[str]] = []
    d: Dict[str, Any] = {}
    # fp16 only: fairseq's --bf16 is its TPU mode (options.py sets --tpu with it), which
    # stock fairseq cannot run on a GPU either; bf16 on a GPU is DeepSpeed's (see ``deepspeed``)
    # fairseq's FP16Optimizer (fp32 masters; per parameter for EmbRace, fp16_masters.py) and
    # its memory-efficient variant
    for name, extra in (("fp16", []), ("fp16_memory_efficient", ["--memory-efficient-fp16"])):
        flags = ["--fp16", *extra, "--max-update", "12"]
        stock = _train(data, "transformer", out / f"fairseq_{name}_stock", flags, plan, cpu)
        ours = _train(data, "embrace_transformer", out / f"fairseq_{name}_embrace", flags, plan, cpu)
        if not cpu:
            d[f"{name}_max_rel_loss_diff"] = err = _rel(ours, stock)
            d[f"{name}_updates"] = len(ours)
            if not (err <= LOSS_TOL["fp16"] and len(ours) >= 12):
                return {"status": "fail", "detail": d}
    return {"status": "skip" if cpu else "pass", "detail": d if not cpu else {"planned": plan}}


def fairseq_resume(out: Path, cpu: bool) -> Dict[str, Any]:
    """--memory-efficient-fp16: 8 updates; 4, then resumed to 8: updates 5..8 alike."""
    data = _corpus(out) if not cpu else Path("<corpus>")
    plan: List[List[str]] = []
    flags = ["--fp16", "--memory-efficient-fp16", "--save-interval-updates", "4"]
    full = _train(data, "embrace_transformer", out / "resume_full", flags + ["--max-update", "8"], plan, cpu)
    _train(data, "embrace_transformer", out / "resume_part", flags + ["--max-update", "4"], plan, cpu)
    resumed = _train(data, "embrace_transformer", out / "resume_part", flags + ["--max-update", "8"], plan, cpu)
    if cpu:
        return {"status": "skip", "detail": {"planned": plan}}
    after = {u: v for u, v in resumed.items() if u > 4}
    err = _rel(after, full)
    d = {"resumed_updates": sorted(after), "max_rel_loss_diff": err}
    ok = sorted(after) == [5, 6, 7, 8] and err <= 1e-3
    return {"status": "pass" if ok else "fail", "detail": d}


def _ds_losses(cfg: Dict[str, Any], sharded: bool, steps: int, device: Any) -> Any:
    import deepspeed
    import torch
    from rank_fns_deepspeed import TinyLM, _batch

    from embrace_fairseq.deepspeed_adapter import initialize

    model = TinyLM(sharded, True).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    init = initialize if sharded else deepspeed.initialize
    engine, *_ = init(model=model, optimizer=opt, model_parameters=list(model.parameters()), config=dict(cfg))
    losses = []
    for step in range(steps):
        ids, tgt = (t.to(device) for t in _batch(step, 0))
        loss = engine(ids, tgt)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, engine, model


def _masters_follow_loaded_weights(cfg: Dict[str, Any], device: Any) -> float:
    """bf16 ZeRO-1: load the initial weights after training, step with lr 0: unchanged."""
    import torch
    from rank_fns_deepspeed import _batch

    from embrace_fairseq.core.sharded_embedding import consolidate, release_consolidated

    _, engine, model = _ds_losses(cfg, True, 0, device)
    consolidate(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    release_consolidated(model)
    for step in range(2):
        engine.backward(engine(*(t.to(device) for t in _batch(step, 0))))
        engine.step()
    model.load_state_dict(initial)
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.0
    engine.backward(engine(*(t.to(device) for t in _batch(7, 0))))
    engine.step()
    consolidate(model)
    after = model.state_dict()
    release_consolidated(model)
    return max(float((after[k].float() - initial[k].float()).abs().max()) for k in initial)


def deepspeed_vs_stock(out: Path, cpu: bool) -> Dict[str, Any]:
    from rank_fns_deepspeed import _ds_config

    cfgs = {"fp16": dict(_ds_config(stage=1), fp16={"enabled": True, "initial_scale_power": 8}),
            "bf16": dict(_ds_config(stage=1), bf16={"enabled": True})}
    if cpu:
        return {"status": "skip", "detail": {"planned": cfgs}}
    import deepspeed
    import torch

    from gpu_check_workers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_SIZE="1")
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    device = torch.device("cuda", 0)
    d: Dict[str, Any] = {}
    for prec, cfg in cfgs.items():
        stock, _, _ = _ds_losses(cfg, False, 8, device)
        ours, _, _ = _ds_losses(cfg, True, 8, device)
        d[f"{prec}_losses"] = {"stock": stock, "embrace": ours}
        d[f"{prec}_max_rel_loss_diff"] = err = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(ours, stock))
        if err > LOSS_TOL[prec]:
            return {"status": "fail", "detail": d}
    d["bf16_weights_after_lr0_step_minus_loaded"] = diff = _masters_follow_loaded_weights(cfgs["bf16"], device)
    return {"status": "pass" if diff == 0.0 else "fail", "detail": d}


def deepspeed_fp16_skip(out: Path, cpu: bool) -> Dict[str, Any]:
    """fp16 ZeRO-1 with ``zero_optimization.compute_grad_norm: false`` (the overflow check is
    DeepSpeed's only skip decision): a NaN in the table shard's gradient at step 2 skips
    that step for the dense weights and the shards alike (both unchanged, the loss scale
    halved); the other steps apply."""
    from rank_fns_deepspeed import _ds_config

    # hysteresis 1: the first overflow halves the scale (DeepSpeed's default waits for a second)
    cfg = dict(_ds_config(stage=1, clip=0.0), fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    cfg["zero_optimization"] = {"stage": 1, "compute_grad_norm": False}
    if cpu:
        return {"status": "skip", "detail": {"planned": cfg, "why": "DeepSpeed's fp16 does not run on CPU; "
                                             "tests/deepspeed_adapter/test_zero1_overflow_shards.py checks the decision"}}
    import deepspeed
    import torch
    from rank_fns_deepspeed import TinyLM, _batch

    from embrace_fairseq.deepspeed_adapter import initialize
    from gpu_check_workers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_SIZE="1")
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    device = torch.device("cuda", 0)
    model = TinyLM(True, True).to(device)
    engine, *_ = initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                            model_parameters=list(model.parameters()), config=dict(cfg))
    poison_at = 2
    model.emb.weight.register_hook(
        lambda g: torch.full_like(g, float("nan")) if engine.global_steps == poison_at else g)
    steps = []
    for step in range(4):
        shard0, dense0 = model.emb.weight.detach().clone(), model.fc1.weight.detach().clone()
        scale0 = float(engine.optimizer.loss_scale)
        ids, tgt = (t.to(device) for t in _batch(step, 0))
        engine.backward(engine(ids, tgt))
        engine.step()
        steps.append({"applied": bool(engine.was_step_applied()),
                      "shard_changed": bool((model.emb.weight.detach() != shard0).any()),
                      "dense_changed": bool((model.fc1.weight.detach() != dense0).any()),
                      "loss_scale_before": scale0, "loss_scale_after": float(engine.optimizer.loss_scale)})
    want = [{"applied": s != poison_at, "shard_changed": s != poison_at, "dense_changed": s != poison_at}
            for s in range(4)]
    got = [{k: r[k] for k in ("applied", "shard_changed", "dense_changed")} for r in steps]
    ok = got == want and steps[poison_at]["loss_scale_after"] < steps[poison_at]["loss_scale_before"]
    return {"status": "pass" if ok else "fail", "detail": {"steps": steps, "expected": want}}


def cleanup(out: Path) -> None:
    for p in out.glob("fairseq_*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
