/*
 * test_ledger.c -- C unit tests of the residency ledger core.
 *
 * Built and run by tests/test_core_c.py (and by `meson test` with
 * -Dtests=true).  Exit status 0 only when every check held; each failed
 * check prints its line.
 */
#include "comfy_standin/ledger.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
static int checks;

#define CHECK(cond)                                                          \
    do {                                                                     \
        checks++;                                                            \
        if (!(cond)) {                                                       \
            failures++;                                                      \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__,           \
                    __LINE__, #cond);                                        \
        }                                                                    \
    } while (0)

#define MiB ((uint64_t)1 << 20)

static cs_model *
reg(cs_worker *w, uint64_t gen, const char *id, uint64_t size)
{
    cs_model *m = NULL;
    cs_status st = cs_worker_register_model(w, gen, id, strlen(id), size, &m);
    CHECK(st == CS_OK);
    return m;
}

static cs_census_entry
entry(const char *id, int64_t seq, uint64_t resident)
{
    cs_census_entry e = {id, strlen(id), seq >= 0, seq, resident};
    return e;
}

static void
test_register_and_read(void)
{
    cs_ledger *l = cs_ledger_new(CS_DEFAULT_FLOOR);
    cs_worker *w = cs_ledger_add_worker(l, 1);
    cs_model *a = reg(w, 1, "unet-0", 100);
    cs_receipt r;

    cs_model_read(a, &r);
    CHECK(r.loaded == 0);
    CHECK(r.seq == CS_SEQ_NONE);
    CHECK(r.source == CS_SOURCE_REGISTERED);
    CHECK(strcmp(cs_source_name(r.source), "registered") == 0);
    CHECK(cs_model_size(a) == 100);
    CHECK(!cs_model_stale(a));

    /* Same id, same size: one shared record. */
    cs_model *again = reg(w, 1, "unet-0", 100);
    CHECK(again == a);
    /* Same id, other size: refused. */
    cs_model *other = NULL;
    CHECK(cs_worker_register_model(w, 1, "unet-0", 6, 99, &other) ==
          CS_ERR_SIZE_MISMATCH);
    CHECK(other == NULL);
    /* Out of range. */
    CHECK(cs_worker_register_model(w, 1, "x", 1, CS_VALUE_MAX + 1, &other) ==
          CS_ERR_RANGE);
    /* An id longer than a record carries is out of range too (not out of
     * memory), refused before a byte of it is read. */
    CHECK(cs_worker_register_model(w, 1, "x", (size_t)UINT32_MAX, 1,
                                   &other) == CS_ERR_RANGE);
    CHECK(other == NULL);

    cs_model *found = cs_worker_find_model(w, "unet-0", 6);
    CHECK(found == a);
    cs_model_decref(found);
    CHECK(cs_worker_find_model(w, "nope", 4) == NULL);

    /* Last handle out takes the model off the table. */
    cs_model_release_handle(again);
    found = cs_worker_find_model(w, "unet-0", 6);
    CHECK(found == a);
    cs_model_decref(found);
    cs_model_release_handle(a);
    CHECK(cs_worker_find_model(w, "unet-0", 6) == NULL);

    cs_worker_decref(w);
    cs_ledger_free(l);
}

