/* module.c: runtime_core.workers.cpu._kernels, the CPU worker's kernels as Python functions.
 *
 * Arrays arrive through the buffer protocol; every one is checked (C-contiguous, its
 * element format, enough elements for the sizes passed, writable where written) so a
 * wrong call raises ValueError or TypeError and never reads or writes outside an
 * array. `Matrix` holds the views of a matrix's stored rows (one or more parts, each
 * writing its own columns of the output), so the file's mapping outlives the loader.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ops.h"
#include "pool.h"
#include "scratch.h"

#define MAX_PARTS 8

/* ---- instruction sets ------------------------------------------------------------------------ */

/* every set the kernels know, portable first; those the host runs, in the same order */
static const char *const KNOWN_ISAS[] = {"portable", "avx2", "avxvnni", "avx512bw", "avx512"};
#define N_KNOWN (int)(sizeof KNOWN_ISAS / sizeof KNOWN_ISAS[0])
static const Isa *HOST_ISAS[N_KNOWN];
static int N_HOST;

static void find_host_isas(void) {
    N_HOST = 0;
    HOST_ISAS[N_HOST++] = &ISA_PORTABLE;
#ifdef GPP_HAVE_AVX2
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
        HOST_ISAS[N_HOST++] = &ISA_AVX2;
#ifdef GPP_HAVE_AVXVNNI
        if (__builtin_cpu_supports("avxvnni")) HOST_ISAS[N_HOST++] = isa_avxvnni();
#endif
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl")) {
            HOST_ISAS[N_HOST++] = isa_avx512bw();
            if (__builtin_cpu_supports("avx512vnni")) HOST_ISAS[N_HOST++] = isa_avx512();
        }
    }
#endif
}

/* the set called name (NULL: the best the host runs); NULL and ValueError if the host
 * runs none of that name */
static const Isa *isa_named(const char *name) {
    if (!name) return HOST_ISAS[N_HOST - 1];
    for (int i = 0; i < N_HOST; ++i)
        if (strcmp(name, HOST_ISAS[i]->name) == 0) return HOST_ISAS[i];
    char runs[64] = "";
    for (int i = 0; i < N_HOST; ++i) {
        strncat(runs, HOST_ISAS[i]->name, sizeof runs - strlen(runs) - 3);
        if (i + 1 < N_HOST) strcat(runs, ", ");
    }
    int known = 0;
    for (int i = 0; i < N_KNOWN; ++i) known |= strcmp(name, KNOWN_ISAS[i]) == 0;
    PyErr_Format(PyExc_ValueError, "instruction set %s is %s (this host runs %s)", name,
                 known ? "not one this processor has" : "not one the kernels know", runs);
    return NULL;
}

/* ---- buffers ----------------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *b) {
    if (b->held) PyBuffer_Release(&b->view);
    b->held = 0;
}

/* fmt: the struct format ("f", "b", "B", "i", "e"; "e|H" for halves given as uint16) */
static int get_buf(PyObject *obj, Buf *b, const char *fmt, int writable, Py_ssize_t items,
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

static int get_opt(PyObject *obj, Buf *b, const char *fmt, Py_ssize_t items, const char *name) {
    b->held = 0;
    if (obj == Py_None) return 0;
    return get_buf(obj, b, fmt, 0, items, name);
}

static int check_threads(int threads) {
    if (threads < 1 || threads > 1024) {
        PyErr_Format(PyExc_ValueError, "threads %d is not in 1..1024", threads);
        return -1;
    }
    return 0;
}

static int qtype_code(const char *name) {
    for (int t = 0; t < T_COUNT; ++t)
        if (strcmp(name, QTYPE_NAMES[t]) == 0) return t;
    return -1;
}

/* ---- Matrix ---------------------------------------------------------------------------- */

#define HUGE_PAGE ((size_t)2 << 20)

/* memory for a repacked part: a copy of HUGE_PAGE or more lies in 2 MiB pages where the
 * system gives them on request (Linux's transparent huge pages in "madvise" mode), so
 * that streaming it crosses a page (and its TLB entry, and the stream prefetchers'
 * window) every 2 MiB instead of every 4 KiB; the last page's unused tail is < 2 MiB.
 * Poisoned like scratch memory in a debug build (scratch.h) */
static uint8_t *alloc_groups(size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= HUGE_PAGE) {
        void *p = NULL;
        if (posix_memalign(&p, HUGE_PAGE, bytes) != 0) return NULL;
        madvise(p, bytes, MADV_HUGEPAGE); /* a hint: without it, 4 KiB pages */
        scratch_poison(p, bytes);
        return p;
    }
#endif
    return scratch_alloc(bytes);
}

