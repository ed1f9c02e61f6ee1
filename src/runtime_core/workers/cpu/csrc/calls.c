/* calls.c: the kernels' calls parsed from Python's arguments, checked, run (calls.h). */
#include "calls.h"
#include "fp_env.h"
#include "pool.h"

#include <math.h>
#include <stdint.h>

/* ---- arrays, arguments -------------------------------------------------------------------- */

/* an "O&" converter: a Python number rounded to float32 in IEEE's default environment
 * (fp_env.h), as PyArg_Parse's "f" rounds it in the caller's (which may round otherwise
 * or flush a subnormal float to zero) */
static int to_f32(PyObject *obj, void *out) {
    const double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred()) return 0;
    const FpEnv caller = fp_env_enter();
    volatile float f = (float)v; /* rounded before the caller's environment is back */
    fp_env_leave(caller);
    *(float *)out = f;
    return 1;
}

void release(Buf *b) {
    if (b->held) PyBuffer_Release(&b->view);
    b->held = 0;
}

int get_buf(PyObject *obj, Buf *b, const char *fmt, int writable, Py_ssize_t items,
            const char *name) {
    b->held = 0;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: a C-contiguous%s array is needed", name,
                     writable ? " writable" : "");
        return -1;
    }
    b->held = 1;
    const char *f = b->view.format ? b->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    int ok = 0;
    for (const char *want = fmt; *want; ++want)
        if (*want != '|' && f[0] == *want && f[1] == 0) ok = 1;
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: elements of format %s, expected %s", name, f, fmt);
        release(b);
        return -1;
    }
    if (items >= 0 && b->view.len / b->view.itemsize < items) {
        PyErr_Format(PyExc_ValueError, "%s: %zd elements, the call needs %zd", name,
                     b->view.len / b->view.itemsize, items);
        release(b);
        return -1;
    }
    return 0;
}

int get_rows(PyObject *obj, Buf *b, const char *fmt, int writable, Py_ssize_t rows,
             Py_ssize_t n, const char *name, int64_t *stride) {
    b->held = 0;
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) {
        PyErr_Clear();
        return get_buf(obj, b, fmt, writable, rows * n, name); /* its error */
    }
    Py_buffer *v = &b->view;
    int strided = !PyBuffer_IsContiguous(v, 'C') && v->ndim == 2 && v->itemsize == 1 &&
                  v->strides[1] == 1 && v->shape[1] == n && v->shape[0] >= rows &&
                  v->strides[0] >= n;
    PyBuffer_Release(v);
    if (!strided) { /* C-contiguous: rows n apart */
        *stride = n;
        return get_buf(obj, b, fmt, writable, rows * n, name);
    }
    if (PyObject_GetBuffer(obj, v, flags) < 0) return -1;
    b->held = 1;
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    if (!(f[0] == fmt[0] && f[1] == 0)) {
        PyErr_Format(PyExc_TypeError, "%s: elements of format %s, expected %s", name, f, fmt);
        release(b);
        return -1;
    }
    *stride = v->strides[0];
    return 0;
}

int get_opt(PyObject *obj, Buf *b, const char *fmt, Py_ssize_t items, const char *name) {
    b->held = 0;
    if (obj == Py_None) return 0;
    return get_buf(obj, b, fmt, 0, items, name);
}

int check_threads(int threads) {
    if (threads < 1 || threads > POOL_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads %d is not in 1..%d", threads, POOL_MAX_THREADS);
        return -1;
    }
    return 0;
}

