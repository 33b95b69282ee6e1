/*
 * errors.c -- the one rule for what Python raises into a path that must
 * not fail with an Exception (the eviction paths, a log line), and the
 * log lines themselves (docs/semantics.md, "Exceptions on the command
 * paths" and "Log lines").
 *
 * The rule: an Exception is caught (taken off, kept, and described for
 * the log line); any other BaseException (KeyboardInterrupt, SystemExit,
 * GeneratorExit) is left pending and the caller returns at once, so it
 * propagates from the call that is running.  Nothing runs with an
 * exception pending.
 */
#include "binding.h"

#include <stdarg.h>
#include <string.h>

/* The pending exception, taken off as an instance with its traceback
 * attached (a new reference), or NULL when nothing is pending. */
static PyObject *
take_pending(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (type == NULL) {
        return NULL;
    }
    PyErr_NormalizeException(&type, &value, &traceback);
    if (value != NULL && traceback != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
#endif
}

/* "TimeoutError: worker busy", or "TimeoutError" for an empty message.
 * NULL with a BaseException pending when the exception's __str__ raised
 * one; an Exception there reads "<str() failed>". */
static PyObject *
describe(PyObject *error)
{
    const char *name = Py_TYPE(error)->tp_name;
    const char *dot = strrchr(name, '.');
    name = dot ? dot + 1 : name;
    PyObject *text = PyObject_Str(error);
    if (text == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return NULL;
        }
        PyErr_Clear();
        return PyUnicode_FromFormat("%s: <str() failed>", name);
    }
    PyObject *r = PyUnicode_GetLength(text) > 0
                      ? PyUnicode_FromFormat("%s: %U", name, text)
                      : PyUnicode_FromString(name);
    Py_DECREF(text);
    return r;
}

int
cs_catch(cs_caught *out)
{
    out->error = out->text = NULL;
    if (!PyErr_Occurred() || !PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    out->error = take_pending();
    if (out->error == NULL) {
        return -1;
    }
    out->text = describe(out->error);
    if (out->text != NULL) {
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        Py_CLEAR(out->error); /* a BaseException from __str__ wins */
        return -1;
    }
    PyErr_Clear(); /* a MemoryError describing it: no description */
    out->text = Py_NewRef(Py_None);
    return 0;
}

void
cs_caught_release(cs_caught *caught)
{
    Py_CLEAR(caught->error);
    Py_CLEAR(caught->text);
}

void
cs_caught_raise(cs_caught *caught)
{
    PyObject *error = caught->error;
    caught->error = NULL;
    Py_CLEAR(caught->text);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(error);
#else
    PyObject *traceback = PyException_GetTraceback(error);
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(error)), error, traceback);
#endif
}

int
cs_raise_from(PyObject *type, PyObject *cause, const char *format, ...)
{
    va_list va;
    va_start(va, format);
    PyObject *message = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (message == NULL) {
        return -1;
    }
    PyObject *error = PyObject_CallOneArg(type, message);
    Py_DECREF(message);
    if (error == NULL) {
        return -1;
    }
    if (cause != NULL) {
        PyException_SetCause(error, Py_NewRef(cause));   /* steals */
        PyException_SetContext(error, Py_NewRef(cause)); /* steals */
    }
    PyErr_SetObject((PyObject *)Py_TYPE(error), error);
    Py_DECREF(error);
    return -1;
}

/* obj.<name>(arg), the name interned (cs_getattr_interned). */
static PyObject *
call_method1(PyObject *obj, const char *name, PyObject *arg)
{
    PyObject *method = cs_getattr_interned(obj, name);
    if (method == NULL) {
        return NULL;
    }
    PyObject *r = PyObject_CallOneArg(method, arg);
    Py_DECREF(method);
    return r;
}

int
cs_log_warning(const char *format, ...)
{
    PyObject *message = NULL, *logging = NULL, *logger = NULL, *r = NULL;
    PyObject *name = NULL;
    va_list va;

    va_start(va, format);
    message = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (message == NULL) {
        goto done;
    }
    logging = PyImport_ImportModule("logging");
    if (logging == NULL) {
        goto done;
    }
    name = PyUnicode_InternFromString("comfy_standin");
    if (name == NULL) {
        goto done;
    }
    logger = call_method1(logging, "getLogger", name);
    if (logger == NULL) {
        goto done;
    }
    r = call_method1(logger, "warning", message);
done:
    Py_XDECREF(r);
    Py_XDECREF(logger);
    Py_XDECREF(logging);
    Py_XDECREF(name);
    Py_XDECREF(message);
    /* Logging is never why an eviction path fails: a handler's Exception
     * is dropped.  Any other BaseException propagates, by the one rule. */
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return -1;
        }
        PyErr_Clear();
    }
    return 0;
}
