/*
 * test_board.c -- C unit tests of the residency board core.
 *
 * Built and run by tests/test_board_c.py (cc -std=c11 -Wall -Wextra
 * -Werror plus $CS_TEST_CFLAGS, which CI sets to the sanitizers).  Exits
 * nonzero when any check fails; every check prints what it compared.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "comfy_standin/board.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int failures;
static int checks;

#define CHECK(cond)                                                         \
    do {                                                                    \
        checks++;                                                           \
        if (!(cond)) {                                                      \
            failures++;                                                     \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__,          \
                    __LINE__, #cond);                                       \
        }                                                                   \
    } while (0)

#define CHECK_EQ(a, b)                                                      \
    do {                                                                    \
        uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                    \
        checks++;                                                           \
        if (a_ != b_) {                                                     \
            failures++;                                                     \
            fprintf(stderr, "%s:%d: %s == %s: %" PRIu64 " != %" PRIu64     \
                    "\n", __FILE__, __LINE__, #a, #b, a_, b_);              \
        }                                                                   \
    } while (0)

#define ID(s) (s), (sizeof(s) - 1)
#define GIB (UINT64_C(1) << 30)

/* The segment's 64-bit word at byte offset `off`. */
static _Atomic uint64_t *
word_at(cs_board *board, size_t off)
{
    return (_Atomic uint64_t *)((unsigned char *)cs_board_memory(board, NULL)
                                + off);
}

static size_t
slot_off(uint32_t slot, size_t field)
{
    return CS_BOARD_HEADER_SIZE + (size_t)slot * CS_BOARD_SLOT_SIZE + field;
}

/* A board made here (the worker's side, *worker) and adopted here (the
 * host's, returned), generation 7.  The tests write the segment through
 * the worker's mapping: the host's is read-only. */
static cs_board *
make_pair(uint32_t slots, uint64_t limit, cs_board **worker)
{
    cs_board *host = NULL;
    int fd = -1, err = 0;
    cs_board_status st = cs_board_make(slots, 7, worker, &fd, &err);
    if (st == CS_BOARD_OK) {
        st = cs_board_adopt(fd, slots, 7, limit, &host, &err);
        close(fd);
    }
    CHECK_EQ(st, CS_BOARD_OK);
    if (host == NULL) {
        fprintf(stderr, "make or adopt failed: %s (errno %d)\n",
                cs_board_status_message(st), err);
        exit(2);
    }
    return host;
}

static cs_board_reading
read_status(cs_board *host, uint32_t slot, uint64_t size, uint64_t *loaded,
            uint64_t *stamp)
{
    return cs_board_read_slot_status(host, slot, 0, size, loaded, stamp);
}

/* Assigns `id` on the host and binds the slot's tag on the worker. */
static uint32_t
assign_bound(cs_board *host, cs_board *worker, const char *id,
             size_t id_len, uint64_t size)
{
    uint32_t slot = UINT32_MAX;
    CHECK_EQ(cs_board_assign(host, id, id_len, size, &slot), CS_BOARD_OK);
    CHECK_EQ(cs_board_bind(worker, slot, cs_board_tag(host, slot)),
             CS_BOARD_OK);
    return slot;
}

static void
test_make_layout(void)
{
    cs_board *worker = NULL;
    cs_board *host = make_pair(4, 0, &worker);
    const char *name = cs_board_name(worker);
    CHECK(strncmp(name, "memfd:csb-", 10) == 0);
    CHECK(strlen(name) < CS_BOARD_NAME_MAX);
    CHECK(!cs_board_is_host(worker));
    CHECK(cs_board_is_host(host));
    CHECK(cs_board_is_own(worker) && cs_board_is_own(host));
    CHECK(cs_board_attached(host) && cs_board_attached(worker));
    CHECK_EQ(cs_board_slot_count(host), 4);
    CHECK_EQ(cs_board_generation(host), 7);
    CHECK_EQ(cs_board_generation(worker), 7);
    size_t length = 0;
    CHECK(cs_board_memory(host, &length) != NULL);
    CHECK_EQ(length, CS_BOARD_HEADER_SIZE + 4 * CS_BOARD_SLOT_SIZE);
    CHECK_EQ(atomic_load(word_at(host, CS_BOARD_OFF_MAGIC)), CS_BOARD_MAGIC);
    CHECK_EQ(atomic_load(word_at(host, CS_BOARD_OFF_VERSION)),
             CS_BOARD_LAYOUT_VERSION);
    CHECK_EQ(atomic_load(word_at(host, CS_BOARD_OFF_SLOT_COUNT)), 4);

    cs_board *none = NULL;
    int fd = -1, err = 0;
    CHECK_EQ(cs_board_make(0, 0, &none, &fd, &err), CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_make(CS_BOARD_MAX_SLOTS + 1, 0, &none, &fd, &err),
             CS_BOARD_ERR_RANGE);
    CHECK(none == NULL && fd == -1);
    cs_board_close(worker);
    cs_board_close(host);
}