typedef struct {
    PyObject_HEAD
    int n_parts;
    int fmt; /* the activation format every part takes */
    int64_t n_in, n_out;
    Part parts[MAX_PARTS];
    Buf views[MAX_PARTS];     /* the stored rows a part reads in place */
    uint8_t *owned[MAX_PARTS]; /* a repacked part's groups */
} MatrixObject;

static void drop_parts(MatrixObject *self) {
    for (int p = 0; p < self->n_parts; ++p) {
        release(&self->views[p]);
        free(self->owned[p]);
        self->owned[p] = NULL;
    }
    self->n_parts = 0;
}

static void Matrix_dealloc(MatrixObject *self) {
    drop_parts(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* packing a part's groups, shared out among threads */
typedef struct {
    int t;
    const uint8_t *rows;
    int64_t n_out, row_bytes, groups;
    uint8_t *out;
} PackJob;

#define PACK_GROUPS 16 /* groups per item */

static void pack_item(void *ctx, int64_t item) {
    const PackJob *J = ctx;
    int64_t g0 = item * PACK_GROUPS, g1 = g0 + PACK_GROUPS < J->groups ? g0 + PACK_GROUPS : J->groups;
    x8_pack(J->t, J->rows, J->n_out, J->row_bytes, g0, g1, J->out);
}

static int Matrix_init(MatrixObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"parts", "repack", "threads", NULL};
    PyObject *seq;
    int repack = 0, threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|pi", kwlist, &seq, &repack, &threads)) return -1;
    if (check_threads(threads) < 0) return -1;
    PyObject *fast = PySequence_Fast(seq, "parts: a sequence of (rows, qtype, n_out, n_in, offset)");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "a matrix of %zd parts (1..%d)", n, MAX_PARTS);
        Py_DECREF(fast);
        return -1;
    }
    drop_parts(self);
    self->n_in = -1;
    self->n_out = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *data;
        const char *qname;
        long long n_out, n_in, offset;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OsLLL;a part is (rows, qtype, n_out, n_in, offset)",
                              &data, &qname, &n_out, &n_in, &offset))
            goto fail;
        int t = qtype_code(qname);
        if (t < 0) {
            PyErr_Format(PyExc_ValueError, "part %zd: %s is not a type the kernels read", i, qname);
            goto fail;
        }
        int be = QTYPE_BLOCK_ELEMS[t];
        if (n_out < 1 || n_in < 32 || n_in % 32 || n_in % be || offset < 0) {
            PyErr_Format(PyExc_ValueError,
                         "part %zd: %lld rows of %lld %s elements at column %lld: rows must be "
                         "whole chunks of 32 and blocks of %d",
                         i, n_out, n_in, qname, offset, be);
            goto fail;
        }
        if (self->n_parts > 0 && QTYPE_FORMAT[t] != self->fmt) {
            PyErr_Format(PyExc_ValueError, "part %zd: %s takes %s activations, part 0 %s", i, qname,
                         FORMAT_NAMES[QTYPE_FORMAT[t]], FORMAT_NAMES[self->fmt]);
            goto fail;
        }
        if (self->n_in >= 0 && n_in != self->n_in) {
            PyErr_Format(PyExc_ValueError, "part %zd: rows of %lld elements, part 0 has %lld", i,
                         n_in, (long long)self->n_in);
            goto fail;
        }
        int64_t row_bytes = n_in / be * QTYPE_BLOCK_BYTES[t];
        Buf *b = &self->views[self->n_parts];
        if (get_buf(data, b, "B", 0, -1, "matrix rows") < 0) goto fail;
        if (b->view.len != row_bytes * n_out) {
            PyErr_Format(PyExc_ValueError, "part %zd: %zd bytes, %lld rows of %lld %s elements are %lld",
                         i, b->view.len, n_out, n_in, qname, (long long)(row_bytes * n_out));
            release(b);
            goto fail;
        }
        Part part = {(const uint8_t *)b->view.buf, t, n_out, n_in, row_bytes, offset, 0};
        if (repack && x8_supported(t)) { /* the groups replace the view */
            uint8_t *groups = alloc_groups((size_t)x8_bytes(t, n_out, n_in));
            if (!groups) {
                release(b);
                PyErr_NoMemory();
                goto fail;
            }
            PackJob job = {t, part.w, n_out, row_bytes, (n_out + X8 - 1) / X8, groups};
            Py_BEGIN_ALLOW_THREADS
            pool_run(threads, (job.groups + PACK_GROUPS - 1) / PACK_GROUPS, pack_item, &job);
            Py_END_ALLOW_THREADS
            release(b);
            self->owned[self->n_parts] = groups;
            part.w = groups;
            part.x8 = 1;
        }
        self->parts[self->n_parts] = part;
        self->n_parts++;
        self->fmt = QTYPE_FORMAT[t];
        self->n_in = n_in;
        if (offset + n_out > self->n_out) self->n_out = offset + n_out;
    }
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    drop_parts(self);
    return -1;
}