static void
test_echo(void)
{
    cs_ledger *l = cs_ledger_new(0);
    cs_worker *w = cs_ledger_add_worker(l, 1);
    cs_model *a = reg(w, 1, "a", 1000);
    cs_receipt r;

    CHECK(cs_model_apply_echo(a, 600, 5, CS_SOURCE_LOAD_ECHO, false, 0) ==
          CS_OK);
    cs_model_read(a, &r);
    CHECK(r.loaded == 600 && r.seq == 5 && r.source == CS_SOURCE_LOAD_ECHO);
    CHECK(cs_model_admission_peak(a) == 600);

    /* An echo older than the receipt (two replies applied out of order)
     * writes nothing; a tie writes. */
    uint64_t before = cs_model_version(a);
    CHECK(cs_model_apply_echo(a, 500, 3, CS_SOURCE_UNLOAD_ECHO, false, 0) ==
          CS_ERR_OLDER);
    cs_model_read(a, &r);
    CHECK(r.loaded == 600 && r.seq == 5 && cs_model_version(a) == before);
    CHECK(cs_model_admission_peak(a) == 600);
    CHECK(cs_model_apply_echo(a, 550, 5, CS_SOURCE_UNLOAD_ECHO, false, 0) ==
          CS_OK);
    CHECK(cs_model_apply_echo(a, 500, 5, CS_SOURCE_UNLOAD_ECHO, false, 0) ==
          CS_OK);
    /* No seq (an older worker) keeps the receipt's seq, and writes. */
    CHECK(cs_model_apply_echo(a, 400, CS_SEQ_NONE, CS_SOURCE_UNLOAD_ECHO,
                              false, 0) == CS_OK);
    cs_model_read(a, &r);
    CHECK(r.loaded == 400 && r.seq == 5);
    /* Beyond the size: a bad reply, nothing written. */
    CHECK(cs_model_apply_echo(a, 1001, 9, CS_SOURCE_LOAD_ECHO, false, 0) ==
          CS_ERR_RANGE);
    CHECK(cs_model_apply_echo(a, 10, -7, CS_SOURCE_LOAD_ECHO, false, 0) ==
          CS_ERR_RANGE);
    cs_model_read(a, &r);
    CHECK(r.loaded == 400 && r.seq == 5);

    /* Peak: rises only in flight, drops to resident when idle. */
    CHECK(cs_model_apply_echo(a, 900, 10, CS_SOURCE_LOAD_ECHO, false, 1) ==
          CS_OK);
    CHECK(cs_model_admission_peak(a) == 900);
    CHECK(cs_model_apply_echo(a, 200, 11, CS_SOURCE_UNLOAD_ECHO, false, 1) ==
          CS_OK);
    CHECK(cs_model_admission_peak(a) == 900);
    CHECK(cs_model_apply_echo(a, 300, 12, CS_SOURCE_LOAD_ECHO, false, 0) ==
          CS_OK);
    CHECK(cs_model_admission_peak(a) == 300);
    /* in_flight < 0 asks the worker. */
    cs_worker_begin_call(w);
    CHECK(cs_model_apply_echo(a, 800, 13, CS_SOURCE_LOAD_ECHO, false, -1) ==
          CS_OK);
    CHECK(cs_model_apply_echo(a, 100, 14, CS_SOURCE_UNLOAD_ECHO, false, -1) ==
          CS_OK);
    CHECK(cs_model_admission_peak(a) == 800);
    /* Unmapped zeroes the peak even in flight. */
    CHECK(cs_model_apply_echo(a, 0, 15, CS_SOURCE_DETACH_ECHO, true, -1) ==
          CS_OK);
    CHECK(cs_model_admission_peak(a) == 0);
    CHECK(cs_worker_end_call(w) == CS_OK);
    CHECK(cs_worker_end_call(w) == CS_ERR_STATE);
    CHECK(cs_worker_in_flight(w) == 0);

    /* Peak-only raise: never lowers, clamps to the size, no receipt. */
    uint64_t writes = cs_model_version(a);
    CHECK(cs_model_raise_peak(a, 700) == CS_OK);
    CHECK(cs_model_admission_peak(a) == 700);
    CHECK(cs_model_raise_peak(a, 100) == CS_OK);
    CHECK(cs_model_admission_peak(a) == 700);
    CHECK(cs_model_raise_peak(a, 99999) == CS_OK);
    CHECK(cs_model_admission_peak(a) == 1000);
    CHECK(cs_model_version(a) == writes);
    CHECK(cs_model_apply_echo(a, 0, 15, CS_SOURCE_DETACH_ECHO, true, 0) ==
          CS_OK);

    /* Deferred flag: set by a binding, cleared by the next echo. */
    cs_model_set_eviction_deferred(a, true);
    CHECK(cs_model_eviction_deferred(a));
    CHECK(cs_model_apply_echo(a, 0, 16, CS_SOURCE_DETACH_ECHO, true, 0) ==
          CS_OK);
    CHECK(!cs_model_eviction_deferred(a));

    cs_model_release_handle(a);
    cs_worker_decref(w);
    cs_ledger_free(l);
}