static void
test_assign_publish_read(void)
{
    cs_board *worker = NULL;
    cs_board *host = make_pair(2, 0, &worker);
    uint32_t a = 99, b = 99, again = 99, found = 99;
    uint64_t loaded = 1, stamp = 1;
    CHECK_EQ(cs_board_assign(host, ID("unet-0"), 8 * GIB, &a), CS_BOARD_OK);
    CHECK_EQ(cs_board_assign(host, ID("clip-0"), 2 * GIB, &b), CS_BOARD_OK);
    CHECK(a != b);
    CHECK_EQ(cs_board_assign(host, ID("unet-0"), 8 * GIB, &again),
             CS_BOARD_OK);
    CHECK_EQ(again, a);
    CHECK_EQ(cs_board_assign(host, ID("unet-0"), GIB, &again),
             CS_BOARD_ERR_SIZE);
    CHECK_EQ(cs_board_assign(host, ID("vae-0"), GIB, &again),
             CS_BOARD_ERR_FULL);
    CHECK_EQ(cs_board_assigned_size(host, a), 8 * GIB);
    CHECK_EQ(cs_board_find(host, ID("clip-0"), &found), CS_BOARD_OK);
    CHECK_EQ(found, b);

    CHECK_EQ(cs_board_owner_pid(host), getpid());
    CHECK_EQ(cs_board_slot_count(worker), 2);
    /* The segment holds no ids: the worker is told (slot, tag). */
    CHECK_EQ(cs_board_find(worker, ID("unet-0"), &found), CS_BOARD_ERR_ROLE);
    CHECK_EQ(cs_board_publish(worker, a, 1), CS_BOARD_ERR_UNBOUND);
    CHECK_EQ(cs_board_bind(worker, a, cs_board_tag(host, a)), CS_BOARD_OK);
    CHECK_EQ(cs_board_bind(worker, b, cs_board_tag(host, b)), CS_BOARD_OK);
    CHECK_EQ(cs_board_bound_tag(worker, a), cs_board_tag(host, a));
    CHECK(cs_board_tag(host, a) != cs_board_tag(host, b));

    /* Assigned, never published. */
    CHECK_EQ(read_status(host, a, 8 * GIB, &loaded, &stamp),
             CS_BOARD_NO_READING);
    CHECK_EQ(loaded, 1); /* outputs untouched on an invalid read */

    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t before = (uint64_t)ts.tv_sec * 1000000000u +
                      (uint64_t)ts.tv_nsec;
    CHECK_EQ(cs_board_publish(worker, a, 3 * GIB), CS_BOARD_OK);
    CHECK_EQ(read_status(host, a, 8 * GIB, &loaded, &stamp),
             CS_BOARD_VALID);
    CHECK_EQ(loaded, 3 * GIB);
    CHECK(stamp >= before);
    CHECK(cs_board_read_slot(host, a, 0, 8 * GIB, &loaded, &stamp));
    CHECK(cs_board_read_slot(host, a, cs_board_tag(host, a), 8 * GIB,
                             &loaded, &stamp));
    CHECK(!cs_board_read_slot(host, a, cs_board_tag(host, b), 8 * GIB,
                              &loaded, &stamp));

    /* The caller's size bounds the value, whatever the worker wrote. */
    CHECK_EQ(cs_board_publish(worker, b, 5 * GIB), CS_BOARD_OK);
    CHECK_EQ(read_status(host, b, 2 * GIB, &loaded, &stamp),
             CS_BOARD_VALID);
    CHECK_EQ(loaded, 2 * GIB);

    /* Roles and ranges. */
    CHECK_EQ(cs_board_publish(host, a, 1), CS_BOARD_ERR_ROLE);
    CHECK_EQ(cs_board_publish(worker, 2, 1), CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_publish(worker, a, CS_BOARD_VALUE_MAX + 1),
             CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_publish_at(worker, a, 1, 0), CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_publish_at(worker, a, 1, UINT64_MAX),
             CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_assign(worker, ID("x"), 1, &again), CS_BOARD_ERR_ROLE);
    CHECK_EQ(read_status(worker, a, GIB, &loaded, &stamp),
             CS_BOARD_UNASSIGNED);
    CHECK_EQ(read_status(host, 2, GIB, &loaded, &stamp),
             CS_BOARD_UNASSIGNED);

    /* Release: the slot reads unassigned, and a new model may take it
     * under a new tag: the old model's reading is never the new one's. */
    uint64_t old_tag = cs_board_tag(host, b);
    CHECK_EQ(cs_board_release(host, b), CS_BOARD_OK);
    CHECK_EQ(cs_board_tag(host, b), 0);
    CHECK_EQ(read_status(host, b, 2 * GIB, &loaded, &stamp),
             CS_BOARD_UNASSIGNED);
    CHECK_EQ(cs_board_find(host, ID("clip-0"), &found), CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_assign(host, ID("vae-0"), GIB, &again), CS_BOARD_OK);
    CHECK_EQ(again, b);
    CHECK(cs_board_tag(host, b) != old_tag);
    CHECK_EQ(read_status(host, b, GIB, &loaded, &stamp),
             CS_BOARD_TAG_MISMATCH);
    CHECK_EQ(cs_board_read_slot_status(host, b, old_tag, GIB, &loaded,
                                       &stamp),
             CS_BOARD_UNASSIGNED);
    CHECK_EQ(cs_board_bind(worker, b, cs_board_tag(host, b)), CS_BOARD_OK);
    CHECK_EQ(cs_board_publish(worker, b, 7), CS_BOARD_OK);
    CHECK_EQ(read_status(host, b, GIB, &loaded, &stamp), CS_BOARD_VALID);
    CHECK_EQ(loaded, 7);

    CHECK_EQ(cs_board_heartbeat(worker), CS_BOARD_OK);

    /* A worker that closes detaches: reads stop being valid. */
    cs_board_close(worker);
    CHECK(!cs_board_attached(host));
    CHECK_EQ(read_status(host, a, 8 * GIB, &loaded, &stamp),
             CS_BOARD_NOT_ATTACHED);
    cs_board_close(host);
}

