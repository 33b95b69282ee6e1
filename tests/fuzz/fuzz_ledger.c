/*
 * fuzz_ledger.c -- libFuzzer harness of the residency ledger (src/ledger.c).
 *
 * The input is a program: each byte picks an operation of
 * include/comfy_standin/ledger.h and the bytes after it its arguments
 * (workers, generations, model ids of 0..8 arbitrary bytes, sizes, census
 * arrays with random ids, lengths, seqs and values, echoes, reports,
 * calls in flight, deaths, restarts, forgets, reserves).  After every
 * operation the harness checks the ledger's invariants and aborts on a
 * violation:
 *
 *   - a receipt never reads above its model's size; a stale model reads 0;
 *     the admission peak never exceeds the size;
 *   - the receipt's write count never goes backwards;
 *   - a census is all or nothing (on an error no receipt of the worker
 *     changed), never lowers a receipt's seq, and writes at most n entries;
 *   - an echo above the size is refused and writes nothing;
 *   - a worker's charge is 0 when gone, else its figures add up: the
 *     models, sizes, receipts and peaks of exactly the models in its table
 *     (found with cs_worker_find_model), and the charge is the documented
 *     max (idle) or sum of sizes (in flight) plus the floor;
 *   - the reserve is the base when not process-local, else never below
 *     the base and, with a card size, never above max(75% of it, base);
 *   - once everything is released, the live worker and model counts
 *     return to where they started (and ASan's leak check sees no leak).
 *
 * Built and run by tests/fuzz/run.sh (see tests/fuzz/README.md).
 */
#include "comfy_standin/ledger.h"
#include "fuzz_common.h"

#define MAX_WORKERS 4
#define MAX_HANDLES 24
#define MAX_CENSUS 12
#define MAX_ID 8

typedef struct handle {
    cs_model *model; /* NULL: free slot */
    int worker;      /* index into workers[] when taken */
} handle;

typedef struct state {
    cs_ledger *ledger;
    uint64_t floor;
    cs_worker *workers[MAX_WORKERS];
    handle handles[MAX_HANDLES];
    uint64_t writes[MAX_HANDLES]; /* last write count seen per handle */
} state;

static uint64_t
sat_add(uint64_t a, uint64_t b)
{
    return a + b < a ? UINT64_MAX : a + b;
}

