"""Stock fairseq commands on CPU with ``--user-dir user_dir`` (fixes in fairseq_adapter/compat.py).

The end-to-end tests run the real console scripts in real processes on a tiny synthetic corpus:
``torchrun --nproc_per_node 2 fairseq-train`` as documented (no --distributed-world-size, no rank
flags), resuming that job with another DDP backend, ``fairseq-generate`` on its checkpoint with
torch's default ``weights_only=True``, and the error for a world size that contradicts torchrun.
The in-process tests pin each fix on its own and run in a few seconds.
"""
from __future__ import annotations

import argparse
import gc
import io
import shutil
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from fairseq_corpus import (
    FairseqRun,
    fairseq_env,
    make_lm_corpus,
    make_translation_corpus,
    run_fairseq_tool,
    run_fairseq_train,
)

fairseq = pytest.importorskip("fairseq")

from embrace_fairseq.fairseq_adapter import compat  # noqa: E402

# Stock transformer, as small as fairseq allows, so a run is dominated by process start-up.
TINY_TRANSFORMER = [
    "--arch", "transformer", "--share-all-embeddings",
    "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]
COMMON = [
    "--cpu", "--distributed-backend", "gloo",
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500",
    "--no-epoch-checkpoints", "--seed", "1",
]


def _update_numbers(run: FairseqRun) -> List[int]:
    return [int(r["num_updates"]) for r in run.updates]


def _assert_one_two_rank_job(run: FairseqRun) -> None:
    """One data-parallel job of 2 ranks, not 2 independent single-process trainings."""
    out = run.output
    assert "distributed init (rank 0): env://" in out, out[-3000:]
    assert "distributed init (rank 1): env://" in out, out[-3000:]
    assert out.count("training on 2 devices") == 1, out[-3000:]
    assert "training on 1 devices" not in out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the plugin tests' corpus (same arguments): binarised once per session, copied by the other module
    return make_translation_corpus(tmp_path_factory.mktemp("corpus"), vocab_size=51, n_train=240, n_valid=24)


@pytest.fixture(scope="module")
def legacy_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, object]:
    save_dir = tmp_path_factory.mktemp("ckpt_legacy")
    run = run_fairseq_train(
        [str(corpus), *TINY_TRANSFORMER, *COMMON, "--ddp-backend", "legacy_ddp",
         "--max-update", "3", "--save-dir", str(save_dir)],
        nproc=2, timeout=240,
    )
    return {"run": run, "save_dir": save_dir}


def test_torchrun_legacy_ddp_trains_one_job(legacy_run: Dict[str, object]) -> None:
    run: FairseqRun = legacy_run["run"]  # type: ignore[assignment]
    run.check()
    _assert_one_two_rank_job(run)
    assert _update_numbers(run) == [1, 2, 3]  # each update logged once: one job
    assert (Path(legacy_run["save_dir"]) / "checkpoint_last.pt").exists()  # type: ignore[arg-type]


def test_torchrun_c10d_resumes_the_job(legacy_run: Dict[str, object],
                                       tmp_path: Path, corpus: Path) -> None:
    """c10d on CPU, resuming the legacy_ddp checkpoint (rank 0 broadcasts it to rank 1)."""
    legacy_run["run"].check()  # type: ignore[union-attr]
    save_dir = tmp_path / "ckpt"
    shutil.copytree(legacy_run["save_dir"], save_dir)  # type: ignore[arg-type]
    run = run_fairseq_train(
        [str(corpus), *TINY_TRANSFORMER, *COMMON, "--ddp-backend", "c10d",
         "--max-update", "5", "--save-dir", str(save_dir), "--disable-validation"],
        nproc=2, timeout=240,
    ).check()
    _assert_one_two_rank_job(run)
    assert "Loaded checkpoint" in run.output and "@ 3 updates" in run.output
    assert _update_numbers(run) == [4, 5]