static void
test_census(void)
{
    cs_ledger *l = cs_ledger_new(0);
    cs_worker *w = cs_ledger_add_worker(l, 1);
    cs_model *a = reg(w, 1, "a", 1000);
    cs_model *b = reg(w, 1, "b", 500);
    cs_model *c = reg(w, 1, "c", 300);
    cs_receipt r;
    size_t applied = 99, bad = 99;

    CHECK(cs_model_apply_echo(a, 100, 10, CS_SOURCE_LOAD_ECHO, false, 0) ==
          CS_OK);
    CHECK(cs_model_apply_echo(c, 300, 1, CS_SOURCE_LOAD_ECHO, false, 0) ==
          CS_OK);

    /* Older seq dropped; tie applies; clamp; c missing keeps its receipt. */
    cs_census_entry good[] = {entry("a", 9, 700), entry("b", 0, 9999)};
    CHECK(cs_worker_apply_census(w, good, 2, &applied, &bad) == CS_OK);
    CHECK(applied == 1);
    cs_model_read(a, &r);
    CHECK(r.loaded == 100 && r.seq == 10);
    cs_model_read(b, &r);
    CHECK(r.loaded == 500 && r.seq == 0 && r.source == CS_SOURCE_CENSUS);
    cs_model_read(c, &r);
    CHECK(r.loaded == 300 && r.seq == 1);

    cs_census_entry tie[] = {entry("a", 10, 50)};
    CHECK(cs_worker_apply_census(w, tie, 1, &applied, &bad) == CS_OK);
    cs_model_read(a, &r);
    CHECK(applied == 1 && r.loaded == 50 && r.source == CS_SOURCE_CENSUS);

    /* No seq (an old worker): applies, keeps the receipt's seq. */
    cs_census_entry noseq[] = {entry("a", -1, 60)};
    CHECK(cs_worker_apply_census(w, noseq, 1, &applied, &bad) == CS_OK);
    cs_model_read(a, &r);
    CHECK(r.loaded == 60 && r.seq == 10);

    /* All or nothing: an error at any position changes nothing. */
    cs_census_entry unknown[] = {entry("a", 20, 1), entry("zzz", 1, 1)};
    CHECK(cs_worker_apply_census(w, unknown, 2, &applied, &bad) ==
          CS_ERR_UNKNOWN_ID);
    CHECK(bad == 1 && applied == 0);
    cs_census_entry dup[] = {entry("b", 20, 1), entry("a", 20, 1),
                             entry("b", 21, 2)};
    CHECK(cs_worker_apply_census(w, dup, 3, &applied, &bad) ==
          CS_ERR_DUPLICATE_ID);
    CHECK(bad == 2);
    cs_census_entry range[] = {entry("a", 20, CS_VALUE_MAX + 1)};
    CHECK(cs_worker_apply_census(w, range, 1, &applied, &bad) ==
          CS_ERR_RANGE);
    cs_census_entry negseq[] = {{"a", 1, true, -5, 1}};
    CHECK(cs_worker_apply_census(w, negseq, 1, &applied, &bad) ==
          CS_ERR_RANGE);
    cs_model_read(a, &r);
    CHECK(r.loaded == 60 && r.seq == 10);
    cs_model_read(b, &r);
    CHECK(r.loaded == 500 && r.seq == 0);

    /* Gone: reads 0, census validated but not applied, echoes refused. */
    cs_worker_gone(w);
    cs_model_read(b, &r);
    CHECK(r.loaded == 0 && r.source == CS_SOURCE_WORKER_GONE && r.seq == 0);
    CHECK(cs_model_stale(b));
    cs_census_entry after[] = {entry("b", 30, 400)};
    CHECK(cs_worker_apply_census(w, after, 1, &applied, &bad) == CS_OK);
    CHECK(applied == 0);
    CHECK(cs_model_loaded(b) == 0);
    CHECK(cs_model_apply_echo(b, 10, 31, CS_SOURCE_LOAD_ECHO, false, 0) ==
          CS_ERR_STALE);
    cs_census_entry unknown2[] = {entry("q", 1, 1)};
    CHECK(cs_worker_apply_census(w, unknown2, 1, &applied, &bad) ==
          CS_ERR_UNKNOWN_ID);
    /* Registered after the worker died: known by id, stale, reading 0,
     * its receipt still "registered". */
    cs_model *late = reg(w, 1, "q", 10);
    cs_model_read(late, &r);
    CHECK(cs_model_stale(late) && r.loaded == 0 &&
          r.source == CS_SOURCE_REGISTERED);
    CHECK(cs_worker_apply_census(w, unknown2, 1, &applied, &bad) == CS_OK);
    CHECK(applied == 0);
    cs_model_release_handle(late);

    cs_model_release_handle(a);
    cs_model_release_handle(b);
    cs_model_release_handle(c);
    cs_worker_decref(w);
    cs_ledger_free(l);
}

