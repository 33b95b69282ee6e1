/*
 * commands.c -- the commands a stand-in sends its worker: partially_load,
 * partially_unload and detach (docs/semantics.md, "The stand-in"), and the
 * reading of their replies.
 */
#include "standin.h"

#include <math.h>
#include <string.h>

static inline cs_module_state *
state_of(StandInObject *self)
{
    return (cs_module_state *)PyType_GetModuleState(Py_TYPE(self));
}

/* ---- StandIn: talking to the worker ------------------------------------ */

/* The byte count to ask for, in *out: `cap` unless `value` names a
 * positive amount below it, rounded up (ComfyUI passes 1e32 for
 * "everything"; 0 means the same).  An amount that cannot be read (its
 * __float__ raises an Exception) also means `cap`.  Returns 0, or -1 with a
 * BaseException pending (KeyboardInterrupt in __float__ propagates). */
static int
requested_bytes(PyObject *value, uint64_t cap, uint64_t *out)
{
    double d;
    *out = cap;
    if (value == NULL || value == Py_None) {
        return 0;
    }
    if (PyBool_Check(value) || PyUnicode_Check(value) ||
        PyBytes_Check(value)) {
        return 0;
    }
    if (PyLong_Check(value)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                return -1;
            }
            PyErr_Clear();
            return 0;
        }
        if (overflow == 0 && v > 0 && (uint64_t)v < cap) {
            *out = (uint64_t)v;
        }
        return 0;
    }
    d = PyFloat_AsDouble(value);
    if (d == -1.0 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    if (!(d > 0.0) || isinf(d) || d >= (double)cap) {
        return 0; /* NaN fails d > 0 */
    }
    /* Rounded up: ComfyUI keeps an entry only when freed >= the float it
     * asked for (load_models_gpu's targets are floats), so the truncated
     * figure would always fall short and escalate to a full detach. */
    uint64_t v = (uint64_t)ceil(d);
    *out = v < cap ? v : cap;
    return 0;
}

/* ---- StandIn: exceptions on the command paths ---------------------------
 *
 * Only Exception is ever swallowed (and logged with its type and message);
 * KeyboardInterrupt, SystemExit, GeneratorExit and any other BaseException
 * propagate.  No Python runs while an exception is pending: it is fetched
 * first and restored or chained afterwards. */

/* "TimeoutError: worker busy" ("TimeoutError" alone for an empty message)
 * for an exception instance.  NULL with a BaseException pending only when
 * its __str__ raised one; an Exception there reads "<str() failed>". */
static PyObject *
describe_exception(PyObject *exc)
{
    const char *name = Py_TYPE(exc)->tp_name;
    const char *dot = strrchr(name, '.');
    name = dot ? dot + 1 : name;
    PyObject *text = PyObject_Str(exc);
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

/* Takes the pending exception off: an Exception is cleared and its
 * description returned (never NULL for it: a description that cannot be
 * built reads "exception").  Any other BaseException stays pending and
 * NULL is returned, for the caller to propagate. */
static PyObject *
take_cause(void)
{
    PyObject *type, *value, *traceback;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return NULL;
    }
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    Py_XDECREF(traceback);
    PyObject *text = value != NULL ? describe_exception(value) : NULL;
    Py_XDECREF(type);
    Py_XDECREF(value);
    if (text == NULL) {
        if (PyErr_Occurred() &&
            !PyErr_ExceptionMatches(PyExc_Exception)) {
            return NULL;
        }
        PyErr_Clear();
        text = PyUnicode_FromString("exception");
        if (text == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                return NULL;
            }
            PyErr_Clear(); /* a MemoryError: no description */
            text = Py_NewRef(Py_None);
        }
    }
    return text;
}

/* worker.is_alive(): 1, 0, or -1 with an exception. */
static int
worker_is_alive(StandInObject *self)
{
    PyObject *r =
        PyObject_CallMethodObjArgs(self->worker, state_of(self)
                                                     ->str_is_alive,
                                   NULL);
    if (r == NULL) {
        return -1;
    }
    int alive = PyObject_IsTrue(r);
    Py_DECREF(r);
    return alive;
}

