"""Where workers go: the device budget and how a fleet is packed onto its nodes.

A worker never spans nodes (no inter-node tensor parallelism). Two placements:
- "local": prefill and decode workers are dealt round-robin over the nodes, and the router sends
  each request to a decode worker on its prefill worker's node, so KV moves over the fast
  intra-node link (DistServe's low node-affinity case). A fleet that cannot give every node with
  a prefill worker a decode worker too has no local placement. The real router has no node
  affinity yet: this models one router per node, or an affinity rule to add.
- "spread": workers are packed onto nodes by role (first fit), and decode is picked cluster-wide,
  so many transfers cross nodes on the slower inter-node link (DistServe's high-affinity case
  when that link is fast).
On one node (one CPU box, or one GPU server) the two are the same: placement is trivial.
"""

from __future__ import annotations

import dataclasses
import math
import re

from distserve.planner.simulator import ClusterConfig, WorkerSpec

PLACEMENTS = ("local", "spread")


@dataclasses.dataclass(frozen=True)
class DeviceBudget:
    """The hardware to plan for: `num_nodes` machines with `per_node` cores (CPU) or GPUs each."""

    num_nodes: int
    per_node: int
    device: str = "cpu"
    """cpu: devices are cores; gpu: devices are GPUs."""
    inter_node_bytes_per_s: float = math.inf
    inter_node_latency_s: float = 0.0
    frontend_s_per_token: float = 0.0
    """Front-end CPU per streamed token taken from the workers' cores (ClusterConfig)."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.per_node < 1:
            raise ValueError(f"DeviceBudget: need at least one node and one device, got {self.label()}")
        if self.device not in ("cpu", "gpu"):
            raise ValueError(f"DeviceBudget.device: {self.device!r} is not cpu or gpu")

    @classmethod
    def cores(cls, num_cores: int) -> "DeviceBudget":
        return cls(1, num_cores, "cpu")

    @classmethod
    def gpus(cls, text: str, **links) -> "DeviceBudget":
        """From "NODESxPER", e.g. "2x4" (or just "8": one node)."""
        match = re.fullmatch(r"(?:(\d+)x)?(\d+)", text.strip())
        if not match:
            raise ValueError(f"--gpus: {text!r} is not NODESxPER (e.g. 1x8 or 2x4)")
        return cls(int(match.group(1) or 1), int(match.group(2)), "gpu", **links)

    @property
    def total(self) -> int:
        return self.num_nodes * self.per_node

    @property
    def unit(self) -> str:
        return "core" if self.device == "cpu" else "GPU"

    def label(self) -> str:
        if self.device == "cpu":
            return f"{self.per_node} cores on one machine"
        return f"{self.num_nodes} node(s) x {self.per_node} GPUs"


def place(workers: list[WorkerSpec], budget: DeviceBudget, placement: str = "local") -> ClusterConfig | None:
    """The fleet with a node on each worker, or None when it does not fit the budget."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: {placement!r} is not one of {PLACEMENTS}")
    if any(w.devices > budget.per_node for w in workers) or sum(w.devices for w in workers) > budget.total:
        return None
    nodes = _deal(workers, budget) if placement == "local" else _first_fit(workers, budget)
    if nodes is None or placement == "local" and not _is_paired(workers, nodes):
        return None
    placed = tuple(dataclasses.replace(w, node=n) for w, n in zip(workers, nodes))
    return ClusterConfig(placed, inter_node_bytes_per_s=budget.inter_node_bytes_per_s,
                         inter_node_latency_s=budget.inter_node_latency_s,
                         is_node_local=placement == "local" and budget.num_nodes > 1,
                         frontend_s_per_token=budget.frontend_s_per_token)


def _deal(workers: list[WorkerSpec], budget: DeviceBudget) -> list[int] | None:
    """Round-robin per role, so each node gets its share of prefill and of decode."""
    free, nodes, turn = [budget.per_node] * budget.num_nodes, [], {}
    for w in workers:
        start = turn.get(w.role, 0)
        for k in range(budget.num_nodes):
            node = (start + k) % budget.num_nodes
            if free[node] >= w.devices:
                break
        else:
            return None
        free[node] -= w.devices
        nodes.append(node)
        turn[w.role] = node + 1
    return nodes


def _is_paired(workers: list[WorkerSpec], nodes: list[int]) -> bool:
    """Every node with a prefill worker has a decode worker (when the fleet has any)."""
    prefill = {n for w, n in zip(workers, nodes) if w.role == "prefill"}
    decode = {n for w, n in zip(workers, nodes) if w.role == "decode"}
    return not decode or prefill <= decode


def _first_fit(workers: list[WorkerSpec], budget: DeviceBudget) -> list[int] | None:
    """First fit, largest workers first (stable, so roles stay together)."""
    free, nodes = [budget.per_node] * budget.num_nodes, [0] * len(workers)
    for i in sorted(range(len(workers)), key=lambda i: -workers[i].devices):
        node = next((n for n in range(budget.num_nodes) if free[n] >= workers[i].devices), None)
        if node is None:
            return None
        free[node] -= workers[i].devices
        nodes[i] = node
    return nodes