static void
test_generations(void)
{
    cs_ledger *l = cs_ledger_new(0);
    cs_worker *w = cs_ledger_add_worker(l, 1);
    cs_model *a = reg(w, 1, "a", 1000);
    cs_receipt r;

    CHECK(cs_model_apply_echo(a, 700, 4, CS_SOURCE_LOAD_ECHO, false, 0) ==
          CS_OK);
    CHECK(cs_worker_bump_generation(w, 1) == CS_ERR_STATE);
    CHECK(cs_worker_bump_generation(w, 2) == CS_OK);
    CHECK(cs_worker_generation(w) == 2);
    CHECK(cs_worker_alive(w));
    cs_model_read(a, &r);
    CHECK(r.loaded == 0 && r.source == CS_SOURCE_WORKER_GONE);
    CHECK(cs_model_stale(a));
    /* The new generation's "a" is a different record. */
    cs_model *a2 = reg(w, 2, "a", 1000);
    CHECK(a2 != a);
    CHECK(!cs_model_stale(a2));
    /* An old-generation registration is stale from birth. */
    cs_model *old = reg(w, 1, "old", 10);
    CHECK(cs_model_stale(old));
    CHECK(cs_model_loaded(old) == 0);
    /* A newer-generation registration bumps the worker. */
    cs_model *a3 = reg(w, 3, "a", 1000);
    CHECK(cs_worker_generation(w) == 3);
    CHECK(cs_model_stale(a2));
    CHECK(!cs_model_stale(a3));

    cs_model_release_handle(a);
    cs_model_release_handle(a2);
    cs_model_release_handle(a3);
    cs_model_release_handle(old);
    cs_worker_decref(w);
    cs_ledger_free(l);
}

/* The reserve with every figure its receipt. */
static uint64_t
reserve(cs_ledger *l, uint64_t base, uint64_t total, bool process_local)
{
    return cs_ledger_reserve(l, base, total, process_local, NULL, 0);
}

