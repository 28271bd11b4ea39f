"""An approximate radix tree of the token prefixes one replica was sent, for routing only.

It mirrors what the replica's prefix cache could hold, not what it does hold: the engine caches
full blocks keyed by namespace + every token before, so the tree keeps prompts as chains of
`chunk`-token pieces under a namespace root (the tenant first: two tenants never share a node,
even for identical tokens). A match is counted in whole chunks, like a cache hit in whole blocks.

The tree is bounded: past `max_nodes` it drops least-recently-used leaves. A walk touches nodes
deepest first, so every parent is more recent than each of its children and the oldest node is
always a leaf (removing it never strands a subtree).

`touch` is a declared seam: a verifier's mutant may replace it on one tree (the recency rule)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

Edge = tuple[int, ...]  # one chunk of token ids (a namespace root is keyed by its name)


@dataclass(eq=False, slots=True)
class _Node:
    parent: _Node | None
    key: Edge | str
    children: dict[Edge | str, _Node] = field(default_factory=dict)


class PrefixTree:
    def __init__(self, chunk: int = 16, max_nodes: int = 100_000) -> None:
        if chunk < 1 or max_nodes < 1:
            raise ValueError(f"chunk and max_nodes must be >= 1, got {chunk}, {max_nodes}")
        self.chunk, self.max_nodes = chunk, max_nodes
        self._root = _Node(None, "")
        self._lru: OrderedDict[_Node, None] = OrderedDict()  # oldest first; the root not in it
        self.evictions = 0

    def __len__(self) -> int:
        """Nodes held: namespace roots plus token chunks."""
        return len(self._lru)

    def match(self, namespace: str, tokens: Sequence[int]) -> int:
        """Tokens of the longest stored prefix of `tokens` under `namespace` (whole chunks)."""
        node = self._root.children.get(namespace)
        matched = 0
        for edge in self._edges(tokens):
            if node is None or (node := node.children.get(edge)) is None:
                break
            matched += len(edge)
        return matched

    def insert(self, namespace: str, tokens: Sequence[int]) -> None:
        """Record that `tokens` were sent here; the path becomes the most recently used."""
        path = [self._child(self._root, namespace)]
        for edge in self._edges(tokens):
            path.append(self._child(path[-1], edge))
        self.touch(path)
        self._evict()

    def touch(self, path: list) -> None:
        """Make `path` (a namespace root, then its chunks in order) the most recently used,
        deepest first, so every parent ends up more recent than its children."""
        for node in reversed(path):
            self._lru[node] = None
            self._lru.move_to_end(node)

    def _edges(self, tokens: Sequence[int]) -> list[Edge]:
        full = len(tokens) - len(tokens) % self.chunk  # a partial chunk is never shared
        return [tuple(tokens[i : i + self.chunk]) for i in range(0, full, self.chunk)]

    @staticmethod
    def _child(node: _Node, key: Edge | str) -> _Node:
        child = node.children.get(key)
        if child is None:
            child = node.children[key] = _Node(node, key)
        return child

    def _evict(self) -> None:
        while len(self._lru) > self.max_nodes:
            leaf, _ = self._lru.popitem(last=False)
            assert not leaf.children, "LRU order broke: the oldest node has children"
            assert leaf.parent is not None
            del leaf.parent.children[leaf.key]
            self.evictions += 1
