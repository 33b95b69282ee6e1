/*
 * ledger.c -- the residency ledger (see include/comfy_standin/ledger.h).
 *
 * Locking, in one place:
 *
 *   ledger->lock   the worker list and the published reserve.
 *   worker->lock   every write to the worker and to its models' receipts,
 *                  peaks and table.  Writers of one worker are therefore
 *                  serialised (linearizable at the lock).
 *   lock order     ledger->lock, then worker->lock.  No worker path takes
 *                  the ledger lock, and no path holds two worker locks.
 *
 * Readers of a receipt take no lock: the receipt's four fields are
 * published through a seqlock (rc_version odd while a writer is inside).
 * The writer is always inside worker->lock, so there is one writer at a
 * time per model, which a seqlock needs.  Every field the seqlock covers is
 * itself an atomic (accessed relaxed) so the concurrent read is not a data
 * race under C11; the fences give the ordering.
 */
#include "comfy_standin/ledger.h"
#include "platform.h"

#include <assert.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* Marks a deleted slot of an open-addressing table: the address of an
 * object no table ever holds (not a pointer made from an integer). */
#define TABLE_TOMBSTONE (&table_tombstone)
#define TABLE_MIN_CAPACITY 8

/* A place on one of the lists of mutexes fork() takes (the fork section):
 * circular, under fork_registry_lock. */
typedef struct fork_node {
    struct fork_node *prev, *next;
} fork_node;

/* One allocation per model, the id bytes inline at its end: 76 bytes
 * before the id, so a record with an id of up to 11 bytes is a 96-byte
 * malloc chunk (one record per stand-in: bench/RESULTS.md, memory). */
struct cs_model {
    /* The receipt.  Written only under worker->lock, inside the seqlock
     * (rc_version odd); read lock-free by cs_model_read.  32 bits: a
     * reader would have to sleep through 2**31 writes to be fooled.  The
     * first word, which cs_model_version reads (ledger.h). */
    _Atomic uint32_t rc_version;
    _Atomic uint32_t refcount;
    uint32_t handles; /* under worker->lock */
    /* Malformed replies a binding rejected; any thread. */
    _Atomic uint32_t bad_replies;

    /* Immutable after creation: read anywhere without a lock. */
    cs_worker *worker; /* strong reference */
    uint64_t size;
    uint64_t generation;

    _Atomic uint64_t rc_loaded;
    _Atomic int64_t rc_seq;
    _Atomic uint64_t rc_time;

    /* Written under worker->lock, read lock-free (single word each). */
    _Atomic uint64_t peak;

    uint16_t id_len;           /* immutable */
    _Atomic uint8_t rc_source; /* the receipt's, as rc_loaded */
    /* MODEL_STALE and MODEL_IN_TABLE change under worker->lock;
     * MODEL_DEFERRED is set by any thread (a binding's eviction path). */
    _Atomic uint8_t flags;

    char id[]; /* NUL-terminated copy; may contain NULs before */
};

enum { MODEL_STALE = 1, MODEL_DEFERRED = 2, MODEL_IN_TABLE = 4 };

static_assert(offsetof(struct cs_model, rc_version) == 0, "ledger.h");
static_assert(offsetof(struct cs_model, id) == 76, "record header");

static inline bool
model_flag(const cs_model *m, uint8_t flag, memory_order order)
{
    return (atomic_load_explicit(&((cs_model *)m)->flags, order) & flag) !=
           0;
}

static inline void
model_set_flag(cs_model *m, uint8_t flag, bool on)
{
    if (on) {
        atomic_fetch_or_explicit(&m->flags, flag, memory_order_release);
    }
    else {
        atomic_fetch_and_explicit(&m->flags, (uint8_t)~flag,
                                  memory_order_release);
    }
}

static cs_model table_tombstone; /* never read or written */

/* Laid out so the narrow fields share words: one per worker process. */
struct cs_worker {
    _Atomic uint32_t refcount;
    _Atomic uint32_t in_flight; /* written under lock, read lock-free */
    cs_mutex lock;

    /* Written under lock, read lock-free. */
    _Atomic uint64_t generation;
    _Atomic uint64_t held;
    _Atomic uint64_t pinned;
    _Atomic uint64_t overhead;
    _Atomic uint64_t reading;

    /* Under lock: the current generation's models by id. */
    cs_model **slots;
    uint32_t capacity; /* a power of two, or 0 */
    uint32_t count;
    uint32_t tombstones;

    _Atomic bool alive; /* written under lock, read lock-free */
    /* Set under lock by a release; exchanged to false by the reserve. */
    _Atomic bool released;
    bool on_books; /* under the owning ledger's lock */

    fork_node registered; /* on fork_workers (the fork section) */
    void *data;           /* the binding's (cs_worker_set_data) */
};

struct cs_ledger {
    cs_mutex lock;
    uint64_t floor; /* immutable */

    /* Under lock. */
    cs_worker **workers; /* strong references */
    size_t count;
    size_t capacity;
    uint64_t published;
    bool has_published;
    /* A release of a worker forgotten since the last reserve: its mark
     * must outlive the worker's place on the books (a dead worker's death
     * is a release even when boundary() forgets it first). */
    bool released;

    fork_node registered; /* on fork_ledgers (the fork section) */
};

/* Objects alive, process-wide: what the leak tests compare. */
static _Atomic int64_t live_workers;
static _Atomic int64_t live_models;

void
cs_ledger_live_counts(int64_t *workers, int64_t *models)
{
    *workers = atomic_load_explicit(&live_workers, memory_order_relaxed);
    *models = atomic_load_explicit(&live_models, memory_order_relaxed);
}

/* ---- fork ------------------------------------------------------------ */

/* A fork() from one thread while another holds a ledger's or a worker's
 * mutex (Ledger.reserve runs with the GIL released and the ledger's lock
 * held) would leave that mutex locked for good in the child, whose only
 * thread never held it.  Every such mutex is registered here, and
 * pthread_atfork() takes them all before fork() and releases them after,
 * in both processes, so the child starts with each one free and the state
 * it guards whole.  The order is the ledger code's own: the registry, then
 * every ledger lock, then every worker lock (no path holds a worker lock
 * while it takes a ledger lock, two worker locks, or the registry's lock
 * while it holds another: workers are made and freed outside them).
 * Windows has no fork(). */