int parse_heads(PyObject *t, Heads *hd) {
    /* bounded so that no product of the sizes overflows (n_kv * ring * head < 2^61) */
    long long nh, nkv, hk, hv, ms;
    int half;
    if (!PyTuple_Check(t)) { /* PyArg_ParseTuple would say SystemError */
        PyErr_Format(PyExc_TypeError, "heads is a tuple (n_heads, n_kv, head_dim_k, head_dim_v, "
                     "max_seq, kv_half), not %.100s", Py_TYPE(t)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(t, "LLLLLp;heads is (n_heads, n_kv, head_dim_k, head_dim_v, max_seq, kv_half)",
                          &nh, &nkv, &hk, &hv, &ms, &half))
        return -1;
    if (nh < 1 || nkv < 1 || nh % nkv || hk < 1 || hv < 1 || ms < 1 || nh > MAX_DIM ||
        hk > MAX_DIM || hv > MAX_DIM || ms > MAX_POSITIONS) {
        PyErr_Format(PyExc_ValueError, "heads %lld / %lld of %lld, %lld in a cache of %lld", nh, nkv,
                     hk, hv, ms);
        return -1;
    }
    *hd = (Heads){nh, nkv, hk, hv, ms, half};
    return 0;
}

static const void *ptr(const Buf *b) { return b->held ? b->view.buf : NULL; }

int check_rows(long long rows, long long n) {
    if (rows < 1 || rows > MAX_ROWS || n < 1 || n > MAX_LENGTH) {
        PyErr_Format(PyExc_ValueError, "%lld rows of %lld (1..%lld rows of 1..%lld)", rows, n,
                     (long long)MAX_ROWS, (long long)MAX_LENGTH);
        return -1;
    }
    return 0;
}

static void start(Call *c, CallKind kind) {
    memset(c, 0, sizeof *c);
    c->kind = kind;
    c->threads = 1;
}

static int take_matrix(Call *c, PyObject *obj) {
    MatrixObject *m = as_matrix(obj);
    if (!m) return -1;
    c->matrix = Py_NewRef(obj);
    return 0;
}

/* ---- products -------------------------------------------------------------------------- */

int parse_linear(PyObject *args, PyObject *kwds, Call *c) {
    static char *kwlist[] = {"", "", "", "", "", "", "", "", "", "", "", "", "", "isa", NULL};
    PyObject *mo, *xo, *qo, *do_, *so, *go, *yo, *bo;
    long long rows;
    int quantize, use_q8, accumulate, threads;
    const char *isa_name = NULL;
    start(c, CALL_LINEAR);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLOOOOOppOOpi|$z", kwlist, &mo, &rows, &xo, &qo,
                                     &do_, &so, &go, &quantize, &use_q8, &yo, &bo, &accumulate,
                                     &threads, &isa_name))
        return -1;
    if (take_matrix(c, mo) < 0) return -1;
    const MatrixObject *m = (const MatrixObject *)c->matrix;
    if (!(c->isa = isa_named(isa_name)) || check_threads(threads) < 0) return -1;
    if (check_rows(rows, m->n_in) < 0) return -1;
    int64_t n = m->n_in;
    Buf *x = &c->bufs[0], *q = &c->bufs[1], *d = &c->bufs[2], *s = &c->bufs[3], *g = &c->bufs[4],
        *y = &c->bufs[5], *bias = &c->bufs[6];
    if (get_buf(xo, x, "f", 0, rows * n, "x") < 0) return -1;
    if (quantize && !use_q8) {
        PyErr_SetString(PyExc_ValueError, "quantize without use_q8");
        return -1;
    }
    if (use_q8 && m->fmt == FMT_F32) {
        PyErr_SetString(PyExc_ValueError, "float weights take float activations (use_q8 false)");
        return -1;
    }
    int64_t qs = n;
    if (use_q8 && (get_rows(qo, q, "b", quantize, rows, n, "q", &qs) < 0 ||
                   get_buf(do_, d, "f", quantize, rows * n / 32, "d") < 0 ||
                   get_buf(so, s, "f", quantize, rows * n / 32, "s") < 0 ||
                   get_buf(go, g, "i", quantize, rows * n / 16, "g") < 0))
        return -1;
    if (get_buf(yo, y, "f", 1, rows * m->n_out, "y") < 0) return -1;
    if (get_opt(bo, bias, "f", m->n_out, "bias") < 0) return -1;
    int64_t ldy = (int64_t)(y->view.len / 4) / rows;
    if (ldy < m->n_out) {
        PyErr_Format(PyExc_ValueError, "y: rows of %lld, the matrix writes %lld columns",
                     (long long)ldy, (long long)m->n_out);
        return -1;
    }
    c->threads = threads;
    c->a.linear.m = m;
    c->a.linear.rows = rows;
    c->a.linear.ldy = ldy;
    c->a.linear.quantize = quantize;
    c->a.linear.use_q8 = use_q8;
    c->a.linear.accumulate = accumulate;
    c->a.linear.x = x->view.buf;
    c->a.linear.bias = ptr(bias);
    c->a.linear.q8 = (Q8Out){(int8_t *)ptr(q), (float *)ptr(d), (float *)ptr(s), (int32_t *)ptr(g),
                             qs};
    c->a.linear.y = y->view.buf;
    return 0;
}

