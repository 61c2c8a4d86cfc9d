"""Waiting-queue order: which waiting requests the prefill adder considers first.

- `fcfs`: arrival order (retracted requests keep their original arrival, so they go first).
- `lpm`: longest cached prefix first (ties by arrival); falls back to fcfs past `LPM_FALLBACK` waiting
  requests, where matching them all each step would cost more than it saves.
- `dfs-weight`: walk the radix tree depth-first, heavier subtrees (more waiting requests below) first, so
  requests sharing a prefix run together while it is cached.
Without the radix cache every policy is fcfs.

Priority (--enable-priority-scheduling): the policy's order is then stably sorted by `rank`, so a higher
priority always comes first and the policy orders requests of one priority. `preemption_victims` lists the
running requests a waiting one may retract: only those ranked lower by more than the threshold, lowest
priority first, then the fewest output tokens (the least work lost).
"""

from __future__ import annotations

from radix_cache import RadixCache, TreeNode
from runtime.scheduler.core import Req

LPM_FALLBACK = 128
POLICIES = ("fcfs", "lpm", "dfs-weight")


def rank(req: Req, low_first: bool) -> int:
    """Sort key of a request's priority: smaller ranks run first."""
    return req.priority if low_first else -req.priority


def order_waiting(policy: str, waiting: list[Req], tree: RadixCache | None,
                  priority_low_first: bool | None = None) -> list[Req]:
    """Return `waiting` in the order admission should try them (a new list; the input is not changed).
    `priority_low_first`: None without priority scheduling, else whether smaller priority values go first."""
    ordered = _order(policy, waiting, tree)
    if priority_low_first is None:
        return ordered
    return sorted(ordered, key=lambda r: rank(r, priority_low_first))


def preemption_victims(head: Req, running: list[Req], threshold: int, low_first: bool) -> list[Req]:
    """Running requests `head` may retract, in retraction order (see the module docstring)."""
    top = rank(head, low_first)
    victims = [r for r in running if rank(r, low_first) - top > threshold]
    return sorted(victims, key=lambda r: (-rank(r, low_first), len(r.output_ids), -r.arrival))


def _order(policy: str, waiting: list[Req], tree: RadixCache | None) -> list[Req]:
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
