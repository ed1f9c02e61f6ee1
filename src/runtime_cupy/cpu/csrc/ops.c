/* ops.c: the fused operations of a step, their items shared out by pool_run.
 *
 * Every output value is computed whole by one item, in an order fixed by the code (the
 * rows of a matrix in blocks of RB, attention by (row, head), the element-wise
 * operations by ranges), so a result never depends on the thread count.
 */
#include "ops.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#define RB 16         /* weight rows per item */
#define ELEMWISE 4096 /* values per item of the element-wise operations */
#define ROWS_MAX_CHUNKS 24

/* ---- 8-bit activations ---------------------------------------------------------------- */

typedef struct {
    int fmt;
    const float *x;
    int64_t n;
    Q8Out out;
} QuantizeJob;

static void quantize_item(void *ctx, int64_t j) {
    const QuantizeJob *J = ctx;
    int64_t n = J->n, nc = n / 32;
    quantize_row(J->fmt, J->x + j * n, n, J->out.q + j * n, J->out.d + j * nc,
                 J->out.s + j * nc, J->out.g + j * 2 * nc);
}

void quantize_rows(int fmt, const float *x, int64_t rows, int64_t n, Q8Out out, int threads) {
    QuantizeJob J = {fmt, x, n, out};
    pool_run(threads, rows, quantize_item, &J);
}

/* ---- matrix products ------------------------------------------------------------------- */

typedef struct {
    const Isa *isa;
    const Part *parts;
    int n_parts;
    int64_t first[9]; /* the first item of each part */
    const XRows *x;
    int64_t rows;
    int use_q8;
    float *y;
    int64_t ldy;
    const float *bias;
    int accumulate;
} LinearJob;

static void linear_item(void *ctx, int64_t b) {
    const LinearJob *J = ctx;
    int p = 0;
    while (b >= J->first[p + 1]) ++p;
    const Part *pt = J->parts + p;
    int64_t r0 = (b - J->first[p]) * RB, r1 = r0 + RB < pt->n_out ? r0 + RB : pt->n_out;
    int64_t nc = pt->n_in / 32;
    int q8 = J->use_q8 && !qtype_is_float(pt->t);
    dot_fn dot = q8 ? J->isa->q8[pt->t] : J->isa->f[pt->t];
    /* short rows (up to ROWS_MAX_CHUNKS chunks: a row's fixed costs outweigh its blocks)
     * of a decode step: several weight rows per call, sharing the activation's loads */
    rows_fn rows_dot = (q8 && nc <= ROWS_MAX_CHUNKS) ? J->isa->q8_rows[pt->t] : NULL;
    float tmp[XT > WT ? XT : WT];
    if (J->rows == 1 && rows_dot) {
        for (int64_t r = r0; r < r1; r += WT) {
            int nw = r1 - r < WT ? (int)(r1 - r) : WT;
            rows_dot(pt->w + r * pt->row_bytes, pt->row_bytes, nw, nc, J->x, 0, tmp);
            for (int i = 0; i < nw; ++i) {
                int64_t col = pt->out_offset + r + i;
                float v = tmp[i];
                if (J->bias) v = v + J->bias[col];
                J->y[col] = J->accumulate ? J->y[col] + v : v;
            }
        }
        return;
    }
    /* the block's weight rows stay in cache while every activation row passes */
    for (int64_t j0 = 0; j0 < J->rows; j0 += XT) {
        int nj = J->rows - j0 < XT ? (int)(J->rows - j0) : XT;
        for (int64_t r = r0; r < r1; ++r) {
            dot(pt->w + r * pt->row_bytes, nc, J->x, j0, nj, tmp);
            int64_t col = pt->out_offset + r;
            for (int k = 0; k < nj; ++k) {
                float v = tmp[k];
                if (J->bias) v = v + J->bias[col];
                float *out = J->y + (j0 + k) * J->ldy + col;
                *out = J->accumulate ? *out + v : v;
            }
        }
    }
}

void linear_rows(const Isa *isa, const Part *parts, int n_parts, const XRows *x, int64_t rows,
                 int use_q8, float *y, int64_t ldy, const float *bias, int accumulate,
                 int threads) {
    LinearJob J = {isa, parts, n_parts, {0}, x, rows, use_q8, y, ldy, bias, accumulate};
    for (int p = 0; p < n_parts; ++p) J.first[p + 1] = J.first[p] + (parts[p].n_out + RB - 1) / RB;
    pool_run(threads, J.first[n_parts], linear_item, &J);
}

