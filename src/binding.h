/*
 * binding.h -- what the parts of the extension module comfy_standin._core
 * share: the module state and each part's exec hook.
 *
 * Each binding source file (standin.c, ledger_binding.c, probe_binding.c,
 * board_binding.c) adds its types and functions to the module from one
 * `cs_<part>_exec(module, state)` called by module.c's Py_mod_exec slot.
 * No PyObject * lives in a C static: every type and exception object is in
 * the module state (PEP 489 / PEP 630).
 */
#ifndef COMFY_STANDIN_BINDING_H
#define COMFY_STANDIN_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The parameter names of every keyword signature (args.c). */
#define CS_KEYWORD_COUNT 34

typedef struct {
    /* Types (strong references, created from specs in the exec hooks). */
    PyTypeObject *ledger_type;
    PyTypeObject *books_type;
    PyTypeObject *record_type;   /* ModelRecord */
    PyTypeObject *standin_type;
    PyTypeObject *sentinel_type; /* clone_base_uuid sentinels */
    PyTypeObject *board_type;
    /* Exceptions. */
    PyObject *echo_error;        /* EchoError(ValueError) */
    PyObject *worker_gone_error; /* WorkerGoneError(RuntimeError) */
    /* Interned strings used on hot paths.  Held here so they stay interned:
     * PyDict_SetItemString would intern a fresh key per call and, once the
     * call's dict is gone, drop it again, churning the interned dict. */
    PyObject *str_send_command;
    PyObject *str_is_alive;
    PyObject *str_model_id;
    PyObject *str_extra_bytes;
    PyObject *str_bytes_to_free;
    PyObject *str_device;
    PyObject *str_loaded;
    PyObject *str_resident;
    PyObject *str_freed;
    PyObject *str_moved;
    PyObject *str_seq;
    PyObject *str_id;
    PyObject *str_get;
    PyObject *str_ledger;    /* "_ledger" */
    PyObject *str_restarted; /* "restarted" */
    PyObject *str_default_pool; /* "_default_pool" */
    /* Strong or NULL, kept for StandIn(): the comfy_standin package
     * (imported on the first stand-in made without a pool), the pool its
     * _default_pool was then and that pool's ledger, and the last class
     * of worker found to have send_command() and is_alive(). */
    PyObject *package;
    PyObject *default_pool;
    PyObject *default_ledger;
    PyObject *worker_type;
    PyObject *mapping_abc; /* collections.abc.Mapping */
    /* The parameter names of args.c's signatures, interned. */
    PyObject *keywords[CS_KEYWORD_COUNT];
    /* Set once the exec hook completed; cleared by m_clear.  Checked by
     * cs_state_checked() so no object outliving its module's state hands
     * out a cleared (NULL) field. */
    int ready;
} cs_module_state;

/* The module state of the module that defined `type`'s module (heap types
 * only) or of `module` itself. */
static inline cs_module_state *
cs_state_of_module(PyObject *module)
{
    return (cs_module_state *)PyModule_GetState(module);
}

int cs_ledger_binding_exec(PyObject *module, cs_module_state *state);
int cs_standin_exec(PyObject *module, cs_module_state *state);
int cs_probe_binding_exec(PyObject *module, cs_module_state *state);
int cs_board_binding_exec(PyObject *module, cs_module_state *state);

/* ---- arguments (args.c) ---------------------------------------------- */

typedef enum {
    CS_SIG_STANDIN,
    CS_SIG_PARTIALLY_LOAD,
    CS_SIG_PARTIALLY_UNLOAD,
    CS_SIG_ATTACH_BOARD,
    CS_SIG_APPLY_ECHO,
    CS_SIG_LEDGER,
    CS_SIG_SET_REPORT,
    CS_SIG_RESERVE,
    CS_SIG_BOARD_ADOPT,
    CS_SIG_BOARD_MAKE,
    CS_SIG_COUNT
} cs_signature_id;

int cs_args_exec(cs_module_state *state);
void cs_args_clear(cs_module_state *state);

/* Parses a call of signature `id` into out[] (one slot per parameter,
 * borrowed, NULL when not given), with the checks and TypeError messages
 * of Python's own functions: too many positional arguments, an unknown or
 * repeated keyword, a missing required argument.  Runs no Python.  0, or
 * -1 with TypeError.  The vectorcall form (METH_FASTCALL | METH_KEYWORDS)
 * and the tuple-and-dict form (tp_new). */