/* An is_alive() that raises an Exception counts as alive (logged), on
 * every path: the send decides, and bytes are never reported freed without
 * evidence.  1, 0, or -1 with a BaseException pending. */
static int
worker_is_alive_quiet(StandInObject *self)
{
    int alive = worker_is_alive(self);
    if (alive >= 0) {
        return alive;
    }
    PyObject *cause = take_cause();
    if (cause == NULL) {
        return -1;
    }
    cs_log_warning("comfy_standin: is_alive() of the worker of model %R "
                   "raised %S; treating it as alive",
                   self->model_id, cause);
    Py_DECREF(cause);
    return 1;
}

/* After a send raised: whether the worker still lives.  The send's
 * exception is set aside while is_alive() runs (no Python call may run
 * with an exception pending).  0: dead, the send's exception dropped.
 * 1: alive, the send's exception (an Exception) pending again, for the
 * caller to read and clear.  -1: a BaseException pending (the send's own,
 * untouched, or is_alive()'s), to propagate. */
static int
send_failed_worker_alive(StandInObject *self)
{
    PyObject *type, *value, *traceback;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
    PyErr_Fetch(&type, &value, &traceback);
    int alive = worker_is_alive_quiet(self);
    if (alive != 1) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return alive;
    }
    PyErr_Restore(type, value, traceback);
    return 1;
}

static PyObject *
send_command(StandInObject *self, const char *command, PyObject *k1,
             PyObject *v1, PyObject *k2, PyObject *v2)
{
    cs_module_state *state = state_of(self);
    PyObject *method = NULL, *args = NULL, *kwargs = NULL, *r = NULL;

    method = PyObject_GetAttr(self->worker, state->str_send_command);
    if (method == NULL) {
        goto done;
    }
    args = Py_BuildValue("(s)", command);
    kwargs = PyDict_New();
    if (args == NULL || kwargs == NULL ||
        PyDict_SetItem(kwargs, state->str_model_id, self->model_id) < 0 ||
        PyDict_SetItem(kwargs, k1, v1) < 0 ||
        (k2 != NULL && PyDict_SetItem(kwargs, k2, v2) < 0)) {
        goto done;
    }
    r = PyObject_Call(method, args, kwargs);
done:
    Py_XDECREF(method);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    return r;
}

/* The worker is gone: its VRAM went with the process.  This model's
 * receipt is zeroed in the core first (its own record too, so a stand-in
 * of a worker the pool already forgot learns the death as well), then the
 * pool is told so it can keep the stand-ins alive until the boundary.
 * Returns 0, or -1 with a BaseException from pool.worker_gone() pending
 * (the receipts are zeroed all the same). */
static int
standin_worker_gone(StandInObject *self)
{
    if (cs_model_stale(self->record)) {
        return 0; /* never touch the worker's newer generation */
    }
    cs_log_warning("comfy_standin: the worker of model %R is gone",
                   self->model_id);
    cs_worker_gone(cs_model_worker(self->record));
    cs_model_gone(self->record);
    if (self->pool == NULL) {
        return 0; /* cleared by the GC */
    }
    PyObject *r = NULL;
    PyObject *method = cs_getattr_interned(self->pool, "worker_gone");
    if (method != NULL) {
        r = PyObject_CallOneArg(method, self->worker);
        Py_DECREF(method);
    }
    if (r == NULL) {
        PyObject *cause = take_cause();
        if (cause == NULL) {
            return -1;
        }
        cs_log_warning("comfy_standin: pool.worker_gone() for model %R "
                       "raised %S; receipts zeroed anyway",
                       self->model_id, cause);
        Py_DECREF(cause);
        return 0;
    }
    Py_DECREF(r);
    return 0;
}

/* Tells on_pressure of a shortfall.  0, or -1 with a BaseException from
 * the callback pending (an Exception is logged and ignored). */