/* ---- norm and feed-forward ------------------------------------------------------------- */

typedef struct {
    const float *x, *w;
    float *out;
    int64_t n;
    double eps;
} NormJob;

static void rmsnorm_item(void *ctx, int64_t j) {
    const NormJob *J = ctx;
    const float *xr = J->x + j * J->n;
    double ss = 0.0;
    for (int64_t i = 0; i < J->n; ++i) ss += (double)xr[i] * (double)xr[i];
    float s = (float)(1.0 / sqrt((double)(float)ss / (double)J->n + J->eps));
    float *o = J->out + j * J->n;
    for (int64_t i = 0; i < J->n; ++i) o[i] = (xr[i] * s) * J->w[i];
}

void rmsnorm_rows(const float *x, const float *w, float *out, int64_t rows, int64_t n, double eps,
                  int threads) {
    NormJob J = {x, w, out, n, eps};
    pool_run(threads, rows, rmsnorm_item, &J);
}

typedef struct {
    const float *h;
    float *act;
    int64_t f, total;
} SwigluJob;

static void swiglu_item(void *ctx, int64_t item) {
    const SwigluJob *J = ctx;
    int64_t end = (item + 1) * ELEMWISE < J->total ? (item + 1) * ELEMWISE : J->total;
    for (int64_t i = item * ELEMWISE; i < end; ++i) {
        int64_t j = i / J->f, e = i - j * J->f;
        float g = J->h[j * 2 * J->f + e], u = J->h[j * 2 * J->f + J->f + e];
        J->act[i] = g / (1.0f + expf(-g)) * u;
    }
}

void swiglu_rows(const float *h, float *act, int64_t rows, int64_t f, int threads) {
    SwigluJob J = {h, act, f, rows * f};
    pool_run(threads, (J.total + ELEMWISE - 1) / ELEMWISE, swiglu_item, &J);
}

/* ---- rotary embedding and the KV cache ------------------------------------------------- */

static void rotate(float *v, const float *rot, int64_t n_rot, int neox) {
    int64_t half = n_rot / 2;
    for (int64_t j = 0; j < half; ++j) {
        int64_t a = neox ? j : 2 * j, b = neox ? j + half : 2 * j + 1;
        float c = rot[2 * j], s = rot[2 * j + 1];
        float va = v[a], vb = v[b];
        v[a] = va * c - vb * s;
        v[b] = va * s + vb * c;
    }
}

static void store_kv(void *cache, int kv_half, int64_t at, const float *v, int64_t n) {
    if (kv_half) {
        uint16_t *dst = (uint16_t *)cache + at;
        for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(v[i]);
    } else {
        memcpy((float *)cache + at, v, (size_t)n * 4);
    }
}

typedef struct {
    float *qkv;
    const float *bias, *rot;
    int64_t pos, n_rot;
    const Heads *hd;
    int neox;
    void *k_cache, *v_cache;
} RopeJob;

static void rope_item(void *ctx, int64_t r) {
    const RopeJob *J = ctx;
    const Heads *hd = J->hd;
    int64_t q_dim = hd->n_heads * hd->hd_k, k_dim = hd->n_kv * hd->hd_k;
    int64_t width = q_dim + k_dim + hd->n_kv * hd->hd_v;
    float *x = J->qkv + r * width;
    int64_t p = J->pos + r;
    if (J->bias)
        for (int64_t i = 0; i < width; ++i) x[i] = x[i] + J->bias[i];
    const float *rp = J->rot + p * J->n_rot; /* n_rot / 2 (cos, sin) pairs */
    for (int64_t h = 0; h < hd->n_heads; ++h) rotate(x + h * hd->hd_k, rp, J->n_rot, J->neox);
    for (int64_t h = 0; h < hd->n_kv; ++h) {
        float *k = x + q_dim + h * hd->hd_k;
        rotate(k, rp, J->n_rot, J->neox);
        store_kv(J->k_cache, hd->kv_half, (h * hd->max_seq + p) * hd->hd_k, k, hd->hd_k);
        store_kv(J->v_cache, hd->kv_half, (h * hd->max_seq + p) * hd->hd_v,
                 x + q_dim + k_dim + h * hd->hd_v, hd->hd_v);
    }
}