/* ---- norms, feed-forward, element-wise ---------------------------------------------------- */

int parse_rmsnorm(PyObject *args, Call *c) {
    PyObject *xo, *wo, *oo;
    long long rows, n;
    double eps;
    int threads, accumulate = 0;
    start(c, CALL_RMSNORM);
    if (!PyArg_ParseTuple(args, "OOOLLdi|p", &xo, &wo, &oo, &rows, &n, &eps, &threads, &accumulate))
        return -1;
    if (check_threads(threads) < 0 || check_rows(rows, n) < 0) return -1;
    if (get_buf(xo, &c->bufs[0], "f", 0, rows * n, "x") < 0 ||
        get_buf(wo, &c->bufs[1], "f", 0, n, "weight") < 0 ||
        get_buf(oo, &c->bufs[2], "f", 1, rows * n, "out") < 0)
        return -1;
    c->threads = threads;
    c->a.norm.x = c->bufs[0].view.buf;
    c->a.norm.w = c->bufs[1].view.buf;
    c->a.norm.out = c->bufs[2].view.buf;
    c->a.norm.rows = rows;
    c->a.norm.n = n;
    c->a.norm.eps = eps;
    c->a.norm.accumulate = accumulate;
    return 0;
}

int parse_gated(PyObject *args, PyObject *kwds, CallKind kind, Call *c) {
    static char *kwlist[] = {"", "", "", "", "", "isa", NULL};
    PyObject *ho, *ao;
    long long rows, f;
    int threads;
    const char *isa_name = NULL;
    start(c, kind);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOLLi|$z", kwlist, &ho, &ao, &rows, &f, &threads,
                                     &isa_name))
        return -1;
    if (!(c->isa = isa_named(isa_name)) || check_threads(threads) < 0 || check_rows(rows, f) < 0)
        return -1;
    if (get_buf(ho, &c->bufs[0], "f", 0, rows * 2 * f, "h") < 0 ||
        get_buf(ao, &c->bufs[1], "f", 1, rows * f, "act") < 0)
        return -1;
    c->threads = threads;
    c->a.gated.h = c->bufs[0].view.buf;
    c->a.gated.act = c->bufs[1].view.buf;
    c->a.gated.rows = rows;
    c->a.gated.f = f;
    return 0;
}