static int
standin_pressure(StandInObject *self, uint64_t shortfall)
{
    if (self->pool == NULL) {
        return 0;
    }
    PyObject *callback = cs_getattr_interned(self->pool, "on_pressure");
    if (callback == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return -1;
        }
        PyErr_Clear(); /* no usable callback: nobody to tell */
        return 0;
    }
    int result = 0;
    if (callback != Py_None) {
        PyObject *r = PyObject_CallFunction(callback, "K",
                                            (unsigned long long)shortfall);
        if (r == NULL) {
            PyObject *cause = take_cause();
            if (cause == NULL) {
                result = -1;
            }
            else {
                cs_log_warning("comfy_standin: on_pressure(%llu) raised %S "
                               "(ignored)",
                               (unsigned long long)shortfall, cause);
                Py_DECREF(cause);
            }
        }
        Py_XDECREF(r);
    }
    Py_DECREF(callback);
    return result;
}

/* reply[key], read as a plain dict (a dict subclass's overrides are not
 * called): a new reference, Py_None when absent, NULL with an exception.
 * The lookup may run __eq__ of a str-subclass key stored in the reply: an
 * Exception it raises becomes EchoError (chained); a BaseException
 * propagates unchanged. */
static PyObject *
reply_value(cs_module_state *state, PyObject *reply, PyObject *key,
            const char *command)
{
    PyObject *value = PyDict_GetItemWithError(reply, key);
    if (value != NULL) {
        return Py_NewRef(value);
    }
    if (!PyErr_Occurred()) {
        return Py_NewRef(Py_None);
    }
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyObject *type, *cause, *traceback;
        PyErr_Fetch(&type, &cause, &traceback);
        PyErr_NormalizeException(&type, &cause, &traceback);
        if (traceback != NULL && cause != NULL) {
            PyException_SetTraceback(cause, traceback);
        }
        Py_XDECREF(type);
        Py_XDECREF(traceback);
        PyErr_Format(state->echo_error,
                     "reply[%R] from %s: looking it up raised %R", key,
                     command, cause);
        if (cause != NULL) {
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_NormalizeException(&t, &v, &tb);
            PyException_SetCause(v, Py_NewRef(cause));
            PyException_SetContext(v, cause); /* steals */
            PyErr_Restore(t, v, tb);
        }
    }
    return NULL;
}

/* Reads reply[key] as a byte count in [0, max].  Returns 1 when present,
 * 0 when absent (or None), -1 with EchoError (or a BaseException) set. */
static int
reply_bytes(cs_module_state *state, PyObject *reply, PyObject *key,
            const char *command, uint64_t max, uint64_t *out)
{
    char field[96];
    PyObject *value = reply_value(state, reply, key, command);
    if (value == NULL) {
        return -1;
    }
    if (value == Py_None) {
        Py_DECREF(value);
        return 0;
    }
    /* An int (subclass or not) is read from its digits: no __index__. */
    int code = cs_value_check(value, max, out);
    if (code != 0) {
        PyOS_snprintf(field, sizeof(field), "reply['%s'] from %s",
                      PyUnicode_AsUTF8(key), command);
        cs_value_error(state->echo_error, code, field, value, max);
        Py_DECREF(value);
        return -1;
    }
    Py_DECREF(value);
    return 1;
}

/* Decodes a reply: a dict, `required` present, `other` and `seq` optional.
 * Returns 0, or -1 with EchoError set (nothing applied); a BaseException
 * raised while reading it propagates. */
