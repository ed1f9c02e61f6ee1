/* ops.c: the fused operations of a step, their items shared out by pool_run (an
 * operation too small to be worth waking other threads for, pool_threads, runs on the
 * caller's).
 *
 * Every output value is computed whole by one item, in an order fixed by the code (the
 * rows of a matrix in blocks of RB, attention by (row, head), the element-wise
 * operations by ranges), so a result never depends on the thread count. The
 * element-wise operations are scalar C shared by every instruction set, so they do not
 * depend on it either.
 */
#include "ops.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ieee32.h"
#include "pool.h"
#include "scratch.h"

#define RB 16         /* weight rows per item (whole x8 groups) */
#define ELEMWISE 4096 /* values per item of the element-wise operations */
#define ROWS_MAX_CHUNKS 24

_Static_assert(RB % X8 == 0, "an item takes whole x8 groups");

/* ---- 8-bit activations ---------------------------------------------------------------- */

typedef struct {
    const Isa *isa;
    int fmt;
    const float *x;
    int64_t n;
    Q8Out out;
} QuantizeJob;

static void quantize_item(void *ctx, int64_t j) {
    const QuantizeJob *J = ctx;
    int64_t n = J->n, nc = n / 32;
    J->isa->quantize(J->fmt, J->x + j * n, n, J->out.q + j * J->out.qs, J->out.d + j * nc,
                     J->out.s + j * nc, J->out.g + j * 2 * nc);
}

void quantize_rows(const Isa *isa, int fmt, const float *x, int64_t rows, int64_t n, Q8Out out,
                   int threads) {
    QuantizeJob J = {isa, fmt, x, n, out};
    pool_run(pool_threads(threads, rows * n), rows, quantize_item, &J);
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
    atomic_int failed; /* an item could not get a row's buffer */
} LinearJob;

static void put(const LinearJob *J, const Part *pt, int64_t j, int64_t r, float v) {
    int64_t col = pt->out_offset + r;
    if (J->bias) v = v + J->bias[col];
    float *out = J->y + j * J->ldy + col;
    *out = J->accumulate ? *out + v : v;
}

/* weight rows r0 .. r1 of an x8 part (r0 a multiple of 8) */
static void linear_x8(LinearJob *J, const Part *pt, int64_t r0, int64_t r1, int q8, dot_fn dot) {
    int64_t nc = pt->n_in / 32;
    x8_fn few = q8 && J->rows <= X8_XT ? J->isa->q8_x8_rows[pt->t][J->rows - 1] : NULL;
    x8_fn fast = few ? few : q8 ? J->isa->q8_x8[pt->t] : NULL;
    float out[X8_TILE][X8], tmp[XT];
    uint8_t *row = NULL;
    if (!fast && !(row = scratch_alloc((size_t)pt->row_bytes))) {
        atomic_store(&J->failed, 1);
        return;
    }
    const int64_t gs = x8_group_bytes(pt->t, pt->n_in);
    x16_fn fast16 = q8 && !few ? J->isa->q8_x16[pt->t] : NULL;
    for (int64_t g0 = r0; g0 < r1;) {
        const uint8_t *grp = pt->w + (g0 / X8) * gs;
        if (fast16 && r1 - g0 > X8) { /* this group and the next at once */
            float out16[X8_TILE][2 * X8];
            int nr = r1 - g0 < 2 * X8 ? (int)(r1 - g0) : 2 * X8;
            for (int64_t j0 = 0; j0 < J->rows; j0 += X8_TILE) {
                int nj = J->rows - j0 < X8_TILE ? (int)(J->rows - j0) : X8_TILE;
                fast16(grp, gs, nc, J->x, j0, nj, out16);
                for (int k = 0; k < nj; ++k)
                    for (int i = 0; i < nr; ++i) put(J, pt, j0 + k, g0 + i, out16[k][i]);
            }
            g0 += 2 * X8;
            continue;
        }
        int nr = r1 - g0 < X8 ? (int)(r1 - g0) : X8;
        if (fast) {
            for (int64_t j0 = 0; j0 < J->rows; j0 += X8_TILE) {
                int nj = J->rows - j0 < X8_TILE ? (int)(J->rows - j0) : X8_TILE;
                fast(grp, gs, nc, J->x, j0, nj, out);
                for (int k = 0; k < nj; ++k)
                    for (int i = 0; i < nr; ++i) put(J, pt, j0 + k, g0 + i, out[k][i]);
            }
            g0 += X8;
            continue;
        }
        for (int i = 0; i < nr; ++i) { /* each stored row, unpacked */
            x8_unpack_row(pt->t, grp, i, pt->n_in, row);
            for (int64_t j0 = 0; j0 < J->rows; j0 += XT) {
                int nj = J->rows - j0 < XT ? (int)(J->rows - j0) : XT;
                dot(row, nc, J->x, j0, nj, tmp);
                for (int k = 0; k < nj; ++k) put(J, pt, j0 + k, g0 + i, tmp[k]);
            }
        }
        g0 += X8;
    }
    free(row);
}