int cs_parse_vector(cs_module_state *state, cs_signature_id id,
                    PyObject *const *args, Py_ssize_t nargs,
                    PyObject *kwnames, PyObject **out);
int cs_parse_tuple(cs_module_state *state, cs_signature_id id,
                   PyObject *args, PyObject *kwargs, PyObject **out);

/* ---- values (values.c) ----------------------------------------------- */

/* Checks a byte count / seq / generation: an int (not a bool) in
 * [0, max].  Returns 0 and sets *out, or 1 (wrong type) or 2 (out of
 * range) with no exception set. */
int cs_value_check(PyObject *value, uint64_t max, uint64_t *out);

/* Raises `exc` (or TypeError / ValueError when exc is NULL, by `code`)
 * with "FIELD: expected an int in [0, MAX], got REPR".  Returns -1. */
int cs_value_error(PyObject *exc, int code, const char *field,
                   PyObject *value, uint64_t max);

/* An int (not a bool) in [min, max]: 0 with *out set, or -1 with
 * TypeError / ValueError "FIELD: expected an int in [MIN, MAX], got REPR"
 * (`exc`, when not NULL, replaces the ValueError). */
int cs_value_in_range(PyObject *value, const char *field, PyObject *exc,
                      uint64_t min, uint64_t max, uint64_t *out);

/* A duration in seconds (an int or a float, not a bool; finite, > 0) in
 * [min_ns, max_ns] once in nanoseconds: 0 with *out_ns set, or -1 with
 * TypeError / ValueError naming FIELD. */
int cs_seconds_in_range(PyObject *value, const char *field, uint64_t min_ns,
                        uint64_t max_ns, uint64_t *out_ns);

/* The module state of `type`'s module, or NULL with RuntimeError when
 * the module was cleared (m_clear ran; its fields are NULL). */
cs_module_state *cs_state_checked(PyTypeObject *type);

/* A model id's UTF-8: 0 and *utf8, *len set (the buffer lives as long as
 * `id`), 1 when the id cannot be encoded (a lone surrogate; no exception
 * set), -1 with any other exception (MemoryError). */
int cs_model_id_utf8(PyObject *id, const char **utf8, Py_ssize_t *len);

/* A census read into C memory before anything is looked up or applied
 * (docs/semantics.md, "Census entry").  ids[i] is an exact str (owned)
 * equal to entries[i].id (its UTF-8, owned by ids[i]). */
typedef struct {
    Py_ssize_t n;
    struct cs_census_entry *entries;
    PyObject **ids;
} cs_census_snapshot;

/* Reads `census` (a list or tuple of mappings) whole, then checks it
 * whole: the form of every entry (EchoError naming the first bad field)
 * and duplicate ids.  User code (a Mapping entry's get(), a dict entry's
 * str-subclass keys) runs only in the read pass, on owned references.
 * Exceptions raised by that code propagate unchanged.  Returns 0, or -1
 * with the snapshot released. */
int cs_census_snapshot_take(cs_module_state *state, PyObject *census,
                            cs_census_snapshot *out);
void cs_census_snapshot_release(cs_census_snapshot *snapshot);

/* ---- exceptions (errors.c): one rule -------------------------------- */

/* What a path that must not fail with an Exception (an eviction, a log
 * line) does with what Python raised: an Exception is caught (taken off,
 * kept and described); any other BaseException is left pending, and the
 * caller returns at once so it propagates (docs/semantics.md,
 * "Exceptions on the command paths"). */
typedef struct {
    PyObject *error; /* the exception instance, traceback attached */
    PyObject *text;  /* "Type: message" ("Type" for an empty message), or
                      * None when even that could not be made */
} cs_caught;

/* 0: the pending exception was an Exception and is now in *out, nothing
 * pending.  -1: what is pending is not an Exception (or its __str__
 * raised one that is not): it stays pending, *out holds nothing. */
int cs_catch(cs_caught *out);
void cs_caught_release(cs_caught *caught);
/* Raises the caught exception again (consumes *caught). */
void cs_caught_raise(cs_caught *caught);

/* Raises `type`(FORMAT % ...) with `cause` (an exception instance, or
 * NULL) as its __cause__ and __context__.  Nothing may be pending on
 * entry.  Returns -1. */
int cs_raise_from(PyObject *type, PyObject *cause, const char *format, ...);

/* Logs a warning on the "comfy_standin" logger.  Nothing may be pending on
 * entry.  A handler's Exception is dropped (logging is never why a call
 * fails); 0, or -1 with any other BaseException a handler raised pending,
 * for the caller to propagate at once. */
