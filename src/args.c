/*
 * args.c -- one table-driven argument parser for every entry point of the
 * module that takes keywords: each signature is a row of `signatures`,
 * its parameter names a run of `keyword_names`, interned into the module
 * state at exec (cs_args_exec) and compared by pointer first (what a call
 * site passes), then by characters (no Python runs either way).
 *
 * The parsed values are borrowed from the caller's arguments; an entry
 * point that runs Python while it still uses them owns them first
 * (cs_args_hold, docs/semantics.md, "Values").
 */
#include "binding.h"

#include <stdint.h>

typedef struct {
    const char *function; /* for messages: "partially_load" */
    uint8_t first;        /* its names: keyword_names[first..first+count) */
    uint8_t count;        /* parameters */
    uint8_t required;     /* the first `required` must be given */
    uint8_t positional;   /* at most this many by position */
} signature;

static const char *const keyword_names[] = {
    /* 0: StandIn */
    "worker", "worker_generation", "model_id", "model_size", "load_device",
    "offload_device", "kind", "pool",
    /* 8: partially_load */
    "device_to", "extra_memory", "force_patch_weights",
    /* 11: partially_unload */
    "device_to", "memory_to_free", "force_patch_weights",
    /* 14: attach_board */
    "board", "slot",
    /* 16: apply_echo */
    "standin", "resident", "seq", "unmapped", "in_flight",
    /* 21: Ledger */
    "floor",
    /* 22: set_report */
    "held", "pinned", "overhead",
    /* 25: reserve */
    "base", "total", "process_local",
    /* 28: Board.adopt */
    "fd", "slots", "generation", "heartbeat_limit",
    /* 32: Board.make */
    "slots", "generation",
};

_Static_assert(sizeof(keyword_names) / sizeof(keyword_names[0]) ==
                   CS_KEYWORD_COUNT,
               "CS_KEYWORD_COUNT is the number of keyword_names");

static const signature signatures[CS_SIG_COUNT] = {
    [CS_SIG_STANDIN] = {"StandIn", 0, 8, 6, 8},
    [CS_SIG_PARTIALLY_LOAD] = {"partially_load", 8, 3, 1, 3},
    [CS_SIG_PARTIALLY_UNLOAD] = {"partially_unload", 11, 3, 0, 3},
    [CS_SIG_ATTACH_BOARD] = {"attach_board", 14, 2, 1, 2},
    [CS_SIG_APPLY_ECHO] = {"apply_echo", 16, 5, 2, 5},
    [CS_SIG_LEDGER] = {"Ledger", 21, 1, 0, 1},
    [CS_SIG_SET_REPORT] = {"set_report", 22, 3, 0, 3},
    [CS_SIG_RESERVE] = {"reserve", 25, 3, 3, 3},
    [CS_SIG_BOARD_ADOPT] = {"adopt", 28, 4, 2, 2},
    [CS_SIG_BOARD_MAKE] = {"make", 32, 2, 0, 1},
};

int
cs_args_exec(cs_module_state *state)
{
    for (int i = 0; i < CS_KEYWORD_COUNT; i++) {
        state->keywords[i] = PyUnicode_InternFromString(keyword_names[i]);
        if (state->keywords[i] == NULL) {
            return -1;
        }
    }
    return 0;
}

void
cs_args_clear(cs_module_state *state)
{
    for (int i = 0; i < CS_KEYWORD_COUNT; i++) {
        Py_CLEAR(state->keywords[i]);
    }
}

/* One keyword argument into out[]: 0, or -1 with TypeError. */
static int
take_keyword(cs_module_state *state, const signature *sig, PyObject *key,
             PyObject *value, PyObject **out)
{
    PyObject *const *names = &state->keywords[sig->first];
    int j = 0;
    if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "%s() keywords must be strings",
                     sig->function);
        return -1;
    }
    while (j < sig->count && key != names[j]) {
        j++;
    }
    for (int k = 0; j == sig->count && k < sig->count; k++) {
        /* Two strs: compares characters, runs no Python, cannot fail. */
        if (PyUnicode_Compare(key, names[k]) == 0) {
            j = k;
        }
    }
    if (j == sig->count) {
        PyErr_Format(PyExc_TypeError,
                     "%R is an invalid keyword argument for %s()", key,
                     sig->function);
        return -1;
    }
    if (out[j] != NULL) {
        PyErr_Format(PyExc_TypeError,
                     "argument for %s() given by name ('%s') and position "
                     "(%d)",
                     sig->function, keyword_names[sig->first + j], j + 1);
        return -1;
    }
    out[j] = value;
    return 0;
}

/* The positional part, shared: 0, or -1 with TypeError. */
static int
take_positional(const signature *sig, PyObject *const *args,
                Py_ssize_t nargs, PyObject **out)
{
    if (nargs > sig->positional) {
        PyErr_Format(PyExc_TypeError,
                     "%s() takes at most %d positional argument%s (%zd "
                     "given)",
                     sig->function, sig->positional,
                     sig->positional == 1 ? "" : "s", nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < sig->count; i++) {
        out[i] = i < nargs ? args[i] : NULL;
    }
    return 0;
}

static int
check_required(const signature *sig, PyObject **out)
{
    for (int i = 0; i < sig->required; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "%s() missing required argument '%s' (pos %d)",
                         sig->function, keyword_names[sig->first + i],
                         i + 1);
            return -1;
        }
    }
    return 0;
}

int
cs_parse_vector(cs_module_state *state, cs_signature_id id,
                PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                PyObject **out)
{
    const signature *sig = &signatures[id];
    if (take_positional(sig, args, nargs, out) < 0) {
        return -1;
    }
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (take_keyword(state, sig, PyTuple_GET_ITEM(kwnames, i),
                         args[nargs + i], out) < 0) {
            return -1;
        }
    }
    return check_required(sig, out);
}

int
cs_parse_tuple(cs_module_state *state, cs_signature_id id, PyObject *args,
               PyObject *kwargs, PyObject **out)
{
    const signature *sig = &signatures[id];
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    if (take_positional(sig, &PyTuple_GET_ITEM(args, 0),
                        PyTuple_GET_SIZE(args), out) < 0) {
        return -1;
    }
    /* Nothing in this loop runs Python (keys compared as strs). */
    while (kwargs != NULL && PyDict_Next(kwargs, &pos, &key, &value)) {
        if (take_keyword(state, sig, key, value, out) < 0) {
            return -1;
        }
    }
    return check_required(sig, out);
}
