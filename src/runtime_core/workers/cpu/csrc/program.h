/* program.h: a step's kernel calls recorded once and run again at every step of the same
 * shape (program.c), and the KV caches of runs they take (KvCache). */
#ifndef GPP_PROGRAM_H
#define GPP_PROGRAM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyTypeObject ProgramType;
extern PyTypeObject KvCacheType;

#endif
