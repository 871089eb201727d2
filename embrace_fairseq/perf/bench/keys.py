"""How a benchmark result names a link and a run (``lm/w4/1gbit_0.1ms``)."""
from __future__ import annotations

from typing import Dict


def link_key(link: Dict[str, float]) -> str:
    """A link's name: its regime's where it was calibrated to one, else rate and latency."""
    return str(link.get("regime") or f"{link['gbit']:g}gbit_{link['latency_ms']:g}ms")


def run_key(model: str, world: int, link: Dict[str, float]) -> str:
    return f"{model}/w{world}/{link_key(link)}"


def record_link(r: Dict[str, object]) -> Dict[str, object]:
    """The link of a run record (``link_gbit``, ``latency_ms``, ``regime`` where set)."""
    return {"gbit": r["link_gbit"], "latency_ms": r["latency_ms"], "regime": r.get("regime")}