static PyObject *Matrix_get_n_in(MatrixObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->n_in);
}

static PyObject *Matrix_get_n_out(MatrixObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->n_out);
}

static PyObject *Matrix_get_format(MatrixObject *self, void *closure) {
    (void)closure;
    return PyUnicode_FromString(FORMAT_NAMES[self->fmt]);
}

static PyObject *Matrix_get_repacked(MatrixObject *self, void *closure) {
    (void)closure;
    PyObject *t = PyTuple_New(self->n_parts);
    if (!t) return NULL;
    for (int p = 0; p < self->n_parts; ++p) PyTuple_SET_ITEM(t, p, PyBool_FromLong(self->parts[p].x8));
    return t;
}

static PyGetSetDef Matrix_getset[] = {
    {"repacked", (getter)Matrix_get_repacked, NULL,
     "per part: repacked 8 rows at a time (an owned copy; the stored rows are not read again)", NULL},
    {"act_format", (getter)Matrix_get_format, NULL, "the activations' 8-bit format (f32: float weights)", NULL},
    {"n_in", (getter)Matrix_get_n_in, NULL, "elements per row", NULL},
    {"n_out", (getter)Matrix_get_n_out, NULL, "columns of the output (the parts' extent)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject MatrixType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "runtime_core.workers.cpu._kernels.Matrix",
    .tp_doc = "Matrix(parts, repack=False, threads=1): stored GGUF rows, each part (rows, qtype, "
              "n_out, n_in, offset) writing output columns offset .. offset + n_out; repack: the "
              "parts of the types that repack (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) are copied 8 "
              "rows at a time (on `threads` threads), computing the same bits",
    .tp_basicsize = sizeof(MatrixObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Matrix_init,
    .tp_dealloc = (destructor)Matrix_dealloc,
    .tp_getset = Matrix_getset,
};

static MatrixObject *as_matrix(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &MatrixType)) {
        PyErr_SetString(PyExc_TypeError, "a Matrix is needed");
        return NULL;
    }
    MatrixObject *m = (MatrixObject *)obj;
    if (m->n_parts < 1) {
        PyErr_SetString(PyExc_ValueError, "the Matrix was never initialized");
        return NULL;
    }
    return m;
}

/* ---- linear ------------------------------------------------------------------------------ */

PyDoc_STRVAR(linear_doc,
"linear(matrix, rows, x, q, d, s, g, quantize, use_q8, y, bias, accumulate, threads, *, isa=None)\n"
"\n"
"y[j, offset + r] (+)= part row r . row j of the activations (+ bias[offset + r]) for\n"
"every part and j < rows: the matrix times `rows` activation rows, each row's result\n"
"the same bits whatever the other rows, their number, the threads or the instruction\n"
"set. x: (rows, n_in) float32. use_q8: quantized parts multiply the rows' 8-bit form\n"
"q, d, s, g (int8 (rows, n_in), float32 (rows, n_in / 32) twice, int32 (rows, n_in /\n"
"16)), first computed from x when `quantize`; without use_q8 they may be None and every\n"
"part takes x. y: (rows, ldy) float32, ldy = y's size / rows. isa: an instruction set\n"
"of isas() (None: the best).");