static int
decode_reply(StandInObject *self, PyObject *reply, const char *command,
             PyObject *required, uint64_t *required_value,
             PyObject *other, uint64_t *other_value, int *has_other,
             int64_t *seq)
{
    cs_module_state *state = cs_state_checked(Py_TYPE(self));
    uint64_t v;
    int r;

    if (state == NULL) {
        return -1;
    }
    if (!PyDict_Check(reply)) {
        PyErr_Format(state->echo_error,
                     "reply from %s: expected a dict, got %R", command,
                     reply);
        return -1;
    }
    if (required != NULL) {
        r = reply_bytes(state, reply, required, command,
                        cs_model_size(self->record), required_value);
        if (r < 0) {
            return -1;
        }
        if (r == 0) {
            PyErr_Format(state->echo_error, "reply[%R] from %s: missing",
                         required, command);
            return -1;
        }
    }
    if (other != NULL) {
        r = reply_bytes(state, reply, other, command,
                        cs_model_size(self->record), other_value);
        if (r < 0) {
            return -1;
        }
        *has_other = r;
    }
    r = reply_bytes(state, reply, state->str_seq, command, CS_VALUE_MAX, &v);
    if (r < 0) {
        return -1;
    }
    *seq = r ? (int64_t)v : CS_SEQ_NONE;
    return 0;
}

/* Raises WorkerGoneError for this model, with `cause` (an exception
 * instance, or NULL) as its __cause__.  Nothing may be pending on entry:
 * the message runs Python (%R of the id).  Returns NULL. */
static PyObject *
gone_error(StandInObject *self, PyObject *cause)
{
    cs_module_state *state = state_of(self);
    PyObject *message = PyUnicode_FromFormat(
        "the worker of model %R (generation %llu) died or restarted; the "
        "model is no longer available: reload the node that loaded it.",
        self->model_id,
        (unsigned long long)cs_model_generation(self->record));
    if (message == NULL) {
        return NULL;
    }
    PyObject *error = PyObject_CallOneArg(state->worker_gone_error, message);
    Py_DECREF(message);
    if (error == NULL) {
        return NULL;
    }
    if (cause != NULL) {
        PyException_SetCause(error, Py_NewRef(cause)); /* steals */
        PyException_SetContext(error, Py_NewRef(cause)); /* steals */
    }
    PyErr_SetObject((PyObject *)Py_TYPE(error), error);
    Py_DECREF(error);
    return NULL;
}

/* A load reply that did not decode: an EchoError is counted and logged
 * as for an eviction and stays pending for the caller; anything else
 * pending (a BaseException from the reply lookup) is left as it is, with
 * nothing counted. */
static void
bad_load_reply(StandInObject *self)
{
    PyObject *type, *value, *traceback, *text;
    if (!PyErr_ExceptionMatches(state_of(self)->echo_error)) {
        return;
    }
    (void)cs_model_bad_reply(self->record);
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    text = value != NULL ? describe_exception(value) : NULL;
    if (text == NULL && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            /* A BaseException while describing it replaces the error. */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            return;
        }
        PyErr_Clear();
    }
    PyErr_Restore(type, value, traceback);
    cs_log_warning("comfy_standin: bad reply for model %R: %S",
                   self->model_id, text != NULL ? text : Py_None);
    Py_XDECREF(text);
}

