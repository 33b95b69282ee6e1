/*
 * stub_getenv.c -- a getenv() interposer (LD_PRELOAD) for the tests: it
 * counts the reads of COMFY_STANDIN_* variables, split by whether the
 * calling thread held the GIL (PyGILState_Check, looked up in the
 * process).  A read without it races os.environ writes in other threads.
 * Test-only: built by the test suite, never installed.
 *
 *   long getenv_spy_count(int locked)   reads seen with (1) / without (0)
 *                                       the GIL
 */
#define _GNU_SOURCE /* RTLD_NEXT, RTLD_DEFAULT */

#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

static _Atomic long reads[2];
static _Thread_local int inside; /* dlsym may call back into getenv */

long getenv_spy_count(int locked);

long
getenv_spy_count(int locked)
{
    return atomic_load(&reads[locked ? 1 : 0]);
}

char *getenv(const char *name);

char *
getenv(const char *name)
{
    char *(*real)(const char *);
    void *symbol = dlsym(RTLD_NEXT, "getenv");
    memcpy(&real, &symbol, sizeof(real));
    if (!inside && name != NULL
        && strncmp(name, "COMFY_STANDIN_", 14) == 0) {
        int (*initialized)(void);
        int (*held)(void);
        void *a, *b;
        inside = 1;
        a = dlsym(RTLD_DEFAULT, "Py_IsInitialized");
        b = dlsym(RTLD_DEFAULT, "PyGILState_Check");
        inside = 0;
        memcpy(&initialized, &a, sizeof(initialized));
        memcpy(&held, &b, sizeof(held));
        if (a != NULL && b != NULL && initialized()) {
            atomic_fetch_add(&reads[held() ? 1 : 0], 1);
        }
    }
    return real != NULL ? real(name) : NULL;
}
