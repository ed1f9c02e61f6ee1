/* program.c: `Program`, a step's kernel calls recorded once, run again at every step of
 * the same shape by one call from Python; `KvCache`, one run's KV cache as the calls
 * take it.
 *
 * A decode step of a stage is a few calls per block (norm, products, rotary and
 * attention, the gate), each a Python call of the module. Between them the interpreter
 * runs the forward program: on a small model that is a sixth of a token's time, and
 * since every product streams megabytes of weights through the caches, the
 * interpreter's own memory is cold at every call. A program records those calls once,
 * their arguments parsed and checked (calls.c), and `run` makes them all in order
 * without the GIL: the same kernels on the same arrays, so the same bits.
 *
 * What changes from step to step: the arrays' contents (the step's token ids, its input
 * rows), which the calls read where they lie, and each segment's position and cache
 * (its run's), which `run` takes: a rotary or attention call is recorded with its slot
 * (segment, block) and takes that segment's position and that block of its cache at
 * every run, checked again (positions within the rotations and the ring, the cache's
 * heads the recorded shape). The recording's own caches are not kept.
 */
#include "program.h"

#include "calls.h"

/* ---- KvCache ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    int n_layers; /* the blocks a run may read: set once every block is checked and held */
    int held;     /* the blocks whose buffers are held (n_layers, or fewer while made) */
    Buf *k, *v;
    Heads *hd;
} KvCacheObject;

static void KvCache_clear(KvCacheObject *self) {
    for (int i = 0; i < self->held; ++i) {
        release(&self->k[i]);
        release(&self->v[i]);
    }
    PyMem_Free(self->k);
    PyMem_Free(self->v);
    PyMem_Free(self->hd);
    self->k = self->v = NULL;
    self->hd = NULL;
    self->n_layers = self->held = 0;
}

static void KvCache_dealloc(KvCacheObject *self) {
    KvCache_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int KvCache_init(KvCacheObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"k", "v", "heads", NULL};
    PyObject *ko, *vo, *ho;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO", kwlist, &ko, &vo, &ho)) return -1;
    if (self->k) { /* a run may be reading it without the GIL */
        PyErr_SetString(PyExc_RuntimeError, "a KvCache is made once");
        return -1;
    }
    /* tuples: parsing an item may run Python, which cannot change them */
    PyObject *k = PySequence_Tuple(ko);
    PyObject *v = k ? PySequence_Tuple(vo) : NULL;
    PyObject *h = v ? PySequence_Tuple(ho) : NULL;
    int rc = -1;
    if (!h) goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(k);
    if (PyTuple_GET_SIZE(v) != n || PyTuple_GET_SIZE(h) != n || n > 1 << 20) {
        PyErr_Format(PyExc_ValueError, "%zd key, %zd value and %zd heads entries: one each per block",
                     n, PyTuple_GET_SIZE(v), PyTuple_GET_SIZE(h));
        goto done;
    }
    self->k = PyMem_Calloc((size_t)n + 1, sizeof(Buf));
    self->v = PyMem_Calloc((size_t)n + 1, sizeof(Buf));
    self->hd = PyMem_Calloc((size_t)n + 1, sizeof(Heads));
    if (!self->k || !self->v || !self->hd) {
        PyErr_NoMemory();
        goto done;
    }
    /* every heads entry first: parsing one may run Python (an __index__), which may hand
     * this cache to a run on another thread; a run reads no block until n_layers says so,
     * and this cache's buffers are taken (no Python runs) only once all are parsed */
    for (Py_ssize_t i = 0; i < n; ++i)
        if (parse_heads(PyTuple_GET_ITEM(h, i), &self->hd[i]) < 0) goto done;
    for (Py_ssize_t i = 0; i < n; ++i) {
        const Heads *hd = &self->hd[i];
        const char *f = hd->kv_half ? "e|H" : "f";
        if (get_buf(PyTuple_GET_ITEM(k, i), &self->k[i], f, 1,
                    hd->n_kv * hd->max_seq * hd->hd_k, "k_cache") < 0)
            goto done;
        if (get_buf(PyTuple_GET_ITEM(v, i), &self->v[i], f, 1,
                    hd->n_kv * hd->max_seq * hd->hd_v, "v_cache") < 0) {
            release(&self->k[i]);
            goto done;
        }
        self->held = (int)i + 1; /* released if a later entry fails */
    }
    self->n_layers = (int)n;
    rc = 0;
done:
    Py_XDECREF(k);
    Py_XDECREF(v);
    Py_XDECREF(h);
    if (rc < 0) KvCache_clear(self);
    return rc;
}

