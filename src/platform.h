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
static inline uint64_t
cs_clock_ns(void)
{
    static LARGE_INTEGER frequency; /* constant after boot; benign race */
    LARGE_INTEGER now;
    if (frequency.QuadPart == 0) {
        QueryPerformanceFrequency(&frequency);
    }
    QueryPerformanceCounter(&now);
    return (uint64_t)((double)now.QuadPart * 1e9 /
                      (double)frequency.QuadPart);
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
static inline uint64_t
cs_clock_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
#endif

#endif /* COMFY_STANDIN_PLATFORM_H */