static void linear_item(void *ctx, int64_t b) {
    LinearJob *J = ctx;
    int p = 0;
    while (b >= J->first[p + 1]) ++p;
    const Part *pt = J->parts + p;
    int64_t r0 = (b - J->first[p]) * RB, r1 = r0 + RB < pt->n_out ? r0 + RB : pt->n_out;
    int64_t nc = pt->n_in / 32;
    int q8 = J->use_q8 && !qtype_is_float(pt->t);
    dot_fn dot = q8 ? J->isa->q8[pt->t] : J->isa->f[pt->t];
    if (pt->x8) {
        linear_x8(J, pt, r0, r1, q8, dot);
        return;
    }
    /* short rows (up to ROWS_MAX_CHUNKS chunks: a row's fixed costs outweigh its blocks)
     * of a decode step: several weight rows per call, sharing the activation's loads */
    rows_fn rows_dot = (q8 && nc <= ROWS_MAX_CHUNKS) ? J->isa->q8_rows[pt->t] : NULL;
    float tmp[XT > WT ? XT : WT];
    if (J->rows == 1 && rows_dot) {
        for (int64_t r = r0; r < r1; r += WT) {
            int nw = r1 - r < WT ? (int)(r1 - r) : WT;
            rows_dot(pt->w + r * pt->row_bytes, pt->row_bytes, nw, nc, J->x, 0, tmp);
            for (int i = 0; i < nw; ++i) put(J, pt, 0, r + i, tmp[i]);
        }
        return;
    }
    /* the block's weight rows stay in cache while every activation row passes */
    for (int64_t j0 = 0; j0 < J->rows; j0 += XT) {
        int nj = J->rows - j0 < XT ? (int)(J->rows - j0) : XT;
        for (int64_t r = r0; r < r1; ++r) {
            dot(pt->w + r * pt->row_bytes, nc, J->x, j0, nj, tmp);
            for (int k = 0; k < nj; ++k) put(J, pt, j0 + k, r, tmp[k]);
        }
    }
}

int linear_rows(const Isa *isa, const Part *parts, int n_parts, const XRows *x, int64_t rows,
                int use_q8, float *y, int64_t ldy, const float *bias, int accumulate,
                int threads) {
    LinearJob J = {isa, parts, n_parts, {0}, x, rows, use_q8, y, ldy, bias, accumulate, 0};
    int64_t work = 0; /* multiply-adds */
    for (int p = 0; p < n_parts; ++p) {
        J.first[p + 1] = J.first[p] + (parts[p].n_out + RB - 1) / RB;
        work += rows * parts[p].n_out * parts[p].n_in;
    }
    pool_run(pool_threads(threads, work), J.first[n_parts], linear_item, &J);
    return atomic_load(&J.failed) ? -1 : 0;
}

typedef struct {
    LinearJob *jobs; /* one per span */
    int64_t *first;  /* the first item of each span, and the count after the last */
    int n;
} SpansJob;

