/*
 * standin.h -- what the parts of the stand-in share (private to the
 * extension module): the object layouts of StandIn, its inner module and
 * its clone_base_uuid sentinel, and the functions one part calls in
 * another.
 *
 *   standin.c   the type: construction, lifetime, what ComfyUI reads
 *   roster.c    a worker's roster of stand-ins and adoption onto it
 *   commands.c  commands to the worker (load, unload, detach)
 *   sync.c      the state sync: apply_echo, apply_residency, raise_peak
 *
 * Thread safety: the receipt lives in the C core (seqlock; any thread).
 * The PyObject fields below are immutable after construction except
 * ModuleObject.device_assigned, .board and .sentinel, StandInObject.module
 * (made on first use) and the roster links, which are touched only with
 * the GIL held, by code that runs no Python between reading and writing
 * them (this module does not claim free-threading support).
 */
#ifndef COMFY_STANDIN_STANDIN_H
#define COMFY_STANDIN_STANDIN_H

#include "binding.h"

#include "comfy_standin/ledger.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    PyObject *model_id; /* strong str; immutable (for the repr) */
} SentinelObject;

typedef struct {
    PyObject_HEAD
    cs_model *record;         /* C reference; immutable */
    PyObject *load_device;    /* strong; immutable */
    PyObject *offload_device; /* strong; immutable */
    PyObject *device_assigned;   /* strong or NULL; GIL */
    uint64_t device_assigned_at; /* receipt write count when assigned */
    PyObject *board;             /* strong Board or NULL; GIL */
    uint32_t board_slot;         /* GIL, with `board` */
    uint64_t board_tag;          /* GIL, with `board`: the slot's tag */
    PyObject *sentinel; /* the stand-in's clone_base_uuid, or NULL until
                         * first use; GIL */
    PyObject *weakreflist;
} ModuleObject;

/* The size and generation live in the record.  The inner module is made on
 * first use (ComfyUI reads `.model` in a few places only), the sentinel on
 * its first use, in the module; both are kept from then on, so every
 * access returns the same object.  Until the module exists no device was
 * assigned and no board attached, and the stand-in answers from the record
 * and its profile.  Twelve pointers: 128 bytes with the GC header, one
 * pymalloc size class (bench/RESULTS.md, memory). */
struct StandInObject {
    PyObject_HEAD
    cs_model *record;   /* a handle (cs_model_release_handle); set before
                         * the object is tracked; immutable */
    PyObject *module;   /* strong ModuleObject, or NULL until first use */
    PyObject *worker;   /* strong; immutable; NULL once GC-cleared */
    PyObject *pool;     /* strong; immutable */
    PyObject *model_id; /* strong str; immutable */
    /* Strong tuple (load_device, offload_device, kind); immutable; NULL
     * once GC-cleared.  Shared with the stand-in before it on its roster
     * when they hold the same three objects (cs_roster_profile_for). */
    PyObject *profile;
    PyObject *weakreflist;
    /* The worker's books whose roster lists this stand-in: strong while
     * listed, NULL before adoption and after it left (roster.c). */
    PyObject *books;
    StandInObject *roster_prev, *roster_next; /* borrowed; GIL */
    /* What model_size() and loaded_size() return, so ComfyUI's calls make
     * no int (a size is beyond CPython's cached small ints): the size, an
     * exact int, strong and immutable; and the last other figure
     * loaded_size() answered above 256, strong or NULL; GIL. */
    PyObject *size_int;
    PyObject *loaded_int;
};

enum { PROFILE_LOAD, PROFILE_OFFLOAD, PROFILE_KIND };

/* A field of the profile, borrowed; NULL once GC-cleared. */
static inline PyObject *
cs_profile_item(StandInObject *self, Py_ssize_t index)
{
    return self->profile ? PyTuple_GET_ITEM(self->profile, index) : NULL;
}

/* The inner module if it was made, else NULL: no device was assigned and
 * no board attached yet.  Readers answer from the record then. */
static inline ModuleObject *
cs_standin_module(StandInObject *self)
{
    return (ModuleObject *)self->module;
}

/* ---- standin.c -------------------------------------------------------- */

/* What the host knows of the model's residency: the receipt, or the
 * board's reading when it is newer (docs/semantics.md, "Which word
 * wins").  The one figure loaded_size(), model_loaded_weight_memory and
 * the pool's charge answer. */
uint64_t cs_standin_loaded(StandInObject *self);
/* The inner module, made on first use: a new reference; None once
 * GC-cleared; NULL with an exception. */
PyObject *cs_standin_module_get(StandInObject *self);
/* The exception raised for pickling or copying (METH_O / METH_NOARGS). */
PyObject *cs_refuse_pickle(PyObject *self, PyObject *unused);

/* ---- roster.c --------------------------------------------------------- */

/* Registers the stand-in's model on its worker's books under `ledger`
 * (made in the same step if need be) and lists it on their roster.  The
 * books are found or made first, then nothing that can run Python happens
 * until the stand-in is listed.  0, or -1 with an exception. */
int cs_standin_enlist(StandInObject *self, PyObject *ledger,
                      uint64_t generation, uint64_t size,
                      PyObject *size_obj);
/* The profile tuple (load_device, offload_device, kind) for a stand-in of
 * `worker` under `ledger`, a new reference: the one the newest stand-in
 * on the worker's roster has when it holds these very objects (identity
 * only: no caller code runs; stand-ins of a worker come in runs with the
 * same devices and kind), else a new one. */
PyObject *cs_roster_profile_for(PyObject *ledger, PyObject *worker,
                                PyObject *load_device,
                                PyObject *offload_device, PyObject *kind);
/* Takes the stand-in off its roster (idempotent).  Runs no Python until
 * the roster is consistent again; dropping the books reference last may
 * run Python (a worker's finalizer). */
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
