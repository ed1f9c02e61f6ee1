/* spans.c: linear_spans, the module function of ops.c's linear_spans: several matrices,
 * each over its own span of rows, in one call and one pool run (a mixture of experts'
 * products: each chosen expert over the rows that chose it, where a call per expert
 * cost its parsing and a wake of the threads each). Checked as linear checks its
 * arguments; not recorded in programs (which experts a step takes is the step's). */
#include "spans.h"

#include "calls.h"
#include "fp_env.h"

#define MAX_SPANS 65536

const char linear_spans_doc[] = PyDoc_STR(
"linear_spans(matrices, spans, x, q, d, s, g, y, threads, *, isa=None)\n"
"\n"
"y[j] = matrices[i] . x[j] for every row j of spans[i] = (first, end), for every i:\n"
"each span's rows the same bits as linear over them alone (no bias, no sum). The\n"
"matrices share n_in, n_out and their activations' format. x: (rows, n_in) float32.\n"
"q, d, s, g: the rows' 8-bit form, computed here from x (as linear's with quantize);\n"
"None for matrices that take float activations (x itself). y: (rows, ldy) float32.");

static int parse_spans(PyObject *seq, MatrixObject **ms, Span *spans, Py_ssize_t n, int64_t rows) {
    PyObject *fast = PySequence_Fast(seq, "spans: a sequence of (first, end) pairs");
    if (!fast) return -1;
    int rc = -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%zd spans for %zd matrices", PySequence_Fast_GET_SIZE(fast),
                     n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        long long first, end;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "LL;a span is (first, end)",
                              &first, &end))
            goto done;
        if (first < 0 || first > end || end > rows) {
            PyErr_Format(PyExc_ValueError, "span %zd is rows %lld..%lld of %lld", i, first, end,
                         (long long)rows);
            goto done;
        }
        spans[i] = (Span){ms[i]->parts, ms[i]->n_parts, first, end};
    }
    rc = 0;
done:
    Py_DECREF(fast);
    return rc;
}

PyObject *py_linear_spans(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"", "", "", "", "", "", "", "", "", "isa", NULL};
    PyObject *mo, *so_, *xo, *qo, *do_, *so, *go, *yo;
    int threads;
    const char *isa_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOi|$z", kwlist, &mo, &so_, &xo, &qo, &do_,
                                     &so, &go, &yo, &threads, &isa_name))
        return NULL;
    const Isa *isa = isa_named(isa_name);
    if (!isa || check_threads(threads) < 0) return NULL;
    PyObject *matrices = PySequence_Tuple(mo); /* held: nothing frees a matrix meanwhile */
    if (!matrices) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(matrices);
    MatrixObject **ms = NULL;
    Span *spans = NULL;
    Buf x = {0}, q = {0}, d = {0}, s = {0}, g = {0}, y = {0};
    PyObject *result = NULL;
    if (n < 1 || n > MAX_SPANS) {
        PyErr_Format(PyExc_ValueError, "%zd matrices (1..%d)", n, MAX_SPANS);
        goto done;
    }
    ms = PyMem_Calloc((size_t)n, sizeof *ms);
    spans = PyMem_Calloc((size_t)n, sizeof *spans);
    if (!ms || !spans) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!(ms[i] = as_matrix(PyTuple_GET_ITEM(matrices, i)))) goto done;
        if (ms[i]->n_in != ms[0]->n_in || ms[i]->n_out != ms[0]->n_out ||
            ms[i]->fmt != ms[0]->fmt) {
            PyErr_Format(PyExc_ValueError, "matrix %zd is not of matrix 0's shape and format", i);
            goto done;
        }
    }
    const MatrixObject *m0 = ms[0];
    int64_t n_in = m0->n_in;
    if (get_buf(xo, &x, "f", 0, -1, "x") < 0) goto done;
    int64_t rows = (int64_t)(x.view.len / 4) / n_in;
    if (rows < 1 || rows > MAX_ROWS || rows * n_in * 4 != (int64_t)x.view.len) {
        PyErr_Format(PyExc_ValueError, "x: %zd floats are not rows of %lld",
                     x.view.len / 4, (long long)n_in);
        goto done;
    }
    if (parse_spans(so_, ms, spans, n, rows) < 0) goto done;
    int use_q8 = qo != Py_None;
    if (use_q8 && m0->fmt == FMT_F32) {
        PyErr_SetString(PyExc_ValueError, "float weights take float activations (q None)");
        goto done;
    }
    int64_t qs = n_in;
    if (use_q8 && (get_rows(qo, &q, "b", 1, rows, n_in, "q", &qs) < 0 ||
                   get_buf(do_, &d, "f", 1, rows * n_in / 32, "d") < 0 ||
                   get_buf(so, &s, "f", 1, rows * n_in / 32, "s") < 0 ||
                   get_buf(go, &g, "i", 1, rows * n_in / 16, "g") < 0))
        goto done;
    if (get_buf(yo, &y, "f", 1, rows * m0->n_out, "y") < 0) goto done;
    int64_t ldy = (int64_t)(y.view.len / 4) / rows;
    Q8Out q8 = {use_q8 ? q.view.buf : NULL, use_q8 ? d.view.buf : NULL,
                use_q8 ? s.view.buf : NULL, use_q8 ? g.view.buf : NULL, qs};
    XRows xr = {q8.q, q8.d, q8.s, q8.g, x.view.buf, n_in, qs};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    const FpEnv caller = fp_env_enter(); /* IEEE's defaults (fp_env.h), the caller's after */
    if (use_q8) quantize_rows(isa, m0->fmt, x.view.buf, rows, n_in, q8, threads);
    rc = linear_spans(isa, spans, (int)n, &xr, use_q8, y.view.buf, ldy, threads);
    fp_env_leave(caller);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    release(&x); release(&q); release(&d); release(&s); release(&g); release(&y);
    PyMem_Free(ms);
    PyMem_Free(spans);
    Py_DECREF(matrices);
    return result;
}