@pytest.mark.slow  # the default suite loads checkpoints with fairseq-generate in test_fairseq_plugin
def test_generate_loads_torchrun_checkpoint(legacy_run: Dict[str, object], corpus: Path) -> None:
    legacy_run["run"].check()  # type: ignore[union-attr]
    env = fairseq_env()
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in env  # torch's default weights_only=True
    ckpt = Path(legacy_run["save_dir"]) / "checkpoint_last.pt"  # type: ignore[arg-type]
    run = run_fairseq_tool(
        "fairseq-generate",
        [str(corpus), "--path", str(ckpt), "--cpu", "--beam", "2", "--max-len-b", "10",
         "--max-tokens", "1000", "--gen-subset", "test"],
        timeout=180,
    ).check()
    assert "Weights only load failed" not in run.output
    hyps = [line for line in run.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) > 0 and "BLEU" in run.stdout


@pytest.mark.slow  # a torchrun launch; the default run has test_torchrun_env_fills_the_config_on_cpu below
def test_world_size_contradicting_torchrun_is_an_error(corpus: Path, tmp_path: Path) -> None:
    run = run_fairseq_train(
        [str(corpus), *TINY_TRANSFORMER, *COMMON, "--max-update", "1",
         "--save-dir", str(tmp_path / "ckpt"), "--distributed-world-size", "3"],
        nproc=2, timeout=180,
    )
    assert run.returncode != 0
    assert "--distributed-world-size 3 disagrees with torchrun" in run.output
    assert "WORLD_SIZE=2" in run.output
    assert run.updates == []


# --------------------------------------------------------------------------- in-process


TORCHRUN_RANK1 = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "2",
                  "RANK": "1", "LOCAL_RANK": "1"}


@pytest.fixture
def patched_du(monkeypatch: pytest.MonkeyPatch):
    compat.apply()
    import fairseq.distributed.utils as du

    for k in TORCHRUN_RANK1:
        monkeypatch.delenv(k, raising=False)
    return du


def _dist_cfg(**kw):
    from fairseq.dataclass.configs import DistributedTrainingConfig

    # tpu is an interpolation ("${common.tpu}") until omegaconf resolves it: set it here.
    return DistributedTrainingConfig(**{"tpu": False, **kw})


def test_apply_is_idempotent() -> None:
    import fairseq.distributed.utils as du
    import fairseq.models.distributed_fairseq_model as dfm

    compat.apply()
    first = (du.infer_init_method, du._infer_torch_distributed_launch_init, du.call_main,
             du._broadcast_object_slow, dfm.DistributedDataParallel)
    n_safe = len(torch.serialization.get_safe_globals())
    compat.apply()
    assert (du.infer_init_method, du._infer_torch_distributed_launch_init, du.call_main,
            du._broadcast_object_slow, dfm.DistributedDataParallel) == first
    assert len(torch.serialization.get_safe_globals()) == n_safe


@pytest.mark.parametrize("argv,explicit", [
    ([], False),
    (["data", "--cpu"], False),
    (["data", "--distributed-world-size", "2"], True),
    (["data", "--distributed-world-size=2"], True),
    (["distributed_training.distributed_world_size=2"], True),
    (["++distributed_training.distributed_world_size=2"], True),
    (["data", "--distributed-world"], False),  # fairseq parsers use allow_abbrev=False
    (["--", "--distributed-world-size", "2"], False),
])
def test_world_size_flag_detection(argv: List[str], explicit: bool) -> None:
    assert compat.world_size_given_on_command_line(argv) is explicit


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="CPU-machine behaviour")
def test_torchrun_env_fills_the_config_on_cpu(patched_du, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in TORCHRUN_RANK1.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["fairseq-train", "data", "--cpu"])
    cfg = _dist_cfg()
    assert cfg.distributed_world_size == 1  # fairseq's default on CPU: it used to stop here
    patched_du.infer_init_method(cfg)
    assert (cfg.distributed_init_method, cfg.distributed_world_size, cfg.distributed_rank,
            cfg.device_id, cfg.distributed_no_spawn) == ("env://", 2, 1, 1, True)

    # An explicit world size that agrees with torchrun is fine ...
    monkeypatch.setattr(sys, "argv", ["fairseq-train", "--distributed-world-size", "2"])
    cfg = _dist_cfg(distributed_world_size=2)
    patched_du.infer_init_method(cfg)
    assert cfg.distributed_world_size == 2 and cfg.distributed_rank == 1
    # ... one that does not is an error, even when it equals the default.
    for given in (1, 3):
        monkeypatch.setattr(sys, "argv", ["fairseq-train", "--distributed-world-size", str(given)])
        with pytest.raises(ValueError, match="disagrees with torchrun"):
            patched_du.infer_init_method(_dist_cfg(distributed_world_size=given))