static void
test_untrusted_header(void)
{
    cs_board *worker = NULL;
    cs_board *host = make_pair(1, 0, &worker);
    uint32_t slot;
    uint64_t loaded, stamp;
    slot = assign_bound(host, worker, ID("m"), 100);
    CHECK_EQ(cs_board_publish(worker, slot, 40), CS_BOARD_OK);
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp), CS_BOARD_VALID);

    /* The host never reads the words it checked at adoption again
     * (bounds come from its own records): rewriting them changes
     * nothing. */
    struct {
        size_t off;
        uint64_t bad;
        cs_board_reading want;
    } cases[] = {
        {CS_BOARD_OFF_MAGIC, 0x1234, CS_BOARD_VALID},
        {CS_BOARD_OFF_VERSION, 2, CS_BOARD_VALID},
        {CS_BOARD_OFF_SLOT_COUNT, UINT64_MAX, CS_BOARD_VALID},
        {CS_BOARD_OFF_GENERATION, 8, CS_BOARD_VALID},
        {CS_BOARD_OFF_OWNER_PID, UINT64_MAX, CS_BOARD_VALID},
        {CS_BOARD_OFF_OWNER_PID, 0, CS_BOARD_NOT_ATTACHED},
        {CS_BOARD_OFF_HEARTBEAT, 0, CS_BOARD_STALE},
        {CS_BOARD_OFF_HEARTBEAT, UINT64_MAX, CS_BOARD_STALE},
        {slot_off(slot, CS_BOARD_SLOT_OFF_SEQ), 1, CS_BOARD_TORN},
        {slot_off(slot, CS_BOARD_SLOT_OFF_TAG), 42, CS_BOARD_TAG_MISMATCH},
        {slot_off(slot, CS_BOARD_SLOT_OFF_TAG), 0, CS_BOARD_NO_READING},
        {slot_off(slot, CS_BOARD_SLOT_OFF_UPDATED), 0, CS_BOARD_NO_READING},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        _Atomic uint64_t *word = word_at(worker, cases[i].off);
        uint64_t saved = atomic_load(word);
        atomic_store(word, cases[i].bad);
        loaded = 7;
        CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp),
                 cases[i].want);
        CHECK_EQ(loaded, cases[i].want == CS_BOARD_VALID ? 40 : 7);
        atomic_store(word, saved);
        CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp),
                 CS_BOARD_VALID);
    }

    /* A huge value clamps; a stamp from the future reads as now. */
    atomic_store(word_at(worker, slot_off(slot, CS_BOARD_SLOT_OFF_LOADED)),
                 UINT64_MAX);
    atomic_store(word_at(worker, slot_off(slot, CS_BOARD_SLOT_OFF_UPDATED)),
                 UINT64_MAX);
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp), CS_BOARD_VALID);
    CHECK_EQ(loaded, 100);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    CHECK(stamp <= (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec);

    /* The pid the host expects. */
    cs_board_expect_owner(host, (int64_t)getpid() + 1);
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp),
             CS_BOARD_WRONG_OWNER);
    cs_board_expect_owner(host, getpid());
    CHECK_EQ(cs_board_expected_owner(host), getpid());
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp), CS_BOARD_VALID);

    /* The host learned the worker died (its pool reaped it). */
    cs_board_owner_gone(host);
    CHECK(cs_board_owner_is_gone(host));
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp),
             CS_BOARD_DEAD_OWNER);

    /* A seqlock word left odd refuses writers (of the worker) at once;
     * host calls never wait on it. */
    _Atomic uint64_t *seq = word_at(worker, slot_off(slot, 0));
    uint64_t saved = atomic_load(seq);
    atomic_store(seq, saved | 1);
    CHECK_EQ(cs_board_publish(worker, slot, 1), CS_BOARD_ERR_BUSY);
    atomic_store(seq, saved);
    CHECK_EQ(cs_board_publish(worker, slot, 1), CS_BOARD_OK);

    cs_board_close(worker);
    cs_board_close(host);
}