#ifndef _WIN32
static pthread_mutex_t fork_registry_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t fork_registry_once = PTHREAD_ONCE_INIT;
static fork_node fork_ledgers = {&fork_ledgers, &fork_ledgers};
static fork_node fork_workers = {&fork_workers, &fork_workers};

/* The mutex of the ledger or worker registered at `node`. */
#define FORK_LOCK(node, type)                                                 \
    (&((type *)(void *)((char *)(node) - offsetof(type, registered)))->lock)

static void
fork_prepare(void)
{
    pthread_mutex_lock(&fork_registry_lock);
    for (fork_node *n = fork_ledgers.next; n != &fork_ledgers; n = n->next) {
        cs_mutex_lock(FORK_LOCK(n, cs_ledger));
    }
    for (fork_node *n = fork_workers.next; n != &fork_workers; n = n->next) {
        cs_mutex_lock(FORK_LOCK(n, cs_worker));
    }
}

/* After fork(), in the parent and in the child (whose only thread is the
 * one that took every lock in fork_prepare). */
static void
fork_release(void)
{
    for (fork_node *n = fork_workers.next; n != &fork_workers; n = n->next) {
        cs_mutex_unlock(FORK_LOCK(n, cs_worker));
    }
    for (fork_node *n = fork_ledgers.next; n != &fork_ledgers; n = n->next) {
        cs_mutex_unlock(FORK_LOCK(n, cs_ledger));
    }
    pthread_mutex_unlock(&fork_registry_lock);
}

static void
fork_registry_install(void)
{
    (void)pthread_atfork(fork_prepare, fork_release, fork_release);
}

static void
fork_register(fork_node *list, fork_node *node)
{
    pthread_once(&fork_registry_once, fork_registry_install);
    pthread_mutex_lock(&fork_registry_lock);
    node->prev = list;
    node->next = list->next;
    list->next->prev = node;
    list->next = node;
    pthread_mutex_unlock(&fork_registry_lock);
}

static void
fork_unregister(fork_node *node)
{
    pthread_mutex_lock(&fork_registry_lock);
    node->prev->next = node->next;
    node->next->prev = node->prev;
    pthread_mutex_unlock(&fork_registry_lock);
}
#else
#define fork_register(list, node) ((void)(node))
#define fork_unregister(node) ((void)(node))
#endif

/* ---- small helpers --------------------------------------------------- */

static const char *const source_names[CS_SOURCE_COUNT] = {
    [CS_SOURCE_REGISTERED] = "registered",
    [CS_SOURCE_LOAD_ECHO] = "load echo",
    [CS_SOURCE_UNLOAD_ECHO] = "unload echo",
    [CS_SOURCE_DETACH_ECHO] = "detach echo",
    [CS_SOURCE_CENSUS] = "census",
    [CS_SOURCE_BOARD] = "board",
    [CS_SOURCE_ASSIGNED] = "assigned",
    [CS_SOURCE_WORKER_GONE] = "worker gone",
};

const char *
cs_source_name(cs_source source)
{
    if ((unsigned)source >= CS_SOURCE_COUNT) {
        return "unknown";
    }
    return source_names[source];
}

static const char *const status_messages[] = {
    [CS_OK] = "ok",
    [CS_ERR_NOMEM] = "out of memory",
    [CS_ERR_RANGE] = "value out of range",
    [CS_ERR_UNKNOWN_ID] = "unknown model id",
    [CS_ERR_DUPLICATE_ID] = "duplicate model id",
    [CS_ERR_SIZE_MISMATCH] = "model id already registered with another size",
    [CS_ERR_STALE] = "model's generation is over or its worker is gone",
    [CS_ERR_STATE] = "call out of order",
    [CS_ERR_OLDER] = "older than the receipt",
};

const char *
cs_status_message(cs_status status)
{
    if ((unsigned)status >= sizeof(status_messages) / sizeof(char *)) {
        return "unknown status";
    }
    return status_messages[status];
}

uint64_t
cs_monotonic_ns(void)
{
    return cs_clock_ns();
}

static uint64_t
add_saturating(uint64_t a, uint64_t b)
{
    uint64_t sum = a + b;
    return sum < a ? UINT64_MAX : sum;
}

static uint64_t
max_u64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

/* FNV-1a: ids are short and few; this only has to spread them. */
static uint64_t
hash_id(const char *id, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)id[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* ---- receipts (seqlock) ---------------------------------------------- */

/* Writer side; caller holds model->worker->lock. */
static void
receipt_write_locked(cs_model *m, uint64_t loaded, int64_t seq,
                     cs_source source)
{
    uint64_t now = cs_monotonic_ns();
    uint32_t v = atomic_load_explicit(&m->rc_version, memory_order_relaxed);
    uint64_t before =
        atomic_load_explicit(&m->rc_loaded, memory_order_relaxed);

    atomic_store_explicit(&m->rc_version, v + 1, memory_order_relaxed);
    /* Orders the odd version before the field stores (a reader that sees
     * any new field also sees the odd version, or a later one). */
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&m->rc_loaded, loaded, memory_order_relaxed);
    atomic_store_explicit(&m->rc_seq, seq, memory_order_relaxed);
    atomic_store_explicit(&m->rc_time, now, memory_order_relaxed);
    atomic_store_explicit(&m->rc_source, (uint8_t)source,
                          memory_order_relaxed);
    atomic_store_explicit(&m->rc_version, v + 2, memory_order_release);

    if (loaded < before) {
        atomic_store_explicit(&m->worker->released, true,
                              memory_order_relaxed);
    }
}

