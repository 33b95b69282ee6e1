/*
 * commands.c -- the commands a stand-in sends its worker: partially_load,
 * partially_unload and detach (docs/semantics.md, "The stand-in"), and the
 * reading of their replies.
 *
 * Exceptions follow the one rule of errors.c: an Exception is caught,
 * logged and turned into an answer (the eviction paths never raise one);
 * any other BaseException propagates from the call at once, whoever raised
 * it (the worker, is_alive(), an amount's __float__, on_pressure, the pool,
 * a log handler).  What a path knows is written before the line that
 * reports it, so a BaseException from a log handler leaves it written.
 */
#include "standin.h"

#include <math.h>
#include <string.h>

/* What a no-spawn eviction's sentinels say (docs/troubleshooting.md). */
#define CS_BUSY_TEXT                                                        \
    "the worker is busy: another thread holds its command lock "           \
    "(send_command_no_spawn answered 'busy')"
#define CS_DEAD_TEXT                                                        \
    "the worker's process is gone (send_command_no_spawn answered 'dead')"

/* The model id for a message: an exact str, or None when even that
 * could not be made (a message is never why a path fails). */
static PyObject *
message_id(StandInObject *self)
{
    PyObject *id = cs_standin_model_id(self);
    if (id == NULL) {
        PyErr_Clear();
        id = Py_NewRef(Py_None);
    }
    return id;
}

/* ---- what to ask for -------------------------------------------------- */

/* The byte count to ask for, in *out: `cap` unless `value` names a
 * positive amount below it, rounded up (ComfyUI passes 1e32 for
 * "everything"; 0 means the same).  An amount that cannot be read (its
 * __float__ raises an Exception) also means `cap`.  Returns 0, or -1 with a
 * BaseException pending (KeyboardInterrupt in __float__ propagates). */
static int
requested_bytes(PyObject *value, uint64_t cap, uint64_t *out)
{
    cs_caught caught;
    double d;
    *out = cap;
    if (value == NULL || value == Py_None || PyBool_Check(value) ||
        PyUnicode_Check(value) || PyBytes_Check(value)) {
        return 0;
    }
    if (PyLong_Check(value)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            if (cs_catch(&caught) < 0) {
                return -1;
            }
            cs_caught_release(&caught);
            return 0;
        }
        if (overflow == 0 && v > 0 && (uint64_t)v < cap) {
            *out = (uint64_t)v;
        }
        return 0;
    }
    d = PyFloat_AsDouble(value);
    if (d == -1.0 && PyErr_Occurred()) {
        if (cs_catch(&caught) < 0) {
            return -1;
        }
        cs_caught_release(&caught); /* unreadable: everything, as 0 */
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

/* ---- the worker ------------------------------------------------------- */

/* worker.is_alive().  One that raises an Exception counts as alive
 * (logged), on every path: the send decides, and bytes are never reported
 * freed without evidence.  1, 0, or -1 with a BaseException pending. */
static int
worker_alive(StandInObject *self, cs_module_state *state)
{
    cs_caught caught;
    PyObject *worker = cs_standin_worker(self);
    if (worker == NULL) {
        return 1; /* GC-cleared: nothing is known, so nothing freed */
    }
    PyObject *r = PyObject_CallMethodNoArgs(worker, state->str_is_alive);
    if (r != NULL) {
        int alive = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (alive >= 0) {
            return alive;
        }
    }
    if (cs_catch(&caught) < 0) {
        return -1;
    }
    PyObject *id = message_id(self);
    int logged = cs_log_warning("comfy_standin: is_alive() of the worker of "
                                "model %R raised %S; treating it as alive",
                                id, caught.text);
    Py_DECREF(id);
    cs_caught_release(&caught);
    return logged < 0 ? -1 : 1;
}

/* The eviction send of a worker with send_command_no_spawn (comfy-env's):
 * 1 with the method in *out, 0 without one (*out NULL), -1 with an
 * exception pending (a getattr that raised other than AttributeError). */
static int
no_spawn_method(StandInObject *self, PyObject **out)
{
    PyObject *worker = cs_standin_worker(self);
    if (worker == NULL) {
        *out = NULL;
        return 0;
    }
    *out = cs_getattr_interned(worker, "send_command_no_spawn");
    if (*out != NULL) {
        if (PyCallable_Check(*out)) {
            return 1;
        }
        Py_CLEAR(*out);
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
        return -1;
    }
    PyErr_Clear();
    return 0;
}

/* A no-spawn send's sentinel ("busy": another thread holds the worker's
 * command lock; "dead": its process is gone) raised as a RuntimeError, so
 * the callers' refusal paths take it: deferred, or gone once is_alive()
 * agrees.  Consumes `r`; returns it, or NULL with the error set. */
static PyObject *
no_spawn_reply(PyObject *r)
{
    if (!PyUnicode_Check(r)) {
        return r;
    }
    if (PyUnicode_CompareWithASCIIString(r, "busy") == 0) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_RuntimeError, CS_BUSY_TEXT);
        return NULL;
    }
    if (PyUnicode_CompareWithASCIIString(r, "dead") == 0) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_RuntimeError, CS_DEAD_TEXT);
        return NULL;
    }
    return r;
}

