/* fp_env.h: the floating-point environment the kernels' bits stand on.
 *
 * The kernels compute the same bits on every machine (dot.h, ieee32.h) under IEEE
 * arithmetic's defaults: round to nearest even, subnormal numbers kept. A thread's
 * MXCSR register may say otherwise: a library built with -ffast-math sets flush-to-zero
 * and denormals-are-zero in the thread that loads it (gcc's crtfastmath.o), and
 * fesetround changes the rounding, for everything the thread computes after. Each call
 * into the kernels sets the defaults in the calling thread for its duration and gives
 * the caller's environment back (fp_env_enter, fp_env_leave); the pool's workers set
 * them when they start (they run nothing but the kernels). */
#ifndef GPP_FP_ENV_H
#define GPP_FP_ENV_H

#if defined(__x86_64__) || defined(__SSE2__)
#include <xmmintrin.h>

/* every exception masked, round to nearest, neither flush-to-zero nor denormals-are-zero */
#define FP_DEFAULT_MXCSR 0x1F80u
#define FP_FLAGS 0x3Fu /* the sticky exception flags, not part of the environment */

typedef unsigned FpEnv;

static inline FpEnv fp_env_enter(void) {
    const unsigned caller = _mm_getcsr();
    if ((caller & ~FP_FLAGS) != FP_DEFAULT_MXCSR) _mm_setcsr(FP_DEFAULT_MXCSR);
    return caller;
}

static inline void fp_env_leave(FpEnv caller) {
    if ((caller & ~FP_FLAGS) != FP_DEFAULT_MXCSR) _mm_setcsr(caller);
}

#else /* no MXCSR: the C library's default environment is the caller's concern */
typedef int FpEnv;
static inline FpEnv fp_env_enter(void) { return 0; }
static inline void fp_env_leave(FpEnv caller) { (void)caller; }
#endif

#endif
