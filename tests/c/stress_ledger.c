/*
 * stress_ledger.c -- many threads on one ledger at once, for
 * ThreadSanitizer (meson setup -Db_sanitize=thread -Dtests=true; meson
 * test stress_ledger) and for the plain build.
 *
 * THREADS threads share WORKERS workers whose models have ids from a small
 * set, and each runs ROUNDS random operations: register and release
 * handles (so models enter and leave tables while others look them up),
 * echoes, per-worker and per-model censuses, reports, readings, calls in
 * flight, charges, reserves, reads, peak raises, lookups, deaths and
 * restarts of a worker, and forgetting a worker while others still hold it
 * (a new one takes its place).  Every read checks what holds whatever the
 * interleaving: a receipt never above its size, stale reads 0, a charge's
 * figures consistent.  Under TSan any data race fails the run (TSan's exit
 * code); here a failed check counts and fails it.
 */
#include "comfy_standin/ledger.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    THREADS = 8,
    WORKERS = 3,
    IDS = 6,
    HANDLES = 8, /* per thread */
    ROUNDS = 100000,
};

static cs_ledger *ledger;
/* The current worker in each place; swapped under `places_lock` when one
 * is forgotten.  A thread takes its own reference before using one. */
static cs_worker *places[WORKERS];
static pthread_mutex_t places_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int start;
static _Atomic long failures;
static _Atomic long operations;

#define CHECK(cond)                                                       \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__,    \
                    #cond);                                               \
            atomic_fetch_add(&failures, 1);                               \
        }                                                                 \
    } while (0)

static uint64_t
next(uint64_t *state)
{
    /* xorshift64 */
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    return x;
}

static cs_worker *
take_worker(unsigned place)
{
    pthread_mutex_lock(&places_lock);
    cs_worker *w = places[place];
    cs_worker_incref(w);
    pthread_mutex_unlock(&places_lock);
    return w;
}

static void
forget_place(unsigned place)
{
    cs_worker *fresh = cs_ledger_add_worker(ledger, 1);
    CHECK(fresh != NULL);
    pthread_mutex_lock(&places_lock);
    cs_worker *old = places[place];
    places[place] = fresh;
    pthread_mutex_unlock(&places_lock);
    cs_ledger_forget_worker(ledger, old);
    cs_worker_decref(old);
}

static const char *const ids[IDS] = {"a", "bb", "ccc", "d", "ee", "fff"};

static uint64_t
size_of(unsigned id)
{
    return ((uint64_t)id + 1) << 20;
}

static void
check_model(const cs_model *m)
{
    cs_receipt r;
    cs_model_read(m, &r);
    CHECK(r.loaded <= cs_model_size(m));
    CHECK((unsigned)r.source < CS_SOURCE_COUNT);
    CHECK(cs_model_admission_peak(m) <= cs_model_size(m));
    (void)cs_model_eviction_deferred(m);
    (void)cs_model_version(m);
    (void)cs_model_stale(m);
}

static void
check_charge(cs_worker *w)
{
    cs_charge c;
    cs_worker_charge(w, CS_DEFAULT_FLOOR, NULL, 0, &c);
    if (!c.alive) {
        CHECK(c.charge == 0);
        return;
    }
    CHECK(c.sum_loaded <= c.sum_sizes);
    CHECK(c.sum_peak <= c.sum_sizes);
    CHECK(c.charge >= CS_DEFAULT_FLOOR);
    CHECK(c.models <= IDS);
}

typedef struct {
    cs_model *model;
    unsigned id;
} held;

