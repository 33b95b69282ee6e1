/*
 * comfy_standin/ledger.h -- the residency ledger: workers, their models'
 * receipts, and what each worker costs the card.
 *
 * Plain C11, no Python.  Every function is safe to call from any thread,
 * with or without the GIL.
 *
 * Vocabulary (docs/semantics.md, docs/reserve.md):
 *
 *   receipt   what a worker last said one of its models has on the card:
 *             (loaded bytes, worker seq, monotonic time, source).
 *   census    the worker's node-boundary list of receipts for all models.
 *   charge    what a worker costs the card, used to size the reserve.
 *
 * Ownership: the three object kinds are reference counted.  A ledger owns
 * its workers; a worker owns the models registered under its current
 * generation (its table); a model owns its worker.  The model -> worker ->
 * model cycle is broken explicitly: cs_model_release_handle() drops a model
 * from its table once no handle holder (a stand-in) is left, and
 * cs_ledger_forget_worker() / cs_ledger_free() empty the tables.
 *
 * Thread safety, per field, is written beside each field in ledger.c.  In
 * short: one mutex per worker serialises every writer of that worker and of
 * its models (so writers are linearizable per worker); a model's receipt is
 * published through a seqlock so readers never take a lock and never see a
 * torn (loaded, seq) pair; scalar counters are C11 atomics.
 */
#ifndef COMFY_STANDIN_LEDGER_H
#define COMFY_STANDIN_LEDGER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CS_LEDGER_ABI_VERSION 2

/* Byte counts and seqs are carried as 64-bit integers; every public input
 * is limited to [0, CS_VALUE_MAX] so sums stay meaningful (they saturate). */
#define CS_VALUE_MAX ((uint64_t)INT64_MAX)

/* The longest model id a record carries, in bytes (its length is kept in
 * 16 bits: a record is one small allocation per stand-in). */
#define CS_MODEL_ID_MAX ((size_t)UINT16_MAX)

/* A receipt that has never carried a worker seq (a registration, or a
 * command reply from a worker too old to send one). Older than any seq. */
#define CS_SEQ_NONE ((int64_t)-1)

/* Default per-process floor: CUDA context and handles, measured by
 * comfy-env at 276-300 MiB per live worker (docs/comfyui.md). */
#define CS_DEFAULT_FLOOR ((uint64_t)300 << 20)

typedef enum cs_source {
    CS_SOURCE_REGISTERED = 0,
    CS_SOURCE_LOAD_ECHO,
    CS_SOURCE_UNLOAD_ECHO,
    CS_SOURCE_DETACH_ECHO,
    CS_SOURCE_CENSUS,
    CS_SOURCE_BOARD,
    CS_SOURCE_ASSIGNED,
    CS_SOURCE_WORKER_GONE,
    CS_SOURCE_COUNT
} cs_source;

typedef enum cs_status {
    CS_OK = 0,
    CS_ERR_NOMEM,        /* allocation failed; nothing changed */
    CS_ERR_RANGE,        /* a value outside [0, CS_VALUE_MAX] or > size */
    CS_ERR_UNKNOWN_ID,   /* a census names a model the worker lacks */
    CS_ERR_DUPLICATE_ID, /* a census names one model twice */
    CS_ERR_SIZE_MISMATCH,/* re-registration of an id with another size */
    CS_ERR_STALE,        /* the model's generation is over or worker gone */
    CS_ERR_STATE,        /* e.g. end_call without a begin_call */
    CS_ERR_OLDER         /* an echo older than the receipt: not written */
} cs_status;

typedef struct cs_receipt {
    uint64_t loaded;  /* bytes on the card, 0 <= loaded <= size */
    int64_t seq;      /* the worker's seq, or CS_SEQ_NONE */
    uint64_t time_ns; /* CLOCK_MONOTONIC when it was written */
    cs_source source;
} cs_receipt;

typedef struct cs_ledger cs_ledger;
typedef struct cs_worker cs_worker;
typedef struct cs_model cs_model;

