/* A single-pass C prototype of the PyTorch path's CPU sums, for
 * scripts/bench_checksum.py only: it is not part of the package and nothing
 * at run time loads it. It exists to measure what a compiled path would
 * reach against XXH3 and a numpy sum on the same bytes (issue 12), before
 * any decision to ship one.
 *
 * One cache tensor of a layer, pieces int64 with a block's heads at
 * head_stride and its tokens at tau_stride (elements; HND or NHD), the
 * pieces of a token contiguous. For each row r, full blocks only:
 *
 *   out[r] += sum_h m_h sum_tau sum_p x * (2 * ((t0[r] + tau) * P + off + p) + 1)
 *
 * mod 2**64, with m_h = 2 * (factor_base + h) + 1: the definition in
 * vllm_kvchecksum/definition.py. Per (block, head) it keeps two running
 * vectors over the tokens, Y = sum_tau x and W = sum of the prefix sums of
 * Y, so sum_tau tau * x = kt * Y - W: adds only in the pass over the data;
 * the multiplies act on Y and W, 1/kt of the data. Blocks are read in the
 * rows' order (no copy), and the block two rows ahead is prefetched. */
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) void
block_rows(const uint64_t *base, int64_t block_elems, int64_t heads, int64_t kt, int64_t pk,
           int64_t head_stride, int64_t tau_stride, const int64_t *ids, const int64_t *t0,
           int64_t rows, uint64_t factor_base, uint64_t P, uint64_t off, uint64_t *out) {
    uint64_t y[64], w[64];
    for (int64_t r = 0; r < rows; r++) {
        const uint64_t *blk = base + ids[r] * block_elems;
        const char *ahead = (const char *)(base + ids[r + 2 < rows ? r + 2 : r] * block_elems);
        uint64_t acc = 0;
        for (int64_t h = 0; h < heads; h++) {
            memset(y, 0, sizeof y);
            memset(w, 0, sizeof w);
            for (int64_t tau = 0; tau < kt; tau++) {
                const uint64_t *x = blk + h * head_stride + tau * tau_stride;
                const char *pf = ahead + ((const char *)x - (const char *)blk);
                for (int64_t q = 0; q < pk * 8; q += 64)
                    __builtin_prefetch(pf + q);
                for (int64_t p = 0; p < pk; p++) {
                    y[p] += x[p];
                    w[p] += y[p];
                }
            }
            uint64_t first = 2 * ((uint64_t)t0[r] * P + off) + 1;
            uint64_t s = 0;
            for (int64_t p = 0; p < pk; p++)
                s += (first + 2 * (uint64_t)p) * y[p] + 2 * P * ((uint64_t)kt * y[p] - w[p]);
            acc += (2 * (factor_base + (uint64_t)h) + 1) * s;
        }
        out[r] += acc;
    }
}

/* Returns -1 (nothing done) for more than 64 pieces per token. */
int kvcs_block_rows(const uint64_t *base, int64_t block_elems, int64_t heads, int64_t kt,
                    int64_t pk, int64_t head_stride, int64_t tau_stride, const int64_t *ids,
                    const int64_t *t0, int64_t rows, uint64_t factor_base, uint64_t P,
                    uint64_t off, uint64_t *out) {
    /* Constant piece counts let the compiler keep Y and W in registers. */
    if (pk == 32)
        block_rows(base, block_elems, heads, kt, 32, head_stride, tau_stride, ids, t0, rows,
                   factor_base, P, off, out);
    else if (pk == 16)
        block_rows(base, block_elems, heads, kt, 16, head_stride, tau_stride, ids, t0, rows,
                   factor_base, P, off, out);
    else if (pk <= 64)
        block_rows(base, block_elems, heads, kt, pk, head_stride, tau_stride, ids, t0, rows,
                   factor_base, P, off, out);
    else
        return -1;
    return 0;
}
