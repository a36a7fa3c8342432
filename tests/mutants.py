"""Deliberately broken kernels: each is the real kernel file with one textual edit.

The tests compile a mutant through the engine's ``kernel_sources`` seam (the same source path
as the real kernel) and check that the oracle comparison, or ThreadSanitizer, catches it. The
edits are applied in memory to the current kernel text; an edit whose text no longer occurs
exactly once raises, so a kernel change cannot silently turn a mutant into the real kernel.
"""

from __future__ import annotations

import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels_cu"

# mutant name -> (kernel file, text to find (exactly once), replacement)
MUTANTS = {
    # Keys past Lk / kv_lengths / the split's range are scored as visible (zero-filled keys
    # then take softmax weight).
    "no_tail_mask": (
        "attention_score.cuh",
        "bool in = i < lq_ && j < key_end_ && j >= j_lo_ && j < j_hi_;",
        "bool in = i < lq_ && j >= j_lo_;",
    ),
    # The diagonal from the lengths (Lk - Lq) instead of the positions: q_offset and k_offset
    # ignored, so chunks merged with `merge` under causal, a window or ALiBi go wrong.
    "diagonal_from_lengths": (
        "attention_score.cuh",
        "r.diag = diagonal_offset;",
        "r.diag = (long long)lk - lq;",
    ),
    # softcap_bias ignored: the cap applies to the content score, before bias and ALiBi.
    "softcap_before_bias": (
        "attention_score.cuh",
        "constexpr bool kCapScore = kHasSoftcap && !kSoftcapBias;\n"
        "constexpr bool kCapLogit = kHasSoftcap && kSoftcapBias;",
        "constexpr bool kCapScore = kHasSoftcap;\nconstexpr bool kCapLogit = false;",
    ),
    # The accumulator is not rescaled when the running max grows (the denominator still is).
    "no_rescale": (
        "common.cuh",
        "        l *= alpha;\n#pragma unroll\n        for (int c = 0; c < kCols; ++c) o[c] *= alpha;\n",
        "        l *= alpha;\n",
    ),
    # No barrier between the P·V reads of one tile and the K load of the next: a race.
    "no_sync": (
        "attention_fwd_simt.cu",
        "            __syncthreads();\n            load_kv_tile<kD, false>(",
        "            load_kv_tile<kD, false>(",
    ),
    # Tensor-core family: the K fragments of the two n-tiles of an ldmatrix.x4 mixed up (b0
    # takes n-tile 0's first register and n-tile 1's second): a wrong fragment layout.
    "mma_k_frag_swapped": (
        "mma_fragments.cuh",
        "((lane / 8) % 2) * kC));\n        b0[0] = r[0]; b0[1] = r[1]; b1[0] = r[2]; b1[1] = r[3];",
        "((lane / 8) % 2) * kC));\n        b0[0] = r[0]; b0[1] = r[2]; b1[0] = r[1]; b1[1] = r[3];",
    ),
    # Tensor-core family, tf32: V read in natural key order while P keeps the lane order
    # (keys 2t, 2t + 1): P·V pairs probabilities with the wrong value rows.
    "mma_tf32_pv_order": (
        "mma_fragments.cuh",
        "b0[0] = __float_as_uint(s[split_offset<L>(8 * kk, n0, 2 * t, g)]);",
        "b0[0] = __float_as_uint(s[split_offset<L>(8 * kk, n0, t, g)]);",
    ),
    # Tensor-core family: no barrier at the end of a key tile, so a warp that finishes early
    # refills the stage (tile n + 2) while a slower warp still reads tile n from it: a race.
    "mma_no_stage_sync": (
        "attention_fwd_mma.cu",
        "            // every warp is done with this stage before a later iteration refills it\n"
        "            __syncthreads();\n",
        "",
    ),
    # Tensor-core family: the K/V stage is read without waiting for its cp.async group (the
    # emulation lands copies only at the wait: the tile reads as poison).
    "mma_no_cp_async_wait": (
        "attention_fwd_mma.cu",
        "            cp_async_wait<kStages - 1>();  // tile n (and Q) landed for this thread...\n",
        "",
    ),
    # Tensor-core family, two query tiles per warp: the second tile's output accumulates the
    # first tile's weights P.
    "mma_m_tiles_share_p": (
        "attention_fwd_mma.cu",
        "Op::mma(o, pf[mt], vf[u]);",
        "Op::mma(o, pf[0], vf[u]);",
    ),
    # Backward, both families: the dQ kernel's sum of P dropped, so every row that sees a key
    # records 0 and the host's check of lse cannot tell a right lse from a wrong one.
    "bwd_simt_no_row_sum": ("attention_bwd_simt.cu", "row_sum[r] += p;", ""),
    "bwd_mma_no_row_sum": ("attention_bwd_mma.cu", "row_sum[h] += p;", ""),
    # Backward: no weight under lse = -inf, so a row that sees keys sums to 0 as a row that
    # sees none does, and an lse of -inf there passes.
    "bwd_weight_zero_under_neg_inf_lse": (
        "attention_grads.cuh",
        "__device__ __forceinline__ Acc summed_weight(Acc s, Acc lse) {\n"
        "    if (s == neg_inf(Acc())) return Acc(0);",
        "__device__ __forceinline__ Acc summed_weight(Acc s, Acc lse) {\n"
        "    if (s == neg_inf(Acc()) || lse == neg_inf(Acc())) return Acc(0);",
    ),
    # Packed batches: each sequence's last key dropped (the sequence's key bound off by one).
    "varlen_last_key_dropped": (
        "attention_score.cuh",
        "    r.key_end = seq[2];\n",
        "    r.key_end = seq[2] > 0 ? seq[2] - 1 : 0;\n",
    ),
    # Packed batches: a block reads the sequence of the table's previous entry (its own tile
    # index): the table lookup off by one.
    "varlen_table_off_by_one": (
        "attention_score.cuh",
        "const long long s = tiles[2 * e];",
        "const long long s = tiles[2 * (e > 0 ? e - 1 : e)];",
    ),
    # Packed batches, backward: dK and dV written at the sequence's first query row instead of
    # its first key row.
    "varlen_bwd_key_rows": (
        "attention_grads.cuh",
        "r.k_start = seq[4];",
        "r.k_start = seq[0];",
    ),
    # Statistics (attention_stats.cu): the entropy's sum not moved to the new maximum (only
    # scaled like l), so rows whose maximum grows after their first keys go wrong.
    "stats_entropy_not_rescaled": (
        "attention_stats.cu",
        "u = alpha * (u + shift * l);",
        "u = alpha * u;",
    ),
    # Statistics: a lane keeps the last key of its maximum, not the first (ties).
    "stats_argmax_last_tie": (
        "attention_stats.cu",
        "if (s > best) {  // strict: the first key of the max; NaN never wins",
        "if (s >= best) {",
    ),
    # Statistics: a key enters the top-k before the entries with its own score (later key
    # first on ties).
    "stats_top_k_ties_later_key_first": (
        "attention_stats.cu",
        "__ballot_sync(CUONLINE_FULL_MASK, st.top_s >= x)",
        "__ballot_sync(CUONLINE_FULL_MASK, st.top_s > x)",
    ),
    # Statistics: the received pass sums P without the query weights.
    "stats_received_ignores_weights": (
        "attention_stats.cu",
        "acc[r] += w * weight_of(",
        "acc[r] += weight_of(",
    ),
    # Statistics: pass 1 stages the next key tile while slower warps still score the last one
    # (the barrier at the top of its loop removed): a race.
    "stats_no_tile_sync": (
        "attention_stats.cu",
        "            __syncthreads();\n"
        "            stage<kBlockN, kLd>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0,\n",
        "            stage<kBlockN, kLd>(sK, k_b, strides[2 * kK], strides[2 * kK + 1], j0,\n",
    ),
}