static Py_ssize_t KvCache_len(KvCacheObject *self) { return self->n_layers; }

static PySequenceMethods KvCache_seq = {.sq_length = (lenfunc)KvCache_len};

PyTypeObject KvCacheType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "runtime_core.workers.cpu._kernels.KvCache",
    .tp_doc = "KvCache(k, v, heads): one run's KV cache as a Program's calls take it: per "
              "block, its keys and values (writable arrays of the ring's positions) and its "
              "heads tuple (n_heads, n_kv, head_dim_k, head_dim_v, ring positions, kv_half)",
    .tp_basicsize = sizeof(KvCacheObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KvCache_init,
    .tp_dealloc = (destructor)KvCache_dealloc,
    .tp_as_sequence = &KvCache_seq,
};

/* ---- Program ---------------------------------------------------------------------------------- */

typedef struct {
    Call call;
    int seg, layer; /* a rotary or attention call's slot; -1 for the others */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry **entries;
    int n, cap;
    int segments; /* the slots' segments: 1 + the largest */
    int running;  /* a run is under way (without the GIL) */
} ProgramObject;

static void Program_clear(ProgramObject *self) {
    for (int i = 0; i < self->n; ++i) {
        call_release(&self->entries[i]->call);
        PyMem_Free(self->entries[i]);
    }
    PyMem_Free(self->entries);
    self->entries = NULL;
    self->n = self->cap = self->segments = 0;
}

static void Program_dealloc(ProgramObject *self) {
    Program_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int refuse_running(const ProgramObject *self) {
    if (!self->running) return 0;
    PyErr_SetString(PyExc_RuntimeError, "the program is running");
    return -1;
}

/* a new entry, its call to be parsed in place (a Py_buffer is not moved) */
static Entry *new_entry(ProgramObject *self) {
    if (refuse_running(self) < 0) return NULL;
    Entry *e = PyMem_Calloc(1, sizeof *e);
    if (!e) return (Entry *)PyErr_NoMemory();
    e->seg = e->layer = -1;
    return e;
}

/* the entry's call parsed (parsed: parse_*'s result) and checked: kept at the end, or
 * freed. Parsing may run Python (an argument's __index__), which may have recorded or
 * started a run meanwhile: the room is made and the program checked only now. */
static PyObject *keep(ProgramObject *self, Entry *e, int parsed) {
    Call *c = &e->call;
    if (parsed < 0 || call_check(c) < 0 || refuse_running(self) < 0) goto fail;
    if (self->n == self->cap) {
        int cap = self->cap ? 2 * self->cap : 64;
        Entry **grown = PyMem_Realloc(self->entries, (size_t)cap * sizeof *grown);
        if (!grown) {
            PyErr_NoMemory();
            goto fail;
        }
        self->entries = grown;
        self->cap = cap;
    }
    if (e->seg >= 0) {
        if (c->a.kv.step.k) {
            PyErr_SetString(PyExc_ValueError, "a program's rotary and attention calls take no "
                                              "step buffers");
            goto fail;
        }
        release(&c->bufs[3]); /* the recording's cache: each run gives its own */
        release(&c->bufs[4]);
        c->a.kv.k = c->a.kv.v = NULL;
        if (e->seg >= self->segments) self->segments = e->seg + 1;
    }
    self->entries[self->n++] = e;
    Py_RETURN_NONE;
fail:
    call_release(c);
    PyMem_Free(e);
    return NULL;
}

#define RECORD(name, parse_expr)                                                              \
    static PyObject *Program_##name(ProgramObject *self, PyObject *args) {                     \
        Entry *e = new_entry(self);                                                            \
        if (!e) return NULL;                                                                   \
        Call *c = &e->call;                                                                    \
        return keep(self, e, parse_expr);                                                      \
    }