static int parse_elems(PyObject *args, PyObject *kwds, CallKind kind, const char *what, Call *c) {
    static char *kwlist[] = {"", "", "", "isa", NULL};
    PyObject *xo;
    float value;
    int threads;
    const char *isa_name = NULL;
    start(c, kind);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO&i|$z", kwlist, &xo, to_f32, &value, &threads,
                                     &isa_name))
        return -1;
    if (!(c->isa = isa_named(isa_name)) || check_threads(threads) < 0) return -1;
    if (kind == CALL_SOFTCAP && (!(value > 0.0f) || isinf(value))) {
        char text[32]; /* PyErr_Format has no %g */
        snprintf(text, sizeof text, "%g", (double)value);
        PyErr_Format(PyExc_ValueError, "a soft cap of %s: it must be finite and above 0", text);
        return -1;
    }
    if (get_buf(xo, &c->bufs[0], "f", 1, 1, what) < 0) return -1;
    c->threads = threads;
    c->a.elems.x = c->bufs[0].view.buf;
    c->a.elems.n = c->bufs[0].view.len / 4;
    c->a.elems.value = value;
    return 0;
}

int parse_softcap(PyObject *args, PyObject *kwds, Call *c) {
    return parse_elems(args, kwds, CALL_SOFTCAP, "logits", c);
}

int parse_scale(PyObject *args, Call *c) { return parse_elems(args, NULL, CALL_SCALE, "x", c); }

int parse_add_scaled(PyObject *args, Call *c) {
    PyObject *xo, *yo;
    float value;
    int threads;
    start(c, CALL_ADD_SCALED);
    if (!PyArg_ParseTuple(args, "OOO&i", &xo, &yo, to_f32, &value, &threads)) return -1;
    if (check_threads(threads) < 0) return -1;
    if (get_buf(xo, &c->bufs[0], "f", 1, 1, "x") < 0) return -1;
    int64_t n = c->bufs[0].view.len / 4;
    if (get_buf(yo, &c->bufs[1], "f", 0, n, "y") < 0) return -1;
    c->threads = threads;
    c->a.elems.x = c->bufs[0].view.buf;
    c->a.elems.y = c->bufs[1].view.buf;
    c->a.elems.n = n;
    c->a.elems.value = value;
    return 0;
}

int parse_round(PyObject *args, Call *c) {
    PyObject *xo, *oo;
    const char *fmt;
    int threads;
    start(c, CALL_ROUND);
    if (!PyArg_ParseTuple(args, "OOsi", &xo, &oo, &fmt, &threads)) return -1;
    if (check_threads(threads) < 0) return -1;
    int half = strcmp(fmt, "f16") == 0;
    if (!half && strcmp(fmt, "bf16") != 0) {
        PyErr_Format(PyExc_ValueError, "round to %s: f16 or bf16", fmt);
        return -1;
    }
    if (get_buf(xo, &c->bufs[0], "f", 0, 1, "x") < 0) return -1;
    int64_t n = c->bufs[0].view.len / 4;
    if (get_buf(oo, &c->bufs[1], "f", 1, n, "out") < 0) return -1;
    c->threads = threads;
    c->a.round.x = c->bufs[0].view.buf;
    c->a.round.out = c->bufs[1].view.buf;
    c->a.round.n = n;
    c->a.round.half = half;
    return 0;
}

/* ---- heads, rotary, attention ---------------------------------------------------------- */

static int64_t qkv_width(const Heads *hd) {
    return hd->n_heads * hd->hd_k + hd->n_kv * (hd->hd_k + hd->hd_v);
}

/* k_step, v_step: both None, or both (n_kv, rows, hd) arrays of the cache's element type */
static int get_step(PyObject *ko, PyObject *vo, Buf *k, Buf *v, const Heads *hd, int64_t rows,
                    int writable, StepKV *step) {
    *step = (StepKV){NULL, NULL};
    k->held = v->held = 0;
    if (ko == Py_None && vo == Py_None) return 0;
    if (ko == Py_None || vo == Py_None) {
        PyErr_SetString(PyExc_ValueError, "k_step and v_step: both arrays, or both None");
        return -1;
    }
    const char *kvf = hd->kv_half ? "e|H" : "f";
    if (get_buf(ko, k, kvf, writable, hd->n_kv * rows * hd->hd_k, "k_step") < 0 ||
        get_buf(vo, v, kvf, writable, hd->n_kv * rows * hd->hd_v, "v_step") < 0)
        return -1;
    *step = (StepKV){k->view.buf, v->view.buf};
    return 0;
}