def mutant_sources(name: str) -> dict:
    """``{kernel file name: mutated text}``, for ``cuda.attention(kernel_sources=...)``."""
    file, find, replace = MUTANTS[name]
    text = (KERNELS / file).read_text(encoding="utf-8")
    if text.count(find) != 1:
        raise ValueError(f"mutant {name}: the edited text occurs {text.count(find)} times in {file}")
    return {file: text.replace(find, replace)}


# --------------------------------------------------------------------------------------------
# generated: one mutant per barrier (__syncthreads, __syncwarp) and per cp.async wait

#: The kernel files the families paste (kernels_cu/*.cu and *.cuh).
BARRIER_FILES = tuple(sorted(p.name for p in KERNELS.glob("*.cu*")))
#: A barrier with this marker on its line, or in the comment block right above it, is known to
#: be redundant; the text after the colon (to the end of the comment) says why.
REDUNDANT_MARKER = "// barrier-redundant:"
_BARRIER_RE = re.compile(r"__syncthreads\(\)\s*;|__syncwarp\([^;]*\)\s*;"
                         r"|cp_async_wait<[^;>]*>\(\)\s*;")


def _barriers():
    """``(file, offset, length, line number, kind, reason or None)`` per barrier call."""
    out = []
    for file in BARRIER_FILES:
        text = (KERNELS / file).read_text(encoding="utf-8")
        lines = text.split("\n")
        for m in _BARRIER_RE.finditer(text):
            line = text.count("\n", 0, m.start())
            here = lines[line]
            reason = None
            if REDUNDANT_MARKER in here:
                reason = here.split(REDUNDANT_MARKER, 1)[1].strip()
            else:
                # the comment block right above the call, read upwards
                comment, up = [], line - 1
                while up >= 0 and lines[up].strip().startswith("//"):
                    comment.insert(0, lines[up].strip())
                    up -= 1
                starts = [i for i, c in enumerate(comment) if c.startswith(REDUNDANT_MARKER)]
                if starts:
                    words = [c[2:].strip() for c in comment[starts[-1]:]]
                    reason = " ".join(words)[len(REDUNDANT_MARKER) - 2:].strip()
            kind = m.group(0).split("(")[0].split("<")[0].strip("_")
            out.append((file, m.start(), m.end() - m.start(), line + 1, kind, reason))
    return out


def barrier_mutants() -> dict:
    """``{name: (file, offset, length)}``: each barrier or cp.async wait call of the kernels,
    removed, unless marked :data:`REDUNDANT_MARKER`. Names read ``attention_fwd_mma.cu:473:
    syncthreads`` (file, line, call); offsets are into the current text."""
    return {f"{file}:{line}:{kind}": (file, offset, length)
            for file, offset, length, line, kind, reason in _barriers() if reason is None}


def barrier_skips() -> dict:
    """``{name: reason}`` of the barriers marked redundant (the generator skips them)."""
    return {f"{file}:{line}:{kind}": reason
            for file, _, _, line, kind, reason in _barriers() if reason is not None}


def barrier_mutant_sources(name: str) -> dict:
    """``{kernel file name: text without that barrier}``, for ``kernel_sources=``."""
    file, offset, length = barrier_mutants()[name]
    text = (KERNELS / file).read_text(encoding="utf-8")
    return {file: text[:offset] + text[offset + length:]}
