/* module.c: runtime_core.workers.cpu._kernels, the CPU worker's kernels as Python functions.
 *
 * Each function parses and checks its arguments into a call (calls.h: every array
 * checked, so a wrong call raises ValueError or TypeError and never reads or writes
 * outside an array) and runs it at once, without the GIL; a `Program` (program.c)
 * records such calls to run them again at every step. `Matrix` holds the views of a
 * matrix's stored rows (one or more parts, each writing its own columns of the output),
 * so the file's mapping outlives the loader.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <stdlib.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "calls.h"
#include "fp_env.h"
#include "ops.h"
#include "pool.h"
#include "program.h"
#include "scratch.h"
#include "spans.h"

/* ---- instruction sets ------------------------------------------------------------------------ */

/* every set the kernels know, portable first; those the host runs, in the same order */
static const char *const KNOWN_ISAS[] = {"portable", "avx2",        "avxvnni",     "avx512bw",
                                          "avx512",   "avx512-zen4", "avx512-intel"};
#define N_KNOWN (int)(sizeof KNOWN_ISAS / sizeof KNOWN_ISAS[0])
static const Isa *HOST_ISAS[N_KNOWN];
static int N_HOST;

#ifdef GPP_HAVE_AVX2
/* What the processor has and the operating system saves (XCR0: the 256-bit and, for
 * AVX-512, the 512-bit and mask registers), read by CPUID as the Intel and AMD manuals
 * describe: not `__builtin_cpu_supports`, whose feature names differ between compilers
 * (clang 14 knows neither "f16c" nor "avxvnni"); and whether it is AMD's family 19h
 * (leaf 0's vendor, leaf 1's base family 0xF plus extended family 0x0A), whose AVX-512
 * processor, Zen 4, takes the avx512-zen4 set's decode kernels (dot_avx512.c), or Intel's
 * (leaf 0's vendor), which take the avx512-intel set's. */
typedef struct {
    int avx2_f16c, avxvnni, avx512, avx512vnni; /* avx512: F, BW and VL */
    int amd_family_19h; /* AMD's family 19h: Zen 3 and Zen 4, of which Zen 4 has AVX-512 */
    int intel;          /* "GenuineIntel" */
} HostFeatures;

static HostFeatures host_features(void) {
    HostFeatures f = {0, 0, 0, 0, 0, 0};
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
    const int amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163; /* "AuthenticAMD" */
    f.intel = b == 0x756e6547 && d == 0x49656e69 && c == 0x6c65746e;       /* "GenuineIntel" */
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    const unsigned base_family = (a >> 8) & 0xF, ext_family = (a >> 20) & 0xFF;
    f.amd_family_19h = amd && base_family == 0xF && base_family + ext_family == 0x19;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx || !f16c || __get_cpuid_max(0, NULL) < 7) return f;
    unsigned xcr0, xcr0_hi;
    __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0 & 0x6) != 0x6) return f; /* SSE and AVX state */
    const int zmm = (xcr0 & 0xE0) == 0xE0; /* opmask, ZMM0-15 high halves, ZMM16-31 */
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned max_subleaf = a;
    const int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1,
              avx512vl = (b >> 31) & 1, avx512vnni = (c >> 11) & 1;
    f.avx2_f16c = avx2;
    f.avx512 = avx2 && zmm && avx512f && avx512bw && avx512vl;
    f.avx512vnni = f.avx512 && avx512vnni;
    if (max_subleaf >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        f.avxvnni = avx2 && ((a >> 4) & 1);
    }
#ifdef GPP_AVXVNNI_AS_EVEX /* a test build: AVX-VNNI's set on AVX-512's VNNI (dot_avxvnni.c) */
    f.avxvnni = f.avx512vnni;
#endif
    return f;
}
#endif

static void find_host_isas(void) {
    N_HOST = 0;
    HOST_ISAS[N_HOST++] = &ISA_PORTABLE;
#ifdef GPP_HAVE_AVX2
    const HostFeatures f = host_features();
    if (f.avx2_f16c) {
        HOST_ISAS[N_HOST++] = &ISA_AVX2;
#ifdef GPP_HAVE_AVXVNNI
        if (f.avxvnni) HOST_ISAS[N_HOST++] = isa_avxvnni();
#endif
        if (f.avx512) {
            HOST_ISAS[N_HOST++] = isa_avx512bw();
            if (f.avx512vnni) HOST_ISAS[N_HOST++] = isa_avx512();
            /* after AVX-512's, so the best on Zen 4 and on Intel's, and offered there only */
            if (f.avx512vnni && f.amd_family_19h) HOST_ISAS[N_HOST++] = isa_avx512_zen4();
            if (f.avx512vnni && f.intel) HOST_ISAS[N_HOST++] = isa_avx512_intel();
        }
    }
#endif
}