uint32_t
cs_model_read(const cs_model *model, cs_receipt *out)
{
    cs_model *m = (cs_model *)model; /* atomics need non-const access */
    for (;;) {
        uint32_t v1 =
            atomic_load_explicit(&m->rc_version, memory_order_acquire);
        if (v1 & 1) {
            /* A writer is inside; it holds no lock we wait for and is a
             * handful of stores long. */
            cs_cpu_relax();
            continue;
        }
        out->loaded = atomic_load_explicit(&m->rc_loaded,
                                           memory_order_relaxed);
        out->seq = atomic_load_explicit(&m->rc_seq, memory_order_relaxed);
        out->time_ns = atomic_load_explicit(&m->rc_time,
                                            memory_order_relaxed);
        out->source = (cs_source)atomic_load_explicit(
            &m->rc_source, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&m->rc_version, memory_order_relaxed) ==
            v1) {
            return v1;
        }
    }
}

uint64_t
cs_model_loaded(const cs_model *model)
{
    /* A single word needs no seqlock; stale models were zeroed. */
    return atomic_load_explicit(&((cs_model *)model)->rc_loaded,
                                memory_order_acquire);
}

/* Peak rule (docs/semantics.md); caller holds the worker lock. */
static void
peak_update_locked(cs_model *m, uint64_t loaded, bool unmapped,
                   bool in_flight)
{
    uint64_t peak = atomic_load_explicit(&m->peak, memory_order_relaxed);
    if (unmapped) {
        peak = 0;
    }
    else if (in_flight) {
        peak = max_u64(peak, loaded);
    }
    else {
        peak = loaded;
    }
    atomic_store_explicit(&m->peak, peak, memory_order_relaxed);
}

/* The model's bytes went with a process; caller holds the worker lock. */
static void
model_mark_gone_locked(cs_model *m)
{
    int64_t seq = atomic_load_explicit(&m->rc_seq, memory_order_relaxed);
    /* Stale first: a reader that sees the new version sees it too. */
    model_set_flag(m, MODEL_STALE, true);
    /* Nothing is left to evict: no eviction is deferred any more. */
    model_set_flag(m, MODEL_DEFERRED, false);
    receipt_write_locked(m, 0, seq, CS_SOURCE_WORKER_GONE);
    atomic_store_explicit(&m->peak, 0, memory_order_relaxed);
}

/* ---- models ---------------------------------------------------------- */

static cs_model *
model_new(cs_worker *worker, uint64_t generation, const char *id,
          size_t id_len, uint64_t size)
{
    if (id_len > CS_MODEL_ID_MAX) {
        return NULL; /* no record can hold it: as out of memory */
    }
    cs_model *m = calloc(1, sizeof(*m) + id_len + 1);
    if (m == NULL) {
        return NULL;
    }
    memcpy(m->id, id, id_len);
    m->id[id_len] = '\0';
    m->id_len = (uint16_t)id_len;
    m->size = size;
    m->generation = generation;
    atomic_init(&m->refcount, 1);
    atomic_init(&m->rc_version, 0);
    atomic_init(&m->rc_loaded, 0);
    atomic_init(&m->rc_seq, CS_SEQ_NONE);
    /* The precise clock: a board reading published before the
     * registration must read as older than it (a coarse stamp lags by up
     * to a tick). */
    atomic_init(&m->rc_time, cs_monotonic_ns());
    atomic_init(&m->rc_source, (uint8_t)CS_SOURCE_REGISTERED);
    atomic_init(&m->bad_replies, 0);
    atomic_init(&m->peak, 0);
    atomic_init(&m->flags, 0);
    cs_worker_incref(worker);
    m->worker = worker;
    atomic_fetch_add_explicit(&live_models, 1, memory_order_relaxed);
    return m;
}

void
cs_model_incref(cs_model *model)
{
    atomic_fetch_add_explicit(&model->refcount, 1, memory_order_relaxed);
}

/* Drops `n` references at once (one atomic step, so a static analyser
 * does not take the first of two separate drops for the last one). */
static void
model_decref_by(cs_model *model, uint32_t n)
{
    if (model == NULL) {
        return;
    }
    if (atomic_fetch_sub_explicit(&model->refcount, n,
                                  memory_order_acq_rel) != n) {
        return;
    }
    cs_worker *worker = model->worker;
    free(model);
    atomic_fetch_sub_explicit(&live_models, 1, memory_order_relaxed);
    cs_worker_decref(worker);
}

void
cs_model_decref(cs_model *model)
{
    model_decref_by(model, 1);
}

uint32_t
cs_model_bad_reply(cs_model *model)
{
    return atomic_fetch_add_explicit(&model->bad_replies, 1,
                                     memory_order_relaxed) +
           1;
}

uint32_t
cs_model_bad_replies(const cs_model *model)
{
    cs_model *m = (cs_model *)model; /* atomics need non-const access */
    return atomic_load_explicit(&m->bad_replies, memory_order_relaxed);
}

const char *
cs_model_id(const cs_model *model, size_t *len)
{
    if (len != NULL) {
        *len = model->id_len;
    }
    return model->id;
}

uint64_t
cs_model_size(const cs_model *model)
{
    return model->size;
}

uint64_t
cs_model_generation(const cs_model *model)
{
    return model->generation;
}

cs_worker *
cs_model_worker(const cs_model *model)
{
    return model->worker;
}

bool
cs_model_stale(const cs_model *model)
{
    return model_flag(model, MODEL_STALE, memory_order_acquire);
}

uint64_t
cs_model_admission_peak(const cs_model *model)
{
    return atomic_load_explicit(&((cs_model *)model)->peak,
                                memory_order_relaxed);
}

cs_status
cs_model_raise_peak(cs_model *model, uint64_t bytes)
{
    cs_status status = CS_OK;
    uint64_t clamped = bytes < model->size ? bytes : model->size;
    cs_mutex_lock(&model->worker->lock);
    if (model_flag(model, MODEL_STALE, memory_order_relaxed)) {
        status = CS_ERR_STALE;
    }
    else if (atomic_load_explicit(&model->peak, memory_order_relaxed) <
             clamped) {
        atomic_store_explicit(&model->peak, clamped, memory_order_relaxed);
    }
    cs_mutex_unlock(&model->worker->lock);
    return status;
}

void
cs_model_set_eviction_deferred(cs_model *model, bool deferred)
{
    model_set_flag(model, MODEL_DEFERRED, deferred);
}

bool
cs_model_eviction_deferred(const cs_model *model)
{
    return model_flag(model, MODEL_DEFERRED, memory_order_relaxed);
}

