/*
 * standin.h -- what the parts of the stand-in share (private to the
 * extension module): the object layouts of StandIn and its
 * clone_base_uuid sentinel, and the functions one part calls in another.
 *
 *   standin.c   the type: construction, lifetime, what ComfyUI reads
 *   inner.c     what it answers as its own inner module (`model.model`):
 *               the device, its sentinel, and the board it reads
 *   roster.c    a worker's roster of stand-ins and adoption onto it
 *   commands.c  commands to the worker (load, unload, detach)
 *   sync.c      the state sync: apply_echo, apply_residency, raise_peak
 *
 * Thread safety: the receipt lives in the C core (seqlock; any thread).
 * The fields below are immutable after construction except those marked
 * GIL, which are touched only with the GIL held, by code that runs no
 * Python between reading and writing them (this module does not claim
 * free-threading support).
 */
#ifndef COMFY_STANDIN_STANDIN_H
#define COMFY_STANDIN_STANDIN_H

#include "binding.h"
#include "board_binding.h"

#include "comfy_standin/ledger.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    PyObject *model_id; /* strong str; immutable (for the repr) */
} SentinelObject;

/* The words a board reading's verdict depends on, besides the clock
 * (standin.c, board_answer). */
typedef struct {
    uint64_t seq;       /* the slot's seqlock word (segment) */
    uint64_t heartbeat; /* the header's (segment) */
    uint64_t owner;     /* the header's owner pid (segment) */
    uint64_t changes;   /* the host's view (cs_board_changes) */
    uint64_t epoch;     /* cs_standin_reread_boards */
    uint32_t version;   /* the receipt's */
} cs_board_seen;

/* The board a stand-in reads (attach_board): PyMem, GIL. */
typedef struct {
    PyObject *object; /* strong Board (host side) */
    uint32_t slot;
    uint64_t tag;     /* the slot's tag when attached */
    /* The Board's core handle when attached (NULL: keep no verdict), and
     * the segment's words in its mapping: read only while the Board still
     * has that handle (it has none once closed). */
    void *handle;
    const _Atomic uint64_t *seq_word, *heartbeat_word, *owner_word,
        *changes_word;
    /* The verdict kept (standin.c, board_decide) and what it was decided
     * from. */
    cs_receipt verdict;
    cs_board_seen seen;
    bool decided;
    uint64_t answered; /* the figure the stand-in's `answer` is */
} cs_board_link;

#ifdef __linux__
/* Moved by cs_standin_reread_boards (inner.c). */
extern _Atomic uint64_t cs_board_epoch;

/* True while `board`'s kept verdict holds: nothing it was decided from
 * moved but the clock (inner.c, board_decide).  The handle first: the
 * words are in a mapping a closed Board no longer has.  No call. */
static inline bool
cs_board_verdict_holds(const cs_board_link *board, const cs_model *record)
{
    return board->decided &&
           cs_board_object_handle(board->object) == board->handle &&
           cs_model_version(record) == board->seen.version &&
           atomic_load_explicit(board->seq_word, memory_order_acquire) ==
               board->seen.seq &&
           atomic_load_explicit(board->heartbeat_word,
                                memory_order_acquire) ==
               board->seen.heartbeat &&
           atomic_load_explicit(board->owner_word, memory_order_acquire) ==
               board->seen.owner &&
           atomic_load_explicit(board->changes_word, memory_order_acquire) ==
               board->seen.changes &&
           atomic_load_explicit(&cs_board_epoch, memory_order_acquire) ==
               board->seen.epoch;
}
#endif

/* What few stand-ins need, made on first need (inner.c): a device
 * ComfyUI or comfy-env assigned, a board, the sentinel.  PyMem; GIL. */
typedef struct {
    PyObject *device_assigned;   /* strong or NULL */
    uint32_t device_assigned_at; /* the receipt's version when assigned */
    cs_board_link *board;        /* or NULL */
    PyObject *sentinel;          /* the clone_base_uuid, or NULL */
} cs_standin_extra;