/* the set called name (NULL: the best the host runs); NULL and ValueError if the host
 * runs none of that name */
const Isa *isa_named(const char *name) {
    if (!name) return HOST_ISAS[N_HOST - 1];
    for (int i = 0; i < N_HOST; ++i)
        if (strcmp(name, HOST_ISAS[i]->name) == 0) return HOST_ISAS[i];
    char runs[128] = ""; /* every set known, with their separators, fits */
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
    PyObject *fast = PySequence_Tuple(seq); /* parsing a part may run Python: a tuple stays */
    if (!fast) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(fast);
    if (n < 1 || n > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "a matrix of %zd parts (1..%d)", n, MAX_PARTS);
        Py_DECREF(fast);
        return -1;
    }
    if (self->made) { /* a program's calls may be reading it */
        PyErr_SetString(PyExc_RuntimeError, "a Matrix is made once");
        Py_DECREF(fast);
        return -1;
    }
    self->made = 1;
    self->n_in = -1;
    self->n_out = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *data, *item = PyTuple_GET_ITEM(fast, i);
        const char *qname;
        long long n_out, n_in, offset;
        if (!PyTuple_Check(item)) { /* PyArg_ParseTuple would say SystemError */
            PyErr_Format(PyExc_TypeError, "part %zd is a tuple (rows, qtype, n_out, n_in, "
                         "offset), not %.100s", i, Py_TYPE(item)->tp_name);
            goto fail;
        }
        if (!PyArg_ParseTuple(item, "OsLLL;a part is (rows, qtype, n_out, n_in, offset)",
                              &data, &qname, &n_out, &n_in, &offset))
            goto fail;
        int t = qtype_code(qname);
        if (t < 0) {
            PyErr_Format(PyExc_ValueError, "part %zd: %s is not a type the kernels read", i, qname);
            goto fail;
        }
        int be = QTYPE_BLOCK_ELEMS[t];
        if (n_out < 1 || n_in < 32 || n_in % 32 || n_in % be || offset < 0 ||
            n_out > MAX_LENGTH || n_in > MAX_LENGTH || offset > MAX_LENGTH) {
            PyErr_Format(PyExc_ValueError,
                         "part %zd: %lld rows of %lld %s elements at column %lld: rows must be "
                         "whole chunks of 32 and blocks of %d, sizes at most %lld",
                         i, n_out, n_in, qname, offset, be, (long long)MAX_LENGTH);
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
        if (b->view.len % row_bytes || b->view.len / row_bytes != n_out) { /* no product: it may wrap */
            PyErr_Format(PyExc_ValueError, "part %zd: %zd bytes, not %lld rows of %lld %s elements "
                         "(%lld bytes each)", i, b->view.len, n_out, n_in, qname, (long long)row_bytes);
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
    self->ready = 1; /* not before: parsing a part may run Python, repacking lets threads run */
    return 0;
fail:
    Py_DECREF(fast);
    drop_parts(self); /* never ready, and never made again: a call may hold it */
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
              "parts of the types that repack (every quantized type) are copied 8 rows at a "
              "time (on `threads` threads), computing the same bits",
    .tp_basicsize = sizeof(MatrixObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Matrix_init,
    .tp_dealloc = (destructor)Matrix_dealloc,
    .tp_getset = Matrix_getset,
};

MatrixObject *as_matrix(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &MatrixType)) {
        PyErr_SetString(PyExc_TypeError, "a Matrix is needed");
        return NULL;
    }
    MatrixObject *m = (MatrixObject *)obj;
    if (!m->ready) {
        PyErr_SetString(PyExc_ValueError,
                        m->made ? "the Matrix is being made, or its making failed"
                                : "the Matrix was never initialized");
        return NULL;
    }
    return m;
}


/* ---- quantize (for tests: the 8-bit form of rows) ---------------------------------------- */