/* ---- the worker's table (caller holds worker->lock) ------------------- */

/* The slot holding `id`, else the first empty one on its probe sequence,
 * else (a full table) SIZE_MAX. */
static size_t
table_find_slot(const cs_worker *w, const char *id, size_t id_len,
                uint64_t hash)
{
    size_t mask = w->capacity - 1;
    size_t i = (size_t)hash & mask;
    for (size_t probes = 0; probes < w->capacity; probes++) {
        cs_model *m = w->slots[i];
        if (m == NULL) {
            return i;
        }
        if (m != TABLE_TOMBSTONE && m->id_len == id_len &&
            memcmp(m->id, id, id_len) == 0) {
            return i;
        }
        i = (i + 1) & mask;
    }
    return SIZE_MAX;
}

static cs_model *
table_lookup(const cs_worker *w, const char *id, size_t id_len,
             uint64_t hash)
{
    size_t i = w->capacity ? table_find_slot(w, id, id_len, hash) : SIZE_MAX;
    return i == SIZE_MAX ? NULL : w->slots[i];
}

/* How many live and deleted entries a table of `capacity` holds before it
 * grows: all of a small one (a worker's few models in one small array:
 * a lookup probes 8 slots at most), 70% of a larger one. */
static uint64_t
table_room(uint64_t capacity)
{
    return capacity <= TABLE_MIN_CAPACITY ? capacity : capacity * 7 / 10;
}

/* The slot of `m`, which is in the table. */
static size_t
table_slot_of(const cs_worker *w, const cs_model *m)
{
    return table_find_slot(w, m->id, m->id_len, hash_id(m->id, m->id_len));
}

static cs_status
table_grow(cs_worker *w)
{
    uint64_t capacity =
        w->capacity ? (uint64_t)w->capacity * 2 : TABLE_MIN_CAPACITY;
    /* Mostly tombstones filled the table: rehash in place at equal size. */
    if (w->capacity && (uint64_t)w->count + 1 <= table_room(w->capacity) / 2) {
        capacity = w->capacity;
    }
    if (capacity > UINT32_MAX) {
        return CS_ERR_NOMEM;
    }
    /* An array of pointers: sizeof(cs_model *) is meant. */
    /* NOLINTNEXTLINE(bugprone-sizeof-expression) */
    cs_model **slots = calloc(capacity, sizeof(*slots));
    if (slots == NULL) {
        return CS_ERR_NOMEM;
    }
    cs_model **old = w->slots;
    size_t old_capacity = w->capacity;
    w->slots = slots;
    w->capacity = (uint32_t)capacity;
    w->tombstones = 0;
    for (size_t i = 0; i < old_capacity; i++) {
        cs_model *m = old[i];
        if (m != NULL && m != TABLE_TOMBSTONE) {
            w->slots[table_slot_of(w, m)] = m;
        }
    }
    free(old);
    return CS_OK;
}

/* Takes over the caller's reference to `m`, whose id hashes to `hash`. */
static cs_status
table_insert(cs_worker *w, cs_model *m, uint64_t hash)
{
    if ((uint64_t)w->count + w->tombstones + 1 > table_room(w->capacity)) {
        cs_status status = table_grow(w);
        if (status != CS_OK) {
            return status;
        }
    }
    w->slots[table_find_slot(w, m->id, m->id_len, hash)] = m;
    w->count++;
    model_set_flag(m, MODEL_IN_TABLE, true);
    return CS_OK;
}

/* Returns the table's reference; the caller drops it after unlocking. */
static cs_model *
table_remove(cs_worker *w, cs_model *m)
{
    size_t i = table_slot_of(w, m);
    if (i == SIZE_MAX || w->slots[i] != m) {
        return NULL;
    }
    w->slots[i] = TABLE_TOMBSTONE;
    w->count--;
    w->tombstones++;
    model_set_flag(m, MODEL_IN_TABLE, false);
    return m;
}

/* Empties the table; returns the array of references to drop (after the
 * caller unlocks) and its length in *n. */
static cs_model **
table_take_all(cs_worker *w, size_t *n)
{
    cs_model **taken = w->slots;
    size_t capacity = w->capacity;
    size_t k = 0;
    for (size_t i = 0; i < capacity; i++) {
        cs_model *m = taken[i];
        if (m != NULL && m != TABLE_TOMBSTONE) {
            model_set_flag(m, MODEL_IN_TABLE, false);
            taken[k++] = m;
        }
    }
    w->slots = NULL;
    w->capacity = 0;
    w->count = 0;
    w->tombstones = 0;
    *n = k;
    return taken;
}

static void
drop_models(cs_model **models, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        cs_model_decref(models[i]);
    }
    free(models);
}

/* ---- workers --------------------------------------------------------- */

static cs_worker *
worker_new(uint64_t generation)
{
    cs_worker *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        return NULL;
    }
    if (cs_mutex_init(&w->lock) != 0) {
        free(w);
        return NULL;
    }
    atomic_init(&w->refcount, 1);
    atomic_init(&w->generation, generation);
    atomic_init(&w->alive, true);
    atomic_init(&w->in_flight, 0);
    atomic_init(&w->held, 0);
    atomic_init(&w->pinned, 0);
    atomic_init(&w->overhead, 0);
    atomic_init(&w->reading, 0);
    atomic_init(&w->released, false);
    atomic_fetch_add_explicit(&live_workers, 1, memory_order_relaxed);
    fork_register(&fork_workers, &w->registered);
    return w;
}

void
cs_worker_incref(cs_worker *worker)
{
    atomic_fetch_add_explicit(&worker->refcount, 1, memory_order_relaxed);
}

void
cs_worker_decref(cs_worker *worker)
{
    if (worker == NULL) {
        return;
    }
    if (atomic_fetch_sub_explicit(&worker->refcount, 1,
                                  memory_order_acq_rel) != 1) {
        return;
    }
    /* The table holds references to models, and every model holds one to
     * its worker, so a worker whose count reached 0 has an empty table. */
    fork_unregister(&worker->registered);
    free(worker->slots);
    cs_mutex_destroy(&worker->lock);
    free(worker);
    atomic_fetch_sub_explicit(&live_workers, 1, memory_order_relaxed);
}