/* worker.send_command(command, model_id=id, k1=v1[, k2=v2]).  An eviction
 * (`evicting`) goes through worker.send_command_no_spawn(command,
 * lock_timeout=0.0, ...) when the worker has it: ComfyUI's thread never
 * waits on a worker that cannot take the command now (its own call holds
 * the lock reentrantly, so a worker's own budget request still evicts). */
static PyObject *
send_command(StandInObject *self, cs_module_state *state,
             const char *command, bool evicting, PyObject *k1, PyObject *v1,
             PyObject *k2, PyObject *v2)
{
    PyObject *method = NULL, *args = NULL, *kwargs = NULL, *r = NULL;
    PyObject *zero = NULL, *model_id = NULL;
    int no_spawn = 0;

    if (evicting) {
        no_spawn = no_spawn_method(self, &method);
        if (no_spawn < 0) {
            goto done;
        }
    }
    if (method == NULL) {
        PyObject *worker = cs_standin_worker(self);
        method = worker ? PyObject_GetAttr(worker, state->str_send_command)
                        : NULL;
        if (method == NULL) {
            if (worker == NULL) {
                PyErr_SetString(PyExc_RuntimeError,
                                "the stand-in was cleared by the garbage "
                                "collector");
            }
            goto done;
        }
    }
    args = Py_BuildValue("(s)", command);
    kwargs = PyDict_New();
    model_id = kwargs ? cs_standin_model_id(self) : NULL;
    if (args == NULL || model_id == NULL ||
        PyDict_SetItem(kwargs, state->str_model_id, model_id) < 0 ||
        PyDict_SetItem(kwargs, k1, v1) < 0 ||
        (k2 != NULL && PyDict_SetItem(kwargs, k2, v2) < 0)) {
        goto done;
    }
    if (no_spawn) {
        PyObject *key = PyUnicode_InternFromString("lock_timeout");
        zero = PyFloat_FromDouble(0.0);
        int set = key != NULL && zero != NULL
                      ? PyDict_SetItem(kwargs, key, zero)
                      : -1;
        Py_XDECREF(key);
        if (set < 0) {
            goto done;
        }
    }
    r = PyObject_Call(method, args, kwargs);
    if (r != NULL && no_spawn) {
        r = no_spawn_reply(r);
    }
done:
    Py_XDECREF(method);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(model_id);
    Py_XDECREF(zero);
    return r;
}

/* The worker is gone: its VRAM went with the process.  This model's
 * receipt is zeroed in the core first (its own record too, so a stand-in
 * of a worker the pool already forgot learns the death as well), then the
 * line is logged and the pool told, so it keeps the stand-ins alive until
 * the boundary.  0, or -1 with a BaseException pending (the receipts are
 * zeroed all the same). */