static void span_item(void *ctx, int64_t b) {
    SpansJob *S = ctx;
    int lo = 0, hi = S->n - 1; /* the span whose items hold b */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (S->first[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    linear_item(&S->jobs[lo], b - S->first[lo]);
}

int linear_spans(const Isa *isa, const Span *spans, int n_spans, const XRows *x, int use_q8,
                 float *y, int64_t ldy, int threads) {
    LinearJob *jobs = calloc((size_t)n_spans, sizeof *jobs);
    XRows *xs = calloc((size_t)n_spans, sizeof *xs);
    int64_t *first = calloc((size_t)n_spans + 1, sizeof *first);
    int rc = -1;
    if (!jobs || !xs || !first) goto done;
    int64_t work = 0;
    for (int i = 0; i < n_spans; ++i) {
        const Span *sp = &spans[i];
        int64_t j = sp->first, n = x->n, nc = n / 32;
        xs[i] = (XRows){x->q ? x->q + j * x->qs : NULL, x->d ? x->d + j * nc : NULL,
                        x->s ? x->s + j * nc : NULL, x->g ? x->g + j * 2 * nc : NULL,
                        x->f + j * n, n, x->qs};
        LinearJob *J = &jobs[i];
        J->isa = isa;
        J->parts = sp->parts;
        J->n_parts = sp->n_parts;
        J->x = &xs[i];
        J->rows = sp->end - sp->first;
        J->use_q8 = use_q8;
        J->y = y + j * ldy;
        J->ldy = ldy;
        atomic_init(&J->failed, 0);
        for (int p = 0; p < sp->n_parts && J->rows > 0; ++p) { /* an empty span: no items */
            J->first[p + 1] = J->first[p] + (sp->parts[p].n_out + RB - 1) / RB;
            work += J->rows * sp->parts[p].n_out * sp->parts[p].n_in;
        }
        first[i + 1] = first[i] + (J->rows > 0 ? J->first[sp->n_parts] : 0);
    }
    SpansJob S = {jobs, first, n_spans};
    if (first[n_spans] > 0) pool_run(pool_threads(threads, work), first[n_spans], span_item, &S);
    rc = 0;
    for (int i = 0; i < n_spans; ++i)
        if (atomic_load(&jobs[i].failed)) rc = -1;
done:
    free(jobs);
    free(xs);
    free(first);
    return rc;
}

/* ---- norm and feed-forward ------------------------------------------------------------- */

/* 1 / sqrt(mean(x^2) + eps): the squares summed in double, in order */
static float rms_scale(const float *x, int64_t n, double eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += (double)x[i] * (double)x[i];
    return (float)(1.0 / sqrt((double)(float)ss / (double)n + eps));
}

typedef struct {
    const float *x, *w;
    float *out;
    int64_t n;
    double eps;
    int accumulate;
} NormJob;

static void rmsnorm_item(void *ctx, int64_t j) {
    const NormJob *J = ctx;
    const float *xr = J->x + j * J->n;
    float s = rms_scale(xr, J->n, J->eps);
    float *o = J->out + j * J->n;
    if (J->accumulate)
        for (int64_t i = 0; i < J->n; ++i) o[i] = o[i] + (xr[i] * s) * J->w[i];
    else
        for (int64_t i = 0; i < J->n; ++i) o[i] = (xr[i] * s) * J->w[i];
}

void rmsnorm_rows(const float *x, const float *w, float *out, int64_t rows, int64_t n, double eps,
                  int accumulate, int threads) {
    NormJob J = {x, w, out, n, eps, accumulate};
    pool_run(pool_threads(threads, rows * n), rows, rmsnorm_item, &J);
}

typedef struct {
    float *qkv;
    const float *bias, *q_norm, *k_norm;
    const Heads *hd;
    double eps;
} QkNormJob;

static void qk_norm_item(void *ctx, int64_t r) {
    const QkNormJob *J = ctx;
    const Heads *hd = J->hd;
    int64_t width = hd->n_heads * hd->hd_k + hd->n_kv * (hd->hd_k + hd->hd_v);
    float *x = J->qkv + r * width;
    if (J->bias)
        for (int64_t i = 0; i < width; ++i) x[i] = x[i] + J->bias[i];
    for (int64_t h = 0; h < hd->n_heads + hd->n_kv; ++h) {
        float *v = x + h * hd->hd_k;
        const float *w = h < hd->n_heads ? J->q_norm : J->k_norm;
        float s = rms_scale(v, hd->hd_k, J->eps);
        for (int64_t i = 0; i < hd->hd_k; ++i) v[i] = (v[i] * s) * w[i];
    }
}

void qk_norm_rows(float *qkv, int64_t rows, const float *bias, const float *q_norm,
                  const float *k_norm, const Heads *hd, double eps, int threads) {
    QkNormJob J = {qkv, bias, q_norm, k_norm, hd, eps};
    int64_t work = rows * (hd->n_heads + hd->n_kv) * hd->hd_k;
    pool_run(pool_threads(threads, work), rows, qk_norm_item, &J);
}

typedef struct {
    const Isa *isa;
    const float *h;
    float *act;
    int64_t f, total;
} SwigluJob;

#define EXP_PIECE 256 /* values whose exp32 one call computes (on the stack) */

static void swiglu_item(void *ctx, int64_t item) {
    const SwigluJob *J = ctx;
    int64_t end = (item + 1) * ELEMWISE < J->total ? (item + 1) * ELEMWISE : J->total;
    /* element i = (row j, column e): pieces of a row's columns, at most EXP_PIECE */
    int64_t i = item * ELEMWISE, j = i / J->f, e = i - j * J->f;
    float t[EXP_PIECE];
    while (i < end) {
        const float *gate = J->h + j * 2 * J->f + e, *up = gate + J->f;
        int64_t n = end - i < J->f - e ? end - i : J->f - e;
        if (n > EXP_PIECE) n = EXP_PIECE;
        for (int64_t k = 0; k < n; ++k) t[k] = -gate[k];
        J->isa->exp32(t, t, n);
        for (int64_t k = 0; k < n; ++k) J->act[i + k] = gate[k] / (1.0f + t[k]) * up[k];
        i += n;
        if ((e += n) == J->f) {
            e = 0;
            ++j;
        }
    }
}

void swiglu_rows(const Isa *isa, const float *h, float *act, int64_t rows, int64_t f, int threads) {
    SwigluJob J = {.isa = isa, .h = h, .act = act, .f = f, .total = rows * f};
    int64_t items = (J.total + ELEMWISE - 1) / ELEMWISE;
    pool_run(pool_threads(threads, 16 * J.total), items, swiglu_item, &J); /* exp32: ~16 units */
}

/* GELU as llama.cpp's CPU path computes it: a table of halves, gelu(v) rounded to half
 * for every half v, read at the input rounded to half (0 below -10, the input above 10) */
static uint16_t GELU_F16[65536];

void gelu_table_init(void) {
    const float a = 0.044715f, sqrt_2_over_pi = 0.7978845608028654f;
    for (uint32_t i = 0; i < 65536; ++i) {
        float v = f16_to_f32((uint16_t)i), t = sqrt_2_over_pi * v * (1.0f + a * v * v);
        tanh32_portable(&t, &t, 1); /* not the C library's tanhf (ieee32.h) */
        float g = 0.5f * v * (1.0f + t);
        GELU_F16[i] = f32_to_f16(g);
    }
}

static void geglu_item(void *ctx, int64_t item) {
    const SwigluJob *J = ctx;
    int64_t end = (item + 1) * ELEMWISE < J->total ? (item + 1) * ELEMWISE : J->total;
    int64_t i = item * ELEMWISE, j = i / J->f, e = i - j * J->f;
    const float *gate = J->h + j * 2 * J->f;
    for (; i < end; ++i, ++e) {
        if (e == J->f) {
            e = 0;
            gate += 2 * J->f;
        }
        float g = gate[e], u = gate[J->f + e];
        if (g <= -10.0f)
            J->act[i] = 0.0f;
        else if (g >= 10.0f)
            J->act[i] = g * u;
        else
            J->act[i] = f16_to_f32(GELU_F16[f32_to_f16(g)]) * u;
    }
}

void geglu_rows(const float *h, float *act, int64_t rows, int64_t f, int threads) {
    SwigluJob J = {.h = h, .act = act, .f = f, .total = rows * f}; /* no isa: no exp */
    int64_t items = (J.total + ELEMWISE - 1) / ELEMWISE;
    pool_run(pool_threads(threads, 16 * J.total), items, geglu_item, &J);
}

typedef struct {
    const Isa *isa; /* softcap's tanh32 */
    float *x;
    const float *y; /* add_scaled's addend (x += y * value) */
    int64_t n;
    float value; /* the cap, the factor */
} ElemJob;

static void softcap_item(void *ctx, int64_t item) {
    const ElemJob *J = ctx;
    float inv = 1.0f / J->value;
    int64_t start = item * ELEMWISE, end = start + ELEMWISE < J->n ? start + ELEMWISE : J->n;
    for (int64_t i = start; i < end; ++i) J->x[i] = J->x[i] * inv;
    J->isa->tanh32(J->x + start, J->x + start, end - start);
    for (int64_t i = start; i < end; ++i) J->x[i] = J->x[i] * J->value;
}

void softcap_rows(const Isa *isa, float *x, int64_t n, float cap, int threads) {
    ElemJob J = {.isa = isa, .x = x, .n = n, .value = cap};
    pool_run(pool_threads(threads, 16 * n), (n + ELEMWISE - 1) / ELEMWISE, softcap_item, &J);
}

static void scale_item(void *ctx, int64_t item) {
    const ElemJob *J = ctx;
    int64_t end = (item + 1) * ELEMWISE < J->n ? (item + 1) * ELEMWISE : J->n;
    for (int64_t i = item * ELEMWISE; i < end; ++i) J->x[i] = J->x[i] * J->value;
}

void scale_rows(float *x, int64_t n, float factor, int threads) {
    ElemJob J = {.x = x, .n = n, .value = factor};
    pool_run(pool_threads(threads, n), (n + ELEMWISE - 1) / ELEMWISE, scale_item, &J);
}

static void add_scaled_item(void *ctx, int64_t item) {
    const ElemJob *J = ctx;
    int64_t end = (item + 1) * ELEMWISE < J->n ? (item + 1) * ELEMWISE : J->n;
    for (int64_t i = item * ELEMWISE; i < end; ++i) {
        float scaled = J->y[i] * J->value;
        J->x[i] = J->x[i] + scaled;
    }
}

void add_scaled_rows(float *x, const float *y, int64_t n, float factor, int threads) {
    ElemJob J = {.x = x, .y = y, .n = n, .value = factor};
    pool_run(pool_threads(threads, n), (n + ELEMWISE - 1) / ELEMWISE, add_scaled_item, &J);
}

typedef struct {
    const float *x;
    float *out;
    int64_t n;
    int half;
} RoundJob;

/* x rounded to bfloat16 (nearest even, as ggml and activations.float32_to_bf16), as a
 * float: NaN stays NaN, made quiet */
static inline float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint32_t h = (bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u
                                                      : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    bits = (h & 0xffffu) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

static void round_item(void *ctx, int64_t item) {
    const RoundJob *J = ctx;
    int64_t end = (item + 1) * ELEMWISE < J->n ? (item + 1) * ELEMWISE : J->n;
    if (J->half)
        for (int64_t i = item * ELEMWISE; i < end; ++i) J->out[i] = f16_to_f32(f32_to_f16(J->x[i]));
    else
        for (int64_t i = item * ELEMWISE; i < end; ++i) J->out[i] = round_bf16(J->x[i]);
}

void round_rows(const float *x, float *out, int64_t n, int half, int threads) {
    RoundJob J = {x, out, n, half};
    pool_run(pool_threads(threads, 4 * n), (n + ELEMWISE - 1) / ELEMWISE, round_item, &J);
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
    int64_t rows, pos, n_rot;
    const Heads *hd;
    int neox;
    float q_scale;
    const float *temps; /* a factor on Q per position, or NULL */
    void *k_cache, *v_cache;
    StepKV step;
} RopeJob;

/* where position p's key (and value) of kv head h lies: the step's own rows, or the
 * ring's slot p % max_seq */
static int64_t kv_row(const Heads *hd, int in_step, int64_t rows, int64_t pos, int64_t h,
                      int64_t p) {
    return in_step ? h * rows + (p - pos) : h * hd->max_seq + p % hd->max_seq;
}

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
    for (int64_t h = 0; h < hd->n_heads; ++h) {
        float *q = x + h * hd->hd_k;
        rotate(q, rp, J->n_rot, J->neox);
        if (J->q_scale != 1.0f)
            for (int64_t i = 0; i < hd->hd_k; ++i) q[i] = q[i] * J->q_scale;
        if (J->temps && J->temps[p] != 1.0f)
            for (int64_t i = 0; i < hd->hd_k; ++i) q[i] = q[i] * J->temps[p];
    }
    int in_step = J->step.k != NULL;
    void *kc = in_step ? J->step.k : J->k_cache, *vc = in_step ? J->step.v : J->v_cache;
    for (int64_t h = 0; h < hd->n_kv; ++h) {
        float *k = x + q_dim + h * hd->hd_k;
        rotate(k, rp, J->n_rot, J->neox);
        int64_t at = kv_row(hd, in_step, J->rows, J->pos, h, p);
        store_kv(kc, hd->kv_half, at * hd->hd_k, k, hd->hd_k);
        store_kv(vc, hd->kv_half, at * hd->hd_v, x + q_dim + k_dim + h * hd->hd_v, hd->hd_v);
    }
}

void rope_kv_rows(float *qkv, int64_t rows, const float *bias, const float *rot, int64_t pos,
                  const Heads *hd, int64_t n_rot, int neox, float q_scale, const float *temps,
                  void *k_cache, void *v_cache, StepKV step, int threads) {
    RopeJob J = {qkv, bias, rot, rows, pos, n_rot, hd, neox, q_scale, temps, k_cache, v_cache,
                 step};
    int64_t work = 4 * rows * (hd->n_heads + hd->n_kv) * hd->hd_k;
    pool_run(pool_threads(threads, work), rows, rope_item, &J);
}

/* ---- attention --------------------------------------------------------------------------- */

typedef struct {
    const Isa *isa;
    const float *qkv;
    const void *k_cache, *v_cache;
    StepKV step;
    int64_t rows, pos, window;
    const Heads *hd;
    float scale, softcap;
    float *out;
    int per, pieces; /* an item's query heads (at most ATT_HEADS), a KV head's items */
    atomic_int failed; /* an item could not get its scores' memory */
} AttentionJob;

/* Runs of positions in order, each contiguous in the ring or the step's rows. */
typedef struct {
    int64_t row, n; /* the first key row (kv_row), and how many follow it */
    int in_step;
} Run;

/* The positions lo .. q that query position q sees, as at most 3 runs: ring slots
 * (wrapping once at the ring's end), then the step's own rows. */
static int runs_of(const AttentionJob *J, int64_t kv, int64_t lo, int64_t q, Run runs[3]) {
    const Heads *hd = J->hd;
    int in_step = J->step.k != NULL, n = 0;
    int64_t ring_hi = in_step ? (q < J->pos ? q : J->pos - 1) : q;
    if (ring_hi >= lo) {
        int64_t a = lo % hd->max_seq, count = ring_hi - lo + 1;
        int64_t first = count < hd->max_seq - a ? count : hd->max_seq - a;
        runs[n++] = (Run){kv * hd->max_seq + a, first, 0};
        if (count > first) runs[n++] = (Run){kv * hd->max_seq, count - first, 0};
    }
    if (in_step) {
        int64_t from = lo > J->pos ? lo : J->pos;
        if (q >= from) runs[n++] = (Run){kv * J->rows + (from - J->pos), q - from + 1, 1};
    }
    return n;
}

/* The largest score, or the last NaN where there is one (what a scan in order keeping
 * the first of equal values finds: max is exact, so 8 lanes find the same value; of
 * +0 and -0 either, and x - m is the same for both) */
static float scores_max(const float *scores, int64_t n) {
    float lane[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                     -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int nan = 0;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8)
        for (int i = 0; i < 8; ++i) {
            float v = scores[t + i];
            nan |= v != v;
            lane[i] = v > lane[i] ? v : lane[i];
        }
    float m = -INFINITY;
    for (int i = 0; i < 8; ++i) m = lane[i] > m ? lane[i] : m;
    for (; t < n; ++t) {
        nan |= scores[t] != scores[t];
        m = scores[t] > m ? scores[t] : m;
    }
    if (nan)
        for (t = n - 1; t >= 0; --t)
            if (isnan(scores[t])) return scores[t];
    return m;
}

/* Item it: row r's query heads h0 .. h0 + nq - 1 of KV head kv (piece `part` of the
 * heads sharing it), side by side: each key and value row read once for them all. */
static void attention_item(void *ctx, int64_t it) {
    const AttentionJob *J = ctx;
    const Heads *hd = J->hd;
    int64_t q_dim = hd->n_heads * hd->hd_k, width = q_dim + hd->n_kv * (hd->hd_k + hd->hd_v);
    int64_t group = hd->n_heads / hd->n_kv, per_row = hd->n_kv * J->pieces;
    int64_t r = it / per_row, kv = (it - r * per_row) / J->pieces, part = it % J->pieces;
    int64_t h0 = kv * group + part * J->per;
    int nq = (int)(group - part * J->per < J->per ? group - part * J->per : J->per);
    int64_t qp = J->pos + r, lo = J->window && qp >= J->window ? qp - J->window + 1 : 0;
    int64_t n_ctx = qp - lo + 1;
    const float *q = J->qkv + r * width + h0 * hd->hd_k;
    float stack[4096];
    size_t bytes = sizeof(float) * (size_t)(nq * n_ctx);
    float *scores = nq * n_ctx <= 4096 ? stack : scratch_alloc(bytes);
    if (scores == stack) scratch_poison(stack, bytes);
    if (!scores) {
        atomic_store(&((AttentionJob *)ctx)->failed, 1);
        return;
    }
    size_t esize = hd->kv_half ? 2 : 4;
    Run runs[3];
    int n_runs = runs_of(J, kv, lo, qp, runs);
    int64_t at = 0;
    for (int i = 0; i < n_runs; ++i) {
        const char *keys = (const char *)(runs[i].in_step ? J->step.k : J->k_cache);
        J->isa->scores(q, nq, keys + (size_t)(runs[i].row * hd->hd_k) * esize, hd->kv_half,
                       runs[i].n, hd->hd_k, J->scale, scores + at, n_ctx);
        at += runs[i].n;
    }
    float sum[ATT_HEADS];
    for (int j = 0; j < nq; ++j) {
        float *sc = scores + j * n_ctx;
        if (J->softcap > 0.0f) { /* the scores capped: llama.cpp's scale, tanh, scale */
            const float inv = 1.0f / J->softcap;
            for (int64_t t = 0; t < n_ctx; ++t) sc[t] = sc[t] * inv;
            J->isa->tanh32(sc, sc, n_ctx);
            for (int64_t t = 0; t < n_ctx; ++t) sc[t] = sc[t] * J->softcap;
        }
        float m = scores_max(sc, n_ctx);
        for (int64_t t = 0; t < n_ctx; ++t) sc[t] = sc[t] - m;
        J->isa->exp32(sc, sc, n_ctx);
        sum[j] = 0.0f;
    }
    for (int64_t t = 0; t < n_ctx; ++t) /* each head's sum in order, the heads' side by side */
        for (int j = 0; j < nq; ++j) sum[j] += scores[j * n_ctx + t];
    float *o = J->out + (r * hd->n_heads + h0) * hd->hd_v;
    memset(o, 0, sizeof(float) * (size_t)(nq * hd->hd_v));
    at = 0;
    for (int i = 0; i < n_runs; ++i) { /* positions in order: as one call over them all */
        const char *values = (const char *)(runs[i].in_step ? J->step.v : J->v_cache);
        J->isa->mix(o, nq, scores + at, n_ctx, values + (size_t)(runs[i].row * hd->hd_v) * esize,
                    hd->kv_half, runs[i].n, hd->hd_v);
        at += runs[i].n;
    }
    for (int j = 0; j < nq; ++j)
        for (int64_t i = 0; i < hd->hd_v; ++i) o[j * hd->hd_v + i] = o[j * hd->hd_v + i] / sum[j];
    if (scores != stack) free(scores);
}

int attention_rows(const Isa *isa, const float *qkv, int64_t rows, void *k_cache, void *v_cache,
                   StepKV step, int64_t pos, int64_t window, const Heads *hd, float scale,
                   float softcap, float *out, int threads) {
    int64_t seen = window && window < pos + rows ? window : pos + rows; /* at most, per row */
    int64_t work = rows * hd->n_heads * seen * (hd->hd_k + hd->hd_v);
    int team = pool_threads(threads, work);
    /* a KV head's query heads in pieces of at most ATT_HEADS, and in more (down to one
     * head each) where the items would be fewer than two a thread */
    int64_t group = hd->n_heads / hd->n_kv, pieces = (group + ATT_HEADS - 1) / ATT_HEADS;
    int64_t wanted = (2 * team + rows * hd->n_kv - 1) / (rows * hd->n_kv);
    if (wanted > pieces) pieces = wanted < group ? wanted : group;
    int per = (int)((group + pieces - 1) / pieces);
    pieces = (group + per - 1) / per;
    AttentionJob J = {isa, qkv, k_cache, v_cache, step, rows, pos, window, hd, scale, softcap, out,
                      per, (int)pieces, 0};
    pool_run(team, rows * hd->n_kv * pieces, attention_item, &J);
    if (step.k) { /* every query has read them: the step's last max_seq positions to the ring */
        size_t esize = hd->kv_half ? 2 : 4;
        int64_t from = pos + rows - hd->max_seq > pos ? pos + rows - hd->max_seq : pos;
        for (int64_t h = 0; h < hd->n_kv; ++h)
            for (int64_t p = from; p < pos + rows; ++p) {
                int64_t src = kv_row(hd, 1, rows, pos, h, p), dst = kv_row(hd, 0, rows, pos, h, p);
                memcpy((char *)k_cache + (size_t)(dst * hd->hd_k) * esize,
                       (const char *)step.k + (size_t)(src * hd->hd_k) * esize,
                       (size_t)hd->hd_k * esize);
                memcpy((char *)v_cache + (size_t)(dst * hd->hd_v) * esize,
                       (const char *)step.v + (size_t)(src * hd->hd_v) * esize,
                       (size_t)hd->hd_v * esize);
            }
    }
    return atomic_load(&J.failed) ? -1 : 0;
}

/* ---- embedding and the greedy token ----------------------------------------------------- */

typedef struct {
    const Part *table;
    const int32_t *ids;
    float *out;
    atomic_int failed;
} EmbedJob;

static void embed_item(void *ctx, int64_t j) {
    EmbedJob *J = ctx;
    const Part *t = J->table;
    int64_t id = *(const volatile int32_t *)&J->ids[j], nc = t->n_in / 32;
    if (id < 0 || id >= t->n_out) {
        atomic_store(&J->failed, OPS_BAD_ID);
        return;
    }
    const uint8_t *row = t->w + id * t->row_bytes;
    uint8_t *unpacked = NULL;
    if (t->x8) {
        if (!(unpacked = scratch_alloc((size_t)t->row_bytes))) {
            atomic_store(&J->failed, -1);
            return;
        }
        x8_unpack_row(t->t, t->w + (id / X8) * x8_group_bytes(t->t, t->n_in), (int)(id % X8),
                      t->n_in, unpacked);
        row = unpacked;
    }
    for (int64_t c = 0; c < nc; ++c) dequant_chunk(row, t->t, c, J->out + j * t->n_in + 32 * c);
    free(unpacked);
}

int embed_rows(const Part *table, const int32_t *ids, int64_t rows, float *out, int threads) {
    EmbedJob J = {table, ids, out, 0};
    pool_run(pool_threads(threads, rows * table->n_in), rows, embed_item, &J);
    int failed = atomic_load(&J.failed);
    return failed == OPS_BAD_ID ? OPS_BAD_ID : failed ? -1 : 0;
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