static void
test_charges_and_reserve(void)
{
    cs_ledger *l = cs_ledger_new(300 * MiB);
    cs_worker *w = cs_ledger_add_worker(l, 1);
    cs_model *a = reg(w, 1, "a", 4000 * MiB);
    cs_model *b = reg(w, 1, "b", 2000 * MiB);
    cs_charge c;

    cs_worker_charge(w, cs_ledger_floor(l), NULL, 0, &c);
    CHECK(c.alive && c.models == 2 && c.charge == 300 * MiB);
    CHECK(cs_model_apply_echo(a, 1000 * MiB, 1, CS_SOURCE_LOAD_ECHO, false,
                              0) == CS_OK);
    uint64_t held = 1500 * MiB;
    CHECK(cs_worker_set_report(w, &held, NULL, NULL) == CS_OK);
    cs_worker_charge(w, cs_ledger_floor(l), NULL, 0, &c);
    CHECK(c.charge == 1800 * MiB); /* held wins, plus the floor */
    CHECK(!c.held_from_reading);
    /* The driver's reading counts the context, which the floor is. */
    CHECK(cs_worker_set_reading(w, 1700 * MiB) == CS_OK);
    cs_worker_charge(w, cs_ledger_floor(l), NULL, 0, &c);
    CHECK(c.charge == 1800 * MiB && !c.held_from_reading);
    CHECK(cs_worker_set_reading(w, 1900 * MiB) == CS_OK);
    cs_worker_charge(w, cs_ledger_floor(l), NULL, 0, &c);
    CHECK(c.charge == 1900 * MiB && c.held_from_reading);
    CHECK(cs_worker_begin_call(w) == CS_OK);
    cs_worker_charge(w, cs_ledger_floor(l), NULL, 0, &c);
    CHECK(c.charge == 6300 * MiB); /* the supremum */
    CHECK(cs_worker_end_call(w) == CS_OK);

    /* Linux: the reserve is the base. */
    CHECK(reserve(l, 400 * MiB, 24000 * MiB, false) == 400 * MiB);
    /* Windows: base + charges, grow at once. */
    uint64_t first = reserve(l, 400 * MiB, 24000 * MiB, true);
    CHECK(first == 2300 * MiB);
    /* Charges fall without a release receipt (the reading drops is a
     * release, so use an echo rising then check the ratchet). */
    CHECK(reserve(l, 400 * MiB, 24000 * MiB, true) == first);
    /* A release lets it shrink. */
    uint64_t zero = 0;
    CHECK(cs_worker_set_reading(w, 0) == CS_OK);
    CHECK(cs_worker_set_report(w, &zero, NULL, NULL) == CS_OK);
    uint64_t after = reserve(l, 400 * MiB, 24000 * MiB, true);
    CHECK(after == 1700 * MiB);
    /* Cap at 75% of the card. */
    CHECK(cs_worker_begin_call(w) == CS_OK);
    CHECK(reserve(l, 400 * MiB, 8000 * MiB, true) == 6000 * MiB);
    /* Without a release it never shrinks, even if the cap is lower. */
    CHECK(cs_worker_end_call(w) == CS_OK);
    CHECK(reserve(l, 400 * MiB, 8000 * MiB, true) == 6000 * MiB);
    /* Gone: charges nothing and counts as a release. */
    cs_worker_gone(w);
    cs_worker_charge(w, cs_ledger_floor(l), NULL, 0, &c);
    CHECK(!c.alive && c.charge == 0);
    CHECK(reserve(l, 400 * MiB, 8000 * MiB, true) == 400 * MiB);
    CHECK(cs_ledger_total_charge(l, NULL, 0) == 0);
    /* Never below the base, even past the cap. */
    CHECK(reserve(l, 7000 * MiB, 8000 * MiB, true) == 7000 * MiB);

    CHECK(cs_ledger_worker_count(l) == 1);
    cs_ledger_forget_worker(l, w);
    CHECK(cs_ledger_worker_count(l) == 0);
    cs_model_release_handle(a);
    cs_model_release_handle(b);
    cs_worker_decref(w);
    cs_ledger_free(l);
}

static void
test_many_models(void)
{
    /* Enough ids to grow the table several times, with removals between
     * (tombstones) so the rehash paths run. */
    enum { N = 2000 };
    cs_ledger *l = cs_ledger_new(0);
    cs_worker *w = cs_ledger_add_worker(l, 7);
    static cs_model *models[N];
    char id[32];

    for (int i = 0; i < N; i++) {
        snprintf(id, sizeof(id), "model-%d", i);
        models[i] = reg(w, 7, id, (uint64_t)i + 1);
        if (i % 3 == 0) {
            cs_model_release_handle(models[i]);
            models[i] = NULL;
        }
    }
    int present = 0;
    for (int i = 0; i < N; i++) {
        snprintf(id, sizeof(id), "model-%d", i);
        cs_model *m = cs_worker_find_model(w, id, strlen(id));
        CHECK((m != NULL) == (models[i] != NULL));
        if (m != NULL) {
            CHECK(m == models[i] && cs_model_size(m) == (uint64_t)i + 1);
            present++;
            cs_model_decref(m);
        }
    }
    CHECK(present == N - (N + 2) / 3);
    for (int i = 0; i < N; i++) {
        if (models[i] != NULL) {
            cs_model_release_handle(models[i]);
        }
    }
    cs_worker_decref(w);
    cs_ledger_free(l);
}