static int
gone_path(StandInObject *self)
{
    cs_caught caught;
    if (cs_model_stale(self->record)) {
        return 0; /* never touch the worker's newer generation */
    }
    cs_worker_gone(cs_model_worker(self->record));
    cs_model_gone(self->record);
    PyObject *id = message_id(self);
    int logged =
        cs_log_warning("comfy_standin: the worker of model %R is gone", id);
    Py_DECREF(id);
    if (logged < 0) {
        return -1;
    }
    if (self->pool == NULL) {
        return 0; /* cleared by the GC */
    }
    PyObject *r = NULL;
    PyObject *worker = Py_XNewRef(cs_standin_worker(self));
    PyObject *method = cs_getattr_interned(self->pool, "worker_gone");
    if (method != NULL) {
        r = PyObject_CallOneArg(method, worker ? worker : Py_None);
        Py_DECREF(method);
    }
    Py_XDECREF(worker);
    if (r != NULL) {
        Py_DECREF(r);
        return 0;
    }
    if (cs_catch(&caught) < 0) {
        return -1;
    }
    id = message_id(self);
    logged = cs_log_warning("comfy_standin: pool.worker_gone() for model %R "
                            "raised %S; receipts zeroed anyway",
                            id, caught.text);
    Py_DECREF(id);
    cs_caught_release(&caught);
    return logged;
}

/* Tells on_pressure of a shortfall.  0, or -1 with a BaseException from
 * the callback (or its log line) pending; an Exception is logged. */
static int
pressure(StandInObject *self, uint64_t shortfall)
{
    cs_caught caught;
    if (self->pool == NULL) {
        return 0;
    }
    PyObject *callback = cs_getattr_interned(self->pool, "on_pressure");
    if (callback == NULL) {
        if (cs_catch(&caught) < 0) {
            return -1;
        }
        cs_caught_release(&caught); /* no usable callback: nobody to tell */
        return 0;
    }
    PyObject *r = Py_NewRef(Py_None);
    if (callback != Py_None) {
        Py_SETREF(r, PyObject_CallFunction(callback, "K",
                                           (unsigned long long)shortfall));
    }
    Py_DECREF(callback);
    if (r != NULL) {
        Py_DECREF(r);
        return 0;
    }
    if (cs_catch(&caught) < 0) {
        return -1;
    }
    int logged = cs_log_warning("comfy_standin: on_pressure(%llu) raised %S "
                                "(ignored)",
                                (unsigned long long)shortfall, caught.text);
    cs_caught_release(&caught);
    return logged;
}

/* A live worker refused `command` (its send raised `text`): the receipt is
 * kept and the eviction marked deferred, then logged.  0, or -1 with a
 * log handler's BaseException pending. */
static int
defer(StandInObject *self, const char *command, PyObject *text)
{
    cs_model_set_eviction_deferred(self->record, true);
    PyObject *id = message_id(self);
    int logged = cs_log_warning("comfy_standin: %s of model %R deferred: %S",
                                command, id, text);
    Py_DECREF(id);
    return logged;
}

/* The same for a detach (its own line in docs/troubleshooting.md): the
 * worker refused model_to_device, or moved nothing. */
static int
defer_detach(StandInObject *self, PyObject *text)
{
    cs_model_set_eviction_deferred(self->record, true);
    PyObject *id = message_id(self);
    int logged = cs_log_warning("comfy_standin: model_to_device of model %R "
                                "deferred: %S",
                                id, text);
    Py_DECREF(id);
    return logged;
}

/* A reply that did not decode (caught): counted, the eviction deferred
 * when `deferring` names the command, then logged.  0, or -1 with a log
 * handler's BaseException pending. */
static int
bad_reply(StandInObject *self, cs_caught *caught, const char *deferring)
{
    (void)cs_model_bad_reply(self->record);
    if (deferring != NULL) {
        cs_model_set_eviction_deferred(self->record, true);
    }
    PyObject *id = message_id(self);
    int logged = cs_log_warning("comfy_standin: bad reply for model %R: %S",
                                id, caught->text);
    if (logged == 0 && deferring != NULL) {
        logged = cs_log_warning("comfy_standin: %s of model %R deferred: %S",
                                deferring, id, caught->text);
    }
    Py_DECREF(id);
    return logged;
}

/* ---- replies ---------------------------------------------------------- */

/* reply[key], read as a plain dict (a dict subclass's overrides are not
 * called): a new reference, Py_None when absent, NULL with an exception.
 * The lookup may run __eq__ of a str-subclass key stored in the reply: an
 * Exception it raises becomes EchoError (chained); a BaseException
 * propagates unchanged. */
