"""Per-rank bodies of the planner's probe tests (real gloo ranks)."""
from __future__ import annotations

import time
from typing import Any, Dict

from embrace_fairseq.planner.inputs import TIED, PlanInputs, TableInput
from embrace_fairseq.planner.plan import choose
from embrace_fairseq.planner.probe import PlanDisagreement, check_agreed, measure_rates

TABLE = TableInput("embed_tokens", 50_000, 64, TIED, lookups_per_rank=512, output_tokens_per_rank=512)


def probe_and_plan(rank: int, world: int) -> Dict[str, Any]:
    """Each rank probes (rank 1 starts late, so its own times differ from the others'), then
    chooses; the rates and the plan must be every rank's."""
    if rank == 1:
        time.sleep(0.2)
    rates = measure_rates(100_000, [TABLE], 512, 64)
    plan = choose(PlanInputs((TABLE,), 100_000, world, world, rates))
    check_agreed(plan.spec())
    try:
        check_agreed(f"rank {rank}")  # different on every rank: stops on every rank
        disagreement = None
    except PlanDisagreement as e:
        disagreement = str(e)
    return {"rates": rates, "spec": plan.spec(), "schedule": plan.schedule, "disagreement": disagreement}
