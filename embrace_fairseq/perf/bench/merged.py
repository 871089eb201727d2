"""Several benchmark results files as one, for the simulator: what one fit over several
runs reads (:func:`merged_bench`)."""
from __future__ import annotations

import copy
from typing import Any, Dict, Sequence


def merged_bench(benches: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One bench dict of several runs (for the simulator): runs concatenated, each model's
    profile from the first run that measured it, its unique-id counts from every run; the
    workloads' shapes (a masked LM's masked share) and the regime calibrations per run key
    from every run that has them."""
    profiles: Dict[str, Any] = {}
    shapes: Dict[str, Any] = {}
    regimes: Dict[str, Any] = {}
    for b in benches:
        for name, p in b["profiles"].items():
            if name not in profiles:
                profiles[name] = copy.deepcopy(p)
            else:
                profiles[name]["unique_ids_per_rank"].update(p.get("unique_ids_per_rank", {}))
        for name, shape in (b.get("workload_shapes") or {}).items():
            shapes.setdefault(name, shape)
        regimes.update(b.get("regimes") or {})
    merged = {"meta": benches[0]["meta"], "profiles": profiles, "runs": [r for b in benches for r in b["runs"]]}
    if shapes:
        merged["workload_shapes"] = shapes
    if regimes:
        merged["regimes"] = regimes
    return merged