/* One census entry (a `_vram_report["residency"]` item, decoded). */
typedef struct cs_census_entry {
    const char *id;
    size_t id_len;
    bool has_seq;      /* false: an old worker; applies like a reply */
    int64_t seq;       /* >= 0 when has_seq */
    uint64_t resident; /* <= CS_VALUE_MAX; clamped to the model's size */
} cs_census_entry;

/* A worker's charge and the figures it came from (docs/reserve.md). */
typedef struct cs_charge {
    uint64_t charge;     /* what the worker costs the card, floor included */
    uint64_t sum_sizes;  /* sum of model sizes: the in-flight supremum */
    uint64_t sum_loaded; /* sum of figures (receipts unless given) */
    uint64_t sum_peak;   /* sum of admission peaks */
    uint64_t held;       /* last reported held (max(aimdo, torch)) */
    uint64_t reading;    /* probe's per-pid reading, 0 when none */
    uint64_t floor;
    uint32_t in_flight;
    uint32_t models;
    bool alive;
    bool held_from_reading; /* reading - floor, not the report, set `held` */
} cs_charge;

/* A model's figure when it is not its receipt: what the host reads of it
 * (a newer valid board reading), from the function its stand-ins answer
 * loaded_size() with, so the charge and the stand-ins agree
 * (docs/semantics.md, "Which word wins").  `model` is only compared. */
typedef struct cs_figure {
    const cs_model *model;
    uint64_t loaded;
} cs_figure;

const char *cs_source_name(cs_source source);
const char *cs_status_message(cs_status status);
/* CLOCK_MONOTONIC in nanoseconds (the receipts' clock). */
uint64_t cs_monotonic_ns(void);

/* Process-wide counts of workers and models not yet freed (leak checks in
 * tests; a handful of atomic adds, always on). */
void cs_ledger_live_counts(int64_t *workers, int64_t *models);

/* ---- ledger ---------------------------------------------------------- */

cs_ledger *cs_ledger_new(uint64_t floor_bytes); /* NULL on ENOMEM */
/* Forgets every worker (their tables are emptied) and drops the ledger's
 * reference.  Models still held by stand-ins stay valid and read as they
 * last did; workers stay valid while a model references them. */
void cs_ledger_free(cs_ledger *ledger);
uint64_t cs_ledger_floor(const cs_ledger *ledger);

/* Creates a worker under `generation`.  Returns a new reference (the
 * caller's), the ledger keeps its own.  NULL on ENOMEM. */
cs_worker *cs_ledger_add_worker(cs_ledger *ledger, uint64_t generation);
/* Drops the worker from the ledger's books (no further charges) and empties
 * its table.  A release it marked and no reserve has seen yet stays with
 * the ledger.  The caller's references stay valid. */
void cs_ledger_forget_worker(cs_ledger *ledger, cs_worker *worker);
size_t cs_ledger_worker_count(cs_ledger *ledger);

/* The reserve to publish as EXTRA_RESERVED_VRAM (docs/reserve.md), each
 * worker charged with `figures` (cs_worker_charge; one table for all).
 * process_local false (Linux, device-wide free memory): `base`.
 * process_local true (Windows WDDM): base + sum of charges, capped at 75%
 * of `total_bytes` (no cap when total is 0), never below base; it grows at
 * once and shrinks only after a release receipt since the last call.  The
 * cap bounds a kept value too. */
uint64_t cs_ledger_reserve(cs_ledger *ledger, uint64_t base,
                           uint64_t total_bytes, bool process_local,
                           const cs_figure *figures, size_t n);
/* Sum of every live worker's charge (figures as cs_ledger_reserve). */
uint64_t cs_ledger_total_charge(cs_ledger *ledger, const cs_figure *figures,
                                size_t n);

/* ---- workers --------------------------------------------------------- */

void cs_worker_incref(cs_worker *worker);
void cs_worker_decref(cs_worker *worker);

/* A pointer the caller keeps with the worker (a binding: its object for
 * the worker), NULL until set.  Not synchronised: set it before the
 * worker is shared. */