static void
test_heartbeat_limit(void)
{
    /* A 10 ms limit; an old beat (1 ns after boot) is stale, a fresh one
     * is not.  No timing: the old beat is written, not waited for. */
    cs_board *worker = NULL;
    cs_board *host = make_pair(1, CS_BOARD_HEARTBEAT_LIMIT_MIN_NS, &worker);
    uint32_t slot;
    uint64_t loaded, stamp;
    CHECK_EQ(cs_board_heartbeat_limit(host), CS_BOARD_HEARTBEAT_LIMIT_MIN_NS);
    slot = assign_bound(host, worker, ID("m"), 10);
    CHECK_EQ(cs_board_publish(worker, slot, 5), CS_BOARD_OK);
    atomic_store(word_at(worker, CS_BOARD_OFF_HEARTBEAT), 1);
    CHECK_EQ(read_status(host, slot, 10, &loaded, &stamp), CS_BOARD_STALE);
    CHECK_EQ(cs_board_heartbeat(worker), CS_BOARD_OK);
    CHECK_EQ(cs_board_heartbeat(host), CS_BOARD_ERR_ROLE);
    cs_board_reading r = read_status(host, slot, 10, &loaded, &stamp);
    /* Valid unless this thread was descheduled for over 10 ms between;
     * then stale is right too, and never anything else. */
    CHECK(r == CS_BOARD_VALID || r == CS_BOARD_STALE);
    cs_board_close(worker);
    cs_board_close(host);
}

static void
test_dead_owner(void)
{
    /* A worker that died without closing (as after SIGKILL) leaves its
     * pid in the header.  Reads do no liveness system call: they stay
     * valid until the host learns of the death from its pool (here:
     * waitpid), even though no process of that pid is left. */
    cs_board *worker = NULL;
    cs_board *host = make_pair(1, 0, &worker);
    uint64_t loaded, stamp;
    uint32_t slot = assign_bound(host, worker, ID("m"), 10);
    CHECK_EQ(cs_board_publish(worker, slot, 9), CS_BOARD_OK);
    fflush(NULL);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        _exit(0);
    }
    int wstatus = 0;
    CHECK(waitpid(child, &wstatus, 0) == child);
    atomic_store(word_at(worker, CS_BOARD_OFF_OWNER_PID), (uint64_t)child);
    cs_board_expect_owner(host, child);
    CHECK_EQ(cs_board_owner_pid(host), child);
    CHECK_EQ(read_status(host, slot, 10, &loaded, &stamp), CS_BOARD_VALID);
    cs_board_owner_gone(host);
    CHECK_EQ(read_status(host, slot, 10, &loaded, &stamp),
             CS_BOARD_DEAD_OWNER);
    CHECK(!cs_board_read_slot(host, slot, 0, 10, &loaded, &stamp));
    atomic_store(word_at(worker, CS_BOARD_OFF_OWNER_PID), (uint64_t)getpid());
    cs_board_close(worker);
    cs_board_close(host);
}

/* ---- fork: a handle belongs to the process that made it ------------ */

static int
noop_sampler(void *context, uint64_t *loaded)
{
    (void)context;
    *loaded = 5;
    return 0;
}

static void
test_fork(void)
{
    cs_board *worker = NULL;
    cs_board *host = make_pair(2, 0, &worker);
    uint32_t slot = assign_bound(host, worker, ID("m"), 10);
    uint64_t loaded, stamp;
    int err;
    CHECK_EQ(cs_board_set_period(worker, 1000000), CS_BOARD_OK);
    CHECK_EQ(cs_board_add_sampler(worker, slot, noop_sampler, NULL, &err),
             CS_BOARD_OK);
    while (cs_board_sampler_passes(worker) < 2) {
        sched_yield();
    }
    for (int round = 0; round < 20; round++) {
        fflush(NULL);
        pid_t child = fork(); /* the sampler thread runs meanwhile */
        CHECK(child >= 0);
        if (child == 0) {
            uint32_t other;
            int bad = 0;
            bad |= cs_board_is_own(host) || cs_board_is_own(worker);
            bad |= read_status(host, slot, 10, &loaded, &stamp) !=
                   CS_BOARD_OTHER_PROCESS;
            bad |= cs_board_assign(host, ID("x"), 1, &other) !=
                   CS_BOARD_ERR_FORKED;
            bad |= cs_board_publish(worker, slot, 1) != CS_BOARD_ERR_FORKED;
            /* Neither close may detach, drop the parent's pidfd, or join
             * the parent's sampler thread (which would hang). */
            cs_board_close(worker);
            cs_board_close(host);
            _exit(bad ? 1 : 0);
        }
        int wstatus = 0;
        CHECK(waitpid(child, &wstatus, 0) == child);
        CHECK(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0);
    }
    CHECK(cs_board_attached(host));
    CHECK_EQ(cs_board_owner_pid(host), getpid());
    uint64_t passes = cs_board_sampler_passes(worker);
    while (cs_board_sampler_passes(worker) < passes + 2) {
        sched_yield();
    }
    CHECK_EQ(read_status(host, slot, 10, &loaded, &stamp), CS_BOARD_VALID);
    CHECK_EQ(loaded, 5);
    cs_board_close(worker);
    cs_board_close(host);
}

/* ---- two threads: the seqlock ------------------------------------- */

typedef struct seqlock_run {
    cs_board *host;
    cs_board *worker;
    uint32_t slot;
    uint64_t rounds;
    uint64_t first; /* this writer's first value */
    _Atomic int writers_left;
    _Atomic uint64_t valid;
    _Atomic uint64_t torn;
    _Atomic uint64_t inconsistent;
} seqlock_run;

typedef struct writer_arg {
    seqlock_run *run;
    uint64_t first;
} writer_arg;

