/* ops.h: the fused operations of a step on host memory (ops.c), called by module.c. */
#ifndef GPP_OPS_H
#define GPP_OPS_H

#include <stdint.h>

#include "dot.h"

typedef struct {
    const uint8_t *w; /* n_out rows of row_bytes */
    int t;
    int64_t n_out, n_in, row_bytes, out_offset;
} Part;

/* Rows of 8-bit activations, written by quantize_rows; row j at q + j n, d + j n / 32,
 * s + j n / 32, g + j n / 16 (each format uses the start of its row's span). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *g;
} Q8Out;

void quantize_rows(int fmt, const float *x, int64_t rows, int64_t n, Q8Out out, int threads);

/* y[j, off + r] (+)= part row r . activation row j (+ bias[off + r]), for every part */
void linear_rows(const Isa *isa, const Part *parts, int n_parts, const XRows *x, int64_t rows,
                 int use_q8, float *y, int64_t ldy, const float *bias, int accumulate, int threads);

void rmsnorm_rows(const float *x, const float *w, float *out, int64_t rows, int64_t n, double eps,
                  int threads);

void swiglu_rows(const float *h, float *act, int64_t rows, int64_t f, int threads);

typedef struct {
    int64_t n_heads, n_kv, hd_k, hd_v, max_seq;
    int kv_half;
} Heads;

void rope_kv_rows(float *qkv, int64_t rows, const float *bias, const float *rot, int64_t pos,
                  const Heads *hd, int64_t n_rot, int neox, void *k_cache, void *v_cache,
                  int threads);

/* returns 0, or -1 when out of memory */
int attention_rows(const Isa *isa, const float *qkv, int64_t rows, const void *k_cache,
                   const void *v_cache, int64_t pos, const Heads *hd, float scale, float *out,
                   int threads);

void embed_rows(const Part *table, const int32_t *ids, int64_t rows, float *out, int threads);

/* the first index of the largest finite value; *bad = the count of non-finite values */
int64_t argmax_finite(const float *x, int64_t n, int64_t *bad);

#endif