int parse_qk_norm(PyObject *args, Call *c) {
    PyObject *qo, *bo, *qno, *kno, *ho;
    long long rows;
    double eps;
    int threads;
    start(c, CALL_QK_NORM);
    if (!PyArg_ParseTuple(args, "OLOOOOdi", &qo, &rows, &bo, &qno, &kno, &ho, &eps, &threads))
        return -1;
    Heads hd;
    if (parse_heads(ho, &hd) < 0 || check_threads(threads) < 0 || check_rows(rows, 1) < 0)
        return -1;
    int64_t width = qkv_width(&hd);
    if (get_buf(qo, &c->bufs[0], "f", 1, rows * width, "qkv") < 0 ||
        get_opt(bo, &c->bufs[1], "f", width, "bias") < 0 ||
        get_buf(qno, &c->bufs[2], "f", 0, hd.hd_k, "q_norm") < 0 ||
        get_buf(kno, &c->bufs[3], "f", 0, hd.hd_k, "k_norm") < 0)
        return -1;
    c->threads = threads;
    c->a.qk.qkv = c->bufs[0].view.buf;
    c->a.qk.rows = rows;
    c->a.qk.bias = ptr(&c->bufs[1]);
    c->a.qk.q_norm = c->bufs[2].view.buf;
    c->a.qk.k_norm = c->bufs[3].view.buf;
    c->a.qk.hd = hd;
    c->a.qk.eps = eps;
    return 0;
}

/* the fields rotary and attention share: the step's rows at pos, qkv in bufs[0] */
static void set_kv(Call *c, int threads, long long rows, long long pos) {
    c->threads = threads;
    c->a.kv.qkv = c->bufs[0].view.buf;
    c->a.kv.rows = rows;
    c->a.kv.pos = pos;
}

/* the KV cache's arrays of one block: bufs[k_at], bufs[k_at + 1] */
static int get_cache(PyObject *ko, PyObject *vo, Call *c, int k_at, int writable) {
    const Heads *hd = &c->a.kv.hd;
    const char *kvf = hd->kv_half ? "e|H" : "f";
    if (get_buf(ko, &c->bufs[k_at], kvf, writable, hd->n_kv * hd->max_seq * hd->hd_k, "k_cache") < 0 ||
        get_buf(vo, &c->bufs[k_at + 1], kvf, writable, hd->n_kv * hd->max_seq * hd->hd_v,
                "v_cache") < 0)
        return -1;
    c->a.kv.k = c->bufs[k_at].view.buf;
    c->a.kv.v = c->bufs[k_at + 1].view.buf;
    return 0;
}