static PyObject *py_linear(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"", "", "", "", "", "", "", "", "", "", "", "", "", "isa", NULL};
    PyObject *mo, *xo, *qo, *do_, *so, *go, *yo, *bo;
    long long rows;
    int quantize, use_q8, accumulate, threads;
    const char *isa_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLOOOOOppOOpi|$z", kwlist, &mo, &rows, &xo, &qo,
                                     &do_, &so, &go, &quantize, &use_q8, &yo, &bo, &accumulate,
                                     &threads, &isa_name))
        return NULL;
    MatrixObject *m = as_matrix(mo);
    const Isa *isa = isa_named(isa_name);
    if (!m || !isa || check_threads(threads) < 0) return NULL;
    if (rows < 1) return PyErr_Format(PyExc_ValueError, "rows %lld < 1", rows);
    int64_t n = m->n_in;
    Buf x = {0}, q = {0}, d = {0}, s = {0}, g = {0}, y = {0}, bias = {0};
    PyObject *result = NULL;
    if (get_buf(xo, &x, "f", 0, rows * n, "x") < 0) goto done;
    if (quantize && !use_q8) {
        PyErr_SetString(PyExc_ValueError, "quantize without use_q8");
        goto done;
    }
    if (use_q8 && m->fmt == FMT_F32) {
        PyErr_SetString(PyExc_ValueError, "float weights take float activations (use_q8 false)");
        goto done;
    }
    if (use_q8 && (get_buf(qo, &q, "b", quantize, rows * n, "q") < 0 ||
                   get_buf(do_, &d, "f", quantize, rows * n / 32, "d") < 0 ||
                   get_buf(so, &s, "f", quantize, rows * n / 32, "s") < 0 ||
                   get_buf(go, &g, "i", quantize, rows * n / 16, "g") < 0))
        goto done;
    if (get_buf(yo, &y, "f", 1, rows * m->n_out, "y") < 0) goto done;
    if (get_opt(bo, &bias, "f", m->n_out, "bias") < 0) goto done;
    int64_t ldy = (int64_t)(y.view.len / 4) / rows;
    int rc = 0;
    if (ldy < m->n_out) {
        PyErr_Format(PyExc_ValueError, "y: rows of %lld, the matrix writes %lld columns",
                     (long long)ldy, (long long)m->n_out);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (quantize) {
        Q8Out out = {(int8_t *)q.view.buf, (float *)d.view.buf, (float *)s.view.buf,
                     (int32_t *)g.view.buf};
        quantize_rows(m->fmt, (const float *)x.view.buf, rows, n, out, threads);
    }
    XRows xr = {q.held ? (const int8_t *)q.view.buf : NULL, d.held ? (const float *)d.view.buf : NULL,
                s.held ? (const float *)s.view.buf : NULL, g.held ? (const int32_t *)g.view.buf : NULL,
                (const float *)x.view.buf, n};
    rc = linear_rows(isa, m->parts, m->n_parts, &xr, rows, use_q8, (float *)y.view.buf, ldy,
                     bias.held ? (const float *)bias.view.buf : NULL, accumulate, threads);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release(&x); release(&q); release(&d); release(&s); release(&g); release(&y); release(&bias);
    return result;
}

