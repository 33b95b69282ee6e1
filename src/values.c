/*
 * values.c -- decoding the integers that come from Python (host arguments
 * and worker replies alike) and the errors that name what was wrong.
 */
#include "binding.h"

#include "comfy_standin/ledger.h"


int
cs_value_check(PyObject *value, uint64_t max, uint64_t *out)
{
    int overflow = 0;
    long long v;

    /* bool is an int subclass, and True is never a byte count. */
    if (!PyLong_Check(value) || PyBool_Check(value)) {
        return 1;
    }
    v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        /* On an int (subclasses too) this runs no Python code; whatever it
         * raised, only an Exception is cleared (cs_value_error keeps any
         * other pending). */
        if (PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear();
        }
        return 1;
    }
    if (overflow != 0 || v < 0 || (uint64_t)v > max) {
        return 2;
    }
    *out = (uint64_t)v;
    return 0;
}

int
cs_value_error(PyObject *exc, int code, const char *field, PyObject *value,
               uint64_t max)
{
    if (PyErr_Occurred()) {
        return -1; /* a BaseException cs_value_check let through wins */
    }
    if (exc == NULL) {
        exc = code == 1 ? PyExc_TypeError : PyExc_ValueError;
    }
    if (max == CS_VALUE_MAX) {
        PyErr_Format(exc, "%s: expected an int in [0, 2**63-1], got %R",
                     field, value);
    }
    else {
        PyErr_Format(exc, "%s: expected an int in [0, %llu], got %R", field,
                     (unsigned long long)max, value);
    }
    return -1;
}

int
cs_value_in_range(PyObject *value, const char *field, PyObject *exc,
                  uint64_t min, uint64_t max, uint64_t *out)
{
    uint64_t v = 0;
    int code = cs_value_check(value, max, &v);
    if (code == 0 && v < min) {
        code = 2;
    }
    if (code == 0) {
        *out = v;
        return 0;
    }
    if (min == 0) {
        return cs_value_error(code == 1 ? NULL : exc, code, field, value,
                              max);
    }
    PyErr_Format(code == 1 ? PyExc_TypeError
                           : (exc != NULL ? exc : PyExc_ValueError),
                 "%s: expected an int in [%llu, %llu], got %R", field,
                 (unsigned long long)min, (unsigned long long)max, value);
    return -1;
}

int
cs_seconds_in_range(PyObject *value, const char *field, uint64_t min_ns,
                    uint64_t max_ns, uint64_t *out_ns)
{
    double seconds;
    /* Exact int or float only: no __float__ of a caller's object runs. */
    if (PyBool_Check(value) ||
        !(PyLong_CheckExact(value) || PyFloat_CheckExact(value))) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a number of seconds (int or float), "
                     "got %R", field, value);
        return -1;
    }
    seconds = PyFloat_AsDouble(value);
    if (seconds == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();
        seconds = -1.0; /* an int too large for a double: refused below */
    }
    /* NaN fails every comparison; inf is above max. */
    if (!(seconds > 0.0 && seconds * 1e9 >= (double)min_ns &&
          seconds * 1e9 <= (double)max_ns)) {
        char range[64];
        PyOS_snprintf(range, sizeof(range), "[%g, %g]",
                      (double)min_ns / 1e9, (double)max_ns / 1e9);
        PyErr_Format(PyExc_ValueError, "%s: expected seconds in %s, got %R",
                     field, range, value);
        return -1;
    }
    *out_ns = (uint64_t)(seconds * 1e9);
    if (*out_ns < min_ns) {
        *out_ns = min_ns;
    }
    return 0;
}

PyObject *
cs_getattr_interned(PyObject *obj, const char *name)
{
    PyObject *key = PyUnicode_InternFromString(name);
    if (key == NULL) {
        return NULL;
    }
    PyObject *value = PyObject_GetAttr(obj, key);
    Py_DECREF(key);
    return value;
}

void
cs_args_hold(PyObject *const *objects, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        Py_XINCREF(objects[i]);
    }
}

void
cs_args_release(PyObject *const *objects, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        Py_XDECREF(objects[i]);
    }
}

int
cs_check_model_id(PyObject *id)
{
    if (!PyUnicode_Check(id)) {
        PyErr_Format(PyExc_TypeError, "model_id: expected a non-empty str, "
                     "got %R", id);
        return -1;
    }
    if (PyUnicode_GetLength(id) == 0) {
        PyErr_Format(PyExc_ValueError, "model_id: expected a non-empty str, "
                     "got %R", id);
        return -1;
    }
    /* The id travels as UTF-8 (the core's table, the board, the worker's
     * transport): a lone surrogate has no UTF-8 form. */
    const char *utf8;
    Py_ssize_t len;
    int code = cs_model_id_utf8(id, &utf8, &len);
    if (code > 0) {
        PyErr_Format(PyExc_ValueError,
                     "model_id: expected a str encodable as UTF-8 (no lone "
                     "surrogates), got %R",
                     id);
    }
    return code == 0 ? 0 : -1;
}