void rope_kv_rows(float *qkv, int64_t rows, const float *bias, const float *rot, int64_t pos,
                  const Heads *hd, int64_t n_rot, int neox, void *k_cache, void *v_cache,
                  int threads) {
    RopeJob J = {qkv, bias, rot, pos, n_rot, hd, neox, k_cache, v_cache};
    pool_run(threads, rows, rope_item, &J);
}

/* ---- attention --------------------------------------------------------------------------- */

typedef struct {
    const Isa *isa;
    const float *qkv;
    const void *k_cache, *v_cache;
    int64_t pos;
    const Heads *hd;
    float scale;
    float *out;
    atomic_int failed; /* an item could not get its scores' memory */
} AttentionJob;

static void attention_item(void *ctx, int64_t it) {
    const AttentionJob *J = ctx;
    const Heads *hd = J->hd;
    int64_t q_dim = hd->n_heads * hd->hd_k, width = q_dim + hd->n_kv * (hd->hd_k + hd->hd_v);
    int64_t r = it / hd->n_heads, h = it - r * hd->n_heads, kv = h / (hd->n_heads / hd->n_kv);
    int64_t n_ctx = J->pos + r + 1;
    const float *q = J->qkv + r * width + h * hd->hd_k;
    float stack[1024];
    float *scores = n_ctx <= 1024 ? stack : malloc(sizeof(float) * (size_t)n_ctx);
    if (!scores) {
        atomic_store(&((AttentionJob *)ctx)->failed, 1);
        return;
    }
    size_t esize = hd->kv_half ? 2 : 4;
    const char *keys = (const char *)J->k_cache + (size_t)(kv * hd->max_seq * hd->hd_k) * esize;
    const char *values = (const char *)J->v_cache + (size_t)(kv * hd->max_seq * hd->hd_v) * esize;
    J->isa->scores(q, keys, hd->kv_half, n_ctx, hd->hd_k, J->scale, scores);
    float m = -INFINITY;
    for (int64_t t = 0; t < n_ctx; ++t)
        if (scores[t] > m || isnan(scores[t])) m = scores[t];
    float sum = 0.0f;
    for (int64_t t = 0; t < n_ctx; ++t) {
        scores[t] = expf(scores[t] - m);
        sum += scores[t];
    }
    float *o = J->out + (r * hd->n_heads + h) * hd->hd_v;
    memset(o, 0, sizeof(float) * (size_t)hd->hd_v);
    J->isa->mix(o, scores, values, hd->kv_half, n_ctx, hd->hd_v);
    for (int64_t i = 0; i < hd->hd_v; ++i) o[i] = o[i] / sum;
    if (scores != stack) free(scores);
}

int attention_rows(const Isa *isa, const float *qkv, int64_t rows, const void *k_cache,
                   const void *v_cache, int64_t pos, const Heads *hd, float scale, float *out,
                   int threads) {
    AttentionJob J = {isa, qkv, k_cache, v_cache, pos, hd, scale, out, 0};
    pool_run(threads, rows * hd->n_heads, attention_item, &J);
    return atomic_load(&J.failed) ? -1 : 0;
}

/* ---- embedding and the greedy token ----------------------------------------------------- */

typedef struct {
    const Part *table;
    const int32_t *ids;
    float *out;
} EmbedJob;

static void embed_item(void *ctx, int64_t j) {
    const EmbedJob *J = ctx;
    const Part *t = J->table;
    const uint8_t *row = t->w + (int64_t)J->ids[j] * t->row_bytes;
    for (int64_t c = 0; c < t->n_in / 32; ++c) dequant_chunk(row, t->t, c, J->out + j * t->n_in + 32 * c);
}

void embed_rows(const Part *table, const int32_t *ids, int64_t rows, float *out, int threads) {
    EmbedJob J = {table, ids, out};
    pool_run(threads, rows, embed_item, &J);
}

int64_t argmax_finite(const float *x, int64_t n, int64_t *bad) {
    int64_t best = -1, nbad = 0;
    float m = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        float v = x[i];
        if (!(fabsf(v) <= 3.402823466e38f)) {
            ++nbad;
        } else if (best < 0 || v > m) {
            m = v;
            best = i;
        }
    }
    *bad = nbad;
    return best < 0 ? 0x7FFFFFFF : best;
}