/* ---- quantize (for tests: the 8-bit form of rows) ---------------------------------------- */

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *qo, *do_, *so, *go;
    const char *fname;
    long long rows, n;
    if (!PyArg_ParseTuple(args, "sOLLOOOO", &fname, &xo, &rows, &n, &qo, &do_, &so, &go)) return NULL;
    int fmt = -1;
    for (int f = 0; f < FMT_F32; ++f)
        if (strcmp(fname, FORMAT_NAMES[f]) == 0) fmt = f;
    if (fmt < 0) return PyErr_Format(PyExc_ValueError, "no 8-bit activation format %s", fname);
    int block = fmt == FMT_Q8_K ? 256 : 32;
    if (rows < 1 || n < block || n % block)
        return PyErr_Format(PyExc_ValueError, "rows of %lld values are not blocks of %d", n, block);
    Buf x = {0}, q = {0}, d = {0}, s = {0}, g = {0};
    PyObject *result = NULL;
    if (get_buf(xo, &x, "f", 0, rows * n, "x") < 0 || get_buf(qo, &q, "b", 1, rows * n, "q") < 0 ||
        get_buf(do_, &d, "f", 1, rows * n / 32, "d") < 0 ||
        get_buf(so, &s, "f", 1, rows * n / 32, "s") < 0 ||
        get_buf(go, &g, "i", 1, rows * n / 16, "g") < 0)
        goto done;
    Q8Out out = {(int8_t *)q.view.buf, (float *)d.view.buf, (float *)s.view.buf, (int32_t *)g.view.buf};
    quantize_rows(fmt, (const float *)x.view.buf, rows, n, out, 1);
    result = Py_NewRef(Py_None);
done:
    release(&x); release(&q); release(&d); release(&s); release(&g);
    return result;
}

/* ---- norm, feed-forward, rotary, attention ------------------------------------------------ */

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wo, *oo;
    long long rows, n;
    double eps;
    int threads, accumulate = 0;
    if (!PyArg_ParseTuple(args, "OOOLLdi|p", &xo, &wo, &oo, &rows, &n, &eps, &threads, &accumulate))
        return NULL;
    if (check_threads(threads) < 0) return NULL;
    if (rows < 1 || n < 1) return PyErr_Format(PyExc_ValueError, "%lld rows of %lld", rows, n);
    Buf x = {0}, w = {0}, o = {0};
    PyObject *result = NULL;
    if (get_buf(xo, &x, "f", 0, rows * n, "x") < 0 || get_buf(wo, &w, "f", 0, n, "weight") < 0 ||
        get_buf(oo, &o, "f", 1, rows * n, "out") < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    rmsnorm_rows((const float *)x.view.buf, (const float *)w.view.buf, (float *)o.view.buf, rows, n,
                 eps, accumulate, threads);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&x); release(&w); release(&o);
    return result;
}

typedef void (*gated_fn)(const float *h, float *act, int64_t rows, int64_t f, int threads);

static PyObject *gated(PyObject *args, gated_fn fn) {
    PyObject *ho, *ao;
    long long rows, f;
    int threads;
    if (!PyArg_ParseTuple(args, "OOLLi", &ho, &ao, &rows, &f, &threads)) return NULL;
    if (check_threads(threads) < 0) return NULL;
    if (rows < 1 || f < 1) return PyErr_Format(PyExc_ValueError, "%lld rows of %lld", rows, f);
    Buf h = {0}, a = {0};
    PyObject *result = NULL;
    if (get_buf(ho, &h, "f", 0, rows * 2 * f, "h") < 0 || get_buf(ao, &a, "f", 1, rows * f, "act") < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    fn((const float *)h.view.buf, (float *)a.view.buf, rows, f, threads);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&h); release(&a);
    return result;
}

static PyObject *py_swiglu(PyObject *self, PyObject *args) {
    (void)self;
    return gated(args, swiglu_rows);
}

static PyObject *py_geglu(PyObject *self, PyObject *args) {
    (void)self;
    return gated(args, geglu_rows);
}