/* Raises what a failed status of the core means ("WHAT: message"): only
 * CS_ERR_NOMEM is a MemoryError; a value out of range, an unknown or
 * repeated id or a size mismatch is a ValueError, a stale model or a call
 * out of order a RuntimeError.  Returns -1. */
static int
raise_status(int status, const char *what)
{
    /* What each failure of the core means to a Python caller: only an
     * allocation that failed is a MemoryError. */
    PyObject *type;
    switch ((cs_status)status) {
    case CS_ERR_NOMEM:
        PyErr_NoMemory();
        return -1;
    case CS_ERR_RANGE:
    case CS_ERR_UNKNOWN_ID:
    case CS_ERR_DUPLICATE_ID:
    case CS_ERR_SIZE_MISMATCH:
        type = PyExc_ValueError;
        break;
    case CS_ERR_STALE:
    case CS_ERR_STATE:
    case CS_ERR_OLDER:
        type = PyExc_RuntimeError;
        break;
    default:
        type = PyExc_SystemError; /* CS_OK or unknown: a bug here */
        break;
    }
    PyErr_Format(type, "%s: %s", what,
                 cs_status_message((cs_status)status));
    return -1;
}

int
cs_register_model(cs_worker *worker, uint64_t generation, PyObject *id_obj,
                  const char *id, size_t id_len, uint64_t size,
                  PyObject *size_obj, cs_model **out)
{
    cs_status status = cs_worker_register_model(worker, generation, id,
                                                id_len, size, out);
    if (status == CS_OK) {
        return 0;
    }
    if (status == CS_ERR_SIZE_MISMATCH) {
        cs_model *existing = cs_worker_find_model(worker, id, id_len);
        PyErr_Format(PyExc_ValueError,
                     "model_size: model %R of this worker is registered "
                     "with size %llu; cannot register it again with size %R",
                     id_obj,
                     existing ? (unsigned long long)cs_model_size(existing)
                              : 0ull,
                     size_obj);
        cs_model_decref(existing);
        return -1;
    }
    if (status == CS_ERR_RANGE && id_len > CS_MODEL_ID_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "model_id: %zu bytes of UTF-8, longer than a model id "
                     "may be (%zu)",
                     id_len, CS_MODEL_ID_MAX);
        return -1;
    }
    return raise_status(status, "registering model");
}


/* ---- census snapshot ------------------------------------------------- */

cs_module_state *
cs_state_checked(PyTypeObject *type)
{
    cs_module_state *state = (cs_module_state *)PyType_GetModuleState(type);
    if (state == NULL) {
        return NULL; /* SystemError set: not a module type */
    }
    if (!state->ready) {
        PyErr_SetString(PyExc_RuntimeError,
                        "comfy_standin._core: the module was cleared "
                        "(interpreter shutdown or a collected module); "
                        "its objects can no longer be used");
        return NULL;
    }
    return state;
}

int
cs_model_id_utf8(PyObject *id, const char **utf8, Py_ssize_t *len)
{
    *utf8 = PyUnicode_AsUTF8AndSize(id, len);
    if (*utf8 != NULL) {
        return 0;
    }
    if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
        PyErr_Clear();
        return 1;
    }
    return -1;
}

/* entry.get(key) as a new reference (None when absent); NULL with the
 * exception raised by the mapping's own code. */
static PyObject *
entry_value(cs_module_state *state, PyObject *entry, PyObject *key)
{
    if (PyDict_CheckExact(entry)) {
        /* May run __eq__ of a str-subclass key stored in the entry. */
        PyObject *value = PyDict_GetItemWithError(entry, key);
        if (value == NULL) {
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        }
        return Py_NewRef(value);
    }
    return PyObject_CallMethodOneArg(entry, state->str_get, key);
}

enum { FIELD_ID, FIELD_RESIDENT, FIELD_SEQ, FIELD_DEVICE, FIELD_COUNT };

/* Phase 1, user code allowed: every entry's four values, owned. */
static int
census_read(cs_module_state *state, PyObject *items, PyObject **values)
{
    PyObject *keys[FIELD_COUNT] = {state->str_id, state->str_resident,
                                   state->str_seq, state->str_device};
    Py_ssize_t n = PyTuple_GET_SIZE(items);

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyTuple_GET_ITEM(items, i); /* the tuple owns it */
        if (!PyDict_CheckExact(entry)) {
            int is_mapping = PyObject_IsInstance(entry, state->mapping_abc);
            if (is_mapping < 0) {
                return -1;
            }
            if (!is_mapping) {
                PyErr_Format(state->echo_error,
                             "census[%zd]: expected a mapping, got %R", i,
                             entry);
                return -1;
            }
        }
        for (int k = 0; k < FIELD_COUNT; k++) {
            values[i * FIELD_COUNT + k] = entry_value(state, entry, keys[k]);
            if (values[i * FIELD_COUNT + k] == NULL) {
                return -1;
            }
        }
    }
    return 0;
}