int cs_log_warning(const char *format, ...);

/* obj.<name> with the name interned.  PyObject_GetAttrString and
 * PyObject_CallMethod make a fresh str per call, and the type attribute
 * cache of Python 3.10 and 3.11 keeps a reference to every name it caches
 * (up to 4096 of them): fresh names there churn the heap on every call. */
PyObject *cs_getattr_interned(PyObject *obj, const char *name);

/* A keyword entry point's parsed arguments are borrowed from its caller's
 * args tuple and keyword dict, and PyObject_Call from C passes the
 * caller's own dict down: any Python the entry point runs (the worker's
 * methods, an argument's __float__ or __bool__, a collection on an
 * allocation, another thread while the GIL is released) may empty that
 * dict and free an argument still in use.  cs_args_hold takes a reference
 * to each non-NULL objects[i] right after parsing; cs_args_release drops
 * them on the way out. */
void cs_args_hold(PyObject *const *objects, size_t n);
void cs_args_release(PyObject *const *objects, size_t n);

/* ---- ledger binding (ledger_binding.c) ------------------------------- */

typedef struct cs_worker cs_worker;
typedef struct cs_ledger cs_ledger;
typedef struct StandInObject StandInObject;

/* A worker's roster: its live stand-ins in adoption order, in an array
 * with a hole (NULL) where one left, compacted when half of it is holes.
 * It lives in the worker's books, which every listed stand-in holds
 * strongly, and changes only with the GIL held, by code that runs no
 * Python between reading and writing it (roster.c). */
typedef struct {
    StandInObject **items; /* PyMem; borrowed stand-ins */
    uint32_t used;         /* items[0, used) are stand-ins or holes */
    uint32_t capacity;
    uint32_t count; /* stand-ins listed */
} cs_roster;

/* One worker's books: the C record of its charges and the roster of its
 * stand-ins, made in one step (cs_ledger_books_for) and owned together. */
typedef struct {
    PyObject_HEAD
    cs_worker *worker; /* strong (C refcount); immutable once made */
    PyObject *key;     /* strong: the worker object; NULL once cleared */
    uint64_t floor;    /* the ledger's floor; immutable */
    cs_roster roster;  /* the worker's live stand-ins */
    PyObject *weakreflist;
} BooksObject;

static inline PyObject *
cs_books_key(PyObject *books)
{
    return ((BooksObject *)books)->key;
}

static inline cs_worker *
cs_books_worker(PyObject *books)
{
    return ((BooksObject *)books)->worker;
}

static inline cs_roster *
cs_books_roster(PyObject *books)
{
    return &((BooksObject *)books)->roster;
}

/* The books of `key` under `ledger` (a Ledger object), made in one step
 * (the Python object, then its C record and its entry) or bumped to
 * `generation`, as Ledger.worker() does.  Only the making may run Python
 * (a collection), and it looks again after it.  A new reference, or NULL
 * with an exception. */
PyObject *cs_ledger_books_for(PyObject *ledger, PyObject *key,
                              uint64_t generation);
/* The profile tuple (load_device, offload_device, kind) for a stand-in of
 * `worker`, a new reference: the one of the stand-in listed last on the
 * worker's roster, or else on the roster used last under `ledger`, when
 * it holds these very objects (identity only: no caller code runs;
 * stand-ins come in runs with the same devices and kind), else a new one;
 * and the worker's books in *books (a new reference, or NULL).  Runs no
 * Python but the allocation of a new tuple. */
PyObject *cs_ledger_profile(PyObject *ledger, PyObject *worker,
                            PyObject *load_device, PyObject *offload_device,
                            PyObject *kind, PyObject **books);
/* The roster's stand-ins, a new list (roster.c). */
PyObject *cs_roster_snapshot(cs_roster *roster);
/* Frees the roster's array (an empty roster's). */
void cs_roster_free(cs_roster *roster);

/* A model id: a non-empty str (TypeError / ValueError naming model_id). */
int cs_check_model_id(PyObject *id);

typedef struct cs_model cs_model;
/* cs_worker_register_model with the errors raised: a size mismatch is a
 * ValueError naming both sizes, an id too long a ValueError naming its
 * length; the rest as what the core's status says (a MemoryError, a
 * ValueError, a RuntimeError).  *out is a handle. */
int cs_register_model(cs_worker *worker, uint64_t generation,
                      PyObject *id_obj, const char *id, size_t id_len,
                      uint64_t size, PyObject *size_obj, cs_model **out);



#endif /* COMFY_STANDIN_BINDING_H */
