"""An emulated cluster on one machine: one network namespace per node, slow links.

Layout (``Cluster.create``; one rank per node, the default)::

    ns <tag>s  (switch)      bridge <tag>br
        |-- <tag>r0b  ====veth====  <tag>r0a  in ns <tag>r0   10.77.0.1/24
        |-- <tag>r1b  ====veth====  <tag>r1a  in ns <tag>r1   10.77.0.2/24
        ...

With ``ranks_per_node=K`` the ranks of one node share its namespace, veth and address,
as processes of one machine share its NIC::

    ns <tag>s  (switch)      bridge <tag>br
        |-- <tag>n0b  ====veth====  <tag>n0a  in ns <tag>n0   10.77.0.1/24   ranks 0..K-1
        |-- <tag>n1b  ====veth====  <tag>n1a  in ns <tag>n1   10.77.0.2/24   ranks K..2K-1
        ...

Every node's link is shaped in both directions: on the node's end (its upload) and on
the switch's end (its download), a ``netem`` qdisc adds half the one-way latency and a
``tbf`` child limits the rate. A kernel without ``sch_netem`` gets the rate limit only
(``describe()["latency_applied"]`` is then false). Two nodes therefore talk over two shaped hops, like two
machines with their own NIC behind a switch. Ranks of one node reach each other at the
node's own address, which the kernel routes over the namespace's loopback: unshaped, the
fast link inside a machine. Nothing leaves the namespaces the run created: the switch
namespace has no route to the host.

Names carry a per-run tag (``ebb`` + 5 hex digits) so concurrent runs do not collide;
the process that builds a cluster records itself as its tag's owner, and
:func:`cleanup_leftovers` removes the namespaces with the ``ebb`` prefix whose owner is
gone (what a killed run leaves), never those of a run still going. Requires root (or CAP_NET_ADMIN) and iproute2; :func:`namespaces_available`
says whether this machine allows it.
"""
from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

PREFIX = "ebb"  # every namespace this module creates starts with it
SUBNET = "10.77.0"


class NetemError(RuntimeError):
    """A namespace, link or qdisc could not be created."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetemError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def new_tag() -> str:
    """A fresh run tag: PREFIX + 5 hex digits (interface names stay within 15 characters)."""
    return PREFIX + secrets.token_hex(3)[:5]


TAG_LEN = len(PREFIX) + 5
# tag -> pid of the process that built the cluster (a file each, so that other processes see it)
OWNERS = Path(tempfile.gettempdir()) / "embrace_netem_owners"


def _claim(tag: str) -> None:
    OWNERS.mkdir(parents=True, exist_ok=True)
    (OWNERS / tag).write_text(str(os.getpid()))


def _release(tag: str) -> None:
    (OWNERS / tag).unlink(missing_ok=True)


def owner_alive(tag: str) -> bool:
    """Whether the process that built the cluster of ``tag`` still runs."""
    try:
        pid = int((OWNERS / tag).read_text())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def list_namespaces(prefix: str = PREFIX) -> List[str]:
    proc = _ip("netns", "list", check=False)
    if proc.returncode != 0:
        return []
    return [line.split()[0] for line in proc.stdout.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def cleanup_leftovers(prefix: str = PREFIX, include_live: bool = False) -> List[str]:
    """Delete the namespaces whose name starts with ``prefix`` (veths inside go with them)
    and whose cluster's owner process is gone; ``include_live``: those of running clusters
    too (a cluster closing itself). Another run's links are never pulled from under it."""
    gone = []
    for ns in list_namespaces(prefix):
        tag = ns[:TAG_LEN]
        if not include_live and owner_alive(tag):
            continue
        if _ip("netns", "delete", ns, check=False).returncode == 0:
            gone.append(ns)
    for f in (OWNERS.glob(f"{prefix}*") if OWNERS.is_dir() else []):
        if not owner_alive(f.name) and not list_namespaces(f.name):
            f.unlink(missing_ok=True)
    return gone