/* Phase 2, no user code: checks one entry's values into C memory.  Only
 * the error messages (%R) may call a value's __repr__. */
static int
census_check(cs_module_state *state, Py_ssize_t i, PyObject **values,
             PyObject *seen, PyObject **id_out, cs_census_entry *entry)
{
    PyObject *echo_error = state->echo_error;
    PyObject *value = values[FIELD_ID];
    char field[64];
    uint64_t v;
    int code;

    if (!PyUnicode_Check(value) || PyUnicode_GetLength(value) == 0) {
        PyErr_Format(echo_error,
                     "census[%zd]['id']: expected a non-empty str, got %R", i,
                     value);
        return -1;
    }
    PyOS_snprintf(field, sizeof(field), "census[%zd]['resident']", i);
    value = values[FIELD_RESIDENT];
    code = cs_value_check(value, CS_VALUE_MAX, &entry->resident);
    if (code != 0) {
        return cs_value_error(echo_error, code, field, value, CS_VALUE_MAX);
    }
    entry->has_seq = false;
    entry->seq = CS_SEQ_NONE;
    value = values[FIELD_SEQ];
    if (value != Py_None) {
        PyOS_snprintf(field, sizeof(field), "census[%zd]['seq']", i);
        code = cs_value_check(value, CS_VALUE_MAX, &v);
        if (code != 0) {
            return cs_value_error(echo_error, code, field, value,
                                  CS_VALUE_MAX);
        }
        entry->has_seq = true;
        entry->seq = (int64_t)v;
    }
    value = values[FIELD_DEVICE];
    if (value != Py_None && !PyUnicode_Check(value)) {
        PyErr_Format(echo_error,
                     "census[%zd]['device']: expected None or a str, got %R",
                     i, value);
        return -1;
    }
    /* An exact copy: hashing and comparing it never runs Python. */
    PyObject *id = PyUnicode_FromObject(values[FIELD_ID]);
    if (id == NULL) {
        return -1;
    }
    *id_out = id;
    Py_ssize_t len;
    code = cs_model_id_utf8(id, &entry->id, &len);
    if (code != 0) {
        if (code > 0) {
            PyErr_Format(echo_error,
                         "census[%zd]['id']: not encodable as UTF-8 (a lone "
                         "surrogate), so no stand-in has it: %R",
                         i, id);
        }
        return -1;
    }
    entry->id_len = (size_t)len;
    int dup = PySet_Contains(seen, id);
    if (dup != 0) {
        if (dup > 0) {
            PyErr_Format(echo_error,
                         "census[%zd]['id']: duplicate model id %R", i, id);
        }
        return -1;
    }
    return PySet_Add(seen, id);
}

int
cs_census_snapshot_take(cs_module_state *state, PyObject *census,
                        cs_census_snapshot *out)
{
    PyObject *items = NULL, *seen = NULL, **values = NULL;
    Py_ssize_t n, i;
    int result = -1;

    out->n = 0;
    out->entries = NULL;
    out->ids = NULL;
    if (PyList_Check(census)) {
        /* The list's own array, not an overridden __iter__. */
        items = PyList_AsTuple(census);
    }
    else if (PyTuple_Check(census)) {
        items = Py_NewRef(census);
    }
    else {
        PyErr_Format(state->echo_error,
                     "census: expected a list or tuple of mappings, got %R",
                     census);
        return -1;
    }
    if (items == NULL) {
        return -1;
    }
    n = PyTuple_GET_SIZE(items);
    values = PyMem_Calloc((size_t)n * FIELD_COUNT + 1, sizeof(PyObject *));
    out->entries = PyMem_Calloc((size_t)n + 1, sizeof(*out->entries));
    out->ids = PyMem_Calloc((size_t)n + 1, sizeof(PyObject *));
    if (values == NULL || out->entries == NULL || out->ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    out->n = n;
    if (census_read(state, items, values) < 0) {
        goto done;
    }
    seen = PySet_New(NULL);
    if (seen == NULL) {
        goto done;
    }
    for (i = 0; i < n; i++) {
        if (census_check(state, i, &values[i * FIELD_COUNT], seen,
                         &out->ids[i], &out->entries[i]) < 0) {
            goto done;
        }
    }
    result = 0;
done:
    if (values != NULL) {
        for (i = 0; i < n * FIELD_COUNT; i++) {
            Py_XDECREF(values[i]);
        }
        PyMem_Free(values);
    }
    Py_XDECREF(seen);
    Py_DECREF(items);
    if (result < 0) {
        cs_census_snapshot_release(out);
    }
    return result;
}

void
cs_census_snapshot_release(cs_census_snapshot *snapshot)
{
    if (snapshot->ids != NULL) {
        for (Py_ssize_t i = 0; i < snapshot->n; i++) {
            Py_XDECREF(snapshot->ids[i]);
        }
    }
    PyMem_Free(snapshot->ids);
    PyMem_Free(snapshot->entries);
    snapshot->ids = NULL;
    snapshot->entries = NULL;
    snapshot->n = 0;
}
