"""Per-rank bodies of the core unit tests (input_dist, output_dist, table_dist, ledger,
agreement), spawned in real gloo ranks by ``run_ranks``.

Each body runs every configuration in one spawn (rank start-up dominates): the whole
world, and the 2-rank subgroup {0, 1} for a second world size. Bodies return their
inputs with their outputs, so the test process can compute the expected values by
hand from *all* ranks' data, without the module under test.

The inputs are plain functions of (case, rank, world, vocab), so the test process
can also regenerate them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

#: (vocab, ranks): uneven vocabularies, and a vocabulary smaller than the world
CONFIGS = [(11, 3), (11, 2), (2, 3), (7, 2)]
ID_CASES = ["random", "repeats", "empty_last", "one_owner", "int32", "all_ids"]
DIM = 3


def hand_bounds(vocab: int, world: int):
    """Row ranges by the rule of the design: sizes differ by at most one, the first
    ``vocab % world`` ranks hold the extra row (written out here, not ShardPlan)."""
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + vocab // world + (1 if r < vocab % world else 0))
    return bounds


def hand_owner(i: int, bounds) -> int:
    return next(r for r in range(len(bounds) - 1) if bounds[r] <= i < bounds[r + 1])


def case_ids(case: str, rank: int, world: int, vocab: int) -> torch.Tensor:
    """The ids rank ``rank`` looks up in ``case`` (a function of its arguments only)."""
    g = torch.Generator().manual_seed(97 * ID_CASES.index(case) + 13 * rank + 7 * world + vocab)
    if case == "empty_last" and rank == world - 1:
        return torch.zeros(0, 4, dtype=torch.long)
    if case == "repeats":
        return torch.randint(0, vocab, (2,), generator=g).repeat(3, 4)
    if case == "one_owner":
        b = hand_bounds(vocab, world)
        owner = max(r for r in range(world) if b[r + 1] > b[r])
        return torch.randint(b[owner], b[owner + 1], (4, 3), generator=g)
    if case == "all_ids":
        return torch.arange(vocab - 1, -1, -1)
    ids = torch.randint(0, vocab, (3, 5), generator=g)
    return ids.to(torch.int32) if case == "int32" else ids


def full_table(vocab: int, dim: int = DIM) -> torch.Tensor:
    return torch.randn(vocab, dim, generator=torch.Generator().manual_seed(5 + vocab))


def plain(obj):
    """Tensors as numpy arrays (tensors through the result queue need the child alive)."""
    if torch.is_tensor(obj):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def _groups(rank: int, world: int):
    """(members, group) per world size: the whole world and the subgroup {0, 1}."""
    pair = dist.new_group([0, 1])  # collective: every rank takes part
    return {world: None, 2: pair}


# --------------------------------------------------------------------------- input dist


def input_dist_rank(rank, world, configs):
    from embrace_fairseq.core.ids import InvalidIdError
    from embrace_fairseq.core.input_dist import plan_exchange
    from embrace_fairseq.core.shard_plan import ShardPlan

    groups = _groups(rank, world)
    out = {}
    for vocab, members in configs:
        if rank >= members:
            continue
        group, plan = groups[members], ShardPlan(vocab, members, "contiguous")  # hand counts by id range
        for case in ID_CASES:
            xp = plan_exchange(case_ids(case, rank, members, vocab).reshape(-1), plan, group, rank)
            out[(vocab, members, case)] = {
                "unique_ids": xp.unique_ids.tolist(),
                "inverse": xp.inverse.tolist(),
                "send_counts": list(xp.send_counts),
                "recv_counts": list(xp.recv_counts),
                "requested_local": xp.requested_local.tolist(),
            }
        # one invalid id on one rank (another rank with an empty batch): every rank raises
        for bad_rank, bad_value, empty_rank in ((members - 1, vocab, None), (0, -3, members - 1)):
            ids = case_ids("random", rank, members, vocab).reshape(-1)
            if rank == empty_rank:
                ids = ids[:0]
            if rank == bad_rank:
                ids = torch.cat([ids, torch.tensor([bad_value])])
            try:
                plan_exchange(ids, plan, group, rank)
                got = ("no error", "")
            except InvalidIdError as e:
                got = ("InvalidIdError", str(e))
            except Exception as e:  # noqa: BLE001 - the type is the result
                got = (type(e).__name__, str(e))
            out[(vocab, members, "bad", bad_rank, bad_value)] = got
        # the ranks are still in step: a valid exchange right after works
        xp = plan_exchange(torch.arange(vocab), plan, group, rank)
        out[(vocab, members, "after_bad")] = xp.unique_ids.tolist()
    return out


# --------------------------------------------------------------------------- output dist

OUT_SCALE = 0.37


def grad_for(unique_ids: torch.Tensor, rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 31 * rank + vocab)
    return torch.randn(len(unique_ids), DIM, generator=g)


def output_dist_rank(rank, world, configs, padding_idx):
    from embrace_fairseq.core.input_dist import plan_exchange
    from embrace_fairseq.core.output_dist import ShardedLookup, fetch_rows, push_grad_rows
    from embrace_fairseq.core.shard_plan import ShardPlan

    groups = _groups(rank, world)
    out = {}
    for vocab, members in configs:
        if rank >= members:
            continue
        group, plan = groups[members], ShardPlan(vocab, members, "contiguous")  # hand counts by id range
        start, end = plan.shard_range(rank)
        shard = full_table(vocab)[start:end].clone()
        pad = padding_idx if padding_idx < vocab else None
        pad_local = pad - start if pad is not None and start <= pad < end else None
        for case in ID_CASES:
            ids = case_ids(case, rank, members, vocab).reshape(-1)
            if pad is not None and ids.numel():
                ids = torch.cat([ids, torch.tensor([pad] * 2, dtype=ids.dtype)])  # the padding id is looked up
            xp = plan_exchange(ids, plan, group, rank)
            rows = fetch_rows(shard, xp)
            g = grad_for(xp.unique_ids, rank, vocab)
            pushed = push_grad_rows(g, xp, shard.shape[0], OUT_SCALE, pad_local)
            # the autograd node: forward rows, backward the same shard gradient
            param = shard.clone().requires_grad_()
            y = ShardedLookup.apply(param, xp, OUT_SCALE, pad_local)
            (y * g).sum().backward()
            out[(vocab, members, case)] = {
                "range": (start, end),
                "unique_ids": xp.unique_ids.clone(),
                "rows": rows.clone(),
                "autograd_rows": y.detach().clone(),
                "grad_unique": g,
                "pushed": pushed.clone(),
                "autograd_grad": param.grad.clone(),
            }
    return plain(out)


# --------------------------------------------------------------------------- table dist

TABLE_SCALE = 0.25


def table_grad_for(rank: int, vocab: int, which: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + 17 * rank + vocab + 1000 * which)
    return torch.randn(vocab, DIM, generator=g)


def table_dist_rank(rank, world, configs):
    from embrace_fairseq.core.ledger import CommLedger
    from embrace_fairseq.core.shard_plan import ShardPlan
    from embrace_fairseq.core.table_dist import (
        gather_table,
        PendingGather,
        PendingTableGrads,
        gather_full,
        reduce_scatter_rows,
    )

    groups = _groups(rank, world)
    out = {}
    for vocab, members in configs:
        if rank >= members:
            continue
        group, plan = groups[members], ShardPlan(vocab, members, "contiguous")  # hand counts by id range
        ledgers = [CommLedger()]
        start, end = plan.shard_range(rank)
        shard = full_table(vocab)[start:end].clone()
        res = {"range": (start, end)}
        res["gather_full"] = gather_full(shard, plan, group, rank)
        res["reduce_scatter"] = reduce_scatter_rows(table_grad_for(rank, vocab, 0), plan, group, rank, TABLE_SCALE, ledgers)
        # autograd: all-gather forward, reduce-scatter backward
        param = shard.clone().requires_grad_()
        full = gather_table(param, plan, group, rank, TABLE_SCALE, None)
        (full * table_grad_for(rank, vocab, 1)).sum().backward()
        res["gather_table"] = full.detach().clone()
        res["gather_table_grad"] = param.grad.clone()
        # overlapped: a gather in flight, awaited twice (same tensor)
        pending = PendingGather(shard, plan, group, ledgers)
        first = pending.wait()
        res["pending_gather"] = first.clone()
        res["pending_same_object"] = pending.wait() is first
        # two reduce-scatters in flight, added to a gradient already there
        grads = PendingTableGrads(plan, group, rank, TABLE_SCALE, ledgers)
        grads.start(table_grad_for(rank, vocab, 2))
        grads.start(table_grad_for(rank, vocab, 3))
        res["in_flight"] = len(grads)
        param2 = shard.clone().requires_grad_()
        param2.grad = torch.full_like(shard, 0.5)
        grads.finish(param2)
        res["pending_grads"] = param2.grad.clone()
        res["in_flight_after"] = len(grads)
        out[(vocab, members)] = res
    return plain(out)


# --------------------------------------------------------------------------- ledger

#: 7 rows over 3 ranks: rank 0 owns 0..2, rank 1 owns 3..4, rank 2 owns 5..6
LEDGER_IDS = {0: [0, 1, 1, 5, 6], 1: [3, 4, 0, 3], 2: []}


def ledger_rank(rank, world):
    from embrace_fairseq.core.input_dist import plan_exchange
    from embrace_fairseq.core.ledger import CommLedger, global_ledger, ledgers_for
    from embrace_fairseq.core.output_dist import fetch_rows, push_grad_rows
    from embrace_fairseq.core.shard_plan import ShardPlan
    from embrace_fairseq.core.table_dist import PendingGather, gather_full, reduce_scatter_rows

    plan = ShardPlan(7, world, "contiguous")
    start, end = plan.shard_range(rank)
    shard = full_table(7, 2)[start:end].clone()  # D = 2 fp32: 8 bytes a row
    global_ledger().reset()
    ledger = CommLedger()
    out = {}
    xp = plan_exchange(torch.tensor(LEDGER_IDS[rank], dtype=torch.long), plan, None, rank, ledger)
    rows = fetch_rows(shard, xp)
    push_grad_rows(torch.ones_like(rows), xp, shard.shape[0], 1.0)
    out["exchange"] = ledger.snapshot()
    ledger.reset()
    gather_full(shard, plan, None, rank, ledger)
    reduce_scatter_rows(torch.ones(7, 2), plan, None, rank, 1.0, ledgers_for(ledger))
    PendingGather(shard, plan, None, ledgers_for(ledger)).wait()
    out["table"] = ledger.snapshot()
    out["global"] = global_ledger().snapshot()
    return out


# --------------------------------------------------------------------------- agreement


def agreement_rank(rank, world):
    from embrace_fairseq.core.agreement import (
        ConfigMismatchError,
        ShardPlanMismatchError,
        check_agreement,
        check_same_plan,
        digest60,
    )
    from embrace_fairseq.core.shard_plan import ShardPlan

    def outcome(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the type is the result
            return (type(e).__name__, str(e))
        return ("ok", "")

    out = {}
    same = {"steps": 4, "schedule": digest60("a")}
    out["same"] = outcome(lambda: check_agreement(same, "the schedule", "Fix it.", shown={"schedule": "hex"}))
    fields = {"steps": 4, "pieces": 8 if rank != 2 else 16, "schedule": digest60("a" if rank == 0 else "b")}
    out["differ"] = outcome(lambda: check_agreement(fields, "the schedule", "Start every rank alike.",
                                                    shown={"schedule": "hex"}))
    out["three_values"] = outcome(lambda: check_agreement({"seed": 10 + rank}, "the seed", "Same seed."))
    out["plan"] = outcome(lambda: check_same_plan(ShardPlan(11, world), 4, 3 if rank == 1 else None))
    out["plan_same"] = outcome(lambda: check_same_plan(ShardPlan(11, world), 4, 3))
    out["classes"] = (ConfigMismatchError.__name__, ShardPlanMismatchError.__name__)
    out["digest_a"], out["digest_b"] = digest60("a"), digest60("b")
    return out


# --------------------------------------------------------------------------- one spawn for all

WORLD = 3


def suite_rank(rank, world):
    """Every section above in one spawn (rank start-up costs far more than the checks);
    a section that raises reports its traceback instead of stopping the others."""
    import traceback

    sections = {
        "input_dist": lambda: input_dist_rank(rank, world, CONFIGS),
        "output_dist": lambda: output_dist_rank(rank, world, CONFIGS, OUT_PADDING),
        "table_dist": lambda: table_dist_rank(rank, world, CONFIGS),
        "ledger": lambda: ledger_rank(rank, world),
        "agreement": lambda: agreement_rank(rank, world),
    }
    out = {}
    for name, fn in sections.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - reported to the test of that section
            out[name] = SectionFailed(traceback.format_exc())
    return out


class SectionFailed(str):
    """A section's traceback, in place of its result."""


OUT_PADDING = 1  # owned by rank 0 in every configuration
_RESULTS = {}


def core_results(section):
    """Per-rank results of one section of :func:`suite_rank` (spawned once per session)."""
    import pytest

    from embrace_fairseq.tools.local_ranks import run_ranks

    if "all" not in _RESULTS:
        _RESULTS["all"] = run_ranks(suite_rank, WORLD, timeout_s=240)
    per_rank = [r[section] for r in _RESULTS["all"]]
    failed = [f"rank {r}:\n{x}" for r, x in enumerate(per_rank) if isinstance(x, SectionFailed)]
    if failed:
        pytest.fail(f"section {section} raised:\n" + "\n".join(failed))
    return per_rank
