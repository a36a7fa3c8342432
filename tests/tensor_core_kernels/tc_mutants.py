"""Deliberately wrong fragment layouts for the tensor-core helpers and their test kernels.

Each mutant is a copy of one file (``kernels_cu/tensor_core.cuh``, the emulation's C++ bodies of
its PTX helpers ``cuonline/testing/cuda_cpu/tensor_core.h``, or a kernel of this folder) with one
textual edit, made in memory by :func:`mutant_sources`; the text to find must occur
exactly once, so an edit that no longer applies fails loudly instead of testing nothing.
``tests/test_tensor_core.py`` runs the check named by each mutant on its copy and asserts that
the check fails.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    file: str      # "tensor_core.cuh", EMULATION (below) or a file of tests/tensor_core_kernels/
    find: str      # text that occurs exactly once in the file
    replace: str
    check: str     # name of the check in test_tensor_core.py that must fail
    why: str


#: The emulation header part that defines the PTX helpers for the CPU (a name of
#: cuonline.testing.emulate.header_files()).
EMULATION = "cuda_cpu/tensor_core.h"

MUTANTS = {
    # Emulated m16n8k16: registers a[1] and a[2] exchanged (A[g+8][2t] taken for A[g][2t+8]).
    "mma16_a_regs_swapped": Mutant(
        EMULATION,
        "mine01 = pack64(a[0], a[1]), mine23 = pack64(a[2], a[3]);",
        "mine01 = pack64(a[0], a[2]), mine23 = pack64(a[1], a[3]);",
        "gemm16_f16_nk",
        "A fragment register order",
    ),
    # Emulated m16n8k16: C/D register i taken as C[g + 8 (i & 1)][2t + (i >> 1)].
    "mma16_c_regs_swapped": Mutant(
        EMULATION,
        "const int h = i >> 1, j = i & 1;  // c[i] = C[g + 8h][2t + j]",
        "const int h = i & 1, j = i >> 1;",
        "gemm16_f16_nk",
        "C/D fragment register order",
    ),
    # Kernel: the A tile loaded with .trans: rows and columns of each 8x8 block swapped.
    "gemm16_a_row_col_swapped": Mutant(
        "gemm16.cu",
        "ldmatrix_x4(af, sA + SwA::offset(",
        "ldmatrix_x4_trans(af, sA + SwA::offset(",
        "gemm16_f16_nk",
        "A fragment rows and columns swapped",
    ),
    # Kernel: V-like (k, n) B tile loaded without the .trans it needs.
    "gemm16_b_without_trans": Mutant(
        "gemm16.cu",
        "ldmatrix_x4_trans(bf, sB + SwB::offset(",
        "ldmatrix_x4(bf, sB + SwB::offset(",
        "gemm16_f16_kn",
        "ldmatrix without .trans where it is needed",
    ),
    # Kernel: the tiles read without waiting for cp.async (the emulation defers the copies).
    "gemm16_no_cp_async_wait": Mutant(
        "gemm16.cu",
        "    cp_async_wait<0>();\n    __syncthreads();\n\n    float acc[kN / 8][4];",
        "    __syncthreads();\n\n    float acc[kN / 8][4];",
        "gemm16_f16_nk",
        "shared tiles read before cp.async.wait_group",
    ),
    # Accumulator -> A fragment: the two n-tiles' halves exchanged.
    "acc_to_a_swapped": Mutant(
        "tensor_core.cuh",
        "    a[1] = pack2_rn<T>(c0[2], c0[3]);\n    a[2] = pack2_rn<T>(c1[0], c1[1]);",
        "    a[1] = pack2_rn<T>(c1[0], c1[1]);\n    a[2] = pack2_rn<T>(c0[2], c0[3]);",
        "chain_f16",
        "score accumulators re-packed in the wrong order for P·V",
    ),
    # Emulated ldmatrix (no .trans): matrices handed out in reverse register order.
    "ldmatrix_register_order": Mutant(
        EMULATION,
        "std::memcpy(&r[i], reinterpret_cast<const char*>(p) + 4 * t, 4);",
        "std::memcpy(&r[kNum - 1 - i], reinterpret_cast<const char*>(p) + 4 * t, 4);",
        "ldmatrix_probe",
        "ldmatrix register order",
    ),
    # Emulated ldmatrix .trans: the two rows of a register exchanged.
    "ldmatrix_trans_pairs": Mutant(
        EMULATION,
        "r[i] = (unsigned)lo | ((unsigned)hi << 16);",
        "r[i] = (unsigned)hi | ((unsigned)lo << 16);",
        "ldmatrix_probe",
        "ldmatrix .trans element order within a register",
    ),
    # Emulated m16n8k8 tf32: b[0] and b[1] exchanged (B[t+4][g] taken for B[t][g]).
    "tf32_b_regs_swapped": Mutant(
        EMULATION,
        "            bcol[j][q] = emu::tf32_value(emu::lo32(y));\n"
        "            bcol[j][q + 4] = emu::tf32_value(emu::hi32(y));",
        "            bcol[j][q] = emu::tf32_value(emu::hi32(y));\n"
        "            bcol[j][q + 4] = emu::tf32_value(emu::lo32(y));",
        "gemm_tf32",
        "tf32 B fragment register order",
    ),
    # Emulated m8n8k4 f64: B read as if lane 4k+n held B[k][n] (row/col of B swapped).
    "f64_b_row_col_swapped": Mutant(
        EMULATION,
        "bcol[j][q] = __shfl_sync(emu::kFull, b, 4 * (2 * t + j) + q);",
        "bcol[j][q] = __shfl_sync(emu::kFull, b, (4 * q + 2 * t + j) & 31);",
        "gemm_f64",
        "f64 B fragment rows and columns swapped",
    ),
    # Emulated m8n8k4 f64: the two C/D registers exchanged.
    "f64_c_regs_swapped": Mutant(
        EMULATION,
        "    d[0] = out[0];\n    d[1] = out[1];",
        "    d[0] = out[1];\n    d[1] = out[0];",
        "gemm_f64",
        "f64 C/D fragment register order",
    ),
    # Swizzle without the XOR: still a consistent layout (the GEMMs pass), but ldmatrix phases
    # hit the same banks 8 (or 4, 2) times.
    "swizzle_identity": Mutant(
        "tensor_core.cuh",
        "return chunk ^ ((row / kRowsPerLine) & kMask);",
        "return chunk;",
        "swizzle",
        "bank conflicts: the swizzle does not permute chunks",
    ),
    # split_offset with the whole column block added outside the XOR: right for the first span
    # of a row only, so fragments of later k-steps would come from the wrong chunks.
    "split_offset_unspanned": Mutant(
        "tensor_core.cuh",
        "return r0 * L::kStride + (c0 / L::kSpan) * L::kSpan + L::offset(r, c0 % L::kSpan + c);",
        "return r0 * L::kStride + c0 + L::offset(r, c);",
        "swizzle",
        "split_offset outside the XOR span",
    ),
}


def apply(name: str, texts: dict) -> dict:
    """Return a copy of ``texts`` (file name -> text) with mutant ``name``'s edit applied."""
    m = MUTANTS[name]
    text = texts[m.file]
    count = text.count(m.find)
    if count != 1:
        raise ValueError(f"mutant {name}: the edited text occurs {count} times in {m.file}")
    out = dict(texts)
    out[m.file] = text.replace(m.find, m.replace)
    return out