static void *
thread_main(void *p)
{
    uint64_t rng = 0x9E3779B97F4A7C15ull * ((uintptr_t)p + 1);
    held handles[HANDLES];
    memset(handles, 0, sizeof(handles));
    int64_t seq = 0;

    while (!atomic_load_explicit(&start, memory_order_acquire)) {
    }
    for (int round = 0; round < ROUNDS; round++) {
        uint64_t x = next(&rng);
        unsigned place = (unsigned)(x >> 8) % WORKERS;
        unsigned id = (unsigned)(x >> 16) % IDS;
        unsigned slot = (unsigned)(x >> 24) % HANDLES;
        cs_model *m = handles[slot].model;
        seq++;
        switch ((x >> 32) % 16) {
        case 0:
        case 1: { /* register (or take another handle) */
            if (m != NULL) {
                cs_model_release_handle(m);
                handles[slot].model = NULL;
            }
            cs_worker *w = take_worker(place);
            cs_model *out = NULL;
            cs_status st = cs_worker_register_model(
                w, cs_worker_generation(w), ids[id], strlen(ids[id]),
                size_of(id), &out);
            CHECK(st == CS_OK);
            if (st == CS_OK) {
                handles[slot].model = out;
                handles[slot].id = id;
            }
            cs_worker_decref(w);
            break;
        }
        case 2: /* release */
            if (m != NULL) {
                cs_model_release_handle(m);
                handles[slot].model = NULL;
            }
            break;
        case 3:
        case 4: /* an echo */
            if (m != NULL) {
                uint64_t loaded = (x >> 40) % (cs_model_size(m) + 1);
                cs_status st = cs_model_apply_echo(
                    m, loaded, (x & 1) ? seq : CS_SEQ_NONE,
                    (x & 2) ? CS_SOURCE_LOAD_ECHO : CS_SOURCE_UNLOAD_ECHO,
                    (x & 4) != 0, -1);
                CHECK(st == CS_OK || st == CS_ERR_STALE ||
                      st == CS_ERR_OLDER);
            }
            break;
        case 5:
        case 6: { /* a worker's census, ids it may or may not know */
            cs_census_entry entries[3];
            size_t n = (size_t)(x >> 44) % 4;
            for (size_t i = 0; i < n; i++) {
                unsigned e = (id + (unsigned)i * 2) % IDS;
                entries[i] = (cs_census_entry){
                    ids[e], strlen(ids[e]), (x >> (50 + i)) & 1, seq,
                    ((x >> 20) + i) % (size_of(e) * 2)};
            }
            cs_worker *w = take_worker(place);
            size_t applied, bad;
            cs_status st = cs_worker_apply_census(w, entries, n, &applied,
                                                  &bad);
            CHECK(st == CS_OK || st == CS_ERR_UNKNOWN_ID ||
                  st == CS_ERR_DUPLICATE_ID);
            CHECK(applied <= n);
            cs_worker_decref(w);
            break;
        }
        case 7: /* one model's census */
            if (m != NULL) {
                bool applied;
                CHECK(cs_model_apply_census(m, (x & 1) != 0, seq,
                                            (x >> 30) % (1u << 22),
                                            &applied) == CS_OK);
            }
            break;
        case 8: { /* a report, a reading, a call in flight */
            cs_worker *w = take_worker(place);
            uint64_t held_bytes = (x >> 20) % (64u << 20);
            CHECK(cs_worker_set_report(w, &held_bytes, NULL, NULL) ==
                  CS_OK);
            CHECK(cs_worker_set_reading(w, (x >> 30) % (64u << 20)) ==
                  CS_OK);
            cs_worker_begin_call(w);
            check_charge(w);
            (void)cs_worker_end_call(w); /* a death may have cleared it */
            cs_worker_decref(w);
            break;
        }
        case 9:
        case 10: { /* charges and the reserve */
            cs_worker *w = take_worker(place);
            check_charge(w);
            cs_worker_decref(w);
            uint64_t base = 1u << 20;
            uint64_t total = (x & 1) ? 0 : (uint64_t)8 << 30;
            uint64_t v = cs_ledger_reserve(ledger, base, total, true, NULL, 0);
            CHECK(v >= base);
            if (total > 0) {
                CHECK(v <= total / 4 * 3);
            }
            (void)cs_ledger_total_charge(ledger, NULL, 0);
            (void)cs_ledger_worker_count(ledger);
            break;
        }
        case 11: /* reads and peaks */
            for (int i = 0; i < HANDLES; i++) {
                if (handles[i].model != NULL) {
                    check_model(handles[i].model);
                }
            }
            if (m != NULL) {
                cs_status st = cs_model_raise_peak(m, x >> 40);
                CHECK(st == CS_OK || st == CS_ERR_STALE);
                cs_model_set_eviction_deferred(m, (x & 1) != 0);
            }
            break;
        case 12: { /* a lookup */
            cs_worker *w = take_worker(place);
            cs_model *found =
                cs_worker_find_model(w, ids[id], strlen(ids[id]));
            if (found != NULL) {
                check_model(found);
                CHECK(cs_model_size(found) == size_of(id));
                cs_model_decref(found);
            }
            cs_worker_decref(w);
            break;
        }
        case 13: { /* a death or a restart, rarely */
            if ((x >> 40) % 16 != 0) {
                break;
            }
            cs_worker *w = take_worker(place);
            if (x & 1) {
                cs_worker_gone(w);
            }
            else {
                cs_status st = cs_worker_bump_generation(
                    w, cs_worker_generation(w) + 1);
                /* Another thread may have bumped to the same number. */
                CHECK(st == CS_OK || st == CS_ERR_STATE);
            }
            cs_worker_decref(w);
            break;
        }
        case 14: /* forget a worker while others hold it, rarely */
            if ((x >> 40) % 64 == 0) {
                forget_place(place);
            }
            break;
        default:
            if (m != NULL) {
                check_model(m);
                size_t len;
                const char *got = cs_model_id(m, &len);
                CHECK(len == strlen(ids[handles[slot].id]) &&
                      memcmp(got, ids[handles[slot].id], len) == 0);
                (void)cs_model_worker(m);
                (void)cs_model_generation(m);
            }
            break;
        }
        atomic_fetch_add_explicit(&operations, 1, memory_order_relaxed);
    }
    for (int i = 0; i < HANDLES; i++) {
        if (handles[i].model != NULL) {
            cs_model_release_handle(handles[i].model);
        }
    }
    return NULL;
}

int
main(void)
{
    pthread_t threads[THREADS];
    ledger = cs_ledger_new(CS_DEFAULT_FLOOR);
    CHECK(ledger != NULL);
    for (int i = 0; i < WORKERS; i++) {
        places[i] = cs_ledger_add_worker(ledger, 1);
        CHECK(places[i] != NULL);
    }
    for (uintptr_t i = 0; i < THREADS; i++) {
        CHECK(pthread_create(&threads[i], NULL, thread_main, (void *)i) ==
              0);
    }
    atomic_store_explicit(&start, 1, memory_order_release);
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
    }
    for (int i = 0; i < WORKERS; i++) {
        cs_worker_decref(places[i]);
    }
    cs_ledger_free(ledger);
    int64_t workers = -1, models = -1;
    cs_ledger_live_counts(&workers, &models);
    CHECK(workers == 0 && models == 0);
    printf("stress_ledger: %d threads, %ld operations, %ld failed checks\n",
           THREADS, atomic_load(&operations), atomic_load(&failures));
    return atomic_load(&failures) == 0 ? 0 : 1;
}