static void
test_a_full_small_table(void)
{
    /* Eight models fill a worker's first table: an absent id is found
     * absent (the probe stops), a census naming one is refused, and a
     * ninth model grows the table. */
    cs_ledger *l = cs_ledger_new(0);
    cs_worker *w = cs_ledger_add_worker(l, 1);
    cs_model *models[9];
    char id[32];
    for (int i = 0; i < 8; i++) {
        snprintf(id, sizeof(id), "m%d", i);
        models[i] = reg(w, 1, id, 10);
    }
    CHECK(cs_worker_find_model(w, "absent", 6) == NULL);
    cs_census_entry entry = {"absent", 6, false, 0, 1};
    size_t bad = 99;
    CHECK(cs_worker_apply_census(w, &entry, 1, NULL, &bad) ==
          CS_ERR_UNKNOWN_ID);
    CHECK(bad == 0);
    models[8] = reg(w, 1, "m8", 10);
    for (int i = 0; i < 9; i++) {
        snprintf(id, sizeof(id), "m%d", i);
        cs_model *m = cs_worker_find_model(w, id, strlen(id));
        CHECK(m == models[i]);
        cs_model_decref(m);
        cs_model_release_handle(models[i]);
    }
    cs_worker_decref(w);
    cs_ledger_free(l);
}

/* ---- threads: no torn pairs, seq never backwards, bounds hold -------- */

enum { WRITERS = 3, READERS = 3, ROUNDS = 20000 };

typedef struct {
    cs_worker *worker;
    cs_model *model;
    uint64_t size;
    int index;
    _Atomic int *start;
    _Atomic int *writers_left;
    int errors;
} thread_arg;

static void
wait_start(_Atomic int *start)
{
    while (!atomic_load_explicit(start, memory_order_acquire)) {
    }
}

/* Every write satisfies loaded == (seq * 7919) % (size + 1): a reader that
 * sees a pair breaking that saw a torn receipt. */
static uint64_t
loaded_for(int64_t seq, uint64_t size)
{
    return ((uint64_t)seq * 7919u) % (size + 1);
}

static void *
writer_main(void *p)
{
    thread_arg *a = p;
    wait_start(a->start);
    for (int i = 0; i < ROUNDS; i++) {
        int64_t seq = (int64_t)i * WRITERS + a->index + 1;
        uint64_t loaded = loaded_for(seq, a->size);
        if (i % 2 == 0) {
            /* Replies of several threads land in any order: an older one
             * than the receipt is refused, never written over it. */
            cs_status st = cs_model_apply_echo(a->model, loaded, seq,
                                               CS_SOURCE_LOAD_ECHO, false,
                                               -1);
            if (st != CS_OK && st != CS_ERR_OLDER) {
                a->errors++;
            }
        }
        else {
            cs_census_entry e = {"m", 1, true, seq, loaded};
            if (cs_worker_apply_census(a->worker, &e, 1, NULL, NULL) !=
                CS_OK) {
                a->errors++;
            }
        }
        if (i % 64 == 0) {
            cs_worker_begin_call(a->worker);
            cs_worker_end_call(a->worker);
        }
    }
    atomic_fetch_sub(a->writers_left, 1);
    return NULL;
}

static void *
reader_main(void *p)
{
    thread_arg *a = p;
    wait_start(a->start);
    while (atomic_load(a->writers_left) > 0) {
        cs_receipt r;
        cs_model_read(a->model, &r);
        if (r.loaded > a->size) {
            a->errors++;
        }
        if (r.seq >= 0 && r.loaded != loaded_for(r.seq, a->size)) {
            a->errors++; /* torn */
        }
    }
    return NULL;
}