void
cs_worker_set_data(cs_worker *worker, void *data)
{
    worker->data = data;
}

void *
cs_worker_data(const cs_worker *worker)
{
    return worker->data;
}

uint64_t
cs_worker_generation(const cs_worker *worker)
{
    return atomic_load_explicit(&((cs_worker *)worker)->generation,
                                memory_order_acquire);
}

bool
cs_worker_alive(const cs_worker *worker)
{
    return atomic_load_explicit(&((cs_worker *)worker)->alive,
                                memory_order_acquire);
}

uint32_t
cs_worker_in_flight(const cs_worker *worker)
{
    return atomic_load_explicit(&((cs_worker *)worker)->in_flight,
                                memory_order_acquire);
}

static void
worker_clear_report_locked(cs_worker *w)
{
    atomic_store_explicit(&w->in_flight, 0, memory_order_release);
    atomic_store_explicit(&w->held, 0, memory_order_relaxed);
    atomic_store_explicit(&w->pinned, 0, memory_order_relaxed);
    atomic_store_explicit(&w->overhead, 0, memory_order_relaxed);
    atomic_store_explicit(&w->reading, 0, memory_order_relaxed);
    atomic_store_explicit(&w->released, true, memory_order_relaxed);
}

/* Caller holds w->lock; returns the references to drop after unlocking. */
static cs_model **
worker_bump_locked(cs_worker *w, uint64_t generation, size_t *n)
{
    cs_model **taken = table_take_all(w, n);
    for (size_t i = 0; i < *n; i++) {
        model_mark_gone_locked(taken[i]);
    }
    atomic_store_explicit(&w->generation, generation, memory_order_release);
    atomic_store_explicit(&w->alive, true, memory_order_release);
    worker_clear_report_locked(w);
    return taken;
}

cs_status
cs_worker_bump_generation(cs_worker *worker, uint64_t generation)
{
    size_t n = 0;
    cs_model **taken;

    if (generation > CS_VALUE_MAX) {
        return CS_ERR_RANGE;
    }
    cs_mutex_lock(&worker->lock);
    if (generation <= atomic_load_explicit(&worker->generation,
                                           memory_order_relaxed)) {
        cs_mutex_unlock(&worker->lock);
        return CS_ERR_STATE;
    }
    taken = worker_bump_locked(worker, generation, &n);
    cs_mutex_unlock(&worker->lock);
    drop_models(taken, n);
    return CS_OK;
}

void
cs_worker_gone(cs_worker *worker)
{
    cs_mutex_lock(&worker->lock);
    if (!atomic_load_explicit(&worker->alive, memory_order_relaxed)) {
        /* Idempotent: what registered since reads 0 already (stale) and
         * keeps its own receipt. */
        cs_mutex_unlock(&worker->lock);
        return;
    }
    for (size_t i = 0; i < worker->capacity; i++) {
        cs_model *m = worker->slots[i];
        if (m != NULL && m != TABLE_TOMBSTONE) {
            model_mark_gone_locked(m);
        }
    }
    atomic_store_explicit(&worker->alive, false, memory_order_release);
    worker_clear_report_locked(worker);
    cs_mutex_unlock(&worker->lock);
}

void
cs_model_gone(cs_model *model)
{
    cs_worker *worker = model->worker;
    cs_mutex_lock(&worker->lock);
    if (!model_flag(model, MODEL_STALE, memory_order_relaxed)) {
        model_mark_gone_locked(model);
    }
    cs_mutex_unlock(&worker->lock);
}

cs_status
cs_worker_begin_call(cs_worker *worker)
{
    cs_mutex_lock(&worker->lock);
    if (atomic_load_explicit(&worker->alive, memory_order_relaxed)) {
        atomic_fetch_add_explicit(&worker->in_flight, 1,
                                  memory_order_release);
    }
    cs_mutex_unlock(&worker->lock);
    return CS_OK;
}

cs_status
cs_worker_end_call(cs_worker *worker)
{
    cs_status status = CS_OK;
    cs_mutex_lock(&worker->lock);
    if (atomic_load_explicit(&worker->alive, memory_order_relaxed)) {
        if (atomic_load_explicit(&worker->in_flight,
                                 memory_order_relaxed) == 0) {
            status = CS_ERR_STATE;
        }
        else {
            atomic_fetch_sub_explicit(&worker->in_flight, 1,
                                      memory_order_release);
        }
    }
    cs_mutex_unlock(&worker->lock);
    return status;
}

cs_status
cs_worker_set_report(cs_worker *worker, const uint64_t *held,
                     const uint64_t *pinned, const uint64_t *overhead)
{
    if ((held && *held > CS_VALUE_MAX) ||
        (pinned && *pinned > CS_VALUE_MAX) ||
        (overhead && *overhead > CS_VALUE_MAX)) {
        return CS_ERR_RANGE;
    }
    cs_mutex_lock(&worker->lock);
    if (!atomic_load_explicit(&worker->alive, memory_order_relaxed)) {
        /* Nobody is left to be believed (a late frame of a dead worker). */
        cs_mutex_unlock(&worker->lock);
        return CS_OK;
    }
    if (held != NULL) {
        uint64_t before =
            atomic_load_explicit(&worker->held, memory_order_relaxed);
        atomic_store_explicit(&worker->held, *held, memory_order_relaxed);
        if (*held < before) {
            atomic_store_explicit(&worker->released, true,
                                  memory_order_relaxed);
        }
    }
    if (pinned != NULL) {
        atomic_store_explicit(&worker->pinned, *pinned,
                              memory_order_relaxed);
    }
    if (overhead != NULL) {
        atomic_store_explicit(&worker->overhead, *overhead,
                              memory_order_relaxed);
    }
    cs_mutex_unlock(&worker->lock);
    return CS_OK;
}

