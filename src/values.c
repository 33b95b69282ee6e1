/*
 * values.c -- decoding the integers that come from Python (host arguments
 * and worker replies alike) and the errors that name what was wrong.
 */
#include "binding.h"

#include "comfy_standin/ledger.h"

#include <stdarg.h>

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
        PyErr_Clear();
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

void
cs_log_warning(const char *format, ...)
{
    PyObject *type, *value, *traceback;
    PyObject *message = NULL, *logging = NULL, *logger = NULL, *r = NULL;
    va_list va;

    PyErr_Fetch(&type, &value, &traceback);
    va_start(va, format);
    message = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (message == NULL) {
        goto error;
    }
    logging = PyImport_ImportModule("logging");
    if (logging == NULL) {
        goto error;
    }
    logger = PyObject_CallMethod(logging, "getLogger", "s", "comfy_standin");
    if (logger == NULL) {
        goto error;
    }
    r = PyObject_CallMethod(logger, "warning", "O", message);
error:
    /* Logging must never be why an eviction path raised. */
    PyErr_Clear();
    Py_XDECREF(r);
    Py_XDECREF(logger);
    Py_XDECREF(logging);
    Py_XDECREF(message);
    PyErr_Restore(type, value, traceback);
}

PyObject *
cs_census_fast(PyObject *echo_error, PyObject *census)
{
    if (!PyList_Check(census) && !PyTuple_Check(census)) {
        PyErr_Format(echo_error,
                     "census: expected a list of entries, got %.100s %R",
                     Py_TYPE(census)->tp_name, census);
        return NULL;
    }
    return PySequence_Fast(census, "census");
}

/* entry[key]: borrowed, or NULL when absent (a dict of str keys cannot
 * raise on lookup by an exact str). */
static PyObject *
entry_get(PyObject *entry, PyObject *key)
{
    PyObject *value = PyDict_GetItemWithError(entry, key);
    if (value == NULL) {
        PyErr_Clear();
    }
    return value;
}

int
cs_decode_census_entry(cs_module_state *state, PyObject *entry,
                       Py_ssize_t index, PyObject **id, uint64_t *resident,
                       int *has_seq, int64_t *seq)
{
    PyObject *echo_error = state->echo_error;
    char field[64];
    PyObject *value;
    uint64_t v;
    int code;

    if (!PyDict_Check(entry)) {
        PyErr_Format(echo_error, "census[%zd]: expected a dict, got %R",
                     index, entry);
        return -1;
    }
    value = entry_get(entry, state->str_id);
    if (value == NULL || !PyUnicode_Check(value) ||
        PyUnicode_GetLength(value) == 0) {
        PyErr_Format(echo_error,
                     "census[%zd]['id']: expected a non-empty str, got %R",
                     index, value ? value : Py_None);
        return -1;
    }
    *id = value;

    PyOS_snprintf(field, sizeof(field), "census[%zd]['resident']", index);
    value = entry_get(entry, state->str_resident);
    if (value == NULL) {
        PyErr_Format(echo_error, "%s: missing", field);
        return -1;
    }
    code = cs_value_check(value, CS_VALUE_MAX, resident);
    if (code != 0) {
        return cs_value_error(echo_error, code, field, value, CS_VALUE_MAX);
    }

    *has_seq = 0;
    *seq = CS_SEQ_NONE;
    value = entry_get(entry, state->str_seq);
    if (value != NULL && value != Py_None) {
        PyOS_snprintf(field, sizeof(field), "census[%zd]['seq']", index);
        code = cs_value_check(value, CS_VALUE_MAX, &v);
        if (code != 0) {
            return cs_value_error(echo_error, code, field, value,
                                  CS_VALUE_MAX);
        }
        *has_seq = 1;
        *seq = (int64_t)v;
    }

    value = entry_get(entry, state->str_device);
    if (value != NULL && value != Py_None && !PyUnicode_Check(value)) {
        PyErr_Format(echo_error,
                     "census[%zd]['device']: expected a str or None, got %R",
                     index, value);
        return -1;
    }
    return 0;
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
    return 0;
}

int
cs_register_model(cs_worker *worker, uint64_t generation, PyObject *id_obj,
                  const char *id, size_t id_len, uint64_t size,
                  PyObject *size_obj, cs_model **out)
{
    switch (cs_worker_register_model(worker, generation, id, id_len, size,
                                     out)) {
    case CS_OK:
        return 0;
    case CS_ERR_SIZE_MISMATCH: {
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
    default:
        PyErr_NoMemory();
        return -1;
    }
}
