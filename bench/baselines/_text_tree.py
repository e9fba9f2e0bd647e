"""An approximate radix tree over request text with per-worker membership, as the SGLang
Model Gateway (and its fork, the vLLM Router) keep for ``cache_aware`` routing.

SGLang's tree has one character per edge step and splits edges where texts diverge; each
node remembers which workers ("tenants") were sent text through it. A character-level
tree in Python is too slow for thousands of ~60 KB prompts, so this one has fixed-width
edges: the text is cut into ``chunk``-byte pieces (the last one may be shorter) and each
piece is one edge, keyed by its bytes. Walking a 60 KB prompt is ~940 dict probes.

The match stays exact to the character: full edges are matched by equality, and at the
edge where the text leaves the tree, the longest common prefix with the stored sibling
edges (each at most ``chunk`` bytes) adds the partial edge, as SGLang's partial-edge
match does. Only that last step is bounded: it scans at most ``refine_scan`` siblings
(a node after a shared system prompt can have thousands), so past that many it may
undercount the match by less than one edge (< ``chunk`` characters).

Membership and eviction: each worker has an LRU of the nodes it was sent through, sized
in bytes of edge text. An insert touches the path leaf-first so the root end is the most
recent; eviction then drops a worker's leaves before their prefixes (SGLang evicts the
least recently used leaves of a tenant over ``max_tree_size``). SGLang evicts in a
background sweep every ``eviction_interval_secs``; here the bound is applied on every
insert, i.e. the same bound without the overshoot between sweeps. Counting bytes, not
characters, is the same for ASCII text.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Walk:
    """A text cut into edges, and the nodes the tree already has along it."""

    root: int
    edges: list[bytes]
    path: list[int]  # path[i] is the node after edges[i]; stops where the tree does


def common_prefix(a: bytes, b: bytes) -> int:
    """Length of the common prefix of two short byte strings."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return n - (x.bit_length() + 7) // 8  # bytes from the first difference to the end


class TextTree:
    def __init__(self, max_bytes_per_worker: int, chunk: int = 64, refine_scan: int = 256) -> None:
        self.max_bytes = max_bytes_per_worker
        self.chunk = chunk
        self.refine_scan = refine_scan
        self._roots: dict[int, int] = {}  # scope (tenant and model seed) -> root node
        self._kids: dict[int, dict[bytes, int]] = {}  # node -> {edge text: child}
        self._parent: dict[int, tuple[int, bytes]] = {}  # node -> (parent, edge text)
        self._owners: dict[int, int] = {}  # node -> bitmask of worker slots
        self._lru: dict[int, OrderedDict[int, int]] = {}  # slot -> {node: edge bytes}
        self._size: dict[int, int] = {}  # slot -> bytes held
        self._next = 0

    def _new_node(self) -> int:
        self._next += 1
        return self._next

    def walk(self, text: bytes, scope: int) -> Walk:
        root = self._roots.get(scope)
        if root is None:
            root = self._roots[scope] = self._new_node()
        c = self.chunk
        edges = [text[i : i + c] for i in range(0, len(text), c)]
        path: list[int] = []
        kids = self._kids
        node = root
        for edge in edges:
            children = kids.get(node)
            nxt = children.get(edge) if children is not None else None
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        return Walk(root, edges, path)

    def match(self, walk: Walk, workers: int) -> tuple[int, int]:
        """``(matched bytes, holders)``: the longest prefix of the text that any of
        ``workers`` (a bitmask) was sent, and the bitmask of those that were."""
        owners = self._owners
        mask = workers
        depth = matched = 0
        for node in walk.path:
            held = owners.get(node, 0) & mask
            if not held:
                break
            mask = held
            matched += len(walk.edges[depth])
            depth += 1
        if depth < len(walk.edges):  # the text leaves the tree inside the next edge
            node = walk.path[depth - 1] if depth else walk.root
            partial, held = self._partial(node, walk.edges[depth], mask)
            if partial:
                matched += partial
                mask = held
        return matched, (mask if matched else 0)

    def _partial(self, node: int, edge: bytes, workers: int) -> tuple[int, int]:
        children = self._kids.get(node)
        if not children:
            return 0, 0
        owners = self._owners
        best = best_mask = 0
        for n, (key, kid) in enumerate(children.items()):
            if n >= self.refine_scan:
                break
            held = owners.get(kid, 0) & workers
            if not held:
                continue
            shared = common_prefix(edge, key)
            if shared > best:
                best, best_mask = shared, held
            elif shared == best and shared:
                best_mask |= held
        return best, best_mask

    def insert(self, walk: Walk, slot: int) -> None:
        """The worker in ``slot`` was sent this text."""
        kids, parent = self._kids, self._parent
        nodes = list(walk.path)
        node = nodes[-1] if nodes else walk.root
        for edge in walk.edges[len(nodes) :]:
            new = self._new_node()
            kids.setdefault(node, {})[edge] = new
            parent[new] = (node, edge)
            nodes.append(new)
            node = new
        walk.path = nodes
        bit = 1 << slot
        owners = self._owners
        lru = self._lru.setdefault(slot, OrderedDict())
        size = self._size.get(slot, 0)
        for node, edge in zip(reversed(nodes), reversed(walk.edges), strict=True):
            if node in lru:
                lru.move_to_end(node)
            else:
                lru[node] = len(edge)
                size += len(edge)
                owners[node] = owners.get(node, 0) | bit
        while size > self.max_bytes and lru:
            size -= self._evict(slot, lru)
        self._size[slot] = size

    def _evict(self, slot: int, lru: OrderedDict[int, int]) -> int:
        node, nbytes = lru.popitem(last=False)
        mask = self._owners[node] & ~(1 << slot)
        if mask:
            self._owners[node] = mask
            return nbytes
        # No worker holds it, so none holds anything below it either (a worker's
        # prefixes are always more recent than their extensions): unlink it.
        del self._owners[node]
        self._kids.pop(node, None)
        up, edge = self._parent.pop(node)
        siblings = self._kids.get(up)
        if siblings is not None:
            siblings.pop(edge, None)
            if not siblings:
                del self._kids[up]
        return nbytes

    def size(self, slot: int) -> int:
        """Bytes of text held for the worker in ``slot``."""
        return self._size.get(slot, 0)