static PyObject *py_softcap(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    float cap;
    int threads;
    if (!PyArg_ParseTuple(args, "Ofi", &xo, &cap, &threads)) return NULL;
    if (check_threads(threads) < 0) return NULL;
    if (!(cap > 0.0f) || isinf(cap)) return PyErr_Format(PyExc_ValueError, "soft cap %g", (double)cap);
    Buf x = {0};
    if (get_buf(xo, &x, "f", 1, 1, "logits") < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    softcap_rows((float *)x.view.buf, x.view.len / 4, cap, threads);
    Py_END_ALLOW_THREADS
    release(&x);
    Py_RETURN_NONE;
}

static int parse_heads(PyObject *t, Heads *hd) {
    long long nh, nkv, hk, hv, ms;
    int half;
    if (!PyArg_ParseTuple(t, "LLLLLp;heads is (n_heads, n_kv, head_dim_k, head_dim_v, max_seq, kv_half)",
                          &nh, &nkv, &hk, &hv, &ms, &half))
        return -1;
    if (nh < 1 || nkv < 1 || nh % nkv || hk < 1 || hv < 1 || ms < 1) {
        PyErr_Format(PyExc_ValueError, "heads %lld / %lld of %lld, %lld in a cache of %lld", nh, nkv,
                     hk, hv, ms);
        return -1;
    }
    *hd = (Heads){nh, nkv, hk, hv, ms, half};
    return 0;
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

static PyObject *py_qk_norm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *qo, *bo, *qno, *kno, *ho;
    long long rows;
    double eps;
    int threads;
    if (!PyArg_ParseTuple(args, "OLOOOOdi", &qo, &rows, &bo, &qno, &kno, &ho, &eps, &threads))
        return NULL;
    Heads hd;
    if (parse_heads(ho, &hd) < 0 || check_threads(threads) < 0) return NULL;
    if (rows < 1) return PyErr_Format(PyExc_ValueError, "rows %lld < 1", rows);
    int64_t width = hd.n_heads * hd.hd_k + hd.n_kv * (hd.hd_k + hd.hd_v);
    Buf q = {0}, b = {0}, qn = {0}, kn = {0};
    PyObject *result = NULL;
    if (get_buf(qo, &q, "f", 1, rows * width, "qkv") < 0 || get_opt(bo, &b, "f", width, "bias") < 0 ||
        get_buf(qno, &qn, "f", 0, hd.hd_k, "q_norm") < 0 ||
        get_buf(kno, &kn, "f", 0, hd.hd_k, "k_norm") < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    qk_norm_rows((float *)q.view.buf, rows, b.held ? (const float *)b.view.buf : NULL,
                 (const float *)qn.view.buf, (const float *)kn.view.buf, &hd, eps, threads);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&q); release(&b); release(&qn); release(&kn);
    return result;
}

static PyObject *py_rope_kv(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *qo, *bo, *ro, *ho, *ko, *vo, *kso = Py_None, *vso = Py_None;
    long long rows, pos, n_rot;
    int neox, threads;
    float q_scale = 1.0f;
    if (!PyArg_ParseTuple(args, "OLOOLOLpOOi|fOO", &qo, &rows, &bo, &ro, &pos, &ho, &n_rot, &neox,
                          &ko, &vo, &threads, &q_scale, &kso, &vso))
        return NULL;
    Heads hd;
    if (parse_heads(ho, &hd) < 0 || check_threads(threads) < 0) return NULL;
    if (rows < 1 || pos < 0 || n_rot < 0 || n_rot % 2 || n_rot > hd.hd_k)
        return PyErr_Format(PyExc_ValueError, "rows %lld at %lld, %lld rotated dims: outside the "
                            "head", rows, pos, n_rot);
    int64_t width = hd.n_heads * hd.hd_k + hd.n_kv * (hd.hd_k + hd.hd_v);
    const char *kvf = hd.kv_half ? "e|H" : "f";
    Buf q = {0}, b = {0}, r = {0}, k = {0}, v = {0}, ks = {0}, vs = {0};
    StepKV step;
    PyObject *result = NULL;
    if (get_buf(qo, &q, "f", 1, rows * width, "qkv") < 0 || get_opt(bo, &b, "f", width, "bias") < 0 ||
        get_buf(ro, &r, "f", 0, (pos + rows) * n_rot, "rot") < 0 ||
        get_buf(ko, &k, kvf, 1, hd.n_kv * hd.max_seq * hd.hd_k, "k_cache") < 0 ||
        get_buf(vo, &v, kvf, 1, hd.n_kv * hd.max_seq * hd.hd_v, "v_cache") < 0 ||
        get_step(kso, vso, &ks, &vs, &hd, rows, 1, &step) < 0)
        goto done;
    if (!step.k && rows > hd.max_seq) {
        PyErr_Format(PyExc_ValueError, "%lld rows into a ring of %lld: give the step's buffers",
                     rows, (long long)hd.max_seq);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    rope_kv_rows((float *)q.view.buf, rows, b.held ? (const float *)b.view.buf : NULL,
                 (const float *)r.view.buf, pos, &hd, n_rot, neox, q_scale, k.view.buf, v.view.buf,
                 step, threads);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&q); release(&b); release(&r); release(&k); release(&v); release(&ks); release(&vs);
    return result;
}

static PyObject *py_attention(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"", "", "", "", "", "", "", "", "", "window", "k_step", "v_step",
                             "isa", NULL};
    PyObject *qo, *ho, *ko, *vo, *oo, *kso = Py_None, *vso = Py_None;
    long long rows, pos, window = 0;
    float scale;
    int threads;
    const char *isa_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLOOLOfOi|LOO$z", kwlist, &qo, &rows, &ko, &vo,
                                     &pos, &ho, &scale, &oo, &threads, &window, &kso, &vso,
                                     &isa_name))
        return NULL;
    Heads hd;
    const Isa *isa = isa_named(isa_name);
    if (!isa || parse_heads(ho, &hd) < 0 || check_threads(threads) < 0) return NULL;
    if (rows < 1 || pos < 0 || window < 0)
        return PyErr_Format(PyExc_ValueError, "rows %lld at %lld, window %lld", rows, pos, window);
    int64_t width = hd.n_heads * hd.hd_k + hd.n_kv * (hd.hd_k + hd.hd_v);
    const char *kvf = hd.kv_half ? "e|H" : "f";
    Buf q = {0}, k = {0}, v = {0}, o = {0}, ks = {0}, vs = {0};
    StepKV step;
    PyObject *result = NULL;
    int rc = 0;
    if (get_buf(qo, &q, "f", 0, rows * width, "qkv") < 0 ||
        get_buf(ko, &k, kvf, kso != Py_None, hd.n_kv * hd.max_seq * hd.hd_k, "k_cache") < 0 ||
        get_buf(vo, &v, kvf, vso != Py_None, hd.n_kv * hd.max_seq * hd.hd_v, "v_cache") < 0 ||
        get_buf(oo, &o, "f", 1, rows * hd.n_heads * hd.hd_v, "out") < 0 ||
        get_step(kso, vso, &ks, &vs, &hd, rows, 0, &step) < 0)
        goto done;
    /* the first row sees from lo; the ring holds the max_seq positions before the step
     * (step buffers given) or before the end of the step (the step's rows in the ring) */
    long long lo = window && pos >= window ? pos - window + 1 : 0;
    long long held_from = step.k ? pos - hd.max_seq : pos + rows - hd.max_seq;
    if (lo < held_from) {
        PyErr_Format(PyExc_ValueError, "rows %lld at %lld see positions from %lld: a ring of %lld "
                     "%s holds them from %lld only", rows, pos, lo, (long long)hd.max_seq,
                     step.k ? "beside the step's rows" : "with the step's rows", held_from);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = attention_rows(isa, (const float *)q.view.buf, rows, k.view.buf, v.view.buf, step, pos,
                        window, &hd, scale, (float *)o.view.buf, threads);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release(&q); release(&k); release(&v); release(&o); release(&ks); release(&vs);
    return result;
}

