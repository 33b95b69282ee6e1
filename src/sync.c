/*
 * sync.c -- the state sync: apply_echo, apply_residency and raise_peak
 * write what a worker said into its stand-ins' receipts
 * (docs/semantics.md, "Receipts").
 */
#include "standin.h"

/* The module state for the sync functions, or NULL with RuntimeError
 * once the module was cleared. */
static cs_module_state *
sync_state(PyObject *module)
{
    cs_module_state *state = cs_state_of_module(module);
    if (state == NULL || !state->ready) {
        PyErr_SetString(PyExc_RuntimeError,
                        "comfy_standin._core: the module was cleared; its "
                        "functions can no longer be used");
        return NULL;
    }
    return state;
}

static StandInObject *
as_standin(PyObject *module, PyObject *object, const char *what)
{
    cs_module_state *state = sync_state(module);
    if (state == NULL) {
        return NULL;
    }
    if (!PyObject_TypeCheck(object, state->standin_type)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a comfy_standin.StandIn (C "
                     "implementation), got %R",
                     what, object);
        return NULL;
    }
    return (StandInObject *)object;
}

static PyObject *
apply_echo(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
           PyObject *kwnames)
{
    PyObject *argv[5], *result = NULL;
    uint64_t resident, seq_value;
    int64_t seq = CS_SEQ_NONE;
    int code;
    cs_module_state *state = sync_state(module);
    if (state == NULL ||
        cs_parse_vector(state, CS_SIG_APPLY_ECHO, args, nargs, kwnames,
                        argv) < 0) {
        return NULL;
    }
    PyObject *resident_obj = argv[1];
    PyObject *seq_obj = argv[2] ? argv[2] : Py_None;
    /* Owned: the flags' __bool__ is the caller's code (cs_args_hold).  It
     * runs first, before anything is read from the stand-in. */
    cs_args_hold(argv, 5);
    int unmapped = argv[3] != NULL ? PyObject_IsTrue(argv[3]) : 0;
    int in_flight = unmapped >= 0 && argv[4] != NULL
                        ? PyObject_IsTrue(argv[4])
                        : 0;
    StandInObject *s = unmapped < 0 || in_flight < 0
                           ? NULL
                           : as_standin(module, argv[0], "standin");
    if (s == NULL) {
        goto done;
    }
    code = cs_value_check(resident_obj, cs_model_size(s->record), &resident);
    if (code != 0) {
        cs_value_error(state->echo_error, code, "resident", resident_obj,
                       cs_model_size(s->record));
        goto done;
    }
    if (seq_obj != Py_None) {
        code = cs_value_check(seq_obj, CS_VALUE_MAX, &seq_value);
        if (code != 0) {
            cs_value_error(state->echo_error, code, "seq", seq_obj,
                           CS_VALUE_MAX);
            goto done;
        }
        seq = (int64_t)seq_value;
    }
    /* The source compares with the receipt the echo replaces, never with
     * a board reading (docs/semantics.md, "Receipts"). */
    cs_source source = CS_SOURCE_LOAD_ECHO;
    if (unmapped) {
        source = CS_SOURCE_DETACH_ECHO;
    }
    else if (resident < cs_model_loaded(s->record)) {
        source = CS_SOURCE_UNLOAD_ECHO;
    }
    cs_status status = cs_model_apply_echo(s->record, resident, seq, source,
                                           unmapped != 0, in_flight != 0);
    result = PyBool_FromLong(status == CS_OK);
done:
    cs_args_release(argv, 5);
    return result;
}

/* One (key, stand-in) of the map into `table`: the value must be a C
 * stand-in filed under its own id.  Runs no Python but the reprs of an
 * error message (on references owned here). */
static int
table_add(cs_module_state *state, PyObject *table, PyObject *key,
          PyObject *value)
{
    int result = -1;

    Py_INCREF(key);
    Py_INCREF(value);
    if (!PyObject_TypeCheck(value, state->standin_type)) {
        PyErr_Format(state->echo_error,
                     "standins[%R]: expected a comfy_standin.StandIn (C "
                     "implementation), got %R",
                     key, value);
        goto done;
    }
    PyObject *model_id = cs_standin_model_id((StandInObject *)value);
    if (model_id == NULL) {
        goto done;
    }
    /* Compares the characters: no __eq__ of a str subclass runs. */
    int same = PyUnicode_Check(key) ? PyUnicode_Compare(model_id, key) : 1;
    if (same == 0) {
        result = PyDict_SetItem(table, model_id, value); /* an exact str */
    }
    else if (same != -1 || !PyErr_Occurred()) {
        PyErr_Format(state->echo_error,
                     "standins[%R]: the stand-in is for model %R", key,
                     model_id);
    }
    Py_DECREF(model_id);
done:
    Py_DECREF(key);
    Py_DECREF(value);
    return result;
}

/* Reads the map once into a private dict {exact id: stand-in}: an exact
 * dict from its storage, any other Mapping through its items() (the only
 * user code of the map that runs).  Every value must be a C stand-in
 * filed under its own id, whether or not the census names it: a wrong
 * map is a caller's bug that would otherwise surface only on the census
 * that happens to name it.  Returns a new reference or NULL. */