/* The id, size and generation live in the record, the worker in the
 * books.  A stand-in is its own inner module (`model` is itself: ComfyUI
 * and comfy-env read `model.model` for a device and a figure only).  Until
 * `extra` exists no device was assigned, no board attached and no
 * sentinel made, and the stand-in answers from the record and its
 * profile.  Eight words: 96 bytes with the GC header, one pymalloc size
 * class (bench/RESULTS.md). */
struct StandInObject {
    PyObject_HEAD
    cs_model *record;   /* a handle (cs_model_release_handle); set before
                         * the object is tracked; immutable */
    PyObject *pool;     /* strong; immutable; NULL once GC-cleared */
    /* Strong tuple (load_device, offload_device, kind); immutable; NULL
     * once GC-cleared.  Shared with the stand-in made before it under the
     * same ledger when they hold the same three objects. */
    PyObject *profile;
    cs_standin_extra *extra; /* or NULL until first need */
    PyObject *weakreflist;
    /* model_size()'s answer: an exact int, strong, immutable. */
    PyObject *size_int;
    /* loaded_size()'s answer while the receipt's version is `answered`
     * (standin.c: a stand-in that reads a board keeps it behind the
     * version); strong; GIL. */
    PyObject *answer;
    uint32_t answered;
    /* While `listed`, the stand-in holds a reference to its worker's books
     * (cs_standin_books) and is on their roster at roster_index: from
     * construction until it is cleared (roster.c).  GIL. */
    uint32_t roster_index : 30;
    uint32_t listed : 1;
    uint32_t reads_board : 1; /* attach_board, detach_board; GIL */
};

/* The worker's books (WorkerBooks, binding.h), borrowed: the record's
 * worker keeps a pointer to them; NULL once GC-cleared. */
static inline PyObject *
cs_standin_books(StandInObject *self)
{
    return self->listed ? cs_worker_data(cs_model_worker(self->record))
                        : NULL;
}

/* The worker, borrowed; NULL once GC-cleared. */
static inline PyObject *
cs_standin_worker(StandInObject *self)
{
    PyObject *books = cs_standin_books(self);
    return books ? cs_books_key(books) : NULL;
}

enum { PROFILE_LOAD, PROFILE_OFFLOAD, PROFILE_KIND };

/* A field of the profile, borrowed; NULL once GC-cleared. */
static inline PyObject *
cs_profile_item(StandInObject *self, Py_ssize_t index)
{
    return self->profile ? PyTuple_GET_ITEM(self->profile, index) : NULL;
}

/* The board the stand-in reads, or NULL. */
static inline cs_board_link *
cs_standin_board(StandInObject *self)
{
    return self->extra ? self->extra->board : NULL;
}

/* ---- standin.c -------------------------------------------------------- */

/* What the host knows of the model's residency: the receipt, or the
 * board's reading when it is newer (docs/semantics.md, "Which word
 * wins").  The one figure loaded_size(), model_loaded_weight_memory and
 * the pool's charge answer. */
uint64_t cs_standin_loaded(StandInObject *self);
/* Sets what loaded_size() answers, once the record is set: 0, or -1 with
 * MemoryError. */
int cs_standin_answer_init(StandInObject *self);
/* Every kept board answer is decided again, the heartbeat's age included,
 * at the next loaded_size() (Ledger.reread_boards). */
void cs_standin_reread_boards(void);
/* The model id, an exact str decoded from the record: a new reference, or
 * NULL with MemoryError. */
PyObject *cs_standin_model_id(StandInObject *self);
/* The exception raised for pickling or copying (METH_O / METH_NOARGS). */
PyObject *cs_refuse_pickle(PyObject *self, PyObject *unused);
/* `type` from `spec`, with the stand-in's __getattr__ when `with_getattr`
 * (an unknown attribute names the upstream contract), immutable. */
PyTypeObject *cs_make_type(PyObject *module, PyType_Spec *spec,
                           bool with_getattr);

/* ---- inner.c ---------------------------------------------------------- */

int cs_inner_exec(PyObject *module, cs_module_state *state);
/* The clone_base_uuid sentinel, made on first use: a new reference; None
 * once GC-cleared; NULL with an exception. */
