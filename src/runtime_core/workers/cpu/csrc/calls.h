/* calls.h: a kernel call, its Python arguments parsed and checked once (calls.c), then
 * run: at once by the module's functions (module.c), or again at every step by a
 * recorded program (program.c), whose rotary and attention calls take each step's
 * positions and KV caches.
 *
 * Parsing takes the arrays through the buffer protocol and checks every one
 * (C-contiguous, its element format, enough elements for the sizes passed, writable
 * where written), so a wrong call raises ValueError or TypeError and never reads or
 * writes outside an array. A call holds its arrays' views (and its matrix) until
 * call_release. Running needs no interpreter: call_run is made without the GIL.
 */
#ifndef GPP_CALLS_H
#define GPP_CALLS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ops.h"

#define MAX_PARTS 8

/* The bounds of a call's sizes, so that no product of them overflows 64 bits: rows of a
 * step, elements of a row (a matrix's n_in), heads and head sizes, a ring's positions,
 * a position. */
#define MAX_ROWS ((int64_t)1 << 24)
#define MAX_LENGTH ((int64_t)1 << 31)
#define MAX_DIM ((int64_t)1 << 16)
#define MAX_POSITIONS ((int64_t)1 << 28)
#define MAX_POSITION ((int64_t)1 << 40)

/* ---- arrays, arguments -------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

void release(Buf *b);
/* fmt: the struct format ("f", "b", "B", "i", "e"; "e|H" for halves given as uint16);
 * items: the elements needed (-1: any) */
int get_buf(PyObject *obj, Buf *b, const char *fmt, int writable, Py_ssize_t items,
            const char *name);
/* rows of n items of q: a C-contiguous array of at least rows * n (stride n), or a view
 * of rows n items long further apart (a (rows, n) slice of wider rows: its stride) */
int get_rows(PyObject *obj, Buf *b, const char *fmt, int writable, Py_ssize_t rows,
             Py_ssize_t n, const char *name, int64_t *stride);
/* get_buf, or nothing held for None */
int get_opt(PyObject *obj, Buf *b, const char *fmt, Py_ssize_t items, const char *name);
int check_threads(int threads);
/* rows of a call (1..MAX_ROWS), and a length (1..MAX_LENGTH): 0, or -1 with ValueError */
int check_rows(long long rows, long long n);
/* the set called name (NULL: the best the host runs); NULL and ValueError if the host
 * runs none of that name (module.c) */
const Isa *isa_named(const char *name);
/* heads is (n_heads, n_kv, head_dim_k, head_dim_v, ring positions, kv_half) */
int parse_heads(PyObject *t, Heads *hd);

/* ---- Matrix (module.c) ----------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    int made;    /* initialized, or being initialized: never again (a failed one stays unusable) */
    int ready;   /* made whole: only then may calls take it (as_matrix) */
    int n_parts;
    int fmt; /* the activation format every part takes */
    int64_t n_in, n_out;
    Part parts[MAX_PARTS];
    Buf views[MAX_PARTS];      /* the stored rows a part reads in place */
    uint8_t *owned[MAX_PARTS]; /* a repacked part's groups */
} MatrixObject;

/* the Matrix obj is, initialized; NULL and TypeError or ValueError if not */
MatrixObject *as_matrix(PyObject *obj);

/* ---- calls ----------------------------------------------------------------------------- */

typedef enum {
    CALL_LINEAR,
    CALL_RMSNORM,
    CALL_SWIGLU,
    CALL_GEGLU,
    CALL_SOFTCAP,
    CALL_SCALE,
    CALL_ADD_SCALED,
    CALL_ROUND,
    CALL_QK_NORM,
    CALL_ROPE_KV,
    CALL_ATTENTION,
    CALL_EMBED,
    CALL_ARGMAX,
} CallKind;

#define CALL_BUFS 8

typedef struct {
    CallKind kind;
    int threads;
    const Isa *isa;
    PyObject *matrix; /* a reference held (linear, embed), or NULL */
    Buf bufs[CALL_BUFS];
    union {
        struct {
            const MatrixObject *m;
            int64_t rows, ldy;
            int quantize, use_q8, accumulate;
            const float *x, *bias;
            Q8Out q8;
            float *y;
        } linear;
        struct {
            const float *x, *w;
            float *out;
            int64_t rows, n;
            double eps;
            int accumulate;
        } norm;
        struct {
            const float *h;
            float *act;
            int64_t rows, f;
        } gated;
        struct {
            float *x;
            const float *y; /* add_scaled: x += y * value */
            int64_t n;
            float value; /* softcap: the cap; scale, add_scaled: the factor */
        } elems;
        struct {
            const float *x;
            float *out;
            int64_t n;
            int half;
        } round;
        struct {
            float *qkv;
            int64_t rows;
            const float *bias, *q_norm, *k_norm;
            Heads hd;
            double eps;
        } qk;
        /* rope_kv and attention: the step's rows against one block of one run's cache */
        struct {
            float *qkv; /* rope_kv: rotated in place; attention: read */
            int64_t rows, pos, window, n_rot, rot_positions, temp_positions;
            const float *bias, *rot, *temps; /* temps: rope_kv's factor on Q per position */
            Heads hd;
            int neox;
            float q_scale, scale, softcap; /* softcap: attention's (0: none) */
            void *k, *v;
            StepKV step;
            float *out;
        } kv;
        struct {
            const MatrixObject *m;
            const int32_t *ids;
            int64_t rows;
            float *out;
        } embed;
        struct {
            const float *x;
            int64_t n, best, bad;
        } argmax;
    } a;
} Call;

/* Each parses a module function's arguments into *c (zeroed first) and checks them:
 * 0, or -1 with an exception set (call_release still frees what was taken). */
int parse_linear(PyObject *args, PyObject *kwds, Call *c);
int parse_rmsnorm(PyObject *args, Call *c);
/* swiglu's and geglu's (h, act, rows, f, threads, *, isa=None) */
int parse_gated(PyObject *args, PyObject *kwds, CallKind kind, Call *c);
/* softcap's (logits, cap, threads, *, isa=None) */
int parse_softcap(PyObject *args, PyObject *kwds, Call *c);
int parse_scale(PyObject *args, Call *c);
int parse_add_scaled(PyObject *args, Call *c);
int parse_round(PyObject *args, Call *c);
int parse_qk_norm(PyObject *args, Call *c);
int parse_rope_kv(PyObject *args, Call *c);
int parse_attention(PyObject *args, PyObject *kwds, Call *c);
int parse_embed(PyObject *args, Call *c);
int parse_argmax(PyObject *arg, Call *c);

/* The checks that depend on what a step changes (its token ids, its positions and
 * cache), under the GIL before call_run: 0, or -1 with ValueError set. */
int call_check(const Call *c);
/* Runs the call (without the GIL): 0, -1 when out of memory, or OPS_BAD_ID when a token
 * id read by the embedding was outside its table (changed since call_check). */
int call_run(Call *c);
/* NULL, with the error call_run's result rc (< 0) stands for set */
PyObject *call_failed(int rc);
void call_release(Call *c);

#endif