def test_without_torchrun_single_process_is_unchanged(patched_du) -> None:
    cfg = _dist_cfg()
    patched_du.infer_init_method(cfg)
    assert cfg.distributed_init_method is None and cfg.distributed_rank == 0


def test_c10d_ddp_accepts_cpu_module_with_device_ids(tmp_path: Path) -> None:
    import torch.distributed as dist
    import fairseq.models.distributed_fairseq_model as dfm
    from torch.nn.parallel import DistributedDataParallel

    compat.apply()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        module = torch.nn.Linear(3, 2)
        with pytest.raises(ValueError):  # what fairseq's call does with plain torch
            DistributedDataParallel(module, device_ids=[0], output_device=0)
        # what fairseq's c10d / pytorch_ddp backend passes
        ddp = dfm.DistributedDataParallel(module=module, device_ids=[0], output_device=0,
                                          broadcast_buffers=False, bucket_cap_mb=25)
        assert isinstance(ddp, DistributedDataParallel) and ddp.device_ids is None
        ddp(torch.randn(4, 3)).sum().backward()
        assert module.weight.grad is not None
        # free DDP's reducer while its group is alive: a reducer collected after the group
        # and its file store are gone can block in the group's destructor (seen once in a
        # full run: the process stopped in ~ProcessGroupGloo joining its threads)
        del ddp
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_checkpoint_globals_load_with_weights_only() -> None:
    """fairseq's checkpoint classes load under weights_only=True while a checkpoint is
    read (scoped to that load), and are not allowed process-wide."""
    import numpy as np

    from embrace_fairseq.guards import safe_load

    compat.apply()
    state = {
        "args": argparse.Namespace(arch="transformer", lr=[0.001]),
        "cfg": {"model": argparse.Namespace(encoder_layers=1)},
        "extra_state": {"metrics": {"valid": [(10, "_bleu_counts", "AverageMeter",
                                               {"val": np.array([7, 0, 0, 0])})]}},
        "model": {"w": torch.ones(2)},
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    with safe_load.allowed(compat.fairseq_checkpoint_globals()):
        buf.seek(0)
        back = torch.load(buf)  # torch's default: weights_only=True
    assert back["args"].arch == "transformer" and back["cfg"]["model"].encoder_layers == 1
    assert back["extra_state"]["metrics"]["valid"][0][3]["val"].tolist() == [7, 0, 0, 0]
    buf.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(buf)  # outside a checkpoint load nothing extra is allowed


# --------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_cpu_spawn_without_torchrun(corpus: Path, tmp_path: Path) -> None:
    """``--cpu --distributed-world-size 2`` without torchrun: fairseq's own spawn, on CPU
    (also on a GPU machine, where stock fairseq asserts the world size fits its GPUs)."""
    run = run_fairseq_tool(
        "fairseq-train",
        [str(corpus), *TINY_TRANSFORMER, *COMMON, "--max-update", "3",
         "--save-dir", str(tmp_path / "ckpt"), "--distributed-world-size", "2",
         "--log-format", "json", "--log-interval", "1", "--disable-validation"],
        timeout=300,
    ).check()
    assert "spawning 2 CPU processes" in run.output
    assert "distributed init (rank 1): tcp://localhost:" in run.output
    assert run.output.count("training on 2 devices") == 1
    assert _update_numbers(run) == [1, 2, 3]


@pytest.mark.slow
def test_eval_tools_load_checkpoints(legacy_run: Dict[str, object], corpus: Path,
                                     tmp_path: Path) -> None:
    """fairseq-eval-lm / -validate / -interactive with --user-dir and weights_only=True."""
    import subprocess

    from fairseq_corpus import USER_DIR, venv_script

    lm = make_lm_corpus(tmp_path / "lm")
    lm_ckpt = tmp_path / "ckpt_lm"
    run_fairseq_train(
        [str(lm), "--task", "language_modeling", "--arch", "transformer_lm",
         "--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
         "--decoder-attention-heads", "2", "--tokens-per-sample", "32",
         "--cpu", "--distributed-backend", "gloo", "--optimizer", "adam", "--lr", "1e-3",
         "--max-tokens", "256", "--max-update", "2", "--save-dir", str(lm_ckpt)],
        nproc=2, timeout=300, check=True,
    )
    ev = run_fairseq_tool(
        "fairseq-eval-lm",
        [str(lm), "--path", str(lm_ckpt / "checkpoint_last.pt"), "--cpu",
         "--max-tokens", "512", "--tokens-per-sample", "32"],
    ).check()
    assert "Perplexity" in ev.output

    ckpt = Path(legacy_run["save_dir"]) / "checkpoint_last.pt"  # type: ignore[arg-type]
    val = run_fairseq_tool(
        "fairseq-validate",
        [str(corpus), "--path", str(ckpt), "--cpu", "--task", "translation",
         "--max-tokens", "500"],
    ).check()
    assert "valid on 'valid' subset" in val.output

    proc = subprocess.run(
        [venv_script("fairseq-interactive"), str(corpus), "--path", str(ckpt), "--cpu",
         "--beam", "2", "--max-len-b", "10", "--source-lang", "src", "--target-lang", "tgt",
         "--user-dir", str(USER_DIR)],
        input="w1 w2 w3\n", capture_output=True, text=True, env=fairseq_env(), timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(line.startswith("H-") for line in proc.stdout.splitlines())


def test_bf16_without_torch_xla_is_named(tmp_path: Path) -> None:
    """fairseq's --bf16 is its TPU mode: without torch_xla the job stops before it starts,
    with one line naming the flag and what to use on GPUs (stock fairseq stopped inside
    distributed_init on an AttributeError)."""
    run = run_fairseq_tool(
        "fairseq-train",
        [str(tmp_path / "no-data-needed"), *TINY_TRANSFORMER, *COMMON, "--task", "translation", "--bf16",
         "--memory-efficient-bf16", "--max-update", "1", "--save-dir", str(tmp_path / "ckpt")],
        timeout=120,
    )
    assert run.returncode == 2, run.output[-3000:]
    assert "TpuModeWithoutXlaError: --bf16 turns on fairseq's TPU mode (--tpu)" in run.output, run.output[-3000:]
    assert "On GPUs train with --fp16," in run.output and "Traceback" not in run.output


def test_numpy_compat_long_for_token_blocks() -> None:
    """fairseq's TokenBlockDataset with --sample-break-mode eos (language-model sampling)
    reads numpy.compat.long, which numpy 2 removed; with the user dir it builds."""
    import numpy as np
    from fairseq.data import TokenBlockDataset

    compat.apply()
    assert np.compat.long is int
    docs = [torch.tensor([5, 6, 2]), torch.tensor([7, 2]), torch.tensor([8, 9, 10, 2])]
    blocks = TokenBlockDataset(docs, np.array([3, 2, 4]), block_size=None, pad=1, eos=2, break_mode="eos")
    assert [blocks[i].tolist() for i in range(len(blocks))] == [d.tolist() for d in docs]


def test_late_import_refused_only_where_fairseq_hydra_set_the_rank_up_alone(monkeypatch):
    """``fairseq-hydra-train`` imports the user dir inside its main: a torchrun rank of several
    that has no process group by then trains alone. fairseq-train (its arguments parsed, the
    hydra entry not loaded) and a world of one pass."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"}
    monkeypatch.delitem(sys.modules, "fairseq_cli.hydra_train", raising=False)
    compat.refuse_late_import(env)
    monkeypatch.setitem(sys.modules, "fairseq_cli.hydra_train", object())
    with pytest.raises(compat.LateUserDirError, match="Start it as embrace-hydra-train"):
        compat.refuse_late_import(env)
    compat.refuse_late_import({**env, "WORLD_SIZE": "1"})
    compat.refuse_late_import({})