static void
test_threads(void)
{
    cs_ledger *l = cs_ledger_new(0);
    cs_worker *w = cs_ledger_add_worker(l, 1);
    uint64_t size = 1u << 30;
    cs_model *m = reg(w, 1, "m", size);
    pthread_t threads[WRITERS + READERS];
    thread_arg args[WRITERS + READERS];
    _Atomic int start = 0;
    _Atomic int writers_left = WRITERS;

    for (int i = 0; i < WRITERS + READERS; i++) {
        args[i] = (thread_arg){w, m, size, i, &start, &writers_left, 0};
        CHECK(pthread_create(&threads[i], NULL,
                             i < WRITERS ? writer_main : reader_main,
                             &args[i]) == 0);
    }
    atomic_store_explicit(&start, 1, memory_order_release);
    int errors = 0;
    for (int i = 0; i < WRITERS + READERS; i++) {
        pthread_join(threads[i], NULL);
        errors += args[i].errors;
    }
    CHECK(errors == 0);
    CHECK(cs_worker_in_flight(w) == 0);
    /* Neither echoes nor censuses let an older seq win: the newest one
     * written by any thread is the receipt. */
    cs_receipt last;
    cs_model_read(m, &last);
    CHECK(last.seq == (int64_t)ROUNDS * WRITERS);
    CHECK(last.loaded == loaded_for(last.seq, size));
    cs_receipt r;
    cs_model_read(m, &r);
    CHECK(r.loaded <= size && r.loaded == loaded_for(r.seq, size));
    cs_model_release_handle(m);
    cs_worker_decref(w);
    cs_ledger_free(l);
}

/* Census writers racing with increasing seqs: the receipt's seq must be
 * the maximum ever applied (no lost update, never backwards). */
typedef struct {
    cs_worker *worker;
    cs_model *model;
    int index;
    _Atomic int *start;
} census_arg;

static void *
census_writer(void *p)
{
    census_arg *a = p;
    wait_start(a->start);
    for (int i = 0; i < ROUNDS; i++) {
        int64_t seq = (int64_t)i * WRITERS + a->index;
        cs_census_entry e = {"m", 1, true, seq, (uint64_t)seq};
        cs_worker_apply_census(a->worker, &e, 1, NULL, NULL);
    }
    return NULL;
}

static void
test_census_race(void)
{
    cs_ledger *l = cs_ledger_new(0);
    cs_worker *w = cs_ledger_add_worker(l, 1);
    cs_model *m = reg(w, 1, "m", CS_VALUE_MAX);
    pthread_t threads[WRITERS];
    census_arg args[WRITERS];
    _Atomic int start = 0;
    int64_t last = -1;
    int backwards = 0;

    for (int i = 0; i < WRITERS; i++) {
        args[i] = (census_arg){w, m, i, &start};
        CHECK(pthread_create(&threads[i], NULL, census_writer, &args[i]) ==
              0);
    }
    atomic_store_explicit(&start, 1, memory_order_release);
    for (int k = 0; k < ROUNDS; k++) {
        cs_receipt r;
        cs_model_read(m, &r);
        if (r.seq < last) {
            backwards++;
        }
        if (r.seq >= 0 && r.loaded != (uint64_t)r.seq) {
            backwards++;
        }
        last = r.seq;
    }
    for (int i = 0; i < WRITERS; i++) {
        pthread_join(threads[i], NULL);
    }
    CHECK(backwards == 0);
    cs_receipt r;
    cs_model_read(m, &r);
    CHECK(r.seq == (int64_t)(ROUNDS - 1) * WRITERS + WRITERS - 1);
    cs_model_release_handle(m);
    cs_worker_decref(w);
    cs_ledger_free(l);
}

int
main(void)
{
    test_register_and_read();
    test_echo();
    test_census();
    test_generations();
    test_charges_and_reserve();
    test_many_models();
    test_a_full_small_table();
    test_threads();
    test_census_race();
    /* Every test freed what it made: the refcounts balance. */
    int64_t workers = -1, models = -1;
    cs_ledger_live_counts(&workers, &models);
    CHECK(workers == 0 && models == 0);
    printf("test_ledger: %d checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