void
cs_worker_report(const cs_worker *worker, uint64_t *held, uint64_t *pinned,
                 uint64_t *overhead)
{
    cs_worker *w = (cs_worker *)worker;
    if (held) {
        *held = atomic_load_explicit(&w->held, memory_order_relaxed);
    }
    if (pinned) {
        *pinned = atomic_load_explicit(&w->pinned, memory_order_relaxed);
    }
    if (overhead) {
        *overhead = atomic_load_explicit(&w->overhead, memory_order_relaxed);
    }
}

uint64_t
cs_worker_reading(const cs_worker *worker)
{
    return atomic_load_explicit(&((cs_worker *)worker)->reading,
                                memory_order_relaxed);
}

cs_status
cs_worker_set_reading(cs_worker *worker, uint64_t used_bytes)
{
    if (used_bytes > CS_VALUE_MAX) {
        return CS_ERR_RANGE;
    }
    cs_mutex_lock(&worker->lock);
    uint64_t before =
        atomic_load_explicit(&worker->reading, memory_order_relaxed);
    atomic_store_explicit(&worker->reading, used_bytes,
                          memory_order_relaxed);
    if (used_bytes < before) {
        atomic_store_explicit(&worker->released, true, memory_order_relaxed);
    }
    cs_mutex_unlock(&worker->lock);
    return CS_OK;
}

cs_status
cs_worker_register_model(cs_worker *worker, uint64_t generation,
                         const char *id, size_t id_len, uint64_t size,
                         cs_model **out)
{
    cs_model **taken = NULL;
    size_t n_taken = 0;
    cs_status status = CS_OK;
    cs_model *m;

    *out = NULL;
    if (size > CS_VALUE_MAX || generation > CS_VALUE_MAX ||
        id_len > CS_MODEL_ID_MAX) {
        return CS_ERR_RANGE;
    }
    uint64_t hash = hash_id(id, id_len);
    cs_mutex_lock(&worker->lock);
    uint64_t current =
        atomic_load_explicit(&worker->generation, memory_order_relaxed);
    if (generation > current) {
        taken = worker_bump_locked(worker, generation, &n_taken);
        current = generation;
    }
    m = generation == current ? table_lookup(worker, id, id_len, hash)
                              : NULL;
    if (m != NULL) {
        if (m->size != size) {
            status = CS_ERR_SIZE_MISMATCH;
            goto done;
        }
        m->handles++;
        cs_model_incref(m);
        *out = m;
        goto done;
    }
    m = model_new(worker, generation, id, id_len, size);
    if (m == NULL) {
        status = CS_ERR_NOMEM;
        goto done;
    }
    if (generation < current) {
        /* A stand-in of an old process: it answers, as offloaded. */
        model_mark_gone_locked(m);
        *out = m;
        goto done;
    }
    if (!atomic_load_explicit(&worker->alive, memory_order_relaxed)) {
        /* Registered on a worker already gone: on the table (its id stays
         * known, like its siblings'), reading 0, its receipt untouched. */
        model_set_flag(m, MODEL_STALE, true);
    }
    cs_model_incref(m); /* the table's reference */
    status = table_insert(worker, m, hash);
    if (status != CS_OK) {
        /* Both references go; m was never visible to anyone. */
        cs_mutex_unlock(&worker->lock);
        model_decref_by(m, 2);
        drop_models(taken, n_taken);
        return status;
    }
    m->handles = 1;
    *out = m;
done:
    cs_mutex_unlock(&worker->lock);
    drop_models(taken, n_taken);
    return status;
}

void
cs_model_release_handle(cs_model *model)
{
    cs_worker *w = model->worker;
    cs_model *table_ref = NULL;

    cs_mutex_lock(&w->lock);
    if (model->handles > 0 && --model->handles == 0 &&
        model_flag(model, MODEL_IN_TABLE, memory_order_relaxed)) {
        table_ref = table_remove(w, model);
    }
    cs_mutex_unlock(&w->lock);
    /* The table's reference (when it went) and the handle's, at once. */
    model_decref_by(model, table_ref == model ? 2 : 1);
}

cs_model *
cs_worker_find_model(cs_worker *worker, const char *id, size_t id_len)
{
    cs_mutex_lock(&worker->lock);
    cs_model *m = table_lookup(worker, id, id_len, hash_id(id, id_len));
    if (m != NULL) {
        cs_model_incref(m);
    }
    cs_mutex_unlock(&worker->lock);
    return m;
}

cs_status
cs_model_apply_echo(cs_model *model, uint64_t loaded, int64_t seq,
                    cs_source source, bool unmapped, int in_flight)
{
    cs_worker *w = model->worker;
    cs_status status = CS_OK;

    if (loaded > model->size || (seq < 0 && seq != CS_SEQ_NONE) ||
        (unsigned)source >= CS_SOURCE_COUNT) {
        return CS_ERR_RANGE;
    }
    cs_mutex_lock(&w->lock);
    if (model_flag(model, MODEL_STALE, memory_order_relaxed)) {
        status = CS_ERR_STALE;
        goto done;
    }
    int64_t kept = atomic_load_explicit(&model->rc_seq, memory_order_relaxed);
    if (seq == CS_SEQ_NONE) {
        seq = kept;
    }
    else if (seq < kept) {
        status = CS_ERR_OLDER; /* the newer word is written already */
        goto done;
    }
    bool busy = in_flight < 0 ? atomic_load_explicit(&w->in_flight,
                                                     memory_order_relaxed) > 0
                              : in_flight != 0;
    receipt_write_locked(model, loaded, seq, source);
    peak_update_locked(model, loaded, unmapped, busy);
    model_set_flag(model, MODEL_DEFERRED, false);
done:
    cs_mutex_unlock(&w->lock);
    return status;
}

/* The census rule for one model; caller holds the worker lock and has
 * validated the values.  Returns whether the entry was written. */
static bool
census_apply_locked(cs_model *m, bool has_seq, int64_t seq,
                    uint64_t resident, bool busy)
{
    int64_t kept = atomic_load_explicit(&m->rc_seq, memory_order_relaxed);
    if (model_flag(m, MODEL_STALE, memory_order_relaxed)) {
        return false;
    }
    if (has_seq) {
        if (seq < kept) {
            return false; /* strictly older: a reply superseded it */
        }
        kept = seq;
    }
    uint64_t loaded = resident < m->size ? resident : m->size;
    receipt_write_locked(m, loaded, kept, CS_SOURCE_CENSUS);
    peak_update_locked(m, loaded, false, busy);
    model_set_flag(m, MODEL_DEFERRED, false);
    return true;
}