static void *
seqlock_writer(void *arg)
{
    writer_arg *w = arg;
    seqlock_run *run = w->run;
    /* Each write pairs loaded = v with updated = v + 1; any read that
     * mixes two writes breaks the pairing. */
    for (uint64_t i = 0; i < run->rounds; i++) {
        uint64_t v = w->first + 2 * i;
        cs_board_status st;
        /* BUSY: the other writer is inside; publish never waits. */
        while ((st = cs_board_publish_at(run->worker, run->slot, v,
                                         v + 1)) == CS_BOARD_ERR_BUSY) {
            sched_yield();
        }
        if (st != CS_BOARD_OK) {
            atomic_fetch_add(&run->inconsistent, 1);
        }
    }
    atomic_fetch_sub(&run->writers_left, 1);
    return NULL;
}

static void *
seqlock_reader(void *arg)
{
    seqlock_run *run = arg;
    while (atomic_load(&run->writers_left) > 0) {
        uint64_t loaded = 0, stamp = 0;
        cs_board_reading r = read_status(run->host, run->slot, UINT64_MAX,
                                         &loaded, &stamp);
        if (r == CS_BOARD_VALID) {
            atomic_fetch_add(&run->valid, 1);
            if (stamp != loaded + 1) {
                atomic_fetch_add(&run->inconsistent, 1);
            }
        }
        else if (r == CS_BOARD_TORN) {
            atomic_fetch_add(&run->torn, 1);
        }
        else if (r != CS_BOARD_NO_READING) {
            atomic_fetch_add(&run->inconsistent, 1);
        }
    }
    return NULL;
}

static void
test_seqlock_threads(void)
{
    cs_board *worker = NULL;
    cs_board *host = make_pair(1, 0, &worker);
    seqlock_run run = {.host = host, .worker = worker, .rounds = 200000};
    run.slot = assign_bound(host, worker, ID("m"), CS_BOARD_VALUE_MAX);
    atomic_init(&run.writers_left, 2);
    /* Two writers (odd and even values) on one slot: the seqlock word
     * must also keep writers apart. */
    writer_arg wa = {&run, 2}, wb = {&run, 3};
    pthread_t a, b, r;
    CHECK(pthread_create(&r, NULL, seqlock_reader, &run) == 0);
    CHECK(pthread_create(&a, NULL, seqlock_writer, &wa) == 0);
    CHECK(pthread_create(&b, NULL, seqlock_writer, &wb) == 0);
    CHECK(pthread_join(a, NULL) == 0);
    CHECK(pthread_join(b, NULL) == 0);
    CHECK(pthread_join(r, NULL) == 0);
    CHECK_EQ(atomic_load(&run.inconsistent), 0);
    uint64_t loaded = 0, stamp = 0;
    CHECK_EQ(read_status(host, run.slot, UINT64_MAX, &loaded, &stamp),
             CS_BOARD_VALID);
    CHECK(loaded == 2 + 2 * (run.rounds - 1) ||
          loaded == 3 + 2 * (run.rounds - 1));
    CHECK_EQ(stamp, loaded + 1);
    fprintf(stderr, "seqlock: %" PRIu64 " valid, %" PRIu64 " torn reads\n",
            atomic_load(&run.valid), atomic_load(&run.torn));
    cs_board_close(worker);
    cs_board_close(host);
}

/* ---- scribbling: the board as untrusted input --------------------- */

typedef struct scribble_run {
    cs_board *worker; /* writes through its mapping */
    _Atomic bool stop;
    uint64_t state;
} scribble_run;

static uint64_t
xorshift(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    return x;
}

static void *
scribbler(void *arg)
{
    scribble_run *run = arg;
    size_t length = 0;
    cs_board_memory(run->worker, &length);
    size_t slot_words = (length - CS_BOARD_HEADER_SIZE) / 8;
    uint64_t header[CS_BOARD_HEADER_SIZE / 8];
    for (size_t i = 0; i < CS_BOARD_HEADER_SIZE / 8; i++) {
        header[i] = atomic_load(word_at(run->worker, i * 8));
    }
    while (!atomic_load(&run->stop)) {
        uint64_t r = xorshift(&run->state);
        /* Half the time a plausible small value, so reads also reach the
         * tag, clamp and stamp checks. */
        uint64_t value = (r >> 40) & 1 ? xorshift(&run->state)
                                       : xorshift(&run->state) & 0xff;
        size_t off;
        switch ((r >> 32) & 7) {
        case 0: /* a header word gets garbage */
            off = (size_t)(r % (CS_BOARD_HEADER_SIZE / 8)) * 8;
            break;
        case 1:
        case 2: /* a header word is put back, so reads get past it */
            off = (size_t)(r % (CS_BOARD_HEADER_SIZE / 8)) * 8;
            value = header[off / 8];
            break;
        default:
            off = CS_BOARD_HEADER_SIZE + (size_t)(r % slot_words) * 8;
            break;
        }
        atomic_store_explicit(word_at(run->worker, off), value,
                              memory_order_relaxed);
    }
    return NULL;
}