static PyObject *
standins_table(cs_module_state *state, PyObject *standins)
{
    PyObject *items = NULL, *pairs = NULL, *table = NULL;
    int is_mapping = PyDict_Check(standins)
                         ? 1
                         : PyObject_IsInstance(standins, state->mapping_abc);

    if (is_mapping <= 0) {
        if (is_mapping == 0) {
            PyErr_Format(PyExc_TypeError,
                         "standins: expected a mapping of model id to "
                         "StandIn, got %R",
                         standins);
        }
        return NULL;
    }
    table = PyDict_New();
    if (table == NULL) {
        return NULL;
    }
    if (PyDict_CheckExact(standins)) {
        /* table_add owns the pair it is given; PyDict_Next stays in
         * bounds even if a finalizer changed the dict meanwhile. */
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(standins, &pos, &key, &value)) {
            if (table_add(state, table, key, value) < 0) {
                goto error;
            }
        }
        return table;
    }
    items = PyMapping_Items(standins);
    if (items == NULL) {
        goto error;
    }
    pairs = PySequence_Tuple(items); /* ours: nobody can change it */
    Py_CLEAR(items);
    if (pairs == NULL) {
        goto error;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pairs); i++) {
        PyObject *pair = PyTuple_GET_ITEM(pairs, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_TypeError,
                         "standins.items(): expected (key, value) pairs, "
                         "got %R",
                         pair);
            goto error;
        }
        if (table_add(state, table, PyTuple_GET_ITEM(pair, 0),
                      PyTuple_GET_ITEM(pair, 1)) < 0) {
            goto error;
        }
    }
    Py_DECREF(pairs);
    return table;
error:
    Py_XDECREF(pairs);
    Py_DECREF(table);
    return NULL;
}

static PyObject *
apply_residency(PyObject *module, PyObject *args)
{
    cs_module_state *state = sync_state(module);
    PyObject *standins, *census, *table = NULL, *result = NULL;
    StandInObject **targets = NULL;
    cs_census_snapshot snapshot = {0, NULL, NULL};
    Py_ssize_t applied = 0;

    if (state == NULL ||
        !PyArg_ParseTuple(args, "OO:apply_residency", &standins, &census)) {
        return NULL;
    }
    /* All user code runs in these two reads (the map's items(), the
     * census entries' get()); the rest works on exact strs, C stand-ins
     * held by `table`, and C memory. */
    table = standins_table(state, standins);
    if (table == NULL) {
        return NULL;
    }
    if (cs_census_snapshot_take(state, census, &snapshot) < 0) {
        goto done;
    }
    targets = PyMem_Calloc((size_t)snapshot.n + 1,
                           sizeof(StandInObject *));
    if (targets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < snapshot.n; i++) {
        /* Exact str in a dict of exact strs: runs no Python. */
        PyObject *value = PyDict_GetItemWithError(table, snapshot.ids[i]);
        if (value == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_Format(state->echo_error,
                             "census[%zd]['id']: unknown model id %R (no "
                             "stand-in for it in the mapping)",
                             i, snapshot.ids[i]);
            }
            goto done;
        }
        targets[i] = (StandInObject *)value; /* held by `table` */
    }
    for (Py_ssize_t i = 0; i < snapshot.n; i++) {
        bool written = false;
        const cs_census_entry *e = &snapshot.entries[i];
        (void)cs_model_apply_census(targets[i]->record, e->has_seq, e->seq,
                                    e->resident, &written);
        applied += written;
    }
    result = PyLong_FromSsize_t(applied);
done:
    PyMem_Free(targets);
    cs_census_snapshot_release(&snapshot);
    Py_DECREF(table);
    return result;
}

static PyObject *
raise_peak(PyObject *module, PyObject *args)
{
    PyObject *object, *bytes_obj;
    uint64_t bytes;

    if (!PyArg_ParseTuple(args, "OO:raise_peak", &object, &bytes_obj)) {
        return NULL;
    }
    StandInObject *s = as_standin(module, object, "standin");
    if (s == NULL) {
        return NULL;
    }
    int code = cs_value_check(bytes_obj, CS_VALUE_MAX, &bytes);
    if (code != 0) {
        return cs_value_error(cs_state_of_module(module)->echo_error, code,
                              "resident", bytes_obj, CS_VALUE_MAX),
               NULL;
    }
    return PyBool_FromLong(cs_model_raise_peak(s->record, bytes) == CS_OK);
}

static PyMethodDef sync_functions[] = {
    {"raise_peak", (PyCFunction)raise_peak, METH_VARARGS,
     "raise_peak(standin, resident, /)\n--\n\nRaises the admission peak "
     "only (never lowers, never writes the receipt): comfy-env's peak pass "
     "for calls with no node boundary.  False when stale."},
    {"apply_echo", (PyCFunction)(void (*)(void))apply_echo,
     METH_FASTCALL | METH_KEYWORDS,
     "apply_echo(standin, resident, seq=None, unmapped=False, "
     "in_flight=False)\n--\n\nWrites a command echo to the stand-in's "
     "receipt (docs/semantics.md, \"Which word wins\").  Returns False, "
     "writing nothing, when the stand-in is stale or the echo's seq is "
     "older than the receipt's."},
    {"apply_residency", (PyCFunction)apply_residency, METH_VARARGS,
     "apply_residency(standins, census, /)\n--\n\nApplies a node-boundary "
     "census, all or nothing (docs/semantics.md).  Call it at a node "
     "boundary, never inside free_memory.  Returns the entries applied."},
    {NULL},
};

int
cs_sync_exec(PyObject *module, cs_module_state *state)
{
    return PyModule_AddFunctions(module, sync_functions);
}