int parse_rope_kv(PyObject *args, Call *c) {
    PyObject *qo, *bo, *ro, *ho, *ko, *vo, *kso = Py_None, *vso = Py_None, *to = Py_None;
    long long rows, pos, n_rot;
    int neox, threads;
    float q_scale = 1.0f;
    start(c, CALL_ROPE_KV);
    if (!PyArg_ParseTuple(args, "OLOOLOLpOOi|O&OOO", &qo, &rows, &bo, &ro, &pos, &ho, &n_rot,
                          &neox, &ko, &vo, &threads, to_f32, &q_scale, &kso, &vso, &to))
        return -1;
    Heads *hd = &c->a.kv.hd;
    if (parse_heads(ho, hd) < 0 || check_threads(threads) < 0) return -1;
    if (rows < 1 || rows > MAX_ROWS || pos < 0 || pos > MAX_POSITION || n_rot < 0 || n_rot % 2 ||
        n_rot > hd->hd_k) {
        PyErr_Format(PyExc_ValueError, "rows %lld at %lld, %lld rotated dims: outside the head",
                     rows, pos, n_rot);
        return -1;
    }
    int64_t width = qkv_width(hd);
    if (get_buf(qo, &c->bufs[0], "f", 1, rows * width, "qkv") < 0 ||
        get_opt(bo, &c->bufs[1], "f", width, "bias") < 0 ||
        get_buf(ro, &c->bufs[2], "f", 0, (pos + rows) * n_rot, "rot") < 0 ||
        get_cache(ko, vo, c, 3, 1) < 0 ||
        get_step(kso, vso, &c->bufs[5], &c->bufs[6], hd, rows, 1, &c->a.kv.step) < 0 ||
        get_opt(to, &c->bufs[7], "f", pos + rows, "temps") < 0)
        return -1;
    set_kv(c, threads, rows, pos);
    c->a.kv.temps = ptr(&c->bufs[7]);
    c->a.kv.temp_positions = c->bufs[7].held ? (int64_t)(c->bufs[7].view.len / 4) : INT64_MAX;
    c->a.kv.n_rot = n_rot;
    c->a.kv.rot_positions = n_rot ? (int64_t)(c->bufs[2].view.len / 4) / n_rot : INT64_MAX;
    c->a.kv.bias = ptr(&c->bufs[1]);
    c->a.kv.rot = c->bufs[2].view.buf;
    c->a.kv.neox = neox;
    c->a.kv.q_scale = q_scale;
    return 0;
}

int parse_attention(PyObject *args, PyObject *kwds, Call *c) {
    static char *kwlist[] = {"", "", "", "", "", "", "", "", "", "window", "k_step", "v_step",
                             "isa", "softcap", NULL};
    PyObject *qo, *ho, *ko, *vo, *oo, *kso = Py_None, *vso = Py_None;
    long long rows, pos, window = 0;
    float scale, softcap = 0.0f;
    int threads;
    const char *isa_name = NULL;
    start(c, CALL_ATTENTION);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLOOLOO&Oi|LOO$zO&", kwlist, &qo, &rows, &ko,
                                     &vo, &pos, &ho, to_f32, &scale, &oo, &threads, &window,
                                     &kso, &vso, &isa_name, to_f32, &softcap))
        return -1;
    if (!(softcap >= 0.0f) || isinf(softcap)) { /* NaN too */
        char text[32]; /* PyErr_Format has no %g */
        snprintf(text, sizeof text, "%g", (double)softcap);
        PyErr_Format(PyExc_ValueError, "a soft cap of %s: it must be finite and not negative",
                     text);
        return -1;
    }
    Heads *hd = &c->a.kv.hd;
    if (!(c->isa = isa_named(isa_name)) || parse_heads(ho, hd) < 0 || check_threads(threads) < 0)
        return -1;
    if (rows < 1 || rows > MAX_ROWS || pos < 0 || pos > MAX_POSITION || window < 0) {
        PyErr_Format(PyExc_ValueError, "rows %lld at %lld, window %lld", rows, pos, window);
        return -1;
    }
    if (get_buf(qo, &c->bufs[0], "f", 0, rows * qkv_width(hd), "qkv") < 0 ||
        get_cache(ko, vo, c, 3, kso != Py_None) < 0 ||
        get_buf(oo, &c->bufs[1], "f", 1, rows * hd->n_heads * hd->hd_v, "out") < 0 ||
        get_step(kso, vso, &c->bufs[5], &c->bufs[6], hd, rows, 0, &c->a.kv.step) < 0)
        return -1;
    set_kv(c, threads, rows, pos);
    c->a.kv.window = window;
    c->a.kv.scale = scale;
    c->a.kv.softcap = softcap;
    c->a.kv.out = c->bufs[1].view.buf;
    return 0;
}

/* ---- embedding, argmax -------------------------------------------------------------------- */