cs_status
cs_model_apply_census(cs_model *model, bool has_seq, int64_t seq,
                      uint64_t resident, bool *applied)
{
    cs_worker *w = model->worker;
    *applied = false;
    if (resident > CS_VALUE_MAX || (has_seq && seq < 0)) {
        return CS_ERR_RANGE;
    }
    cs_mutex_lock(&w->lock);
    if (atomic_load_explicit(&w->alive, memory_order_relaxed)) {
        bool busy =
            atomic_load_explicit(&w->in_flight, memory_order_relaxed) > 0;
        *applied = census_apply_locked(model, has_seq, seq, resident, busy);
    }
    cs_mutex_unlock(&w->lock);
    return CS_OK;
}

/* A census entry's model, by entry: what pass 1 of a census finds. */
typedef struct {
    cs_model *model;
    size_t index;
} census_hit;

static int
hit_order(const void *a, const void *b)
{
    const census_hit *x = a, *y = b;
    if (x->model != y->model) {
        return (uintptr_t)x->model < (uintptr_t)y->model ? -1 : 1;
    }
    return x->index < y->index ? -1 : x->index > y->index;
}

/* The first of hits[0, n) (in census order) whose model an earlier entry
 * names too, or n.  Sorts `hits`. */
static size_t
first_duplicate(census_hit *hits, size_t n)
{
    size_t first = n;
    if (n > 1) {
        qsort(hits, n, sizeof(*hits), hit_order);
    }
    for (size_t i = 1; i < n; i++) {
        if (hits[i].model == hits[i - 1].model && hits[i].index < first) {
            first = hits[i].index;
        }
    }
    return first;
}

cs_status
cs_worker_apply_census(cs_worker *worker, const cs_census_entry *entries,
                       size_t n, size_t *applied, size_t *bad_index)
{
    cs_status status = CS_OK;
    size_t count = 0, bad = n;

    if (applied != NULL) {
        *applied = 0;
    }
    census_hit *hits = n ? malloc(n * sizeof(*hits)) : NULL;
    if (n && hits == NULL) {
        return CS_ERR_NOMEM;
    }
    cs_mutex_lock(&worker->lock);
    /* Pass 1: validate everything; nothing is written. */
    for (size_t i = 0; i < n && status == CS_OK; i++) {
        const cs_census_entry *e = &entries[i];
        hits[i].index = i;
        hits[i].model = NULL;
        if (e->resident > CS_VALUE_MAX || (e->has_seq && e->seq < 0)) {
            status = CS_ERR_RANGE;
        }
        else {
            hits[i].model = table_lookup(worker, e->id, e->id_len,
                                         hash_id(e->id, e->id_len));
            status = hits[i].model ? CS_OK : CS_ERR_UNKNOWN_ID;
        }
        if (status != CS_OK) {
            bad = i;
        }
    }
    /* A duplicate before the first other error is the first error. */
    size_t duplicate = first_duplicate(hits, bad);
    if (duplicate < bad) {
        status = CS_ERR_DUPLICATE_ID;
        bad = duplicate;
    }
    if (status != CS_OK) {
        if (bad_index != NULL) {
            *bad_index = bad;
        }
        goto done;
    }
    if (!atomic_load_explicit(&worker->alive, memory_order_relaxed)) {
        goto done; /* valid, but nobody is there to be believed */
    }
    /* Pass 2: apply (each model once, so in any order). */
    bool busy =
        atomic_load_explicit(&worker->in_flight, memory_order_relaxed) > 0;
    for (size_t i = 0; i < n; i++) {
        const cs_census_entry *e = &entries[hits[i].index];
        count += census_apply_locked(hits[i].model, e->has_seq, e->seq,
                                     e->resident, busy);
    }
done:
    cs_mutex_unlock(&worker->lock);
    free(hits);
    if (applied != NULL) {
        *applied = count;
    }
    return status;
}

/* The figure of `m` in `figures` (sorted by address), else its receipt. */
static uint64_t
figure_of(const cs_model *m, const cs_figure *figures, size_t n)
{
    size_t low = 0, high = n;
    while (low < high) {
        size_t mid = low + (high - low) / 2;
        if ((uintptr_t)figures[mid].model < (uintptr_t)m) {
            low = mid + 1;
        }
        else {
            high = mid;
        }
    }
    if (low < n && figures[low].model == m) {
        return figures[low].loaded;
    }
    return atomic_load_explicit(&((cs_model *)m)->rc_loaded,
                                memory_order_relaxed);
}

void
cs_worker_charge(cs_worker *worker, uint64_t floor_bytes,
                 const cs_figure *figures, size_t n, cs_charge *out)
{
    memset(out, 0, sizeof(*out));
    cs_mutex_lock(&worker->lock);
    if (!atomic_load_explicit(&worker->alive, memory_order_relaxed)) {
        cs_mutex_unlock(&worker->lock);
        return;
    }
    out->alive = true;
    out->floor = floor_bytes;
    out->in_flight =
        atomic_load_explicit(&worker->in_flight, memory_order_relaxed);
    out->held = atomic_load_explicit(&worker->held, memory_order_relaxed);
    out->reading =
        atomic_load_explicit(&worker->reading, memory_order_relaxed);
    for (size_t i = 0; i < worker->capacity; i++) {
        cs_model *m = worker->slots[i];
        if (m == NULL || m == TABLE_TOMBSTONE) {
            continue;
        }
        out->models++;
        out->sum_sizes = add_saturating(out->sum_sizes, m->size);
        out->sum_loaded = add_saturating(out->sum_loaded,
                                         figure_of(m, figures, n));
        out->sum_peak = add_saturating(
            out->sum_peak,
            atomic_load_explicit(&m->peak, memory_order_relaxed));
    }
    cs_mutex_unlock(&worker->lock);

    /* The driver's reading counts the CUDA context the floor stands for. */
    uint64_t beyond = out->reading > floor_bytes ? out->reading - floor_bytes
                                                 : 0;
    out->held_from_reading = beyond > out->held;
    uint64_t body;
    if (out->in_flight > 0) {
        body = out->sum_sizes;
    }
    else {
        body = max_u64(max_u64(out->sum_loaded, out->sum_peak),
                       max_u64(out->held, beyond));
    }
    out->charge = add_saturating(body, floor_bytes);
}