RECORD(rmsnorm, parse_rmsnorm(args, c))
RECORD(geglu, parse_gated(args, NULL, CALL_GEGLU, c))

static PyObject *Program_swiglu(ProgramObject *self, PyObject *args, PyObject *kwds) {
    Entry *e = new_entry(self);
    if (!e) return NULL;
    return keep(self, e, parse_gated(args, kwds, CALL_SWIGLU, &e->call));
}

static PyObject *Program_softcap(ProgramObject *self, PyObject *args, PyObject *kwds) {
    Entry *e = new_entry(self);
    if (!e) return NULL;
    return keep(self, e, parse_softcap(args, kwds, &e->call));
}
RECORD(scale, parse_scale(args, c))
RECORD(add_scaled, parse_add_scaled(args, c))
RECORD(round, parse_round(args, c))
RECORD(qk_norm, parse_qk_norm(args, c))
RECORD(embed, parse_embed(args, c))
RECORD(argmax, parse_argmax(args, c))

static PyObject *Program_linear(ProgramObject *self, PyObject *args, PyObject *kwds) {
    Entry *e = new_entry(self);
    if (!e) return NULL;
    return keep(self, e, parse_linear(args, kwds, &e->call));
}

/* kwds without "slot", whose (segment, block) goes to the entry; a new reference, or
 * NULL (with an exception set, and *e freed) */
static PyObject *take_slot(PyObject *kwds, Entry *e) {
    PyObject *slot = kwds ? PyDict_GetItemString(kwds, "slot") : NULL;
    PyObject *rest = NULL;
    Py_XINCREF(slot); /* parsing its items may run Python that changes kwds */
    if (!slot) {
        PyErr_SetString(PyExc_TypeError, "a program's rotary and attention calls name their "
                                         "slot=(segment, block)");
        goto fail;
    }
    if (!PyTuple_Check(slot) ||
        !PyArg_ParseTuple(slot, "ii;slot is (segment, block)", &e->seg, &e->layer)) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_SystemError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "slot is a tuple (segment, block)");
        }
        goto fail;
    }
    if (e->seg < 0 || e->layer < 0 || e->seg >= 1 << 16) {
        PyErr_Format(PyExc_ValueError, "slot (%d, %d): a segment and a block from 0", e->seg,
                     e->layer);
        goto fail;
    }
    if (!(rest = PyDict_Copy(kwds)) || PyDict_DelItemString(rest, "slot") < 0) goto fail;
    Py_DECREF(slot);
    return rest;
fail:
    Py_XDECREF(slot);
    Py_XDECREF(rest);
    PyMem_Free(e);
    return NULL;
}

static PyObject *Program_rope_kv(ProgramObject *self, PyObject *args, PyObject *kwds) {
    Entry *e = new_entry(self);
    if (!e) return NULL;
    PyObject *rest = take_slot(kwds, e);
    if (!rest) return NULL;
    PyObject *out = NULL;
    if (PyDict_GET_SIZE(rest)) {
        PyErr_SetString(PyExc_TypeError, "rope_kv takes no keywords but slot");
        PyMem_Free(e);
    } else {
        out = keep(self, e, parse_rope_kv(args, &e->call));
    }
    Py_DECREF(rest);
    return out;
}

