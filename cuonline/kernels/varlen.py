"""Packed variable-length batches on the CUDA kernels: the block table and the offset rows.

A packed batch (``cu_seqlens_q``, ``cu_seqlens_k``) launches one thread block per (query tile
of a sequence, batch element), never a tile that crosses two sequences: the work is
``sum_b len_q(b) * len_k(b)``. The kernels (``varlen_block_range`` in
``kernels_cu/attention_score.cuh``) find their tile in :func:`tile_table`'s table and their
sequence's lengths and diagonal in :func:`sequence_table`'s, and address q, k, v and rel_q
through :func:`expand_offsets`'s offset rows, which already point at the sequence's first row:
inside the kernel every index is local to the sequence, so every score term (causal, window,
ALiBi, the relative terms, the soft cap) applies per sequence with no code of its own.

Pure functions of host integers (NumPy), like the planners.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SEQUENCE_COLUMNS", "TileTable", "expand_offsets", "key_tile_table",
           "sequence_table", "tile_table"]

#: Columns of :func:`sequence_table` (``varlen_seqs`` in the kernels).
SEQUENCE_COLUMNS = ("q_start", "lq", "lk", "diagonal", "k_start")


@dataclass(frozen=True, eq=False)
class TileTable:
    """The blocks of a packed batch (per batch element): ``tiles`` (n, 2) int32, each row
    (sequence, query tile), heaviest first (``varlen_tiles`` in the kernels); ``seqs`` (B, 5)
    int64, :data:`SEQUENCE_COLUMNS` per sequence (``varlen_seqs``)."""

    tiles: np.ndarray
    seqs: np.ndarray

    def __len__(self) -> int:
        return int(self.tiles.shape[0])


def sequence_table(cu_seqlens_q, cu_seqlens_k, diagonals) -> np.ndarray:
    """(B, 5) int64 (:data:`SEQUENCE_COLUMNS`): per sequence its first query row in the
    packed q, its query and key lengths, its diagonal offset (the key facing its query 0) and
    its first key row in the packed k."""
    cq = np.asarray(cu_seqlens_q, dtype=np.int64)
    ck = np.asarray(cu_seqlens_k, dtype=np.int64)
    seqs = np.empty((cq.shape[0] - 1, len(SEQUENCE_COLUMNS)), dtype=np.int64)
    seqs[:, 0] = cq[:-1]
    seqs[:, 1] = np.diff(cq)
    seqs[:, 2] = np.diff(ck)
    seqs[:, 3] = np.asarray(diagonals, dtype=np.int64).reshape(-1)
    seqs[:, 4] = ck[:-1]
    return seqs


def tile_table(cu_seqlens_q, cu_seqlens_k, diagonals, window, block_m) -> TileTable:
    """The thread blocks of a packed batch (per batch element): every ``block_m``-row query
    tile of every sequence with queries, the heaviest first.

    A tile's weight is its rows times the keys its band can see (``window`` = (left, right),
    None = unbounded; the same range the kernel's ``varlen_block_range`` takes), plus one
    tile of work for the block itself: launching the longest tiles first keeps a GPU from
    finishing on one long sequence (longest-processing-time order). Ties keep the packed
    order (a stable sort), so the table is a function of its arguments.
    """
    seqs = sequence_table(cu_seqlens_q, cu_seqlens_k, diagonals)
    lq, lk, diag = seqs[:, 1], seqs[:, 2], seqs[:, 3]
    n_tiles = -(-lq // block_m)
    seq = np.repeat(np.arange(seqs.shape[0], dtype=np.int64), n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    tile = np.arange(seq.shape[0], dtype=np.int64) - np.repeat(first, n_tiles)
    i0 = tile * block_m
    i1 = np.minimum(i0 + block_m, lq[seq])
    left, right = window
    j0 = np.zeros_like(i0) if left is None else np.clip(i0 + diag[seq] - left, 0, lk[seq])
    j1 = lk[seq] if right is None else np.clip(i1 + diag[seq] + right, 0, lk[seq])
    weight = (i1 - i0) * (np.maximum(j1 - j0, 0) + block_m)
    order = np.argsort(-weight, kind="stable")
    tiles = np.stack([seq[order], tile[order]], axis=1).astype(np.int32)
    return TileTable(np.ascontiguousarray(tiles), seqs)


def key_tile_table(cu_seqlens_q, cu_seqlens_k, diagonals, window, block) -> np.ndarray:
    """The blocks of a backward's key-owned kernel (dK, dV): (n, 2) int32, every
    ``block``-key tile of every sequence with keys as (sequence, key tile), the heaviest
    first (``varlen_key_tiles``). Key j sees the queries ``i`` with ``j - diag - right <= i
    <= j - diag + left``: :func:`tile_table` with the roles of queries and keys swapped
    (diagonal negated, window sides exchanged). A sequence with keys but no queries has tiles
    too: its blocks write the zero gradients of its keys."""
    left, right = window
    mirrored = tile_table(cu_seqlens_k, cu_seqlens_q, -np.asarray(diagonals, dtype=np.int64),
                          (right, left), block)
    return mirrored.tiles


def expand_offsets(offsets, strides, table, operands, q_side, k_side) -> np.ndarray:
    """The offset table of a packed batch: (B * nbatch, len(operands)) int64, row ``s *
    nbatch + b`` is batch element ``b``'s row of ``offsets`` (nbatch, len(operands)) with the
    operands named in ``q_side`` moved down to sequence ``s``'s first query row and those in
    ``k_side`` to its first key row (``strides`` (len(operands), 2) gives their row strides;
    ``table`` is the :class:`TileTable`)."""
    shift = np.zeros((table.seqs.shape[0], len(operands)), dtype=np.int64)
    for names, starts in ((q_side, table.seqs[:, 0]), (k_side, table.seqs[:, 4])):
        for name in names:
            op = operands.index(name)
            shift[:, op] = starts * int(strides[op][0])
    rows = shift[:, None, :] + np.asarray(offsets, dtype=np.int64)[None, :, :]
    return np.ascontiguousarray(rows.reshape(-1, len(operands)))
