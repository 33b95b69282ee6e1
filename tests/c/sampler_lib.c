/*
 * sampler_lib.c -- a stand-in for a native pager's "resident bytes"
 * function, built into a shared library by the test suite and handed to
 * Board.add_sampler() through ctypes.
 *
 * Each call writes one byte to a pipe, so a test can wait for sampler
 * calls on the pipe instead of sleeping.  A held sampler keeps its call
 * (and so the board's sampler pass) running until it is let go, or for 10
 * seconds at most.
 */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef struct test_sampler {
    _Atomic uint64_t value;
    _Atomic bool fail;
    _Atomic uint64_t calls;
    _Atomic bool hold;     /* the next call waits until this is false */
    _Atomic bool holding;  /* a call is waiting */
    _Atomic bool held_out; /* a call gave up waiting after 10 seconds */
    int notify;            /* write end of a pipe (non-blocking), or -1 */
} test_sampler;

/* Exported: the library is loaded with ctypes. */
test_sampler *test_sampler_new(uint64_t value, int notify);
void test_sampler_free(test_sampler *s);
void test_sampler_set(test_sampler *s, uint64_t value);
void test_sampler_set_fail(test_sampler *s, int fail);
uint64_t test_sampler_calls(const test_sampler *s);
void test_sampler_hold(test_sampler *s, int hold);
int test_sampler_holding(const test_sampler *s);
int test_sampler_held_out(const test_sampler *s);
int test_sampler_sample(void *context, uint64_t *loaded);

test_sampler *
test_sampler_new(uint64_t value, int notify)
{
    test_sampler *s = malloc(sizeof(*s));
    if (s == NULL) {
        return NULL;
    }
    atomic_init(&s->value, value);
    atomic_init(&s->fail, false);
    atomic_init(&s->calls, 0);
    atomic_init(&s->hold, false);
    atomic_init(&s->holding, false);
    atomic_init(&s->held_out, false);
    s->notify = notify;
    return s;
}

void
test_sampler_free(test_sampler *s)
{
    free(s);
}

void
test_sampler_set(test_sampler *s, uint64_t value)
{
    atomic_store(&s->value, value);
}

void
test_sampler_set_fail(test_sampler *s, int fail)
{
    atomic_store(&s->fail, fail != 0);
}

uint64_t
test_sampler_calls(const test_sampler *s)
{
    return atomic_load(&s->calls);
}

void
test_sampler_hold(test_sampler *s, int hold)
{
    atomic_store(&s->hold, hold != 0);
}

int
test_sampler_holding(const test_sampler *s)
{
    return atomic_load(&s->holding);
}

int
test_sampler_held_out(const test_sampler *s)
{
    return atomic_load(&s->held_out);
}

int
test_sampler_sample(void *context, uint64_t *loaded)
{
    test_sampler *s = context;
    if (atomic_load(&s->hold)) {
        struct timespec tick = {0, 1000000};
        atomic_store(&s->holding, true);
        for (int i = 0; i < 10000 && atomic_load(&s->hold); i++) {
            nanosleep(&tick, NULL);
        }
        atomic_store(&s->held_out, atomic_load(&s->hold));
        atomic_store(&s->holding, false);
    }
    *loaded = atomic_load(&s->value);
    atomic_fetch_add(&s->calls, 1);
    if (s->notify >= 0) {
        char byte = 1;
        ssize_t ignored = write(s->notify, &byte, 1);
        (void)ignored; /* a full pipe drops the notification */
    }
    return atomic_load(&s->fail) ? -1 : 0;
}