int parse_embed(PyObject *args, Call *c) {
    PyObject *mo, *io, *oo;
    int threads;
    start(c, CALL_EMBED);
    if (!PyArg_ParseTuple(args, "OOOi", &mo, &io, &oo, &threads)) return -1;
    if (take_matrix(c, mo) < 0 || check_threads(threads) < 0) return -1;
    const MatrixObject *m = (const MatrixObject *)c->matrix;
    if (m->n_parts != 1) {
        PyErr_Format(PyExc_ValueError, "a table of one part, not %d", m->n_parts);
        return -1;
    }
    if (get_buf(io, &c->bufs[0], "i", 0, 1, "ids") < 0) return -1;
    int64_t rows = c->bufs[0].view.len / 4;
    if (get_buf(oo, &c->bufs[1], "f", 1, rows * m->n_in, "out") < 0) return -1;
    c->threads = threads;
    c->a.embed.m = m;
    c->a.embed.ids = c->bufs[0].view.buf;
    c->a.embed.rows = rows;
    c->a.embed.out = c->bufs[1].view.buf;
    return 0;
}

int parse_argmax(PyObject *arg, Call *c) {
    start(c, CALL_ARGMAX);
    if (get_buf(arg, &c->bufs[0], "f", 0, 1, "logits") < 0) return -1;
    c->a.argmax.x = c->bufs[0].view.buf;
    c->a.argmax.n = c->bufs[0].view.len / 4;
    return 0;
}

/* ---- checks, running -------------------------------------------------------------------- */

int call_check(const Call *c) {
    if (c->kind == CALL_EMBED) {
        const int32_t *id = c->a.embed.ids;
        int64_t n_out = c->a.embed.m->parts[0].n_out;
        for (int64_t j = 0; j < c->a.embed.rows; ++j)
            if (id[j] < 0 || id[j] >= n_out) {
                PyErr_Format(PyExc_ValueError, "token id %d outside 0..%lld", id[j],
                             (long long)n_out - 1);
                return -1;
            }
        return 0;
    }
    if (c->kind != CALL_ROPE_KV && c->kind != CALL_ATTENTION) return 0;
    long long rows = c->a.kv.rows, pos = c->a.kv.pos, ring = c->a.kv.hd.max_seq;
    const StepKV *step = &c->a.kv.step;
    if (c->kind == CALL_ROPE_KV) {
        if (pos + rows > c->a.kv.rot_positions) {
            PyErr_Format(PyExc_ValueError, "rows %lld at %lld: rotations for %lld positions", rows,
                         pos, (long long)c->a.kv.rot_positions);
            return -1;
        }
        if (pos + rows > c->a.kv.temp_positions) {
            PyErr_Format(PyExc_ValueError, "rows %lld at %lld: temperatures for %lld positions",
                         rows, pos, (long long)c->a.kv.temp_positions);
            return -1;
        }
        if (!step->k && rows > ring) {
            PyErr_Format(PyExc_ValueError, "%lld rows into a ring of %lld: give the step's buffers",
                         rows, ring);
            return -1;
        }
        return 0;
    }
    /* the first row sees from lo; the ring holds the max_seq positions before the step
     * (step buffers given) or before the end of the step (the step's rows in the ring) */
    long long window = c->a.kv.window;
    long long lo = window && pos >= window ? pos - window + 1 : 0;
    long long held_from = step->k ? pos - ring : pos + rows - ring;
    if (lo < held_from) {
        PyErr_Format(PyExc_ValueError, "rows %lld at %lld see positions from %lld: a ring of %lld "
                     "%s holds them from %lld only", rows, pos, lo, ring,
                     step->k ? "beside the step's rows" : "with the step's rows", held_from);
        return -1;
    }
    return 0;
}