/* ---- ledger ---------------------------------------------------------- */

cs_ledger *
cs_ledger_new(uint64_t floor_bytes)
{
    cs_ledger *l = calloc(1, sizeof(*l));
    if (l == NULL) {
        return NULL;
    }
    if (cs_mutex_init(&l->lock) != 0) {
        free(l);
        return NULL;
    }
    l->floor = floor_bytes;
    fork_register(&fork_ledgers, &l->registered);
    return l;
}

static void
worker_empty_table(cs_worker *w)
{
    size_t n = 0;
    cs_mutex_lock(&w->lock);
    cs_model **taken = table_take_all(w, &n);
    cs_mutex_unlock(&w->lock);
    drop_models(taken, n);
}

void
cs_ledger_free(cs_ledger *ledger)
{
    if (ledger == NULL) {
        return;
    }
    fork_unregister(&ledger->registered);
    for (size_t i = 0; i < ledger->count; i++) {
        worker_empty_table(ledger->workers[i]);
        cs_worker_decref(ledger->workers[i]);
    }
    free(ledger->workers);
    cs_mutex_destroy(&ledger->lock);
    free(ledger);
}

uint64_t
cs_ledger_floor(const cs_ledger *ledger)
{
    return ledger->floor;
}

cs_worker *
cs_ledger_add_worker(cs_ledger *ledger, uint64_t generation)
{
    if (generation > CS_VALUE_MAX) {
        return NULL;
    }
    cs_worker *w = worker_new(generation);
    if (w == NULL) {
        return NULL;
    }
    cs_mutex_lock(&ledger->lock);
    if (ledger->count == ledger->capacity) {
        size_t capacity = ledger->capacity ? ledger->capacity * 2 : 4;
        /* An array of pointers: sizeof(cs_worker *) is meant. */
        /* NOLINTBEGIN(bugprone-sizeof-expression) */
        cs_worker **grown =
            realloc(ledger->workers, capacity * sizeof(*grown));
        /* NOLINTEND(bugprone-sizeof-expression) */
        if (grown == NULL) {
            cs_mutex_unlock(&ledger->lock);
            cs_worker_decref(w);
            return NULL;
        }
        ledger->workers = grown;
        ledger->capacity = capacity;
    }
    cs_worker_incref(w); /* the ledger's */
    w->on_books = true;
    ledger->workers[ledger->count++] = w;
    cs_mutex_unlock(&ledger->lock);
    return w;
}

void
cs_ledger_forget_worker(cs_ledger *ledger, cs_worker *worker)
{
    bool found = false;
    cs_mutex_lock(&ledger->lock);
    for (size_t i = 0; i < ledger->count; i++) {
        if (ledger->workers[i] == worker) {
            memmove(&ledger->workers[i], &ledger->workers[i + 1],
                    (ledger->count - i - 1) * sizeof(cs_worker *));
            ledger->count--;
            worker->on_books = false;
            if (atomic_exchange_explicit(&worker->released, false,
                                         memory_order_relaxed)) {
                ledger->released = true;
            }
            found = true;
            break;
        }
    }
    cs_mutex_unlock(&ledger->lock);
    if (found) {
        worker_empty_table(worker);
        cs_worker_decref(worker);
    }
}

size_t
cs_ledger_worker_count(cs_ledger *ledger)
{
    cs_mutex_lock(&ledger->lock);
    size_t n = ledger->count;
    cs_mutex_unlock(&ledger->lock);
    return n;
}

/* Caller holds ledger->lock. */
static uint64_t
ledger_total_charge_locked(cs_ledger *ledger, const cs_figure *figures,
                           size_t n, bool *released)
{
    uint64_t total = 0;
    for (size_t i = 0; i < ledger->count; i++) {
        cs_charge charge;
        cs_worker *w = ledger->workers[i];
        cs_worker_charge(w, ledger->floor, figures, n, &charge);
        total = add_saturating(total, charge.charge);
        if (released != NULL &&
            atomic_exchange_explicit(&w->released, false,
                                     memory_order_relaxed)) {
            *released = true;
        }
    }
    return total;
}

uint64_t
cs_ledger_total_charge(cs_ledger *ledger, const cs_figure *figures,
                       size_t n)
{
    cs_mutex_lock(&ledger->lock);
    uint64_t total = ledger_total_charge_locked(ledger, figures, n, NULL);
    cs_mutex_unlock(&ledger->lock);
    return total;
}

uint64_t
cs_ledger_reserve(cs_ledger *ledger, uint64_t base, uint64_t total_bytes,
                  bool process_local, const cs_figure *figures, size_t n)
{
    if (!process_local) {
        /* Device-wide free memory already lacks every worker byte. */
        return base;
    }
    cs_mutex_lock(&ledger->lock);
    bool released = ledger->released;
    ledger->released = false;
    uint64_t target = add_saturating(
        base, ledger_total_charge_locked(ledger, figures, n, &released));
    uint64_t cap = total_bytes / 4 * 3 + (total_bytes % 4) * 3 / 4;
    if (total_bytes > 0 && target > cap) {
        target = cap;
    }
    if (target < base) {
        target = base;
    }
    uint64_t value = target;
    if (ledger->has_published && target < ledger->published && !released) {
        value = ledger->published; /* shrink only after a release */
    }
    if (total_bytes > 0) {
        /* The cap holds for a kept value too (the card's size may arrive
         * after the first call, or the base may drop): a reserve above 75%
         * of the card would starve ComfyUI.  Never below the base. */
        if (value > cap) {
            value = cap;
        }
        if (value < base) {
            value = base;
        }
    }
    ledger->published = value;
    ledger->has_published = true;
    uint64_t published = value;
    cs_mutex_unlock(&ledger->lock);
    return published;
}