/* ---- embedding, argmax -------------------------------------------------------------------- */

static PyObject *py_embed(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *mo, *io, *oo;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOi", &mo, &io, &oo, &threads)) return NULL;
    MatrixObject *m = as_matrix(mo);
    if (!m || check_threads(threads) < 0) return NULL;
    if (m->n_parts != 1) return PyErr_Format(PyExc_ValueError, "a table of one part, not %d", m->n_parts);
    Buf ids = {0}, o = {0};
    PyObject *result = NULL;
    if (get_buf(io, &ids, "i", 0, 1, "ids") < 0) goto done;
    Py_ssize_t rows = ids.view.len / 4;
    const int32_t *id = (const int32_t *)ids.view.buf;
    for (Py_ssize_t j = 0; j < rows; ++j)
        if (id[j] < 0 || id[j] >= m->parts[0].n_out) {
            PyErr_Format(PyExc_ValueError, "token id %d outside 0..%lld", id[j],
                         (long long)m->parts[0].n_out - 1);
            goto done;
        }
    if (get_buf(oo, &o, "f", 1, rows * m->n_in, "out") < 0) goto done;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = embed_rows(&m->parts[0], id, rows, (float *)o.view.buf, threads);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release(&ids); release(&o);
    return result;
}

static PyObject *py_argmax(PyObject *self, PyObject *arg) {
    (void)self;
    Buf x = {0};
    if (get_buf(arg, &x, "f", 0, 1, "logits") < 0) return NULL;
    int64_t bad = 0, best = argmax_finite((const float *)x.view.buf, x.view.len / 4, &bad);
    release(&x);
    return Py_BuildValue("(LL)", (long long)best, (long long)bad);
}