static void
test_scribbled_board(void)
{
    cs_board *worker = NULL;
    cs_board *host = make_pair(4, 0, &worker);
    uint32_t slots[4];
    uint64_t sizes[4] = {1, 100, GIB, CS_BOARD_VALUE_MAX};
    for (uint32_t i = 0; i < 4; i++) {
        char id[8] = {'m', (char)('0' + i), 0};
        slots[i] = assign_bound(host, worker, id, 2, sizes[i]);
        CHECK_EQ(cs_board_publish(worker, slots[i], sizes[i] / 2),
                 CS_BOARD_OK);
    }
    /* The worker handle must not run anything while its memory is being
     * scribbled on (its close only touches the owner word). */
    scribble_run run = {.worker = worker, .state = 0x9e3779b97f4a7c15u};
    atomic_init(&run.stop, false);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, scribbler, &run) == 0);
    uint64_t out_of_range = 0, counts[CS_BOARD_READING_COUNT] = {0};
    for (int i = 0; i < 200000; i++) {
        uint32_t k = (uint32_t)i % 4;
        uint64_t loaded = 0, stamp = 0;
        cs_board_reading r = read_status(host, slots[k], sizes[k], &loaded,
                                         &stamp);
        counts[r]++;
        if (r == CS_BOARD_VALID && (loaded > sizes[k] || stamp == 0)) {
            out_of_range++;
        }
    }
    atomic_store(&run.stop, true);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK_EQ(out_of_range, 0);
    fprintf(stderr, "scribble:");
    for (int r = 0; r < CS_BOARD_READING_COUNT; r++) {
        fprintf(stderr, " %s=%" PRIu64, cs_board_reading_name(r), counts[r]);
    }
    fprintf(stderr, "\n");
    cs_board_close(worker);
    cs_board_close(host);
}

/* ---- the sampler thread ------------------------------------------- */

typedef struct sample_source {
    _Atomic uint64_t value;
    _Atomic bool fail;
    int notify; /* write end of a pipe: one byte per call */
} sample_source;

static int
sample(void *context, uint64_t *loaded)
{
    sample_source *src = context;
    *loaded = atomic_load(&src->value);
    char byte = 1;
    ssize_t ignored = write(src->notify, &byte, 1);
    (void)ignored;
    return atomic_load(&src->fail) ? -1 : 0;
}

/* Waits for `n` sampler calls.  The third call after a change starts
 * after the call that saw the change has published. */
static void
wait_calls(int fd, int n)
{
    for (int i = 0; i < n; i++) {
        char byte;
        CHECK(read(fd, &byte, 1) == 1);
    }
}

static void
drain(int fd)
{
    char buf[256];
    while (read(fd, buf, sizeof(buf)) > 0) {
    }
}

static void
test_sampler(void)
{
    cs_board *worker = NULL;
    cs_board *host = make_pair(2, 0, &worker);
    uint32_t slot;
    uint64_t loaded = 0, stamp = 0;
    int fds[2];
    int err;
    CHECK(pipe(fds) == 0);
    /* Non-blocking write end: a full pipe drops notifications rather
     * than stalling the sampler thread. */
    CHECK(fcntl(fds[1], F_SETFL, O_NONBLOCK) == 0);
    sample_source src = {.notify = fds[1]};
    atomic_init(&src.value, 11);
    atomic_init(&src.fail, false);
    slot = assign_bound(host, worker, ID("m"), 100);
    CHECK_EQ(cs_board_set_period(worker, 1000), CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_set_period(worker, 1000000), CS_BOARD_OK);
    CHECK_EQ(cs_board_period(worker), 1000000);
    CHECK_EQ(cs_board_add_sampler(host, slot, sample, &src, &err),
             CS_BOARD_ERR_ROLE);
    CHECK_EQ(cs_board_add_sampler(worker, 2, sample, &src, &err),
             CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_add_sampler(worker, slot, sample, &src, &err),
             CS_BOARD_OK);
    wait_calls(fds[0], 2);
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp), CS_BOARD_VALID);
    CHECK_EQ(loaded, 11);
    CHECK(cs_board_sampler_passes(worker) >= 1);

    atomic_store(&src.value, 250); /* clamps to the host's size */
    CHECK(fcntl(fds[0], F_SETFL, O_NONBLOCK) == 0);
    drain(fds[0]);
    CHECK(fcntl(fds[0], F_SETFL, 0) == 0);
    wait_calls(fds[0], 3);
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp), CS_BOARD_VALID);
    CHECK_EQ(loaded, 100);

    /* A sampler that declines publishes nothing. */
    atomic_store(&src.fail, true);
    atomic_store(&src.value, 5);
    wait_calls(fds[0], 3);
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp), CS_BOARD_VALID);
    CHECK_EQ(loaded, 100);

    /* After removal it never runs again. */
    CHECK_EQ(cs_board_remove_sampler(worker, slot), CS_BOARD_OK);
    CHECK(fcntl(fds[0], F_SETFL, O_NONBLOCK) == 0);
    drain(fds[0]);
    atomic_store(&src.fail, false);
    uint64_t passes = cs_board_sampler_passes(worker);
    while (cs_board_sampler_passes(worker) < passes + 2) {
        sched_yield(); /* the thread keeps beating with no samplers */
    }
    char byte;
    CHECK(read(fds[0], &byte, 1) < 0 && errno == EAGAIN);

    CHECK_EQ(cs_board_add_sampler(worker, slot, sample, &src, &err),
             CS_BOARD_OK);
    cs_board_close(worker); /* joins the thread */
    cs_board_close(host);
    close(fds[0]);
    close(fds[1]);
}

/* ---- worker makes, host adopts ---------------------------------------- */

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