/* partially_load's body, on owned arguments (extra may be NULL). */
static PyObject *
load_body(StandInObject *self, PyObject *device_to, PyObject *extra)
{
    PyObject *want_obj = NULL, *device_str = NULL, *reply = NULL;
    PyObject *result = NULL;
    uint64_t loaded = 0, resident = 0, want;
    int has_resident = 0;
    int64_t seq;

    if (cs_model_stale(self->record) || self->worker == NULL) {
        /* (worker NULL: cleared by the GC, never to be used again) */
        return gone_error(self, NULL);
    }
    /* An is_alive() that raises an Exception counts as alive here too
     * (docs/semantics.md): the send decides. */
    int alive = worker_is_alive_quiet(self);
    if (alive < 0) {
        return NULL;
    }
    if (!alive) {
        if (standin_worker_gone(self) < 0) {
            return NULL;
        }
        return gone_error(self, NULL);
    }
    if (cs_model_size(self->record) == 0) {
        return PyLong_FromLong(0);
    }
    uint64_t before = cs_standin_loaded(self);
    if (requested_bytes(extra, cs_model_size(self->record), &want) < 0) {
        return NULL;
    }
    want_obj = PyLong_FromUnsignedLongLong(want);
    device_str = PyObject_Str(device_to);
    if (want_obj == NULL || device_str == NULL) {
        goto done;
    }
    reply = send_command(self, "model_partial_load",
                         state_of(self)->str_extra_bytes, want_obj,
                         state_of(self)->str_device, device_str);
    if (reply == NULL) {
        /* Loading is not eviction: failures propagate.  A transport that
         * died is told apart so the caller gets the actionable error, with
         * the transport's exception as its cause. */
        PyObject *type, *value, *traceback;
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            goto done; /* KeyboardInterrupt and the like, as they are */
        }
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (value != NULL && traceback != NULL) {
            PyException_SetTraceback(value, traceback);
        }
        alive = worker_is_alive_quiet(self);
        if (alive == 1) {
            PyErr_Restore(type, value, traceback);
        }
        else if (alive == 0 && standin_worker_gone(self) == 0) {
            gone_error(self, value);
        }
        if (alive != 1) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
        }
        goto done;
    }
    cs_module_state *state = state_of(self);
    if (decode_reply(self, reply, "model_partial_load", state->str_loaded,
                     &loaded, state->str_resident, &resident, &has_resident,
                     &seq) < 0) {
        bad_load_reply(self);
        goto done;
    }
    if (!has_resident) {
        /* An older worker: derive it. */
        resident = before + loaded;
        if (resident < before || resident > cs_model_size(self->record)) {
            resident = cs_model_size(self->record);
        }
    }
    (void)cs_model_apply_echo(self->record, resident, seq,
                              CS_SOURCE_LOAD_ECHO, false, -1);
    result = PyLong_FromUnsignedLongLong(loaded);
done:
    Py_XDECREF(want_obj);
    Py_XDECREF(device_str);
    Py_XDECREF(reply);
    return result;
}

PyObject *
cs_standin_partially_load(StandInObject *self, PyObject *args,
                          PyObject *kwargs)
{
    static char *keywords[] = {"device_to", "extra_memory",
                               "force_patch_weights", NULL};
    PyObject *argv[3] = {NULL, NULL, NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:partially_load",
                                     keywords, &argv[0], &argv[1],
                                     &argv[2])) {
        return NULL;
    }
    /* Owned across the worker's code and the amount's (cs_args_hold). */
    cs_args_hold(argv, 3);
    PyObject *result = load_body(self, argv[0], argv[1]);
    cs_args_release(argv, 3);
    return result;
}

/* Logs `command` of the model deferred because of the pending Exception
 * (cleared) and marks the receipt so.  -1 when what is pending is a
 * BaseException (left pending, nothing marked). */
static int
defer_eviction(StandInObject *self, const char *command)
{
    PyObject *cause = take_cause();
    if (cause == NULL) {
        return -1;
    }
    cs_log_warning("comfy_standin: %s of model %R deferred: %S", command,
                   self->model_id, cause);
    Py_DECREF(cause);
    cs_model_set_eviction_deferred(self->record, true);
    return 0;
}

/* A reply that did not decode (EchoError pending): counted, logged, and
 * the eviction deferred.  -1 when a BaseException is pending instead. */
static int
bad_eviction_reply(StandInObject *self, const char *command)
{
    PyObject *cause = take_cause();
    if (cause == NULL) {
        return -1;
    }
    (void)cs_model_bad_reply(self->record);
    cs_log_warning("comfy_standin: bad reply for model %R: %S",
                   self->model_id, cause);
    cs_log_warning("comfy_standin: %s of model %R deferred: %S", command,
                   self->model_id, cause);
    Py_DECREF(cause);
    cs_model_set_eviction_deferred(self->record, true);
    return 0;
}

/* partially_unload's body.  Returns the bytes freed.  May leave an
 * exception pending: an Exception for failures of this process
 * (MemoryError), which the caller turns into "freed 0", or a
 * BaseException raised by the worker, the pool or the amount, which
 * propagates.  A BaseException out of send_command leaves everything as it
 * was (receipt, eviction_deferred, no on_pressure call): no answer came. */