def namespaces_available() -> Optional[str]:
    """``None`` when namespaces, veths and tc work here, else the reason they do not."""
    if os.name != "posix":
        return "not a POSIX system"
    for tool in ("ip", "tc"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"'{tool}' (iproute2) is not installed"
    probe = new_tag() + "p"
    proc = _ip("netns", "add", probe, check=False)
    if proc.returncode != 0:
        return f"cannot create a network namespace: {proc.stderr.strip() or 'permission denied'}"
    try:
        proc = _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        if proc.returncode != 0:
            return f"cannot create veth links in a namespace: {proc.stderr.strip()}"
        proc = _run(["tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "tbf", "rate", "1gbit",
                     "burst", "128k", "latency", "50ms"], check=False)
        if proc.returncode != 0:
            return f"cannot add a tbf qdisc (sch_tbf): {proc.stderr.strip()}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


@dataclass(frozen=True)
class LinkSpec:
    """Per-node link: rate in Gbit/s, one-way node-to-node latency in ms; ``regime``: the
    compute-matched regime the link was calibrated for (it names the link then)."""

    gbit: float
    latency_ms: float
    regime: Optional[str] = None

    def label(self) -> str:
        return self.regime or f"{self.gbit:g}gbit_{self.latency_ms:g}ms"

    def as_dict(self) -> Dict[str, object]:
        """What a result records of the link (a regime's name only where there is one)."""
        d: Dict[str, object] = {"gbit": self.gbit, "latency_ms": self.latency_ms}
        if self.regime:
            d["regime"] = self.regime
        return d


@dataclass
class RankPlacement:
    """Where one rank runs; the ranks of one node share netns, ifname and addr."""

    rank: int
    netns: Optional[str]  # None: loopback (no namespace)
    ifname: str  # the interface gloo binds to (GLOO_SOCKET_IFNAME)
    addr: str
    node: Optional[int] = None  # None: the rank is a node of its own (node = rank)

    def __post_init__(self) -> None:
        # placements written before nodes existed (a worker's spec) have one rank per node
        if self.node is None:
            self.node = self.rank

    def command_prefix(self) -> List[str]:
        """Prefix that runs a command inside this rank's (node's) namespace."""
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    def tx_bytes_path(self) -> str:
        return f"/sys/class/net/{self.ifname}/statistics/tx_bytes"


@dataclass
class Cluster:
    """N ranks on ``N / ranks_per_node`` emulated nodes (or on loopback when ``loopback``)."""

    world_size: int
    tag: str
    loopback: bool
    ranks: List[RankPlacement] = field(default_factory=list)
    switch_ns: Optional[str] = None
    link: Optional[LinkSpec] = None
    ranks_per_node: int = 1
    _closed: bool = False

    # ------------------------------------------------------------------ building
    @classmethod
    def create(cls, world_size: int, link: LinkSpec, *, loopback: bool = False,
               ranks_per_node: int = 1) -> "Cluster":
        """Build the namespaces and links; node ``n`` holds ranks ``n*K .. n*K+K-1``
        (``K = ranks_per_node``, which must divide ``world_size``)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"ranks_per_node must be >= 1 and divide world_size {world_size}, got {ranks_per_node}")
        if world_size // ranks_per_node > 250:  # one address per node in a /24
            raise ValueError(f"at most 250 nodes, got {world_size // ranks_per_node}")
        tag = new_tag()
        if loopback:
            ranks = [RankPlacement(r, None, "lo", "127.0.0.1", r // ranks_per_node) for r in range(world_size)]
            return cls(world_size, tag, True, ranks, ranks_per_node=ranks_per_node)
        cluster = cls(world_size, tag, False, switch_ns=f"{tag}s", ranks_per_node=ranks_per_node)
        _claim(tag)
        _register_cleanup(cluster)
        try:
            cluster._build(link)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _node_names(self, node: int) -> Tuple[str, str, str]:
        """(namespace, node end, switch end) of a node's link. One rank per node keeps the
        per-rank names (``<tag>r<rank>``) that callers and leftover clean-ups know."""
        kind = "r" if self.ranks_per_node == 1 else "n"
        base = f"{self.tag}{kind}{node}"
        return base, f"{base}a", f"{base}b"

    def _build(self, link: LinkSpec) -> None:
        sw = self.switch_ns
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", f"{self.tag}br", "type", "bridge")
        _ip("-n", sw, "link", "set", f"{self.tag}br", "up")
        _ip("-n", sw, "link", "set", "lo", "up")
        for n in range(self.nodes):
            ns, a, b = self._node_names(n)
            _ip("netns", "add", ns)
            # created in the switch namespace, the node end then moved: nothing lands in the host's
            _ip("-n", sw, "link", "add", b, "type", "veth", "peer", "name", a, "netns", ns)
            _ip("-n", sw, "link", "set", b, "master", f"{self.tag}br")
            _ip("-n", sw, "link", "set", b, "up")
            addr = f"{SUBNET}.{n + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", a)
            _ip("-n", ns, "link", "set", a, "up")
            # the node's ranks talk to each other over it (their own address is routed to lo)
            _ip("-n", ns, "link", "set", "lo", "up")
            for local in range(self.ranks_per_node):
                self.ranks.append(RankPlacement(n * self.ranks_per_node + local, ns, a, addr, n))
        self.set_link(link)

    # ------------------------------------------------------------------ topology
    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_ranks(self, node: int) -> List[RankPlacement]:
        """The placements of one node's ranks, by rank."""
        return [p for p in self.ranks if p.node == node]

    def node_placements(self) -> List[RankPlacement]:
        """One placement per node (its first rank): the node's namespace, interface, address."""
        seen: Dict[int, RankPlacement] = {}
        for p in self.ranks:
            seen.setdefault(p.node, p)
        return [seen[n] for n in sorted(seen)]

    # ------------------------------------------------------------------ shaping
    def set_link(self, link: LinkSpec) -> None:
        """(Re)shape every node's link in both directions; safe while traffic flows."""
        self.link = link
        if self.loopback:
            return
        for place in self.node_placements():
            _shape(place.netns, place.ifname, link)
            _shape(self.switch_ns, _switch_end(place.ifname), link)

    def describe(self) -> Dict[str, object]:
        return {
            "loopback": self.loopback,
            "tag": self.tag,
            "world_size": self.world_size,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "ranks": [{"rank": p.rank, "node": p.node, "netns": p.netns, "ifname": p.ifname, "addr": p.addr}
                      for p in self.ranks],
            "switch_ns": self.switch_ns,
            "shaping": None if self.loopback else (
                ("per rank link" if self.ranks_per_node == 1 else
                 "per node link (ranks of a node: unshaped, over the node's loopback)")
                + ", both directions: "
                + ("netem delay latency/2 + tbf rate" if netem_available() else
                   "tbf rate only (this kernel has no sch_netem: latency not applied)")),
            "latency_applied": (not self.loopback) and netem_available(),
        }

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.loopback:
            return
        for ns in dict.fromkeys([p.netns for p in self.ranks] + [self.switch_ns]):
            if ns:
                _ip("netns", "delete", ns, check=False)
        # a half-built cluster may hold namespaces not yet in self.ranks
        cleanup_leftovers(self.tag, include_live=True)
        _release(self.tag)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def netem_available() -> bool:
    """Whether the kernel has ``sch_netem`` (latency); without it links get rate limits only."""
    global _NETEM
    if _NETEM is None:
        probe = new_tag() + "q"
        try:
            _ip("netns", "add", probe)
            _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
            _NETEM = _run(["tc", "-n", probe, "qdisc", "add", "dev", "probe0", "root", "netem", "delay", "1ms"],
                          check=False).returncode == 0
        except NetemError:
            _NETEM = False
        finally:
            _ip("netns", "delete", probe, check=False)
    return _NETEM


_NETEM: Optional[bool] = None


def _switch_end(ifname: str) -> str:
    """The switch's end of a node's veth: the same name, ``b`` for ``a``."""
    return ifname[:-1] + "b"


def tbf_burst_bytes(gbit: float) -> int:
    """tbf bucket: at least 1 ms of traffic at the rate and a 64 KiB GSO segment."""
    return max(64 * 1024, int(gbit * 1e9 / 8 / 1000))


def _shape(netns: str, dev: str, link: LinkSpec) -> None:
    delay_us = max(0, int(round(link.latency_ms * 1000 / 2)))
    # kbit: a calibrated rate is any real number (tc takes integers)
    rate = f"{max(1, int(round(link.gbit * 1e6)))}kbit"
    tbf = ["tbf", "rate", rate, "burst", str(tbf_burst_bytes(link.gbit)), "latency", "50ms"]
    _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], check=False)
    if netem_available() and delay_us > 0:
        _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
              f"{delay_us}us", "limit", "100000"])
        _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
    else:  # no sch_netem in this kernel: the rate limit alone
        _run(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])


# ---------------------------------------------------------------------- cleanup on exit and signals
_LIVE: List[Cluster] = []
_LOCK = threading.Lock()
_HANDLERS_SET = False


def _cleanup_all() -> None:
    with _LOCK:
        live = list(_LIVE)
        _LIVE.clear()
    for c in live:
        try:
            c.close()
        except Exception:
            pass


def _on_signal(signum, frame):  # pragma: no cover - exercised by the slow test
    # unwind: ``finally`` blocks (which stop the ranks) and atexit (which removes the
    # namespaces) run, as they do for Ctrl-C's KeyboardInterrupt
    _cleanup_all()
    raise SystemExit(128 + signum)


def _register_cleanup(cluster: Cluster) -> None:
    global _HANDLERS_SET
    with _LOCK:
        _LIVE.append(cluster)
        if not _HANDLERS_SET:
            atexit.register(_cleanup_all)
            if threading.current_thread() is threading.main_thread():
                # SIGINT already unwinds (KeyboardInterrupt); take over the others only where
                # nobody else handles them
                for sig in (signal.SIGTERM, signal.SIGHUP):
                    if signal.getsignal(sig) == signal.SIG_DFL:
                        signal.signal(sig, _on_signal)
            _HANDLERS_SET = True