static PyObject *py_quantize(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"", "", "", "", "", "", "", "", "isa", NULL};
    PyObject *xo, *qo, *do_, *so, *go;
    const char *fname, *isa_name = NULL;
    long long rows, n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOLLOOOO|$z", kwlist, &fname, &xo, &rows, &n,
                                     &qo, &do_, &so, &go, &isa_name))
        return NULL;
    const Isa *isa = isa_named(isa_name);
    if (!isa) return NULL;
    int fmt = -1;
    for (int f = 0; f < FMT_F32; ++f)
        if (strcmp(fname, FORMAT_NAMES[f]) == 0) fmt = f;
    if (fmt < 0) return PyErr_Format(PyExc_ValueError, "no 8-bit activation format %s", fname);
    int block = fmt == FMT_Q8_K ? 256 : 32;
    if (check_rows(rows, n) < 0) return NULL; /* so rows * n cannot wrap */
    if (n < block || n % block)
        return PyErr_Format(PyExc_ValueError, "rows of %lld values are not blocks of %d", n, block);
    Buf x = {0}, q = {0}, d = {0}, s = {0}, g = {0};
    PyObject *result = NULL;
    if (get_buf(xo, &x, "f", 0, rows * n, "x") < 0 || get_buf(qo, &q, "b", 1, rows * n, "q") < 0 ||
        get_buf(do_, &d, "f", 1, rows * n / 32, "d") < 0 ||
        get_buf(so, &s, "f", 1, rows * n / 32, "s") < 0 ||
        get_buf(go, &g, "i", 1, rows * n / 16, "g") < 0)
        goto done;
    Q8Out out = {(int8_t *)q.view.buf, (float *)d.view.buf, (float *)s.view.buf, (int32_t *)g.view.buf,
                 n};
    Py_BEGIN_ALLOW_THREADS /* the buffers are held: nothing here needs the interpreter */
    const FpEnv caller = fp_env_enter();
    quantize_rows(isa, fmt, (const float *)x.view.buf, rows, n, out, 1);
    fp_env_leave(caller);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&x); release(&q); release(&d); release(&s); release(&g);
    return result;
}

/* ---- exp32, tanh32 (ieee_math.exp32 and tanh32 call them) ------------------------------- */

/* y = exp32(x), or tanh32(x) where tanh, on the instruction set named (isa=, default the
 * best) */
static PyObject *ieee32_call(PyObject *args, PyObject *kwds, int tanh) {
    static char *kwlist[] = {"", "", "isa", NULL};
    PyObject *xo, *yo;
    const char *isa_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|$z", kwlist, &xo, &yo, &isa_name)) return NULL;
    const Isa *isa = isa_named(isa_name);
    if (!isa) return NULL;
    void (*fn)(const float *, float *, int64_t) = tanh ? isa->tanh32 : isa->exp32;
    Buf x = {0}, y = {0};
    PyObject *result = NULL;
    if (get_buf(xo, &x, "f", 0, -1, "x") < 0) goto done;
    Py_ssize_t n = x.view.len / (Py_ssize_t)sizeof(float);
    if (get_buf(yo, &y, "f", 1, n, "y") < 0) goto done;
    Py_BEGIN_ALLOW_THREADS
    const FpEnv caller = fp_env_enter();
    fn((const float *)x.view.buf, (float *)y.view.buf, n);
    fp_env_leave(caller);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    release(&x); release(&y);
    return result;
}

static PyObject *py_exp32(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    return ieee32_call(args, kwds, 0);
}