PyObject *cs_standin_sentinel_get(StandInObject *self);
/* What the host knows of the model's residency: the receipt, or the
 * verdict of the board the stand-in reads (docs/semantics.md, "Which word
 * wins").  Fills *out when given.  Runs no Python. */
uint64_t cs_standin_read(StandInObject *self, cs_receipt *out);
/* model.device: the device assigned, until the next receipt; else the
 * load device while loaded, the offload device when not; None once
 * GC-cleared.  New reference. */
PyObject *cs_standin_device(StandInObject *self);
/* The figure of the board the stand-in reads, in *figure; false when it
 * reads none or its board was closed.  Runs no Python. */
bool cs_standin_board_figure(StandInObject *self, uint64_t *figure);
/* The stand-in reads (slot, tag) of `board_obj` from now on.  0, or -1
 * with an exception (the board was closed, MemoryError). */
int cs_standin_set_board(StandInObject *self, PyObject *board_obj,
                         uint32_t slot, uint64_t tag);
/* Stops reading its board.  Dropping the Board may run Python: last. */
void cs_standin_drop_board(StandInObject *self);
/* tp_traverse and tp_clear of what `extra` holds; the clear frees it. */
int cs_standin_extra_traverse(StandInObject *self, visitproc visit,
                              void *arg);
void cs_standin_extra_clear(StandInObject *self);
/* `device` and `model_loaded_weight_memory`, as ComfyUI and comfy-env
 * read and assign them on `model.model` (standin_getset). */
PyObject *cs_inner_get_device(StandInObject *self, void *closure);
int cs_inner_set_device(StandInObject *self, PyObject *value,
                        void *closure);
PyObject *cs_inner_get_loaded(StandInObject *self, void *closure);
int cs_inner_set_loaded(StandInObject *self, PyObject *value,
                        void *closure);

/* ---- roster.c --------------------------------------------------------- */

/* Registers the stand-in's model on `worker`'s books under `ledger`
 * (made in the same step if need be) and lists it on their roster.  The
 * books are found or made first, then nothing that can run Python happens
 * until the stand-in is listed.  0, or -1 with an exception. */
int cs_standin_enlist(StandInObject *self, PyObject *ledger,
                      PyObject *worker, PyObject *model_id,
                      uint64_t generation, uint64_t size,
                      PyObject *size_obj);
/* Takes the stand-in off its roster and drops its books (idempotent).
 * Runs no Python until the roster is consistent again; dropping the books
 * last may run Python (a worker's finalizer). */
void cs_roster_unlink(StandInObject *s);

/* The figures the charge takes for models whose stand-ins read something
 * newer than the receipt (a board): a growable table, sorted by model
 * address before use, each model held (cs_model_incref) until released,
 * so it may be used with the GIL released. */
typedef struct {
    cs_figure *items;
    size_t n, cap;
} cs_figures;

/* Adds the figure of every model on `roster` whose stand-in reads a board
 * (cs_standin_loaded: what loaded_size() answers), once per model.  Runs
 * no Python.  0, or -1 with MemoryError. */
int cs_figures_add_roster(cs_figures *figures, cs_roster *roster);
void cs_figures_sort(cs_figures *figures);
void cs_figures_release(cs_figures *figures);

/* ---- commands.c ------------------------------------------------------- */

/* METH_FASTCALL | METH_KEYWORDS methods. */
PyObject *cs_standin_partially_load(StandInObject *self,
                                    PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames);
PyObject *cs_standin_partially_unload(StandInObject *self,
                                      PyObject *const *args,
                                      Py_ssize_t nargs, PyObject *kwnames);
PyObject *cs_standin_detach(StandInObject *self, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames);
PyObject *cs_standin_mark_worker_gone(StandInObject *self, PyObject *unused);

/* ---- sync.c ----------------------------------------------------------- */

int cs_sync_exec(PyObject *module, cs_module_state *state);

#endif /* COMFY_STANDIN_STANDIN_H */
