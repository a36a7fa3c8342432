// attention_grads.cuh: what the backward families share, one text for both.
//
// Pasted (by cuonline/kernels/source.py, in the order cuonline/kernels/families.py lists) after
// attention_score.cuh into attention_bwd_simt.cu and attention_bwd_mma.cu: their parameter list
// and the two per-place functions of the backward math (docs/algorithm.md, "The backward
// pass"), so that the SIMT and the tensor-core gradients are the same formulas.

namespace cuonline {

// P = exp(s - lse) of logit s (-inf: invisible) in a row of log-sum-exp lse; 0 for an
// invisible place and for a row that sees no key (lse = -inf), whatever the other value.
template <class Acc>
__device__ __forceinline__ Acc backward_weight(Acc s, Acc lse) {
    if (s == neg_inf(Acc()) || lse == neg_inf(Acc())) return Acc(0);
    return exp2_((s - lse) * log2e(Acc()));
}

// The dQ kernels' P, which they also sum per row (row_sums) for the host's check of lse
// (cuonline/_lse_check.py): 0 for an invisible place, whatever lse (a row that sees no key
// has only those), so that an lse of -inf on a row that sees a key gives infinite weights
// and the host refuses it. (backward_weight keeps the dK/dV kernels' registers as they were.)
template <class Acc>
__device__ __forceinline__ Acc summed_weight(Acc s, Acc lse) {
    if (s == neg_inf(Acc())) return Acc(0);
    return exp2_((s - lse) * log2e(Acc()));
}

// From P, dP and Delta at one place: g_bias, the gradient of the loss with respect to the
// place's additive bias term (dS, through the derivative of a soft cap of the whole logit),
// g_content, with respect to the content score scale q·k + rel (through the content score's
// soft cap), and the return value, with respect to the raw q·k (times the scale). s is the
// logit, qk the raw score, rel = rel_q·rel_k (0 without it). A zero weight gives exactly 0.
template <class Acc>
__device__ __forceinline__ Acc logit_grads(Acc p, Acc dp, Acc delta, Acc s, Acc qk, Acc rel,
                                           Acc scale, Acc softcap, Acc& g_bias,
                                           Acc& g_content) {
    if (p == Acc(0)) {  // invisible (s = -inf: no cap derivative to form) or no weight
        g_bias = g_content = Acc(0);
        return Acc(0);
    }
    Acc g = p * (dp - delta);
    if constexpr (kCapLogit) {
        const Acc t = s / softcap;  // s = cap tanh(z / cap): d s / d z = 1 - tanh^2
        g *= Acc(1) - t * t;
    }
    g_bias = g;
    if constexpr (kCapScore) {
        const Acc t = tanh_((qk * scale + rel) / softcap);
        g *= Acc(1) - t * t;
    }
    g_content = g;
    return g * scale;
}

}  // namespace cuonline

// The parameters of every backward kernel, in the order cuonline/kernels/arguments.py passes
// them (ATTENTION_BWD_SIGNATURE).
#define CUONLINE_ATTENTION_BWD_PARAMS                                                          \
    const CUONLINE_T* __restrict__ q,             /* per batch: (lq, D) */                    \
        const CUONLINE_T* __restrict__ k,         /* per batch: (lk, D) */                    \
        const CUONLINE_T* __restrict__ v,         /* per batch: (lk, Dv) */                   \
        const CUONLINE_ACC* __restrict__ bias,    /* per batch: (lq, lk) or null */           \
        const unsigned char* __restrict__ mask,   /* per batch: (lq, lk) or null */           \
        const long long* __restrict__ kv_lengths, /* (nbatch,) or null */                     \
        const CUONLINE_ACC* __restrict__ alibi,   /* (nbatch,) or null */                     \
        const CUONLINE_ACC* __restrict__ rel_bias, /* per batch: (1, Rb) or null */           \
        const CUONLINE_ACC* __restrict__ rel_q,   /* per batch: (lq, Dr) or null */           \
        const CUONLINE_ACC* __restrict__ rel_k,   /* per batch: (Rk, Dr) or null */           \
        const CUONLINE_T* __restrict__ dout,      /* per batch: (lq, Dv) */                   \
        const CUONLINE_ACC* __restrict__ lse,     /* (nbatch, lq) */                          \
        const CUONLINE_ACC* __restrict__ delta,   /* (nbatch, lq) */                          \
        CUONLINE_ACC* __restrict__ dq,            /* (nbatch, lq, D) */                       \
        CUONLINE_ACC* __restrict__ dk,            /* (nbatch, lk, D) */                       \
        CUONLINE_ACC* __restrict__ dv,            /* (nbatch, lk, Dv) */                      \
        CUONLINE_ACC* __restrict__ ds,            /* (nbatch, lq, lk) or null */              \
        CUONLINE_ACC* __restrict__ dc,            /* (nbatch, lq, lk) or null */              \
        CUONLINE_ACC* __restrict__ row_sums,      /* (nbatch, lq): each row's sum of P */     \
        const long long* __restrict__ offsets,    /* (nbatch, kCount + 1) */                  \
        const long long* __restrict__ strides,    /* (kCount + 1, 2) */                       \
        int lq, int lk, long long diagonal_offset, CUONLINE_ACC scale, CUONLINE_ACC softcap,  \
        long long window_left, long long window_right, /* >= 2^60: unbounded */              \
        int bias_block_rows, int bias_block_cols,      /* (r, c) of a block bias, else 1 */  \
        int rel_bias_radius, int rel_k_radius /* (Rb - 1) / 2, (Rk - 1) / 2 */