static PyObject *Program_attention(ProgramObject *self, PyObject *args, PyObject *kwds) {
    Entry *e = new_entry(self);
    if (!e) return NULL;
    PyObject *rest = take_slot(kwds, e);
    if (!rest) return NULL;
    PyObject *out = keep(self, e, parse_attention(args, rest, &e->call));
    Py_DECREF(rest);
    return out;
}

/* the slot calls take their segment's position and cache (*held: the caches, to be
 * released after the run): 0, or -1 with an exception */
static int bind(ProgramObject *self, PyObject *positions, PyObject *caches, PyObject **held) {
    /* tuples: converting an item may run Python, which cannot change them */
    PyObject *pos = PySequence_Tuple(positions);
    PyObject *kv = pos ? PySequence_Tuple(caches) : NULL;
    long long *at = NULL;
    int rc = -1;
    if (!kv) goto done;
    if (PyTuple_GET_SIZE(pos) != self->segments ||
        PyTuple_GET_SIZE(kv) != self->segments) {
        PyErr_Format(PyExc_ValueError, "%zd positions and %zd caches for a program of %d segments",
                     PyTuple_GET_SIZE(pos), PyTuple_GET_SIZE(kv), self->segments);
        goto done;
    }
    for (int s = 0; s < self->segments; ++s)
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(kv, s), &KvCacheType)) {
            PyErr_Format(PyExc_TypeError, "caches[%d]: a KvCache is needed", s);
            goto done;
        }
    /* the positions first: converting one may run Python, before any call changes */
    at = PyMem_Calloc((size_t)self->segments + 1, sizeof *at);
    if (!at) {
        PyErr_NoMemory();
        goto done;
    }
    for (int s = 0; s < self->segments; ++s) {
        at[s] = PyLong_AsLongLong(PyTuple_GET_ITEM(pos, s));
        if (at[s] == -1 && PyErr_Occurred()) goto done;
        if (at[s] < 0 || at[s] > MAX_POSITION) {
            PyErr_Format(PyExc_ValueError, "segment %d at position %lld (0..%lld)", s, at[s],
                         (long long)MAX_POSITION);
            goto done;
        }
    }
    for (int i = 0; i < self->n; ++i) {
        Entry *e = self->entries[i];
        Call *c = &e->call;
        if (e->seg >= 0) {
            long long p = at[e->seg];
            const KvCacheObject *cache = (const KvCacheObject *)PyTuple_GET_ITEM(kv, e->seg);
            if (e->layer >= cache->n_layers) {
                PyErr_Format(PyExc_ValueError, "segment %d at position %lld of a cache of %d blocks: "
                             "block %d", e->seg, p, cache->n_layers, e->layer);
                goto done;
            }
            const Heads *have = &cache->hd[e->layer], *want = &c->a.kv.hd;
            if (have->n_heads != want->n_heads || have->n_kv != want->n_kv ||
                have->hd_k != want->hd_k || have->hd_v != want->hd_v ||
                have->kv_half != want->kv_half) {
                PyErr_Format(PyExc_ValueError, "segment %d's cache, block %d: heads %lld / %lld of "
                             "%lld, %lld (%s), the program's %lld / %lld of %lld, %lld (%s)",
                             e->seg, e->layer, (long long)have->n_heads, (long long)have->n_kv,
                             (long long)have->hd_k, (long long)have->hd_v,
                             have->kv_half ? "half" : "float", (long long)want->n_heads,
                             (long long)want->n_kv, (long long)want->hd_k, (long long)want->hd_v,
                             want->kv_half ? "half" : "float");
                goto done;
            }
            c->a.kv.pos = p;
            c->a.kv.hd.max_seq = have->max_seq;
            c->a.kv.k = cache->k[e->layer].view.buf;
            c->a.kv.v = cache->v[e->layer].view.buf;
        }
        if (call_check(c) < 0) goto done;
    }
    rc = 0;
done:
    PyMem_Free(at);
    Py_XDECREF(pos);
    if (rc == 0)
        *held = kv;
    else
        Py_XDECREF(kv);
    return rc;
}

