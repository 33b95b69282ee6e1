/*
 * platform.h -- the few OS services the core needs, behind one spelling:
 * a mutex, a once-guard, a monotonic clock and a CPU pause for spin loops.
 * Internal to the core; not installed.
 */
#ifndef COMFY_STANDIN_PLATFORM_H
#define COMFY_STANDIN_PLATFORM_H

#include <stdint.h>

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <windows.h>

typedef SRWLOCK cs_mutex;
#define CS_MUTEX_INIT SRWLOCK_INIT
static inline int
cs_mutex_init(cs_mutex *m)
{
    InitializeSRWLock(m);
    return 0;
}
static inline void
cs_mutex_destroy(cs_mutex *m)
{
    (void)m;
}
static inline void
cs_mutex_lock(cs_mutex *m)
{
    AcquireSRWLockExclusive(m);
}
static inline void
cs_mutex_unlock(cs_mutex *m)
{
    ReleaseSRWLockExclusive(m);
}
static inline void
cs_cpu_relax(void)
{
    YieldProcessor();
}
#else
#include <pthread.h>
#include <time.h>

typedef pthread_mutex_t cs_mutex;
static inline int
cs_mutex_init(cs_mutex *m)
{
    return pthread_mutex_init(m, NULL);
}
static inline void
cs_mutex_destroy(cs_mutex *m)
{
    pthread_mutex_destroy(m);
}
static inline void
cs_mutex_lock(cs_mutex *m)
{
    pthread_mutex_lock(m);
}
static inline void
cs_mutex_unlock(cs_mutex *m)
{
    pthread_mutex_unlock(m);
}
static inline void
cs_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
#endif

#endif /* COMFY_STANDIN_PLATFORM_H */