void cs_worker_set_data(cs_worker *worker, void *data);
void *cs_worker_data(const cs_worker *worker);

uint64_t cs_worker_generation(const cs_worker *worker);
bool cs_worker_alive(const cs_worker *worker);
uint32_t cs_worker_in_flight(const cs_worker *worker);

/* A restart: `generation` must be greater than the current one (else
 * CS_ERR_STATE).  Every model of the old generation reads 0 with source
 * "worker gone" (its VRAM went with the old process) and leaves the table;
 * the worker is alive again with no calls in flight and no report. */
cs_status cs_worker_bump_generation(cs_worker *worker, uint64_t generation);
/* The process died: every model reads 0 ("worker gone"), calls in flight
 * and the report are cleared, the worker charges nothing.  Idempotent. */
void cs_worker_gone(cs_worker *worker);
/* This model's process died: it reads 0 ("worker gone"), its peak and
 * deferred flag clear and it is stale, whether or not it is still in its
 * worker's table (a forgotten worker's models are not).  Idempotent. */
void cs_model_gone(cs_model *model);

/* In-flight bracketing of a worker call (docs/reserve.md).  end_call without
 * a matching begin_call returns CS_ERR_STATE and changes nothing. */
cs_status cs_worker_begin_call(cs_worker *worker);
cs_status cs_worker_end_call(cs_worker *worker);

/* The scalar part of a `_vram_report`.  A NULL pointer leaves that figure
 * as it was.  Values above CS_VALUE_MAX: CS_ERR_RANGE, nothing changed. */
cs_status cs_worker_set_report(cs_worker *worker, const uint64_t *held,
                               const uint64_t *pinned,
                               const uint64_t *overhead);
void cs_worker_report(const cs_worker *worker, uint64_t *held,
                      uint64_t *pinned, uint64_t *overhead);
/* The probe's per-pid reading of the worker's process (0: none), CUDA
 * context included.  What it holds beyond the floor is a floor under
 * `held` in the charge. */
cs_status cs_worker_set_reading(cs_worker *worker, uint64_t used_bytes);
uint64_t cs_worker_reading(const cs_worker *worker);

/* Registers model `id` under `generation`.
 * - generation older than the worker's: the model is created stale (reads
 *   0, "worker gone"), outside the table, so an old stand-in still answers.
 * - generation newer: the worker is bumped first (a restart).
 * - id already in the table: the same model is returned when the size
 *   matches (CS_ERR_SIZE_MISMATCH otherwise); stand-ins of one worker
 *   model share one receipt.
 * CS_ERR_RANGE: size or generation above CS_VALUE_MAX, or an id longer
 * than CS_MODEL_ID_MAX bytes (refused before the id is read).
 * On CS_OK *out is a new handle: release it with cs_model_release_handle.
 */
cs_status cs_worker_register_model(cs_worker *worker, uint64_t generation,
                                   const char *id, size_t id_len,
                                   uint64_t size, cs_model **out);

/* O(1) average lookup in the current generation's table; a new reference
 * (release with cs_model_decref) or NULL. */
cs_model *cs_worker_find_model(cs_worker *worker, const char *id,
                               size_t id_len);

/* Applies a census to one worker (docs/semantics.md), all or nothing: every
 * entry is validated first (unknown id, duplicate id, resident above
 * CS_VALUE_MAX, negative seq); on an error nothing changed and *bad_index
 * names the entry.  Then per entry: a seq strictly older than the
 * receipt's is dropped (a tie goes to the census); resident is clamped to
 * [0, size].  Models missing from the census keep their receipt.  A gone
 * worker validates, then applies nothing (CS_OK, *applied 0): nobody is
 * left to be believed.  *applied (may be NULL) counts the entries
 * written. */
cs_status cs_worker_apply_census(cs_worker *worker,
                                 const cs_census_entry *entries, size_t n,
                                 size_t *applied, size_t *bad_index);

/* One census entry applied to one model, the same rules as
 * cs_worker_apply_census (for censuses keyed by stand-in rather than by
 * worker).  A stale model, or a seq strictly older than the receipt's, is
 * skipped (CS_OK, *applied false).  resident above CS_VALUE_MAX or a
 * negative seq: CS_ERR_RANGE. */