static cs_board *
make_worker(uint32_t slots, int *fd)
{
    cs_board *worker = NULL;
    int err = 0;
    cs_board_status st = cs_board_make(slots, 9, &worker, fd, &err);
    CHECK_EQ(st, CS_BOARD_OK);
    if (worker == NULL) {
        fprintf(stderr, "make failed: %s (errno %d)\n",
                cs_board_status_message(st), err);
        exit(2);
    }
    return worker;
}

static void
test_make_adopt(void)
{
    int fd = -1, err = 0;
    cs_board *worker = make_worker(3, &fd);
    size_t length = CS_BOARD_HEADER_SIZE + 3 * CS_BOARD_SLOT_SIZE;
    CHECK(!cs_board_is_host(worker));
    CHECK_EQ(cs_board_owner_pid(worker), getpid());
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    int seals = fcntl(fd, F_GET_SEALS);
    int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL | F_SEAL_FUTURE_WRITE;
    CHECK((seals & want) == want);
    CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) != 0 && errno == EPERM);

    /* Whoever gets a descriptor of it (here by reopening through /proc, as
     * another process of the same user could) cannot write it: no new
     * writable mapping, no write(), no resize. */
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    int other = open(path, O_RDWR | O_CLOEXEC);
    CHECK(other >= 0);
    void *map = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED,
                     other, 0);
    CHECK(map == MAP_FAILED && errno == EPERM);
    CHECK(pwrite(other, "x", 1, 0) < 0 && errno == EPERM);
    CHECK(ftruncate(other, 0) != 0 && errno == EPERM);
    close(other);

    cs_board *host = NULL;
    CHECK_EQ(cs_board_adopt(fd, 3, 9, 0, &host, &err), CS_BOARD_OK);
    close(fd); /* the host keeps no descriptor: only its mapping */
    CHECK(host != NULL);
    if (host == NULL) {
        cs_board_close(worker);
        return;
    }
    CHECK(cs_board_is_host(host));
    CHECK(cs_board_attached(host));
    CHECK_EQ(cs_board_slot_count(host), 3);
    CHECK_EQ(cs_board_generation(host), 9);
    /* Labelled with the worker's memfd name, as /proc/<pid>/maps shows
     * the host's mapping. */
    CHECK(strcmp(cs_board_name(host), cs_board_name(worker)) == 0);
    cs_board_expect_owner(host, getpid());

    uint64_t loaded = 0, stamp = 0;
    uint32_t slot = assign_bound(host, worker, ID("unet"), 100);
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp),
             CS_BOARD_NO_READING);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t measured = (uint64_t)ts.tv_sec * 1000000000u +
                        (uint64_t)ts.tv_nsec;
    CHECK_EQ(cs_board_publish_at(worker, slot, 64, measured), CS_BOARD_OK);
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp), CS_BOARD_VALID);
    CHECK_EQ(loaded, 64);
    CHECK_EQ(stamp, measured);
    cs_board_close(worker); /* detaches */
    CHECK_EQ(read_status(host, slot, 100, &loaded, &stamp),
             CS_BOARD_NOT_ATTACHED);
    cs_board_close(host);
    cs_board_close(NULL);
}

/* A memfd of `length` bytes whose header is `words` (magic, version,
 * slot size, slot count); `seals` added after the header is written. */
static int
forged(size_t length, const uint64_t words[4], int seals)
{
    int fd = memfd_create("forged", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, (off_t)length) == 0);
    if (length >= 4 * sizeof(uint64_t)) {
        CHECK(pwrite(fd, words, 4 * sizeof(uint64_t), 0) ==
              (ssize_t)(4 * sizeof(uint64_t)));
    }
    if (seals != 0) {
        CHECK(fcntl(fd, F_ADD_SEALS, seals) == 0);
    }
    return fd;
}

/* A forged board whose header says `version` and `slots`. */
static int
forged_board(size_t length, uint64_t version, uint64_t slots, int seals)
{
    uint64_t words[4] = {CS_BOARD_MAGIC, version, CS_BOARD_SLOT_SIZE, slots};
    return forged(length, words, seals);
}