static PyObject *
reply_value(cs_module_state *state, PyObject *reply, PyObject *key,
            const char *command)
{
    cs_caught caught;
    PyObject *value = PyDict_GetItemWithError(reply, key);
    if (value != NULL) {
        return Py_NewRef(value);
    }
    if (!PyErr_Occurred()) {
        return Py_NewRef(Py_None);
    }
    if (cs_catch(&caught) == 0) {
        cs_raise_from(state->echo_error, caught.error,
                      "reply[%R] from %s: looking it up raised %R", key,
                      command, caught.error);
        cs_caught_release(&caught);
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
decode_reply(StandInObject *self, cs_module_state *state, PyObject *reply,
             const char *command, PyObject *required,
             uint64_t *required_value, PyObject *other,
             uint64_t *other_value, int *has_other, int64_t *seq)
{
    uint64_t v;
    int r;

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

/* reply['moved'] of a detach: 1 when something moved (True, a byte count
 * above 0, or absent: an older worker that does not say), 0 when nothing
 * did (False, or 0), -1 with EchoError (or a BaseException) set. */
static int
reply_moved(cs_module_state *state, PyObject *reply)
{
    uint64_t bytes;
    PyObject *value = reply_value(state, reply, state->str_moved,
                                  "model_to_device");
    if (value == NULL) {
        return -1;
    }
    int moved = -1;
    if (value == Py_None || value == Py_True) {
        moved = 1;
    }
    else if (value == Py_False) {
        moved = 0;
    }
    else if (cs_value_check(value, CS_VALUE_MAX, &bytes) == 0) {
        moved = bytes > 0;
    }
    else if (!PyErr_Occurred()) {
        PyErr_Format(state->echo_error,
                     "reply['moved'] from model_to_device: expected a bool "
                     "or a byte count, got %R",
                     value);
    }
    Py_DECREF(value);
    return moved;
}

/* Writes what a good reply says, by the rules of docs/semantics.md ("Which
 * word wins"): a reply that says something moved writes its resident
 * figure; one that says nothing moved writes only a resident figure above
 * 0 that it measured (`measured`), never 0.  An echo older than the
 * receipt (its seq strictly below) writes nothing (cs_model_apply_echo). */
static void
apply_reply(StandInObject *self, bool moved, bool measured,
            uint64_t resident, int64_t seq, cs_source source)
{
    if (moved || (measured && resident > 0)) {
        (void)cs_model_apply_echo(self->record, resident, seq, source,
                                  source == CS_SOURCE_DETACH_ECHO, -1);
    }
}

/* Raises WorkerGoneError for this model, with `cause` (an exception
 * instance, or NULL) as its __cause__.  Returns NULL. */
static PyObject *
gone_error(StandInObject *self, cs_module_state *state, PyObject *cause)
{
    PyObject *id = message_id(self);
    cs_raise_from(state->worker_gone_error, cause,
                  "the worker of model %R (generation %llu) died or "
                  "restarted; the model is no longer available: reload the "
                  "node that loaded it.",
                  id, (unsigned long long)cs_model_generation(self->record));
    Py_DECREF(id);
    return NULL;
}

/* ---- partially_load --------------------------------------------------- */

/* After a load's send raised (pending): a live worker's Exception is
 * raised again as it was; a dead worker's becomes the __cause__ of
 * WorkerGoneError.  Returns NULL, with whatever propagates pending. */
static PyObject *
load_send_failed(StandInObject *self, cs_module_state *state)
{
    cs_caught caught;
    if (cs_catch(&caught) < 0) {
        return NULL; /* KeyboardInterrupt and the like, as they are */
    }
    int alive = worker_alive(self, state);
    if (alive == 1) {
        cs_caught_raise(&caught); /* loading is not eviction */
        return NULL;
    }
    if (alive == 0 && gone_path(self) == 0) {
        gone_error(self, state, caught.error);
    }
    cs_caught_release(&caught);
    return NULL;
}

PyObject *
cs_standin_partially_load(StandInObject *self, PyObject *const *args,
                          Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *argv[3];
    cs_module_state *state = cs_state_checked(Py_TYPE(self));
    if (state == NULL ||
        cs_parse_vector(state, CS_SIG_PARTIALLY_LOAD, args, nargs, kwnames,
                        argv) < 0) {
        return NULL;
    }
    PyObject *want_obj = NULL, *device_str = NULL, *reply = NULL;
    PyObject *result = NULL;
    uint64_t loaded = 0, resident = 0, before, want;
    int has_resident = 0, alive;
    int64_t seq;
    cs_caught caught;

    /* Owned across the worker's code and the amount's (cs_args_hold). */
    cs_args_hold(argv, 3);
    if (cs_model_stale(self->record) || cs_standin_worker(self) == NULL) {
        gone_error(self, state, NULL); /* a GC-cleared one is never used */
        goto done;
    }
    alive = worker_alive(self, state);
    if (alive < 0 || (alive == 0 && gone_path(self) < 0)) {
        goto done;
    }
    if (alive == 0) {
        gone_error(self, state, NULL);
        goto done;
    }
    if (cs_model_size(self->record) == 0) {
        result = PyLong_FromLong(0);
        goto done;
    }
    before = cs_standin_loaded(self);
    if (requested_bytes(argv[1], cs_model_size(self->record), &want) < 0) {
        goto done;
    }
    want_obj = PyLong_FromUnsignedLongLong(want);
    device_str = PyObject_Str(argv[0]);
    if (want_obj == NULL || device_str == NULL) {
        goto done;
    }
    reply = send_command(self, state, "model_partial_load", false,
                         state->str_extra_bytes, want_obj, state->str_device,
                         device_str);
    if (reply == NULL) {
        load_send_failed(self, state);
        goto done;
    }
    if (decode_reply(self, state, reply, "model_partial_load",
                     state->str_loaded, &loaded, state->str_resident,
                     &resident, &has_resident, &seq) < 0) {
        /* An EchoError is counted and logged, then raised; a
         * BaseException from reading the reply propagates as it is. */
        if (PyErr_ExceptionMatches(state->echo_error) &&
            cs_catch(&caught) == 0) {
            if (bad_reply(self, &caught, NULL) == 0) {
                cs_caught_raise(&caught);
            }
            cs_caught_release(&caught);
        }
        goto done;
    }
    if (!has_resident) {
        /* An older worker: derive it. */
        resident = before + loaded;
        if (resident < before || resident > cs_model_size(self->record)) {
            resident = cs_model_size(self->record);
        }
    }
    apply_reply(self, loaded > 0, has_resident, resident, seq,
                CS_SOURCE_LOAD_ECHO);
    result = PyLong_FromUnsignedLongLong(loaded);
done:
    Py_XDECREF(want_obj);
    Py_XDECREF(device_str);
    Py_XDECREF(reply);
    cs_args_release(argv, 3);
    return result;
}

/* ---- partially_unload ------------------------------------------------- */

/* partially_unload's body.  Returns the bytes freed.  May leave an
 * exception pending: an Exception for failures of this process
 * (MemoryError), which the caller turns into "freed 0", or a
 * BaseException, which propagates.  A BaseException out of send_command
 * leaves everything as it was (receipt, eviction_deferred, no on_pressure
 * call): no answer came. */
static uint64_t
unload_body(StandInObject *self, cs_module_state *state,
            PyObject *memory_to_free)
{
    PyObject *want_obj = NULL, *reply = NULL;
    uint64_t freed = 0, resident = 0, want;
    int has_resident = 0;
    int64_t seq;
    cs_caught caught;

    if (cs_model_stale(self->record) || cs_standin_worker(self) == NULL) {
        return 0; /* reads 0 already: nothing of ours is on the card */
    }
    uint64_t before = cs_standin_loaded(self);
    if (before == 0 || requested_bytes(memory_to_free, before, &want) < 0) {
        return 0;
    }
    int alive = worker_alive(self, state);
    if (alive <= 0) {
        /* Dead: its bytes went with the process, freed once, and the
         * record is stale from now on, so no later call reports them
         * again. */
        return alive == 0 && gone_path(self) == 0 ? before : 0;
    }
    want_obj = PyLong_FromUnsignedLongLong(want);
    if (want_obj == NULL) {
        return 0;
    }
    reply = send_command(self, state, "model_partial_unload", true,
                         state->str_bytes_to_free, want_obj, NULL, NULL);
    Py_DECREF(want_obj);
    if (reply == NULL) {
        if (cs_catch(&caught) < 0) {
            return 0;
        }
        alive = worker_alive(self, state);
        if (alive == 1 &&
            defer(self, "model_partial_unload", caught.text) < 0) {
            alive = -1;
        }
        cs_caught_release(&caught);
        if (alive <= 0) {
            return alive == 0 && gone_path(self) == 0 ? before : 0;
        }
        goto deferred;
    }
    int decoded = decode_reply(self, state, reply, "model_partial_unload",
                               state->str_freed, &freed, state->str_resident,
                               &resident, &has_resident, &seq);
    Py_DECREF(reply);
    if (decoded < 0) {
        if (cs_catch(&caught) < 0) {
            return 0;
        }
        int logged = bad_reply(self, &caught, "model_partial_unload");
        cs_caught_release(&caught);
        if (logged < 0) {
            return 0;
        }
        goto deferred;
    }
    if (!has_resident) {
        resident = freed < before ? before - freed : 0;
    }
    /* The bytes freed are returned whatever was written: an older echo
     * than the receipt (another thread's reply applied first) still freed
     * them. */
    apply_reply(self, freed > 0, has_resident, resident, seq,
                CS_SOURCE_UNLOAD_ECHO);
    if (freed < want) {
        (void)pressure(self, want - freed);
    }
    return freed;

deferred:
    (void)pressure(self, want);
    return 0;
}

/* Logs that partially_unload of the model freed nothing because of the
 * pending Exception: its arguments were bad (`bad_arguments`), or it
 * failed in the host.  0, or -1 with a BaseException pending (the one
 * raised, or a log handler's). */
static int
unload_failed(StandInObject *self, bool bad_arguments)
{
    cs_caught caught;
    if (cs_catch(&caught) < 0) {
        return -1;
    }
    PyObject *id = message_id(self);
    int logged =
        bad_arguments
            ? cs_log_warning("comfy_standin: partially_unload of model %R "
                             "called with bad arguments: %S; freed nothing",
                             id, caught.text)
            : cs_log_warning("comfy_standin: partially_unload of model %R "
                             "failed in the host: %S; freed nothing",
                             id, caught.text);
    Py_DECREF(id);
    cs_caught_release(&caught);
    return logged;
}

PyObject *
cs_standin_partially_unload(StandInObject *self, PyObject *const *args,
                            Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *argv[3];
    /* Never raises an Exception: it runs inside ComfyUI's free_memory
     * loop, where one poisons every later load.  Even bad arguments answer
     * 0 (docs/semantics.md); a BaseException propagates. */
    cs_module_state *state = cs_state_checked(Py_TYPE(self));
    if (state != NULL &&
        cs_parse_vector(state, CS_SIG_PARTIALLY_UNLOAD, args, nargs,
                        kwnames, argv) < 0) {
        return unload_failed(self, true) < 0
                   ? NULL
                   : PyLong_FromLong(0);
    }
    uint64_t freed = 0;
    if (state != NULL) {
        /* Owned across the worker's code and the amount's own __float__,
         * after which CPython may still read it (cs_args_hold). */
        cs_args_hold(argv, 3);
        freed = unload_body(self, state, argv[1]);
        cs_args_release(argv, 3);
    }
    if (PyErr_Occurred()) {
        if (unload_failed(self, false) < 0) {
            return NULL;
        }
        freed = 0;
    }
    return PyLong_FromUnsignedLongLong(freed);
}

/* ---- detach ----------------------------------------------------------- */

/* After a detach's send raised (caught): the worker died, lost the model
 * (comfy-env answers "not registered" after a restart nobody told us of:
 * the model, and its bytes, went with the old process), or refused. 0, or
 * -1 with a BaseException pending. */
static int
detach_send_failed(StandInObject *self, cs_module_state *state,
                   cs_caught *caught)
{
    int alive = worker_alive(self, state);
    if (alive <= 0) {
        return alive < 0 ? -1 : gone_path(self);
    }
    int lost = 0;
    if (caught->text != Py_None) {
        PyObject *needle = PyUnicode_FromString("not registered");
        lost = needle != NULL ? PyUnicode_Contains(caught->text, needle) : -1;
        Py_XDECREF(needle);
        if (lost < 0) {
            cs_caught other;
            if (cs_catch(&other) < 0) {
                return -1;
            }
            cs_caught_release(&other); /* two strs: MemoryError only */
            lost = 0;
        }
    }
    if (lost) {
        (void)cs_model_apply_echo(self->record, 0, CS_SEQ_NONE,
                                  CS_SOURCE_WORKER_GONE, true, 0);
        return 0;
    }
    return defer_detach(self, caught->text);
}

/* detach's body.  May leave an exception pending, as unload_body. */
static void
detach_body(StandInObject *self, cs_module_state *state)
{
    PyObject *device_str = NULL, *reply = NULL, *offload;
    uint64_t unused;
    int has_unused;
    int64_t seq;
    cs_caught caught;

    if (cs_model_stale(self->record) || cs_standin_loaded(self) == 0) {
        return; /* already off the card: no round trip */
    }
    int alive = worker_alive(self, state);
    if (alive == 0) {
        (void)gone_path(self);
    }
    if (alive <= 0) {
        return;
    }
    offload = cs_profile_item(self, PROFILE_OFFLOAD);
    device_str = PyObject_Str(offload != NULL ? offload : Py_None);
    if (device_str == NULL) {
        return;
    }
    reply = send_command(self, state, "model_to_device", true,
                         state->str_device,
                         device_str, NULL, NULL);
    Py_DECREF(device_str);
    if (reply == NULL) {
        if (cs_catch(&caught) == 0) {
            (void)detach_send_failed(self, state, &caught);
            cs_caught_release(&caught);
        }
        return;
    }
    int moved = -1;
    if (decode_reply(self, state, reply, "model_to_device", NULL, &unused,
                     NULL, &unused, &has_unused, &seq) == 0) {
        moved = reply_moved(state, reply);
    }
    Py_DECREF(reply);
    if (moved < 0) {
        if (cs_catch(&caught) == 0) {
            (void)bad_reply(self, &caught, "model_to_device");
            cs_caught_release(&caught);
        }
        return;
    }
    if (moved) {
        apply_reply(self, true, false, 0, seq, CS_SOURCE_DETACH_ECHO);
        return;
    }
    /* Nothing moved (comfy-env answers so when the model's first parameter
     * is already on the offload device, whatever else is on the card): no
     * byte was freed, so none is written, and the eviction is deferred,
     * so the pool lists the model again once ComfyUI drops its entry. */
    PyObject *text = PyUnicode_FromString("the worker moved nothing "
                                          "(moved: False)");
    if (text != NULL) {
        (void)defer_detach(self, text);
        Py_DECREF(text);
    }
}

PyObject *
cs_standin_detach(StandInObject *self, PyObject *const *args,
                  Py_ssize_t nargs, PyObject *kwnames)
{
    cs_caught caught;
    /* Never raises an Exception (runs inside free_memory); its arguments
     * (unpatch_all, unpatch_weights) mean nothing for a worker-held model
     * and are ignored, whatever they are.  Returns `model`: itself. */
    if (cs_standin_worker(self) == NULL) {
        Py_RETURN_NONE; /* GC-cleared */
    }
    cs_module_state *state = cs_state_checked(Py_TYPE(self));
    if (state != NULL) {
        detach_body(self, state);
    }
    if (PyErr_Occurred()) {
        if (cs_catch(&caught) < 0) {
            return NULL;
        }
        PyObject *id = message_id(self);
        int logged = cs_log_warning("comfy_standin: detach of model %R "
                                    "failed in the host: %S; receipt kept",
                                    id, caught.text);
        Py_DECREF(id);
        cs_caught_release(&caught);
        if (logged < 0) {
            return NULL;
        }
    }
    if (cs_standin_worker(self) == NULL) {
        Py_RETURN_NONE; /* cleared meanwhile */
    }
    return Py_NewRef(self); /* its own inner module */
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