static uint64_t
unload_body(StandInObject *self, PyObject *memory_to_free)
{
    PyObject *want_obj = NULL, *reply = NULL;
    uint64_t freed = 0, resident = 0, want;
    int has_resident = 0;
    int64_t seq;

    if (cs_model_stale(self->record) || self->worker == NULL) {
        return 0; /* reads 0 already: nothing of ours is on the card */
    }
    uint64_t before = cs_standin_loaded(self);
    if (before == 0) {
        return 0;
    }
    if (requested_bytes(memory_to_free, before, &want) < 0) {
        return 0;
    }
    int alive = worker_is_alive_quiet(self);
    if (alive < 0) {
        return 0;
    }
    if (!alive) {
        /* Its bytes went with the process: freed once, and the record is
         * stale from now on, so no later call reports them again. */
        (void)standin_worker_gone(self);
        return before;
    }
    want_obj = PyLong_FromUnsignedLongLong(want);
    if (want_obj == NULL) {
        return 0;
    }
    reply = send_command(self, "model_partial_unload",
                         state_of(self)->str_bytes_to_free,
                         want_obj, NULL, NULL);
    Py_DECREF(want_obj);
    if (reply == NULL) {
        alive = send_failed_worker_alive(self);
        if (alive < 0) {
            return 0;
        }
        if (alive == 0) {
            (void)standin_worker_gone(self);
            return before;
        }
        if (defer_eviction(self, "model_partial_unload") < 0) {
            return 0;
        }
        goto deferred;
    }
    cs_module_state *state = state_of(self);
    if (decode_reply(self, reply, "model_partial_unload", state->str_freed,
                     &freed, state->str_resident, &resident, &has_resident,
                     &seq) < 0) {
        Py_DECREF(reply);
        if (bad_eviction_reply(self, "model_partial_unload") < 0) {
            return 0;
        }
        goto deferred;
    }
    Py_DECREF(reply);
    if (!has_resident) {
        resident = freed < before ? before - freed : 0;
    }
    (void)cs_model_apply_echo(self->record, resident, seq,
                              CS_SOURCE_UNLOAD_ECHO, false, -1);
    if (freed < want) {
        (void)standin_pressure(self, want - freed);
    }
    return freed;

deferred:
    (void)standin_pressure(self, want);
    return 0;
}

PyObject *
cs_standin_partially_unload(StandInObject *self, PyObject *args,
                         PyObject *kwargs)
{
    static char *keywords[] = {"device_to", "memory_to_free",
                               "force_patch_weights", NULL};
    PyObject *argv[3] = {NULL, NULL, NULL};
    PyObject *cause;

    /* Never raises an Exception: it runs inside ComfyUI's free_memory
     * loop, where one poisons every later load.  Even bad arguments answer
     * 0 (docs/semantics.md); a BaseException propagates. */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OOO:partially_unload",
                                     keywords, &argv[0], &argv[1],
                                     &argv[2])) {
        cause = take_cause();
        if (cause == NULL) {
            return NULL;
        }
        cs_log_warning("comfy_standin: partially_unload of model %R called "
                       "with bad arguments: %S; freed nothing",
                       self->model_id, cause);
        Py_DECREF(cause);
        return PyLong_FromLong(0);
    }
    /* Owned across the worker's code and the amount's own __float__,
     * after which CPython may still read it (cs_args_hold). */
    cs_args_hold(argv, 3);
    uint64_t freed = unload_body(self, argv[1]);
    cs_args_release(argv, 3);
    if (PyErr_Occurred()) {
        cause = take_cause();
        if (cause == NULL) {
            return NULL;
        }
        cs_log_warning("comfy_standin: partially_unload of model %R failed "
                       "in the host: %S; freed nothing",
                       self->model_id, cause);
        Py_DECREF(cause);
        freed = 0;
    }
    return PyLong_FromUnsignedLongLong(freed);
}

