"""radix_cache: the prefix cache over token ids (a leaf package: stdlib and torch only)."""

from __future__ import annotations

from radix_cache.tree import HitStats, MatchResult, RadixCache, TreeNode

__all__ = ["HitStats", "MatchResult", "RadixCache", "TreeNode"]
