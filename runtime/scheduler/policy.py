"""Waiting-queue order: which waiting requests the prefill adder considers first.

- `fcfs`: arrival order (retracted requests keep their original arrival, so they go first).
- `lpm`: longest cached prefix first (ties by arrival); falls back to fcfs past `LPM_FALLBACK` waiting
  requests, where matching them all each step would cost more than it saves.
- `dfs-weight`: walk the radix tree depth-first, heavier subtrees (more waiting requests below) first, so
  requests sharing a prefix run together while it is cached.
Without the radix cache every policy is fcfs.
"""

from __future__ import annotations

from radix_cache import RadixCache, TreeNode
from runtime.scheduler.core import Req

LPM_FALLBACK = 128
POLICIES = ("fcfs", "lpm", "dfs-weight")


def order_waiting(policy: str, waiting: list[Req], tree: RadixCache | None) -> list[Req]:
    """Return `waiting` in the order admission should try them (a new list; the input is not changed)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown schedule policy {policy!r}")
    by_arrival = sorted(waiting, key=lambda r: r.arrival)
    if tree is None or policy == "fcfs" or len(waiting) > LPM_FALLBACK:
        return by_arrival
    matches = {id(r): _match(tree, r) for r in by_arrival}
    if policy == "lpm":
        return sorted(by_arrival, key=lambda r: -matches[id(r)][0])
    return _dfs_weight(by_arrival, {k: v[1] for k, v in matches.items()}, tree)


def _match(tree: RadixCache, req: Req) -> tuple[int, TreeNode]:
    ids = req.fill_ids[: req.match_cap()]
    if not ids:
        return 0, tree.root
    m = tree.match_prefix(ids, record=False)
    return m.length, m.last_node


def _dfs_weight(reqs: list[Req], nodes: dict[int, TreeNode], tree: RadixCache) -> list[Req]:
    """Requests grouped by the tree node their match ends at; subtrees visited heaviest first."""
    weight: dict[int, int] = {}
    at_node: dict[int, list[Req]] = {}
    for r in reqs:
        node: TreeNode | None = nodes[id(r)]
        at_node.setdefault(id(node), []).append(r)
        while node is not None:
            weight[id(node)] = weight.get(id(node), 0) + 1
            node = node.parent
    out: list[Req] = []
    stack = [tree.root]
    while stack:
        node = stack.pop()
        out.extend(at_node.get(id(node), []))
        kids = [c for c in node.children.values() if id(c) in weight]
        # Heaviest first: push lightest first so the heaviest pops next.
        kids.sort(key=lambda c: (weight[id(c)], -c.id))
        stack.extend(kids)
    return out