static uint64_t
max2(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

/* An id: mostly from a tiny alphabet so ids collide (re-registration,
 * duplicates in a census, lookups that hit), sometimes any bytes. */
static size_t
take_id(fuzz_reader *r, char *out)
{
    uint8_t spec = fuzz_u8(r);
    size_t len = spec % (MAX_ID + 1);
    bool raw = (spec & 0x80) != 0;
    for (size_t i = 0; i < len; i++) {
        uint8_t b = fuzz_u8(r);
        out[i] = raw ? (char)b : (char)('a' + b % 3);
    }
    return len;
}

static int
pick_worker(state *s, fuzz_reader *r)
{
    int i = fuzz_u8(r) % MAX_WORKERS;
    return s->workers[i] != NULL ? i : -1;
}

static int
pick_handle(state *s, fuzz_reader *r)
{
    int i = fuzz_u8(r) % MAX_HANDLES;
    return s->handles[i].model != NULL ? i : -1;
}

static void
check_model(const cs_model *m)
{
    cs_receipt rc;
    cs_model_read(m, &rc);
    FUZZ_CHECK(rc.loaded <= cs_model_size(m));
    FUZZ_CHECK(rc.loaded == cs_model_loaded(m));
    FUZZ_CHECK((unsigned)rc.source < CS_SOURCE_COUNT);
    FUZZ_CHECK(rc.seq >= CS_SEQ_NONE);
    FUZZ_CHECK(cs_model_admission_peak(m) <= cs_model_size(m));
    if (cs_model_stale(m)) {
        FUZZ_CHECK(rc.loaded == 0);
    }
}

static void
check_all(state *s)
{
    for (int i = 0; i < MAX_HANDLES; i++) {
        cs_model *m = s->handles[i].model;
        if (m == NULL) {
            continue;
        }
        check_model(m);
        uint64_t w = cs_model_version(m);
        FUZZ_CHECK(w >= s->writes[i]);
        s->writes[i] = w;
    }
}

/* Whether handle slot i is the first of the slots sharing its model. */
static bool
first_of_model(state *s, int i)
{
    for (int j = 0; j < i; j++) {
        if (s->handles[j].model == s->handles[i].model) {
            return false;
        }
    }
    return true;
}

static void
check_charge(state *s, int wi)
{
    cs_worker *w = s->workers[wi];
    cs_charge c;
    cs_worker_charge(w, s->floor, NULL, 0, &c);
    if (!cs_worker_alive(w)) {
        FUZZ_CHECK(c.charge == 0 && c.models == 0 && !c.alive);
        return;
    }
    FUZZ_CHECK(c.alive && c.floor == s->floor);
    /* What the harness can see of the table. */
    uint64_t sizes = 0, loaded = 0, peaks = 0;
    uint32_t models = 0;
    for (int i = 0; i < MAX_HANDLES; i++) {
        cs_model *m = s->handles[i].model;
        if (m == NULL || cs_model_worker(m) != w || !first_of_model(s, i)) {
            continue;
        }
        size_t len;
        const char *id = cs_model_id(m, &len);
        cs_model *found = cs_worker_find_model(w, id, len);
        if (found == m) {
            models++;
            sizes = sat_add(sizes, cs_model_size(m));
            loaded = sat_add(loaded, cs_model_loaded(m));
            peaks = sat_add(peaks, cs_model_admission_peak(m));
        }
        cs_model_decref(found);
    }
    FUZZ_CHECK(c.models == models);
    FUZZ_CHECK(c.sum_sizes == sizes);
    FUZZ_CHECK(c.sum_loaded == loaded);
    FUZZ_CHECK(c.sum_peak == peaks);
    FUZZ_CHECK(c.sum_loaded <= c.sum_sizes);
    FUZZ_CHECK(c.sum_peak <= c.sum_sizes);
    FUZZ_CHECK(c.in_flight == cs_worker_in_flight(w));
    /* The reading counts the CUDA context, which the floor is. */
    uint64_t beyond = c.reading > s->floor ? c.reading - s->floor : 0;
    uint64_t body = c.in_flight > 0
                        ? c.sum_sizes
                        : max2(max2(c.sum_loaded, c.sum_peak),
                               max2(c.held, beyond));
    FUZZ_CHECK(c.charge == sat_add(body, s->floor));
    FUZZ_CHECK(c.held_from_reading == (beyond > c.held));
}

static void
op_register(state *s, fuzz_reader *r)
{
    int wi = pick_worker(s, r);
    if (wi < 0) {
        return;
    }
    cs_worker *w = s->workers[wi];
    char id[MAX_ID];
    size_t len = take_id(r, id);
    uint64_t gen = cs_worker_generation(w);
    switch (fuzz_u8(r) % 5) {
    case 0:
        gen = gen > 0 ? gen - 1 : 0; /* an old process's stand-in */
        break;
    case 1:
        gen = sat_add(gen, 1); /* a restart */
        break;
    case 2:
        gen = fuzz_value(r);
        break;
    default:
        break;
    }
    uint64_t size = fuzz_value(r);
    cs_model *m = NULL;
    cs_status st = cs_worker_register_model(w, gen, id, len, size, &m);
    if (size > CS_VALUE_MAX || gen > CS_VALUE_MAX) {
        FUZZ_CHECK(st == CS_ERR_RANGE && m == NULL);
        return;
    }
    FUZZ_CHECK(st == CS_OK || st == CS_ERR_SIZE_MISMATCH);
    if (st != CS_OK) {
        FUZZ_CHECK(m == NULL);
        return;
    }
    FUZZ_CHECK(m != NULL && cs_model_size(m) == size);
    FUZZ_CHECK(cs_model_worker(m) == w);
    size_t got_len;
    const char *got = cs_model_id(m, &got_len);
    FUZZ_CHECK(got_len == len && memcmp(got, id, len) == 0);
    FUZZ_CHECK(cs_worker_generation(w) >= gen);
    for (int i = 0; i < MAX_HANDLES; i++) {
        if (s->handles[i].model == NULL) {
            s->handles[i].model = m;
            s->handles[i].worker = wi;
            s->writes[i] = cs_model_version(m);
            return;
        }
    }
    cs_model_release_handle(m); /* no room: give it straight back */
}

static void
op_census(state *s, fuzz_reader *r)
{
    int wi = pick_worker(s, r);
    if (wi < 0) {
        return;
    }
    cs_worker *w = s->workers[wi];
    cs_census_entry entries[MAX_CENSUS];
    char ids[MAX_CENSUS][MAX_ID];
    size_t n = fuzz_u8(r) % (MAX_CENSUS + 1);
    for (size_t i = 0; i < n; i++) {
        uint8_t how = fuzz_u8(r);
        int hi = (how & 1) ? pick_handle(s, r) : -1;
        if (hi >= 0) {
            /* An id the worker may well know (any handle's id). */
            size_t len;
            const char *id = cs_model_id(s->handles[hi].model, &len);
            memcpy(ids[i], id, len);
            entries[i].id_len = len;
        }
        else {
            entries[i].id_len = take_id(r, ids[i]);
        }
        entries[i].id = ids[i];
        entries[i].has_seq = (how & 2) != 0;
        entries[i].seq = (how & 4) ? -(int64_t)fuzz_u8(r)
                                   : (int64_t)(fuzz_value(r) >> 1);
        entries[i].resident = fuzz_value(r);
    }

    /* Before: each held model of this worker. */
    cs_receipt before[MAX_HANDLES];
    for (int i = 0; i < MAX_HANDLES; i++) {
        if (s->handles[i].model != NULL) {
            cs_model_read(s->handles[i].model, &before[i]);
            s->writes[i] = cs_model_version(s->handles[i].model);
        }
    }
    size_t applied = 99, bad = 99;
    cs_status st = cs_worker_apply_census(w, entries, n, &applied, &bad);
    FUZZ_CHECK(st == CS_OK || st == CS_ERR_RANGE ||
               st == CS_ERR_UNKNOWN_ID || st == CS_ERR_DUPLICATE_ID);
    FUZZ_CHECK(applied <= n);
    if (st != CS_OK) {
        FUZZ_CHECK(bad < n && applied == 0);
        if (st == CS_ERR_RANGE) {
            FUZZ_CHECK(entries[bad].resident > CS_VALUE_MAX ||
                       (entries[bad].has_seq && entries[bad].seq < 0));
        }
    }
    if (!cs_worker_alive(w)) {
        FUZZ_CHECK(applied == 0);
    }
    for (int i = 0; i < MAX_HANDLES; i++) {
        cs_model *m = s->handles[i].model;
        if (m == NULL) {
            continue;
        }
        cs_receipt after;
        cs_model_read(m, &after);
        if (st != CS_OK || cs_model_worker(m) != w) {
            /* All or nothing; and other workers are untouched. */
            FUZZ_CHECK(cs_model_version(m) == s->writes[i]);
            FUZZ_CHECK(after.loaded == before[i].loaded &&
                       after.seq == before[i].seq);
        }
        else {
            FUZZ_CHECK(after.seq >= before[i].seq); /* seq monotone */
        }
    }
}

static void
op_model_census(state *s, fuzz_reader *r)
{
    int hi = pick_handle(s, r);
    if (hi < 0) {
        return;
    }
    cs_model *m = s->handles[hi].model;
    uint8_t how = fuzz_u8(r);
    bool has_seq = (how & 1) != 0;
    int64_t seq = (how & 2) ? -(int64_t)fuzz_u8(r)
                            : (int64_t)(fuzz_value(r) >> 1);
    uint64_t resident = fuzz_value(r);
    cs_receipt before, after;
    cs_model_read(m, &before);
    uint64_t writes = cs_model_version(m);
    bool applied = true;
    cs_status st = cs_model_apply_census(m, has_seq, seq, resident,
                                         &applied);
    cs_model_read(m, &after);
    if (resident > CS_VALUE_MAX || (has_seq && seq < 0)) {
        FUZZ_CHECK(st == CS_ERR_RANGE && !applied);
    }
    else {
        FUZZ_CHECK(st == CS_OK);
    }
    if (!applied) {
        FUZZ_CHECK(cs_model_version(m) == writes);
    }
    else {
        FUZZ_CHECK(!cs_model_stale(m));
        FUZZ_CHECK(after.source == CS_SOURCE_CENSUS);
        FUZZ_CHECK(after.loaded ==
                   (resident < cs_model_size(m) ? resident
                                                : cs_model_size(m)));
    }
    FUZZ_CHECK(after.seq >= before.seq);
}

static void
op_echo(state *s, fuzz_reader *r)
{
    int hi = pick_handle(s, r);
    if (hi < 0) {
        return;
    }
    cs_model *m = s->handles[hi].model;
    uint8_t how = fuzz_u8(r);
    uint64_t loaded = (how & 1) ? fuzz_value(r)
                                : cs_model_size(m) - (fuzz_value(r) %
                                                      (cs_model_size(m) + 1));
    int64_t seq = (how & 2) ? CS_SEQ_NONE : (int64_t)(fuzz_value(r) >> 1);
    if (how & 4) {
        seq = -(int64_t)fuzz_u8(r) - 2; /* a negative, not SEQ_NONE */
    }
    cs_source source = (cs_source)(fuzz_u8(r) % (CS_SOURCE_COUNT + 2));
    bool unmapped = (how & 8) != 0;
    int in_flight = (int)(how >> 4) % 3 - 1;
    cs_receipt before, after;
    cs_model_read(m, &before);
    uint64_t writes = cs_model_version(m);
    bool stale = cs_model_stale(m);
    cs_status st = cs_model_apply_echo(m, loaded, seq, source, unmapped,
                                       in_flight);
    cs_model_read(m, &after);
    bool bad = loaded > cs_model_size(m) || (seq < 0 && seq != CS_SEQ_NONE)
               || (unsigned)source >= CS_SOURCE_COUNT;
    if (bad) {
        FUZZ_CHECK(st == CS_ERR_RANGE);
    }
    else if (stale) {
        FUZZ_CHECK(st == CS_ERR_STALE);
    }
    else if (seq != CS_SEQ_NONE && seq < before.seq) {
        FUZZ_CHECK(st == CS_ERR_OLDER); /* an older word: not written */
    }
    else {
        FUZZ_CHECK(st == CS_OK);
        FUZZ_CHECK(after.loaded == loaded && after.source == source);
        FUZZ_CHECK(after.seq == (seq == CS_SEQ_NONE ? before.seq : seq));
        FUZZ_CHECK(!cs_model_eviction_deferred(m));
        if (unmapped) {
            FUZZ_CHECK(cs_model_admission_peak(m) == 0);
        }
    }
    if (st != CS_OK) {
        FUZZ_CHECK(cs_model_version(m) == writes);
        FUZZ_CHECK(after.loaded == before.loaded);
    }
}

static void
op_worker(state *s, fuzz_reader *r)
{
    int wi = pick_worker(s, r);
    if (wi < 0) {
        return;
    }
    cs_worker *w = s->workers[wi];
    uint8_t what = fuzz_u8(r);
    switch (what % 8) {
    case 0:
        FUZZ_CHECK(cs_worker_begin_call(w) == CS_OK);
        break;
    case 1: {
        uint32_t before = cs_worker_in_flight(w);
        cs_status st = cs_worker_end_call(w);
        if (cs_worker_alive(w)) {
            FUZZ_CHECK(st == (before == 0 ? CS_ERR_STATE : CS_OK));
        }
        break;
    }
    case 2: {
        uint64_t held = fuzz_value(r), pinned = fuzz_value(r),
                 overhead = fuzz_value(r);
        cs_status st = cs_worker_set_report(w, (what & 8) ? NULL : &held,
                                            (what & 16) ? NULL : &pinned,
                                            &overhead);
        FUZZ_CHECK(st == CS_OK || st == CS_ERR_RANGE);
        break;
    }
    case 3: {
        uint64_t used = fuzz_value(r);
        cs_status st = cs_worker_set_reading(w, used);
        FUZZ_CHECK(st == (used > CS_VALUE_MAX ? CS_ERR_RANGE : CS_OK));
        if (st == CS_OK) {
            FUZZ_CHECK(cs_worker_reading(w) == used);
        }
        break;
    }
    case 4:
        cs_worker_gone(w);
        FUZZ_CHECK(!cs_worker_alive(w) && cs_worker_in_flight(w) == 0);
        break;
    case 5: {
        uint64_t old = cs_worker_generation(w);
        uint64_t gen = (what & 8) ? fuzz_value(r) : old + 1;
        cs_status st = cs_worker_bump_generation(w, gen);
        if (gen > CS_VALUE_MAX) {
            FUZZ_CHECK(st == CS_ERR_RANGE);
        }
        else if (gen <= old) {
            FUZZ_CHECK(st == CS_ERR_STATE);
        }
        else {
            FUZZ_CHECK(st == CS_OK && cs_worker_alive(w) &&
                       cs_worker_generation(w) == gen);
        }
        break;
    }
    case 6: {
        /* raise the peak of one of its models */
        int hi = pick_handle(s, r);
        if (hi >= 0) {
            cs_model *m = s->handles[hi].model;
            uint64_t before = cs_model_admission_peak(m);
            cs_status st = cs_model_raise_peak(m, fuzz_value(r));
            FUZZ_CHECK(st == CS_OK || st == CS_ERR_STALE);
            if (st == CS_OK) {
                FUZZ_CHECK(cs_model_admission_peak(m) >= before);
            }
        }
        break;
    }
    default: {
        int hi = pick_handle(s, r);
        if (hi >= 0) {
            cs_model_set_eviction_deferred(s->handles[hi].model,
                                           (what & 8) != 0);
            FUZZ_CHECK(cs_model_eviction_deferred(s->handles[hi].model) ==
                       ((what & 8) != 0));
        }
        break;
    }
    }
}

static void
op_reserve(state *s, fuzz_reader *r)
{
    uint64_t base = fuzz_value(r) >> 2;
    uint64_t total = fuzz_value(r);
    bool local = (fuzz_u8(r) & 1) != 0;
    uint64_t v = cs_ledger_reserve(s->ledger, base, total, local, NULL, 0);
    if (!local) {
        FUZZ_CHECK(v == base);
        return;
    }
    FUZZ_CHECK(v >= base);
    if (total > 0) {
        uint64_t cap = total / 4 * 3 + (total % 4) * 3 / 4;
        FUZZ_CHECK(v <= max2(cap, base));
    }
    if (total == 0) {
        /* No cap: at least what every live worker costs. */
        FUZZ_CHECK(v >= sat_add(base,
                                cs_ledger_total_charge(s->ledger, NULL, 0)));
    }
}

static void
release_handle(state *s, int hi)
{
    cs_model_release_handle(s->handles[hi].model);
    s->handles[hi].model = NULL;
}

static void
op_lifecycle(state *s, fuzz_reader *r)
{
    uint8_t what = fuzz_u8(r);
    switch (what % 4) {
    case 0: {
        int wi = what / 4 % MAX_WORKERS;
        if (s->workers[wi] == NULL) {
            uint64_t gen = fuzz_value(r);
            s->workers[wi] = cs_ledger_add_worker(s->ledger, gen);
            if (gen > CS_VALUE_MAX) {
                FUZZ_CHECK(s->workers[wi] == NULL);
            }
            else {
                FUZZ_CHECK(s->workers[wi] != NULL);
                FUZZ_CHECK(cs_worker_generation(s->workers[wi]) == gen);
            }
        }
        break;
    }
    case 1: {
        int hi = pick_handle(s, r);
        if (hi >= 0) {
            release_handle(s, hi);
        }
        break;
    }
    case 2: {
        /* forget: the ledger drops it; the handles stay valid */
        int wi = pick_worker(s, r);
        if (wi >= 0) {
            size_t before = cs_ledger_worker_count(s->ledger);
            cs_ledger_forget_worker(s->ledger, s->workers[wi]);
            FUZZ_CHECK(cs_ledger_worker_count(s->ledger) + 1 == before);
            cs_ledger_forget_worker(s->ledger, s->workers[wi]);
            FUZZ_CHECK(cs_ledger_worker_count(s->ledger) + 1 == before);
            cs_worker_decref(s->workers[wi]);
            s->workers[wi] = NULL;
        }
        break;
    }
    default: {
        int wi = pick_worker(s, r);
        if (wi >= 0) {
            char id[MAX_ID];
            size_t len = take_id(r, id);
            cs_model *m = cs_worker_find_model(s->workers[wi], id, len);
            if (m != NULL) {
                size_t got;
                FUZZ_CHECK(memcmp(cs_model_id(m, &got), id, len) == 0);
                FUZZ_CHECK(got == len && !cs_model_stale(m) ==
                                             cs_worker_alive(
                                                 s->workers[wi]));
                cs_model_decref(m);
            }
        }
        break;
    }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_reader r = {data, size, 0};
    int64_t workers0, models0;
    cs_ledger_live_counts(&workers0, &models0);

    state s;
    memset(&s, 0, sizeof(s));
    s.floor = fuzz_u8(&r) % 2 ? CS_DEFAULT_FLOOR : fuzz_value(&r);
    s.ledger = cs_ledger_new(s.floor);
    FUZZ_CHECK(s.ledger != NULL);
    FUZZ_CHECK(cs_ledger_floor(s.ledger) == s.floor);
    s.workers[0] = cs_ledger_add_worker(s.ledger, 0);
    FUZZ_CHECK(s.workers[0] != NULL);

    for (int steps = 0; !fuzz_done(&r) && steps < 4096; steps++) {
        switch (fuzz_u8(&r) % 8) {
        case 0:
        case 1:
            op_register(&s, &r);
            break;
        case 2:
            op_census(&s, &r);
            break;
        case 3:
            op_model_census(&s, &r);
            break;
        case 4:
            op_echo(&s, &r);
            break;
        case 5:
            op_worker(&s, &r);
            break;
        case 6:
            op_reserve(&s, &r);
            break;
        default:
            op_lifecycle(&s, &r);
            break;
        }
        check_all(&s);
        for (int wi = 0; wi < MAX_WORKERS; wi++) {
            if (s.workers[wi] != NULL) {
                check_charge(&s, wi);
            }
        }
    }

    /* Tear down in an input-chosen order: the ledger first or last. */
    bool ledger_first = (size & 1) != 0;
    if (ledger_first) {
        cs_ledger_free(s.ledger);
        check_all(&s); /* handles outlive the ledger */
    }
    for (int i = 0; i < MAX_HANDLES; i++) {
        if (s.handles[i].model != NULL) {
            release_handle(&s, i);
        }
    }
    for (int wi = 0; wi < MAX_WORKERS; wi++) {
        cs_worker_decref(s.workers[wi]);
    }
    if (!ledger_first) {
        cs_ledger_free(s.ledger);
    }
    int64_t workers1, models1;
    cs_ledger_live_counts(&workers1, &models1);
    FUZZ_CHECK(workers1 == workers0 && models1 == models0);
    return 0;
}
