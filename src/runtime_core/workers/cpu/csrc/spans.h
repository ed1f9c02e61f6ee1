/* spans.h: linear_spans, the module function (spans.c) over ops.c's linear_spans. */
#ifndef GPP_SPANS_H
#define GPP_SPANS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *py_linear_spans(PyObject *self, PyObject *args, PyObject *kwds);
/* its docstring */
extern const char linear_spans_doc[];

#endif