static void
test_adopt_refusals(void)
{
    int all = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL | F_SEAL_FUTURE_WRITE;
    size_t two = CS_BOARD_HEADER_SIZE + 2 * CS_BOARD_SLOT_SIZE;
    cs_board *host = NULL;
    int err = 0;

    /* A forged board of the right shape is adopted (the check is of the
     * descriptor and the layout, not of who wrote it: the peer check is
     * the caller's). */
    int fd = forged_board(two, CS_BOARD_LAYOUT_VERSION, 2, all);
    CHECK_EQ(cs_board_adopt(fd, 2, 0, 0, &host, &err), CS_BOARD_OK);
    /* Its memfd name is not one of ours: the host labels it itself. */
    CHECK(host != NULL && strncmp(cs_board_name(host), "memfd:csb-", 10) ==
                              0 && strlen(cs_board_name(host)) == 34);
    cs_board_close(host);
    host = NULL;
    /* Another slot count than the host's own. */
    CHECK_EQ(cs_board_adopt(fd, 3, 0, 0, &host, &err), CS_BOARD_ERR_SIZE);
    CHECK(host == NULL);
    close(fd);
    /* The header disagrees with the length. */
    fd = forged_board(two, CS_BOARD_LAYOUT_VERSION, 3, all);
    CHECK_EQ(cs_board_adopt(fd, 2, 0, 0, &host, &err), CS_BOARD_ERR_SIZE);
    close(fd);
    fd = forged_board(two, CS_BOARD_LAYOUT_VERSION + 1, 2, all);
    CHECK_EQ(cs_board_adopt(fd, 2, 0, 0, &host, &err),
             CS_BOARD_ERR_VERSION);
    close(fd);
    /* Without the write seal (or any seal), the worker could not be the
     * only writer: refused before mapping. */
    fd = forged_board(two, CS_BOARD_LAYOUT_VERSION, 2,
                      F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    CHECK_EQ(cs_board_adopt(fd, 2, 0, 0, &host, &err), CS_BOARD_ERR_SEALS);
    close(fd);
    fd = forged_board(two, CS_BOARD_LAYOUT_VERSION, 2, 0);
    CHECK_EQ(cs_board_adopt(fd, 2, 0, 0, &host, &err), CS_BOARD_ERR_SEALS);
    close(fd);
    /* Not a board, or of another slot size; too short to be a board. */
    uint64_t zeros[4] = {0, 0, 0, 0};
    fd = forged(two, zeros, all);
    CHECK_EQ(cs_board_adopt(fd, 2, 0, 0, &host, &err), CS_BOARD_ERR_MAGIC);
    close(fd);
    uint64_t wide[4] = {CS_BOARD_MAGIC, CS_BOARD_LAYOUT_VERSION, 32, 2};
    fd = forged(two, wide, all);
    CHECK_EQ(cs_board_adopt(fd, 2, 0, 0, &host, &err), CS_BOARD_ERR_SIZE);
    close(fd);
    fd = forged(16, zeros, all);
    CHECK_EQ(cs_board_adopt(fd, 2, 0, 0, &host, &err), CS_BOARD_ERR_SIZE);
    close(fd);
    /* Not a file at all, and no descriptor. */
    int pipe_fds[2];
    CHECK(pipe(pipe_fds) == 0);
    CHECK_EQ(cs_board_adopt(pipe_fds[0], 2, 0, 0, &host, &err),
             CS_BOARD_ERR_SIZE);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    CHECK_EQ(cs_board_adopt(-1, 2, 0, 0, &host, &err), CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_adopt(0, 0, 0, 0, &host, &err), CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_adopt(0, 2, 0, 1, &host, &err), CS_BOARD_ERR_RANGE);
    CHECK_EQ(cs_board_adopt(999999, 2, 0, 0, &host, &err),
             CS_BOARD_ERR_SYSTEM);
    CHECK_EQ(err, EBADF);
    CHECK(host == NULL);
    CHECK_EQ(cs_board_layout_version(), CS_BOARD_LAYOUT_VERSION);
}

/* ---- the owner's pidfd under concurrent calls ------------------------ */

typedef struct race {
    cs_board *host;
    pid_t child;
    atomic_bool stop;
} race;

static void *
race_expect(void *arg)
{
    race *r = arg;
    while (!atomic_load(&r->stop)) {
        cs_board_expect_owner(r->host, r->child); /* closes the old pidfd */
    }
    return NULL;
}

static void *
race_reuse(void *arg)
{
    /* Fills freed descriptor numbers with readable pipes: a poll on a
     * number the pidfd once had would see "readable" and take the owner
     * for dead. */
    race *r = arg;
    while (!atomic_load(&r->stop)) {
        int fds[2];
        if (pipe(fds) == 0) {
            (void)!write(fds[1], "x", 1);
            sched_yield();
            close(fds[0]);
            close(fds[1]);
        }
    }
    return NULL;
}

static void
test_owner_poll_race(void)
{
    cs_board *worker = NULL;
    cs_board *host = make_pair(1, 0, &worker);
    fflush(NULL);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        pause();
        _exit(0);
    }
    race r = {.host = host, .child = child};
    atomic_init(&r.stop, false);
    pthread_t expecter, reuser;
    CHECK(pthread_create(&expecter, NULL, race_expect, &r) == 0);
    CHECK(pthread_create(&reuser, NULL, race_reuse, &r) == 0);
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    do {
        (void)cs_board_poll_owner(host);
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while (!cs_board_owner_is_gone(host) &&
             now.tv_sec - start.tv_sec < 2);
    atomic_store(&r.stop, true);
    pthread_join(expecter, NULL);
    pthread_join(reuser, NULL);
    /* The child lives: nothing may have called it gone. */
    CHECK(!cs_board_owner_is_gone(host));
    kill(child, SIGKILL);
    int wstatus = 0;
    CHECK(waitpid(child, &wstatus, 0) == child);
    CHECK(cs_board_poll_owner(host)); /* now it is */
    cs_board_close(worker);
    cs_board_close(host);
}

int
main(void)
{
    test_make_layout();
    test_assign_publish_read();
    test_untrusted_header();
    test_heartbeat_limit();
    test_dead_owner();
    test_fork();
    test_seqlock_threads();
    test_scribbled_board();
    test_sampler();
    test_make_adopt();
    test_adopt_refusals();
    test_owner_poll_race();
    printf("%d checks, %d failures\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