/* ---- instruction sets ---------------------------------------------------------------------- */

static PyObject *py_isas(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *t = PyTuple_New(N_HOST);
    if (!t) return NULL;
    for (int i = 0; i < N_HOST; ++i) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(HOST_ISAS[i]->name));
    return t;
}

static PyMethodDef methods[] = {
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_VARARGS | METH_KEYWORDS, linear_doc},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(format, x, rows, n, q, d, s, g): the rows' 8-bit form, as linear computes it"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS,
     "rmsnorm(x, weight, out, rows, n, eps, threads, accumulate=False): out (+)= rmsnorm(x) * weight"},
    {"swiglu", py_swiglu, METH_VARARGS, "swiglu(h, act, rows, ffn, threads): silu(gate) * up"},
    {"geglu", py_geglu, METH_VARARGS,
     "geglu(h, act, rows, ffn, threads): gelu(gate) * up, gelu as llama.cpp's table of halves"},
    {"softcap", py_softcap, METH_VARARGS, "softcap(logits, cap, threads): cap * tanh(logits / cap)"},
    {"qk_norm", py_qk_norm, METH_VARARGS,
     "qk_norm(qkv, rows, bias, q_norm, k_norm, heads, eps, threads): qkv += bias, then every Q "
     "and K head rmsnorm'd times its weight"},
    {"rope_kv", py_rope_kv, METH_VARARGS,
     "rope_kv(qkv, rows, bias, rot, pos, heads, n_rot, neox, k_cache, v_cache, threads, "
     "q_scale=1.0, k_step=None, v_step=None): K, V to ring slot p % max_seq, or the step's rows"},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_VARARGS | METH_KEYWORDS,
     "attention(qkv, rows, k_cache, v_cache, pos, heads, scale, out, threads, window=0, "
     "k_step=None, v_step=None, *, isa=None): then the step's rows (when given) to the ring"},
    {"embed", py_embed, METH_VARARGS, "embed(table, ids, out, threads): rows of a table, dequantized"},
    {"argmax", py_argmax, METH_O, "argmax(logits) -> (first index of the largest finite, non-finite count)"},
    {"isas", py_isas, METH_NOARGS,
     "the instruction sets this host runs, portable first, the best last (the default)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "The CPU worker's kernels (runtime_core/workers/cpu/csrc).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    if (PyType_Ready(&MatrixType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    find_host_isas();
    gelu_table_init();
    Py_INCREF(&MatrixType);
    if (PyModule_AddObject(m, "Matrix", (PyObject *)&MatrixType) < 0) {
        Py_DECREF(&MatrixType);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *names = PyTuple_New(T_COUNT);
    if (!names) {
        Py_DECREF(m);
        return NULL;
    }
    for (int t = 0; t < T_COUNT; ++t) PyTuple_SET_ITEM(names, t, PyUnicode_FromString(QTYPE_NAMES[t]));
    if (PyModule_AddObject(m, "QTYPES", names) < 0) {
        Py_DECREF(names);
        Py_DECREF(m);
        return NULL;
    }
    PyObject *known = PyTuple_New(N_KNOWN);
    if (!known) {
        Py_DECREF(m);
        return NULL;
    }
    for (int i = 0; i < N_KNOWN; ++i) PyTuple_SET_ITEM(known, i, PyUnicode_FromString(KNOWN_ISAS[i]));
    if (PyModule_AddObject(m, "KNOWN_ISAS", known) < 0) {
        Py_DECREF(known);
        Py_DECREF(m);
        return NULL;
    }
    /* a debug build's scratch memory starts as 0xFF bytes (scratch.h) */
    if (PyModule_AddIntConstant(m, "POISON", GPP_POISONED) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
