"""Double binary tree allreduce, pipelined (the shape NCCL uses between nodes).

Two binary trees span the M daemons; the first half of the buffer is reduced up
and broadcast down the first tree, the second half the second tree.  In the
first tree the leaves are the even ranks; the second is its mirror image (M
even) or its shift by one (M odd), so its leaves are the odd ranks (and rank 0
when M is odd).  Every daemon is a leaf in one tree and interior in the other,
so each link carries about the same load: each daemon sends about 2 · D
elements, and latency grows with the tree height ⌊log2 M⌋, not with M.

Each half is cut into `chunks` pipeline chunks.  With h the height of a daemon
in its tree (0 for leaves) and δ its depth (0 for the root), H the tree height:

* reduce: chunk k goes up to the parent at step k + h, so it leaves once both
  children's copies of it have arrived (their height is lower);
* broadcast: the root sends the finished chunk k down at step k + H, and a
  daemon at depth δ forwards it at step k + H + δ.

Chunk k + 1 thus follows chunk k one step behind, up and down at once; the
collective takes chunks + 2H - 1 steps.  The ranges a daemon touches in one
step are distinct chunks (up, down and received chunks differ in index), except
that both children's copies of one chunk arrive together and are reduced one
after the other.
"""

from __future__ import annotations

import dataclasses

from gradsync.daemon.algorithms.schedule import Schedule, StepBuilder, check_args, split_bounds

#: Default pipeline chunk, in elements, when the caller does not pick a chunk count.
TREE_CHUNK_ELEMENTS = 1 << 16
#: Upper bound on the default chunk count, so per-step overhead stays bounded.
MAX_TREE_CHUNKS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class TreeLinks:
    """One binary tree over ranks 0..M-1: its root, each rank's parent and children."""

    root: int
    parent: tuple[int | None, ...]
    children: tuple[tuple[int, ...], ...]

    def height(self, rank: int) -> int:
        """Edges from `rank` down to its deepest descendant (0 for a leaf)."""
        below = self.children[rank]
        return 1 + max(self.height(child) for child in below) if below else 0

    def depth(self, rank: int) -> int:
        """Edges from `rank` up to the root."""
        depth = 0
        parent = self.parent[rank]
        while parent is not None:
            depth, parent = depth + 1, self.parent[parent]
        return depth


def _inorder_tree(size: int) -> TreeLinks:
    """A balanced binary tree whose in-order traversal is 0..size-1, even positions leaves.

    Numbering positions from 1, the root is the largest power of two p ≤ size;
    its left subtree is the perfect tree on 1..p-1 and its right subtree the
    same construction on p+1..size.  In a perfect in-order tree the odd (1-based)
    positions are exactly the leaves, and offsets by powers of two keep parity.
    """
    parent: list[int | None] = [None] * size
    children: list[list[int]] = [[] for _ in range(size)]

    def build(offset: int, length: int) -> int | None:
        # Positions offset+1 .. offset+length (1-based); returns the 0-based root.
        if length <= 0:
            return None
        top = 1 << (length.bit_length() - 1)
        root = offset + top - 1
        for sub in (build(offset, top - 1), build(offset + top, length - top)):
            if sub is not None:
                parent[sub] = root
                children[root].append(sub)
        return root

    root = build(0, size)
    assert root is not None
    return TreeLinks(root, tuple(parent), tuple(tuple(c) for c in children))


def _relabel(tree: TreeLinks, rank_of: list[int]) -> TreeLinks:
    """The same tree with position i renamed to rank ``rank_of[i]``."""
    size = len(rank_of)
    parent: list[int | None] = [None] * size
    children: list[tuple[int, ...]] = [()] * size
    for position in range(size):
        up = tree.parent[position]
        parent[rank_of[position]] = None if up is None else rank_of[up]
        children[rank_of[position]] = tuple(rank_of[c] for c in tree.children[position])
    return TreeLinks(rank_of[tree.root], tuple(parent), tuple(children))


def double_binary_tree(size: int) -> tuple[TreeLinks, TreeLinks]:
    """The two complementary trees over `size` daemons (first: even leaves; second: odd)."""
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    first = _inorder_tree(size)
    if size % 2 == 0:
        rank_of = [size - 1 - position for position in range(size)]
    else:
        rank_of = [(position + 1) % size for position in range(size)]
    return first, _relabel(first, rank_of)


def default_tree_chunks(count: int) -> int:
    """Pipeline chunks per half: ~`TREE_CHUNK_ELEMENTS` each, 1 to `MAX_TREE_CHUNKS`."""
    half = -(-count // 2)
    return max(1, min(MAX_TREE_CHUNKS, -(-half // TREE_CHUNK_ELEMENTS)))


def tree_steps(size: int, chunks: int) -> int:
    """Steps of a pipelined double-binary-tree allreduce: chunks + 2⌊log2 M⌋ - 1 (0 if M = 1)."""
    if size == 1:
        return 0
    return chunks + 2 * (size.bit_length() - 1) - 1


def tree(rank: int, size: int, count: int, chunks: int | None = None) -> Schedule:
    """Daemon `rank`'s part of a pipelined double-binary-tree allreduce.

    `chunks` is the number of pipeline chunks per half of the buffer; by default
    `default_tree_chunks(count)`.  Every daemon must be given the same value.
    """
    check_args(rank, size, count)
    if chunks is None:
        chunks = default_tree_chunks(count)
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if size == 1:
        return Schedule("tree", rank, size, count, ())
    builder = StepBuilder(tree_steps(size, chunks))
    middle = count // 2
    for links, (start, stop) in zip(
        double_binary_tree(size), ((0, middle), (middle, count)), strict=True
    ):
        top = links.height(links.root)
        height, depth = links.height(rank), links.depth(rank)
        up = links.parent[rank]
        below = [(child, links.height(child)) for child in links.children[rank]]
        bounds = split_bounds(start, stop, chunks)
        for k in range(chunks):
            lo, hi = bounds[k], bounds[k + 1]
            for child, child_height in below:
                builder.recv(k + child_height, child, lo, hi, reduce=True)
            if up is not None:
                builder.send(k + height, up, lo, hi)
                builder.recv(k + top + depth - 1, up, lo, hi, reduce=False)
            for child, _ in below:
                builder.send(k + top + depth, child, lo, hi)
    return builder.build("tree", rank, size, count)