cs_status cs_model_apply_census(cs_model *model, bool has_seq, int64_t seq,
                                uint64_t resident, bool *applied);

/* The worker's charge (docs/reserve.md):
 *   gone:      0
 *   in flight: sum of sizes + floor
 *   idle:      max(sum of figures, sum of peaks, held, reading - floor)
 *              + floor (the reading counts the context the floor is)
 * A model's figure is its entry in `figures` (n entries, sorted by model
 * address; NULL and 0 for none), else its receipt. */
void cs_worker_charge(cs_worker *worker, uint64_t floor_bytes,
                      const cs_figure *figures, size_t n, cs_charge *out);

/* ---- models ---------------------------------------------------------- */

void cs_model_incref(cs_model *model);
void cs_model_decref(cs_model *model);
/* Drops a handle taken by cs_worker_register_model; the last handle takes
 * the model out of its worker's table (and drops that reference too). */
void cs_model_release_handle(cs_model *model);

const char *cs_model_id(const cs_model *model, size_t *len);
/* Counts a malformed reply a binding rejected; returns the new count
 * (wraps at 2**32).  Any thread. */
uint32_t cs_model_bad_reply(cs_model *model);
uint32_t cs_model_bad_replies(const cs_model *model);
uint64_t cs_model_size(const cs_model *model);
uint64_t cs_model_generation(const cs_model *model);
cs_worker *cs_model_worker(const cs_model *model); /* borrowed */
/* True when the model's generation is over or its worker is gone. */
bool cs_model_stale(const cs_model *model);

/* Lock-free, never blocks, never torn.  Stale models read 0.  Returns
 * the (even) version it was read at (cs_model_version). */
uint32_t cs_model_read(const cs_model *model, cs_receipt *out);
uint64_t cs_model_loaded(const cs_model *model);
uint64_t cs_model_admission_peak(const cs_model *model);


/* A command echo (docs/semantics.md, "Which word wins"): written unless
 * its seq is strictly older than the receipt's (CS_ERR_OLDER: two
 * threads' replies applied out of order, the newer already written).  A
 * tie, a receipt with no seq yet, or seq CS_SEQ_NONE (an older worker's
 * reply, which keeps the receipt's seq) writes.  `loaded` above the size
 * is CS_ERR_RANGE (a bad reply; nothing written).  `unmapped` (a full
 * detach) zeroes the admission peak; otherwise the peak rises to `loaded`
 * while in flight and drops to `loaded` when idle.  in_flight < 0 means
 * "ask the worker" (its in-flight count > 0).  A stale model: CS_ERR_STALE,
 * nothing written. */
cs_status cs_model_apply_echo(cs_model *model, uint64_t loaded, int64_t seq,
                              cs_source source, bool unmapped,
                              int in_flight);

/* Raises the admission peak to min(bytes, size) if it is lower; never
 * lowers it, never touches the receipt (comfy-env's peak-only pass for a
 * call path with no node boundary).  Stale: CS_ERR_STALE. */
cs_status cs_model_raise_peak(cs_model *model, uint64_t bytes);

/* Eviction was refused by a live worker (docs/semantics.md).  Cleared by the
 * next echo. */
void cs_model_set_eviction_deferred(cs_model *model, bool deferred);
bool cs_model_eviction_deferred(const cs_model *model);

#ifdef __cplusplus
}
#else
#include <stdatomic.h>

/* The receipt's seqlock word: even, advanced by every write (and by the
 * model turning stale), odd while a writer is inside.  A reader that saw
 * an even version and sees it again knows that nothing it read changed.
 * Inline for the hot getters of a binding: it is a record's first word. */
static inline uint32_t
cs_model_version(const cs_model *model)
{
    return atomic_load_explicit((_Atomic uint32_t *)(void *)model,
                                memory_order_acquire);
}
#endif

#endif /* COMFY_STANDIN_LEDGER_H */
