/* ops.h: the fused operations of a step on host memory (ops.c), called by module.c. */
#ifndef GPP_OPS_H
#define GPP_OPS_H

#include <stdint.h>

#include "dot.h"
#include "repack.h"

typedef struct {
    const uint8_t *w; /* n_out rows of row_bytes, or their x8 groups (repack.h) */
    int t;
    int64_t n_out, n_in, row_bytes, out_offset;
    int x8; /* repacked */
} Part;

/* Rows of 8-bit activations, written by quantize_rows; row j at q + j qs (qs >= n: a
 * padded row, so that rows a whole number of 4 KiB apart do not alias), d + j n / 32,
 * s + j n / 32, g + j n / 16 (each format uses the start of its row's span). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *g;
    int64_t qs;
} Q8Out;

void quantize_rows(const Isa *isa, int fmt, const float *x, int64_t rows, int64_t n, Q8Out out,
                   int threads);

/* y[j, off + r] (+)= part row r . activation row j (+ bias[off + r]), for every part.
 * Returns 0, or -1 when out of memory (an x8 part without its instruction set's kernel
 * unpacks rows into buffers). */
int linear_rows(const Isa *isa, const Part *parts, int n_parts, const XRows *x, int64_t rows,
                int use_q8, float *y, int64_t ldy, const float *bias, int accumulate, int threads);

/* One matrix's product over a span of rows (rows first .. end - 1 of x and y). */
typedef struct {
    const Part *parts;
    int n_parts;
    int64_t first, end;
} Span;

/* y[j] = span i's matrix . x row j for every row j of every span i (no bias, no sum):
 * each span as linear_rows over its rows alone computes it, the same bits, in one pool
 * run for all the spans (a mixture's experts, each over the rows that chose it). -1 when
 * out of memory. */
int linear_spans(const Isa *isa, const Span *spans, int n_spans, const XRows *x, int use_q8,
                 float *y, int64_t ldy, int threads);

/* out = rmsnorm(x) * w, or out += rmsnorm(x) * w when accumulate */
void rmsnorm_rows(const float *x, const float *w, float *out, int64_t rows, int64_t n, double eps,
                  int accumulate, int threads);

/* act = silu(gate) * up: gate / (1 + exp32(-gate)) * up (ieee32.h) */
void swiglu_rows(const Isa *isa, const float *h, float *act, int64_t rows, int64_t f, int threads);

/* act = gelu(gate) * up, gelu as llama.cpp's table of halves (gelu_table_init fills it,
 * llama.cpp's float32 formula with tanh32: ieee32.h) */
void gelu_table_init(void);
void geglu_rows(const float *h, float *act, int64_t rows, int64_t f, int threads);

/* x = tanh32(x * (1 / cap)) * cap (llama.cpp's three operations; tanh32: ieee32.h, the
 * set's) */
void softcap_rows(const Isa *isa, float *x, int64_t n, float cap, int threads);

/* x *= factor (float32 products, as NumPy's) */
void scale_rows(float *x, int64_t n, float factor, int threads);
/* x += y * factor, the product rounded before the sum (ggml's scale, then add: granite's
 * residual scale) */
void add_scaled_rows(float *x, const float *y, int64_t n, float factor, int threads);

/* out = x rounded to half (half) or bfloat16, nearest even, as float32: what llama.cpp's
 * products with F16 / BF16 weights multiply (half: NumPy's astype(float16), out of range
 * infinity; NaN stays NaN, quiet) */
void round_rows(const float *x, float *out, int64_t n, int half, int threads);

/* A block's KV cache is a ring of max_seq slots: position p in slot p % max_seq (a
 * global block's ring is as long as the sequence, so slot and position are one). */
typedef struct {
    int64_t n_heads, n_kv, hd_k, hd_v, max_seq;
    int kv_half;
} Heads;

/* The step's own keys and values ((n_kv, rows, hd) each, the cache's element type), for a
 * sliding block whose ring cannot take them before attention has read the positions
 * they would overwrite; {NULL, NULL}: they go to the ring. */
typedef struct {
    void *k, *v;
} StepKV;

/* per row: qkv += bias; every Q head = rmsnorm(head) * q_norm, every K head * k_norm */
void qk_norm_rows(float *qkv, int64_t rows, const float *bias, const float *q_norm,
                  const float *k_norm, const Heads *hd, double eps, int threads);

/* per row: qkv += bias; rotate Q, K; Q *= q_scale (unless 1); Q *= temps[position] (temps
 * given: mistral3's query temperature); K, V to the ring or step */
void rope_kv_rows(float *qkv, int64_t rows, const float *bias, const float *rot, int64_t pos,
                  const Heads *hd, int64_t n_rot, int neox, float q_scale, const float *temps,
                  void *k_cache, void *v_cache, StepKV step, int threads);

/* Row r (position q = pos + r) attends to positions max(0, q - window + 1) .. q (window
 * 0: 0 .. q), in order, read from the ring and (when given) the step's rows, whose last
 * max_seq positions then go to the ring. Scores are q.k * scale, then (softcap > 0)
 * tanh32(score * (1 / softcap)) * softcap, llama.cpp's three operations (tanh32: the
 * set's, ieee32.h), before the softmax. Returns 0, or -1 when out of memory. */
int attention_rows(const Isa *isa, const float *qkv, int64_t rows, void *k_cache, void *v_cache,
                   StepKV step, int64_t pos, int64_t window, const Heads *hd, float scale,
                   float softcap, float *out, int threads);

/* Each id is read once and checked where it is used: a caller's checks ran before the
 * GIL was released, and another thread may have written the ids since. Returns 0, -1 when
 * out of memory, or OPS_BAD_ID when an id read here was outside the table (its rows then
 * hold no meaning; nothing outside the table was read). */
#define OPS_BAD_ID -2
int embed_rows(const Part *table, const int32_t *ids, int64_t rows, float *out, int threads);

/* the first index of the largest finite value; *bad = the count of non-finite values */
int64_t argmax_finite(const float *x, int64_t n, int64_t *bad);

#endif