/* detach's body.  May leave an exception pending, as unload_body. */
static void
detach_body(StandInObject *self)
{
    PyObject *device_str = NULL, *reply = NULL, *offload;
    uint64_t unused;
    int has_unused;
    int64_t seq;

    if (cs_model_stale(self->record) || self->worker == NULL ||
        cs_standin_loaded(self) == 0) {
        return; /* already off the card (or cleared): no round trip */
    }
    int alive = worker_is_alive_quiet(self);
    if (alive < 0) {
        return;
    }
    if (!alive) {
        (void)standin_worker_gone(self);
        return;
    }
    offload = cs_profile_item(self, PROFILE_OFFLOAD);
    device_str = PyObject_Str(offload != NULL ? offload : Py_None);
    if (device_str == NULL) {
        return;
    }
    reply = send_command(self, "model_to_device",
                         state_of(self)->str_device, device_str,
                         NULL, NULL);
    Py_DECREF(device_str);
    if (reply == NULL) {
        alive = send_failed_worker_alive(self);
        if (alive < 0) {
            return;
        }
        if (alive == 0) {
            (void)standin_worker_gone(self);
            return;
        }
        PyObject *cause = take_cause();
        if (cause == NULL) {
            return;
        }
        PyObject *needle = PyUnicode_FromString("not registered");
        int lost = needle != NULL && PyUnicode_Check(cause)
                       ? PyUnicode_Contains(cause, needle)
                       : 0;
        Py_XDECREF(needle);
        if (lost < 0 && !PyErr_ExceptionMatches(PyExc_Exception)) {
            return;
        }
        if (lost < 0) {
            PyErr_Clear(); /* two str: only MemoryError; not "lost" */
            lost = 0;
        }
        if (lost) {
            /* comfy-env answers "not registered" after a restart nobody
             * told us about: the model, and its bytes, went with the old
             * process. */
            (void)cs_model_apply_echo(self->record, 0, CS_SEQ_NONE,
                                      CS_SOURCE_WORKER_GONE, true, 0);
        }
        else {
            cs_log_warning("comfy_standin: model_to_device of model %R "
                           "deferred: %S",
                           self->model_id, cause);
            cs_model_set_eviction_deferred(self->record, true);
        }
        Py_DECREF(cause);
        return;
    }
    if (decode_reply(self, reply, "model_to_device", NULL, &unused, NULL,
                     &unused, &has_unused, &seq) < 0) {
        Py_DECREF(reply);
        (void)bad_eviction_reply(self, "model_to_device");
        return;
    }
    Py_DECREF(reply);
    (void)cs_model_apply_echo(self->record, 0, seq, CS_SOURCE_DETACH_ECHO,
                              true, -1);
}

/* The pool says the worker's process died (Pool.worker_gone, also after
 * Pool.forget): recorded in this stand-in's own model record and worker
 * books.  No call back into the pool, no log; idempotent. */
PyObject *
cs_standin_mark_worker_gone(StandInObject *self, PyObject *unused)
{
    if (!cs_model_stale(self->record)) {
        cs_worker_gone(cs_model_worker(self->record));
        cs_model_gone(self->record);
    }
    Py_RETURN_NONE;
}

PyObject *
cs_standin_detach(StandInObject *self, PyObject *args, PyObject *kwargs)
{
    /* Never raises an Exception (runs inside free_memory); its arguments
     * (unpatch_all, unpatch_weights) mean nothing for a worker-held model
     * and are ignored, whatever they are.  Returns the inner module. */
    if (self->worker == NULL) {
        Py_RETURN_NONE; /* GC-cleared */
    }
    detach_body(self);
    if (PyErr_Occurred()) {
        PyObject *cause = take_cause();
        if (cause == NULL) {
            return NULL;
        }
        cs_log_warning("comfy_standin: detach of model %R failed in the "
                       "host: %S; receipt kept",
                       self->model_id, cause);
        Py_DECREF(cause);
    }
    PyObject *module = cs_standin_module_get(self);
    if (module == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear(); /* never raises an Exception: None, as if cleared */
        Py_RETURN_NONE;
    }
    return module;
}