static PyObject *py_tanh32(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    return ieee32_call(args, kwds, 1);
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


/* ---- the calls, run at once ---------------------------------------------------------------- */

/* runs a parsed call (parsed: parse_*'s result) without the GIL; its arrays released */
static PyObject *run_now(Call *c, int parsed) {
    if (parsed < 0 || call_check(c) < 0) {
        call_release(c);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = call_run(c);
    Py_END_ALLOW_THREADS
    call_release(c);
    if (rc < 0) return call_failed(rc);
    if (c->kind == CALL_ARGMAX)
        return Py_BuildValue("(LL)", (long long)c->a.argmax.best, (long long)c->a.argmax.bad);
    Py_RETURN_NONE;
}

static PyObject *py_linear(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    Call c;
    return run_now(&c, parse_linear(args, kwds, &c));
}

static PyObject *py_attention(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    Call c;
    return run_now(&c, parse_attention(args, kwds, &c));
}

/* a module function of positional arguments: the call parsed, then run at once */
#define NOW(name, parse_expr)                                                                  \
    static PyObject *py_##name(PyObject *self, PyObject *args) {                               \
        (void)self;                                                                            \
        Call c;                                                                                \
        return run_now(&c, parse_expr);                                                        \
    }

NOW(rmsnorm, parse_rmsnorm(args, &c))
NOW(geglu, parse_gated(args, NULL, CALL_GEGLU, &c))

static PyObject *py_swiglu(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    Call c;
    return run_now(&c, parse_gated(args, kwds, CALL_SWIGLU, &c));
}

static PyObject *py_softcap(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    Call c;
    return run_now(&c, parse_softcap(args, kwds, &c));
}
NOW(scale, parse_scale(args, &c))
NOW(add_scaled, parse_add_scaled(args, &c))
NOW(round, parse_round(args, &c))
NOW(qk_norm, parse_qk_norm(args, &c))
NOW(rope_kv, parse_rope_kv(args, &c))
NOW(embed, parse_embed(args, &c))
NOW(argmax, parse_argmax(args, &c))

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
    {"linear_spans", (PyCFunction)(void (*)(void))py_linear_spans, METH_VARARGS | METH_KEYWORDS,
     linear_spans_doc},
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_VARARGS | METH_KEYWORDS,
     "quantize(format, x, rows, n, q, d, s, g, *, isa=None): the rows' 8-bit form, as linear\n"
     "computes it (on the instruction set named, default the best: the same bits on each)"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS,
     "rmsnorm(x, weight, out, rows, n, eps, threads, accumulate=False): out (+)= rmsnorm(x) * weight"},
    {"swiglu", (PyCFunction)(void (*)(void))py_swiglu, METH_VARARGS | METH_KEYWORDS,
     "swiglu(h, act, rows, ffn, threads, *, isa=None): silu(gate) * up, silu(g) = g / (1 + "
     "exp32(-g))"},
    {"geglu", py_geglu, METH_VARARGS,
     "geglu(h, act, rows, ffn, threads): gelu(gate) * up, gelu as llama.cpp's table of halves"},
    {"softcap", (PyCFunction)(void (*)(void))py_softcap, METH_VARARGS | METH_KEYWORDS,
     "softcap(logits, cap, threads, *, isa=None): tanh32(logits * (1 / cap)) * cap"},
    {"scale", py_scale, METH_VARARGS, "scale(x, factor, threads): x *= factor"},
    {"add_scaled", py_add_scaled, METH_VARARGS,
     "add_scaled(x, y, factor, threads): x += y * factor, the product rounded first"},
    {"round", py_round, METH_VARARGS,
     "round(x, out, format, threads): out = x rounded to format (f16, bf16; nearest even) as "
     "float32, what products with F16 / BF16 weights multiply"},
    {"qk_norm", py_qk_norm, METH_VARARGS,
     "qk_norm(qkv, rows, bias, q_norm, k_norm, heads, eps, threads): qkv += bias, then every Q "
     "and K head rmsnorm'd times its weight"},
    {"rope_kv", py_rope_kv, METH_VARARGS,
     "rope_kv(qkv, rows, bias, rot, pos, heads, n_rot, neox, k_cache, v_cache, threads, "
     "q_scale=1.0, k_step=None, v_step=None, temps=None): Q times temps[p] where given; K, V to "
     "ring slot p % max_seq, or the step's rows"},
    {"attention", (PyCFunction)(void (*)(void))py_attention, METH_VARARGS | METH_KEYWORDS,
     "attention(qkv, rows, k_cache, v_cache, pos, heads, scale, out, threads, window=0, "
     "k_step=None, v_step=None, *, isa=None, softcap=0.0): scores capped at softcap (0: "
     "none), then the step's rows (when given) to the ring"},
    {"embed", py_embed, METH_VARARGS, "embed(table, ids, out, threads): rows of a table, dequantized"},
    {"argmax", py_argmax, METH_O, "argmax(logits) -> (first index of the largest finite, non-finite count)"},
    {"exp32", (PyCFunction)(void (*)(void))py_exp32, METH_VARARGS | METH_KEYWORDS,
     "exp32(x, y, *, isa=None): y[i] = exp(x[i]) for every float32 of x, the same bits on every "
     "machine (ieee32.h: runtime_core.ieee_math.exp32's)"},
    {"tanh32", (PyCFunction)(void (*)(void))py_tanh32, METH_VARARGS | METH_KEYWORDS,
     "tanh32(x, y, *, isa=None): y[i] = tanh(x[i]) correctly rounded for every float32 of x, the "
     "same bits on every machine (ieee32.h: runtime_core.ieee_math.tanh32's)"},
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
    if (PyType_Ready(&MatrixType) < 0 || PyType_Ready(&ProgramType) < 0 ||
        PyType_Ready(&KvCacheType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    find_host_isas();
    const FpEnv caller = fp_env_enter(); /* the table's bits: IEEE's defaults (fp_env.h) */
    gelu_table_init();
    fp_env_leave(caller);
    Py_INCREF(&MatrixType);
    if (PyModule_AddObject(m, "Matrix", (PyObject *)&MatrixType) < 0) {
        Py_DECREF(&MatrixType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ProgramType);
    if (PyModule_AddObject(m, "Program", (PyObject *)&ProgramType) < 0) {
        Py_DECREF(&ProgramType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&KvCacheType);
    if (PyModule_AddObject(m, "KvCache", (PyObject *)&KvCacheType) < 0) {
        Py_DECREF(&KvCacheType);
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
#ifdef GPP_AVXVNNI_AS_EVEX
    const int avxvnni_as_evex = 1; /* a test build (dot_avxvnni.c) */
#else
    const int avxvnni_as_evex = 0;
#endif
    if (PyModule_AddIntConstant(m, "AVXVNNI_AS_EVEX", avxvnni_as_evex) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