static PyObject *Program_run(ProgramObject *self, PyObject *args) {
    PyObject *positions, *caches;
    if (!PyArg_ParseTuple(args, "OO", &positions, &caches)) return NULL;
    if (refuse_running(self) < 0) return NULL;
    self->running = 1; /* from here on no other run and no recording, until the end */
    PyObject *held = NULL;
    if (bind(self, positions, caches, &held) < 0) {
        self->running = 0;
        return NULL;
    }
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < self->n && rc == 0; ++i) rc = call_run(&self->entries[i]->call);
    Py_END_ALLOW_THREADS
    self->running = 0;
    Py_DECREF(held);
    if (rc < 0) return call_failed(rc);
    PyObject *tokens = PyList_New(0);
    for (int i = 0; tokens && i < self->n; ++i) {
        const Call *c = &self->entries[i]->call;
        if (c->kind != CALL_ARGMAX) continue;
        PyObject *t = Py_BuildValue("(LL)", (long long)c->a.argmax.best, (long long)c->a.argmax.bad);
        if (!t || PyList_Append(tokens, t) < 0) Py_CLEAR(tokens);
        Py_XDECREF(t);
    }
    return tokens;
}

static Py_ssize_t Program_len(ProgramObject *self) { return self->n; }

static PyObject *Program_get_segments(ProgramObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->segments);
}

static PySequenceMethods Program_seq = {.sq_length = (lenfunc)Program_len};

static PyGetSetDef Program_getset[] = {
    {"segments", (getter)Program_get_segments, NULL,
     "the segments whose positions and caches run takes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define KW (PyCFunction)(void (*)(void))
static PyMethodDef Program_methods[] = {
    {"linear", KW Program_linear, METH_VARARGS | METH_KEYWORDS, "records linear(...)"},
    {"rmsnorm", (PyCFunction)Program_rmsnorm, METH_VARARGS, "records rmsnorm(...)"},
    {"swiglu", KW Program_swiglu, METH_VARARGS | METH_KEYWORDS, "records swiglu(...)"},
    {"geglu", (PyCFunction)Program_geglu, METH_VARARGS, "records geglu(...)"},
    {"softcap", KW Program_softcap, METH_VARARGS | METH_KEYWORDS, "records softcap(...)"},
    {"scale", (PyCFunction)Program_scale, METH_VARARGS, "records scale(...)"},
    {"add_scaled", (PyCFunction)Program_add_scaled, METH_VARARGS, "records add_scaled(...)"},
    {"round", (PyCFunction)Program_round, METH_VARARGS, "records round(...)"},
    {"qk_norm", (PyCFunction)Program_qk_norm, METH_VARARGS, "records qk_norm(...)"},
    {"embed", (PyCFunction)Program_embed, METH_VARARGS, "records embed(...)"},
    {"argmax", (PyCFunction)Program_argmax, METH_O, "records argmax(logits): run returns its token"},
    {"rope_kv", KW Program_rope_kv, METH_VARARGS | METH_KEYWORDS,
     "records rope_kv(..., slot=(segment, block)): each run gives the position and cache"},
    {"attention", KW Program_attention, METH_VARARGS | METH_KEYWORDS,
     "records attention(..., slot=(segment, block)): each run gives the position and cache"},
    {"run", (PyCFunction)Program_run, METH_VARARGS,
     "run(positions, caches) -> [(token, non-finite count) per argmax]: every call in order, "
     "segment s at positions[s] of caches[s] (a KvCache)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject ProgramType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "runtime_core.workers.cpu._kernels.Program",
    .tp_doc = "Program(): kernel calls recorded (its methods take the module functions' "
              "arguments), run again in order by run(positions, caches) without the GIL",
    .tp_basicsize = sizeof(ProgramObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)Program_dealloc,
    .tp_methods = Program_methods,
    .tp_getset = Program_getset,
    .tp_as_sequence = &Program_seq,
};
