/* scratch.h: memory an operation takes for itself.
 *
 * A build with GPP_POISON defined (the sanitizer builds of `make sanitize-address` and
 * `make sanitize-thread`) fills it with 0xFF bytes first, a NaN as a float or a half,
 * so that a value read before the operation wrote it shows in its results instead of
 * passing for a plausible number. The module says whether it was built so
 * (`_kernels.POISON`), and the backend then poisons its own buffers alike.
 */
#ifndef GPP_SCRATCH_H
#define GPP_SCRATCH_H

#include <stdlib.h>
#include <string.h>

#ifdef GPP_POISON
#define GPP_POISONED 1
#else
#define GPP_POISONED 0
#endif

static inline void scratch_poison(void *p, size_t n) {
    if (GPP_POISONED && p) memset(p, 0xFF, n);
}

static inline void *scratch_alloc(size_t n) {
    void *p = malloc(n);
    scratch_poison(p, n);
    return p;
}

#endif