static int run_call(Call *c) {
    int threads = c->threads;
    switch (c->kind) {
    case CALL_LINEAR: {
        const MatrixObject *m = c->a.linear.m;
        int64_t rows = c->a.linear.rows;
        Q8Out q8 = c->a.linear.q8;
        if (c->a.linear.quantize)
            quantize_rows(c->isa, m->fmt, c->a.linear.x, rows, m->n_in, q8, threads);
        XRows xr = {q8.q, q8.d, q8.s, q8.g, c->a.linear.x, m->n_in, q8.qs};
        return linear_rows(c->isa, m->parts, m->n_parts, &xr, rows, c->a.linear.use_q8,
                           c->a.linear.y, c->a.linear.ldy, c->a.linear.bias,
                           c->a.linear.accumulate, threads);
    }
    case CALL_RMSNORM:
        rmsnorm_rows(c->a.norm.x, c->a.norm.w, c->a.norm.out, c->a.norm.rows, c->a.norm.n,
                     c->a.norm.eps, c->a.norm.accumulate, threads);
        return 0;
    case CALL_SWIGLU:
        swiglu_rows(c->isa, c->a.gated.h, c->a.gated.act, c->a.gated.rows, c->a.gated.f, threads);
        return 0;
    case CALL_GEGLU:
        geglu_rows(c->a.gated.h, c->a.gated.act, c->a.gated.rows, c->a.gated.f, threads);
        return 0;
    case CALL_SOFTCAP:
        softcap_rows(c->isa, c->a.elems.x, c->a.elems.n, c->a.elems.value, threads);
        return 0;
    case CALL_SCALE:
        scale_rows(c->a.elems.x, c->a.elems.n, c->a.elems.value, threads);
        return 0;
    case CALL_ADD_SCALED:
        add_scaled_rows(c->a.elems.x, c->a.elems.y, c->a.elems.n, c->a.elems.value, threads);
        return 0;
    case CALL_ROUND:
        round_rows(c->a.round.x, c->a.round.out, c->a.round.n, c->a.round.half, threads);
        return 0;
    case CALL_QK_NORM:
        qk_norm_rows(c->a.qk.qkv, c->a.qk.rows, c->a.qk.bias, c->a.qk.q_norm, c->a.qk.k_norm,
                     &c->a.qk.hd, c->a.qk.eps, threads);
        return 0;
    case CALL_ROPE_KV:
        rope_kv_rows(c->a.kv.qkv, c->a.kv.rows, c->a.kv.bias, c->a.kv.rot, c->a.kv.pos, &c->a.kv.hd,
                     c->a.kv.n_rot, c->a.kv.neox, c->a.kv.q_scale, c->a.kv.temps, c->a.kv.k,
                     c->a.kv.v, c->a.kv.step, threads);
        return 0;
    case CALL_ATTENTION:
        return attention_rows(c->isa, c->a.kv.qkv, c->a.kv.rows, c->a.kv.k, c->a.kv.v, c->a.kv.step,
                              c->a.kv.pos, c->a.kv.window, &c->a.kv.hd, c->a.kv.scale,
                              c->a.kv.softcap, c->a.kv.out, threads);
    case CALL_EMBED:
        return embed_rows(&c->a.embed.m->parts[0], c->a.embed.ids, c->a.embed.rows, c->a.embed.out,
                          threads);
    case CALL_ARGMAX:
        c->a.argmax.best = argmax_finite(c->a.argmax.x, c->a.argmax.n, &c->a.argmax.bad);
        return 0;
    }
    return 0;
}

PyObject *call_failed(int rc) {
    if (rc == OPS_BAD_ID)
        return PyErr_Format(PyExc_ValueError, "a token id was changed while the kernels ran, "
                            "to one outside the table");
    return PyErr_NoMemory();
}

void call_release(Call *c) {
    for (int i = 0; i < CALL_BUFS; ++i) release(&c->bufs[i]);
    Py_CLEAR(c->matrix);
}

/* the call in IEEE's default environment (fp_env.h), the caller's given back */
int call_run(Call *c) {
    const FpEnv caller = fp_env_enter();
    const int rc = run_call(c);
    fp_env_leave(caller);
    return rc;
}
