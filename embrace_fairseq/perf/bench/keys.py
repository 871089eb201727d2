"""How a benchmark result names a link and a run (``lm/w4/1gbit_0.1ms``)."""
from __future__ import annotations

from typing import Dict


def link_key(link: Dict[str, float]) -> str:
    return f"{link['gbit']:g}gbit_{link['latency_ms']:g}ms"


def run_key(model: str, world: int, link: Dict[str, float]) -> str:
    return f"{model}/w{world}/{link_key(link)}"
