/*
 * standin.c -- the stand-in type ComfyUI's model_management loads directly
 * (DESIGN.md 3.1-3.3), its inner module, the clone_base_uuid sentinel, and
 * the state sync functions apply_echo / apply_residency.
 *
 * Thread safety: the receipt lives in the C core (seqlock; any thread).
 * The PyObject fields below are immutable after construction except
 * ModuleObject.device_assigned and StandInObject.bad_replies, which are
 * touched only with the GIL held (this module does not claim free-threading
 * support).
 */
#include "binding.h"

#include "board_binding.h"
#include "comfy_standin/ledger.h"

#include <math.h>
#include <string.h>
#include <structmember.h>

/* ---- object layouts --------------------------------------------------- */

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
    PyObject *weakreflist;
} ModuleObject;

typedef struct {
    PyObject_HEAD
    cs_model *record;   /* a handle (cs_model_release_handle); immutable */
    PyObject *module;   /* strong ModuleObject; immutable */
    PyObject *worker;   /* strong; immutable */
    PyObject *pool;     /* strong; immutable */
    PyObject *books;    /* strong WorkerBooks; immutable */
    PyObject *model_id; /* strong str; immutable */
    PyObject *kind;     /* strong str; immutable */
    PyObject *sentinel; /* strong SentinelObject; immutable */
    uint64_t generation;
    uint64_t size;
    uint64_t bad_replies; /* GIL */
    PyObject *weakreflist;
} StandInObject;

static inline cs_module_state *
state_of(PyObject *self)
{
    return (cs_module_state *)PyType_GetModuleState(Py_TYPE(self));
}

/* "StandIn" of "comfy_standin._core.StandIn" (heap types keep the dotted
 * name in tp_name; _PyType_Name is private API). */
static const char *
short_type_name(PyObject *self)
{
    const char *name = Py_TYPE(self)->tp_name;
    const char *dot = strrchr(name, '.');
    return dot ? dot + 1 : name;
}

static int
is_dunder(PyObject *name)
{
    Py_ssize_t n = PyUnicode_GetLength(name);
    if (n < 5) {
        return 0;
    }
    return PyUnicode_READ_CHAR(name, 0) == '_' &&
           PyUnicode_READ_CHAR(name, 1) == '_' &&
           PyUnicode_READ_CHAR(name, n - 1) == '_' &&
           PyUnicode_READ_CHAR(name, n - 2) == '_';
}

/* Unknown attributes name themselves; dunders stay plain so copy, pickle
 * and weakref probes and getattr(x, name, default) behave. */
static PyObject *
contract_getattro(PyObject *self, PyObject *name)
{
    PyObject *value = PyObject_GenericGetAttr(self, name);
    if (value != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError) ||
        !PyUnicode_Check(name)) {
        return value;
    }
    PyErr_Clear();
    if (is_dunder(name)) {
        PyErr_SetObject(PyExc_AttributeError, name);
        return NULL;
    }
    PyErr_Format(PyExc_AttributeError,
                 "%.50s has no attribute %R: ComfyUI touched a ModelPatcher "
                 "member the stand-in does not implement, which means the "
                 "upstream contract changed. Implement it in comfy_standin "
                 "(C type and reference) rather than inheriting "
                 "ModelPatcher.",
                 short_type_name(self), name);
    return NULL;
}

/* ---- sentinel --------------------------------------------------------- */

static void
sentinel_dealloc(SentinelObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_CLEAR(self->model_id);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
sentinel_repr(SentinelObject *self)
{
    return PyUnicode_FromFormat("<comfy_standin private clone_base_uuid of "
                                "model %R (never equals a uuid)>",
                                self->model_id);
}

static PyType_Slot sentinel_slots[] = {
    {Py_tp_doc, "A stand-in's clone_base_uuid: equal only to itself, so "
                "unload_model_and_clones and the MultiGPU reuse loop never "
                "match it with a host model or another stand-in."},
    {Py_tp_dealloc, sentinel_dealloc},
    {Py_tp_repr, sentinel_repr},
    {0, NULL},
};

static PyType_Spec sentinel_spec = {
    .name = "comfy_standin._core.CloneBaseSentinel",
    .basicsize = sizeof(SentinelObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = sentinel_slots,
};

/* ---- the inner module ------------------------------------------------- */

/* What the host knows of the model's residency: the receipt, or the
 * board's reading when one is attached, valid, and newer than the receipt
 * (DESIGN.md 5).  Fills *out when given; its source is "board" when the
 * board won.  Never blocks: the board read is wait-free with bounded
 * retries, and an untrustworthy board (torn slot, dead or stale owner,
 * rewritten header) falls back to the receipt. */
static uint64_t
module_read(ModuleObject *m, cs_receipt *out)
{
    cs_receipt local;
    uint64_t loaded, updated_ns;

    if (m->board == NULL && out == NULL) {
        return cs_model_loaded(m->record); /* the hot path: one load */
    }
    if (out == NULL) {
        out = &local;
    }
    cs_model_read(m->record, out);
    if (m->board == NULL || cs_model_stale(m->record)) {
        return out->loaded;
    }
    /* A closed board, a slot reassigned since (its tag changed), or
     * anything doubtful: the receipt is all we have. */
    if (cs_board_object_read(m->board, m->board_slot, m->board_tag,
                             cs_model_size(m->record), &loaded,
                             &updated_ns) &&
        updated_ns > out->time_ns) {
        out->loaded = loaded;
        out->time_ns = updated_ns;
        out->source = CS_SOURCE_BOARD;
    }
    return out->loaded;
}

static uint64_t
module_loaded(ModuleObject *m)
{
    return module_read(m, NULL);
}

static PyObject *
module_device(ModuleObject *m)
{
    /* An assignment holds until the next receipt; then the receipt rules. */
    if (m->device_assigned != NULL &&
        cs_model_write_count(m->record) == m->device_assigned_at) {
        return Py_NewRef(m->device_assigned);
    }
    return Py_NewRef(module_loaded(m) > 0 ? m->load_device
                                          : m->offload_device);
}

static int
module_traverse(ModuleObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->load_device);
    Py_VISIT(self->offload_device);
    Py_VISIT(self->device_assigned);
    Py_VISIT(self->board);
    return 0;
}

static int
module_clear(ModuleObject *self)
{
    Py_CLEAR(self->load_device);
    Py_CLEAR(self->offload_device);
    Py_CLEAR(self->device_assigned);
    Py_CLEAR(self->board);
    return 0;
}

static void
module_dealloc(ModuleObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    module_clear(self);
    cs_model_decref(self->record);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
module_get_device(ModuleObject *self, void *closure)
{
    return module_device(self);
}

static int
module_set_device(ModuleObject *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "device cannot be deleted");
        return -1;
    }
    Py_XSETREF(self->device_assigned, Py_NewRef(value));
    self->device_assigned_at = cs_model_write_count(self->record);
    return 0;
}

static PyObject *
module_get_loaded(ModuleObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(module_loaded(self));
}

static int
module_set_loaded(ModuleObject *self, PyObject *value, void *closure)
{
    uint64_t loaded;
    uint64_t size = cs_model_size(self->record);

    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError,
                        "model_loaded_weight_memory cannot be deleted");
        return -1;
    }
    int code = cs_value_check(value, size, &loaded);
    if (code != 0) {
        return cs_value_error(NULL, code, "model_loaded_weight_memory",
                              value, size);
    }
    /* Stale: the bytes went with the old process; nothing to assign. */
    (void)cs_model_apply_echo(self->record, loaded, CS_SEQ_NONE,
                              CS_SOURCE_ASSIGNED, false, 0);
    return 0;
}

static PyObject *
module_get_false(PyObject *self, void *closure)
{
    Py_RETURN_FALSE;
}

static PyObject *
module_get_zero(PyObject *self, void *closure)
{
    return PyLong_FromLong(0);
}

static PyObject *
module_get_none(PyObject *self, void *closure)
{
    Py_RETURN_NONE;
}

static PyGetSetDef module_getset[] = {
    {"device", (getter)module_get_device, (setter)module_set_device,
     "load_device while loaded > 0, else offload_device; an assignment "
     "holds until the next receipt.",
     NULL},
    {"model_loaded_weight_memory", (getter)module_get_loaded,
     (setter)module_set_loaded,
     "The receipt's loaded bytes; assigning writes a receipt (\"assigned\").",
     NULL},
    {"model_lowvram", module_get_false, NULL, "Always False.", NULL},
    {"lowvram_patch_counter", module_get_zero, NULL, "Always 0.", NULL},
    {"current_weight_patches_uuid", module_get_none, NULL, "Always None.",
     NULL},
    {"model_offload_buffer_memory", module_get_zero, NULL, "Always 0.", NULL},
    {NULL},
};

static PyObject *refuse_pickle(PyObject *self, PyObject *unused);

static PyMethodDef module_methods[] = {
    {"__reduce_ex__", refuse_pickle, METH_O,
     "__reduce_ex__($self, protocol, /)\n--\n\nRaises TypeError."},
    {NULL},
};

static PyMemberDef module_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(ModuleObject, weakreflist),
     READONLY},
    {NULL},
};

static PyObject *
module_repr(ModuleObject *self)
{
    size_t len;
    const char *id = cs_model_id(self->record, &len);
    return PyUnicode_FromFormat("<StandInModule of model '%.200s': %llu "
                                "bytes loaded>",
                                id, (unsigned long long)module_loaded(self));
}

static PyType_Slot module_slots[] = {
    {Py_tp_doc, "The inner module of a stand-in (what ComfyUI calls "
                "`model.model`): holds no weights, weak-referenceable."},
    {Py_tp_traverse, module_traverse},
    {Py_tp_clear, module_clear},
    {Py_tp_dealloc, module_dealloc},
    {Py_tp_getset, module_getset},
    {Py_tp_members, module_members},
    {Py_tp_methods, module_methods},
    {Py_tp_getattro, contract_getattro},
    {Py_tp_repr, module_repr},
    {0, NULL},
};

static PyType_Spec module_spec = {
    .name = "comfy_standin._core.StandInModule",
    .basicsize = sizeof(ModuleObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = module_slots,
};

/* ---- StandIn: construction and lifetime ------------------------------- */

static int
check_worker(PyObject *worker, cs_module_state *state)
{
    PyObject *names[2] = {state->str_send_command, state->str_is_alive};
    for (int i = 0; i < 2; i++) {
        PyObject *method = PyObject_GetAttr(worker, names[i]);
        if (method == NULL || !PyCallable_Check(method)) {
            Py_XDECREF(method);
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "worker: expected an object with send_command() "
                         "and is_alive() (comfy-env's SubprocessWorker), "
                         "got %R lacking %U()",
                         worker, names[i]);
            return -1;
        }
        Py_DECREF(method);
    }
    return 0;
}

static PyObject *
resolve_pool(PyObject *pool, cs_module_state *state, PyObject **ledger)
{
    if (pool == NULL || pool == Py_None) {
        PyObject *package = PyImport_ImportModule("comfy_standin");
        if (package == NULL) {
            return NULL;
        }
        pool = PyObject_CallMethod(package, "default_pool", NULL);
        Py_DECREF(package);
        if (pool == NULL) {
            return NULL;
        }
    }
    else {
        Py_INCREF(pool);
    }
    *ledger = PyObject_GetAttrString(pool, "_ledger");
    if (*ledger == NULL || !PyObject_TypeCheck(*ledger, state->ledger_type)) {
        Py_XDECREF(*ledger);
        *ledger = NULL;
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "pool: expected a comfy_standin.Pool (of the C "
                     "implementation), got %R",
                     pool);
        Py_DECREF(pool);
        return NULL;
    }
    return pool;
}

static PyObject *
standin_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"worker",         "worker_generation",
                               "model_id",       "model_size",
                               "load_device",    "offload_device",
                               "kind",           "pool",
                               NULL};
    cs_module_state *state = PyType_GetModuleState(type);
    PyObject *worker, *generation_obj, *model_id, *size_obj, *load_device,
        *offload_device, *kind = NULL, *pool_arg = NULL;
    PyObject *pool = NULL, *ledger = NULL, *books = NULL, *r = NULL;
    StandInObject *self = NULL;
    ModuleObject *module = NULL;
    SentinelObject *sentinel = NULL;
    uint64_t generation, size;
    cs_model *record = NULL;
    Py_ssize_t id_len;
    const char *id;
    int code;

    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOOOOO|OO:StandIn", keywords, &worker,
            &generation_obj, &model_id, &size_obj, &load_device,
            &offload_device, &kind, &pool_arg)) {
        return NULL;
    }
    if (check_worker(worker, state) < 0) {
        return NULL;
    }
    code = cs_value_check(generation_obj, CS_VALUE_MAX, &generation);
    if (code != 0) {
        return cs_value_error(NULL, code, "worker_generation", generation_obj,
                              CS_VALUE_MAX),
               NULL;
    }
    if (cs_check_model_id(model_id) < 0) {
        return NULL;
    }
    id = PyUnicode_AsUTF8AndSize(model_id, &id_len);
    if (id == NULL) {
        return NULL;
    }
    code = cs_value_check(size_obj, CS_VALUE_MAX, &size);
    if (code != 0) {
        return cs_value_error(NULL, code, "model_size", size_obj,
                              CS_VALUE_MAX),
               NULL;
    }
    if (kind == NULL) {
        kind = PyUnicode_InternFromString("other");
        if (kind == NULL) {
            return NULL;
        }
    }
    else if (!PyUnicode_Check(kind)) {
        PyErr_Format(PyExc_TypeError, "kind: expected a str, got %R", kind);
        return NULL;
    }
    else {
        Py_INCREF(kind);
    }

    pool = resolve_pool(pool_arg, state, &ledger);
    if (pool == NULL) {
        goto error;
    }
    books = cs_ledger_books_for(state, ledger, worker, generation);
    if (books == NULL) {
        goto error;
    }
    if (cs_register_model(cs_books_worker(books), generation, model_id, id,
                          (size_t)id_len, size, size_obj, &record) < 0) {
        goto error;
    }

    module = PyObject_GC_New(ModuleObject, state->module_type);
    if (module == NULL) {
        goto error;
    }
    cs_model_incref(record);
    module->record = record;
    module->load_device = Py_NewRef(load_device);
    module->offload_device = Py_NewRef(offload_device);
    module->device_assigned = NULL;
    module->device_assigned_at = 0;
    module->board = NULL;
    module->board_slot = 0;
    module->board_tag = 0;
    module->weakreflist = NULL;
    PyObject_GC_Track(module);

    sentinel = PyObject_New(SentinelObject, state->sentinel_type);
    if (sentinel == NULL) {
        goto error;
    }
    sentinel->model_id = Py_NewRef(model_id);

    self = (StandInObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        goto error;
    }
    self->record = record;
    record = NULL;
    self->module = (PyObject *)module;
    module = NULL;
    self->sentinel = (PyObject *)sentinel;
    sentinel = NULL;
    self->worker = Py_NewRef(worker);
    self->pool = pool;
    pool = NULL;
    self->books = books;
    books = NULL;
    self->model_id = Py_NewRef(model_id);
    self->kind = kind;
    kind = NULL;
    self->generation = generation;
    self->size = size;

    /* The pool keeps the stand-in for its graveyard (DESIGN.md 3.4). */
    r = PyObject_CallMethod(self->pool, "_adopt", "O", (PyObject *)self);
    if (r == NULL) {
        goto error;
    }
    Py_DECREF(r);
    Py_DECREF(ledger);
    return (PyObject *)self;

error:
    Py_XDECREF(self);
    Py_XDECREF(sentinel);
    Py_XDECREF(module);
    if (record != NULL) {
        cs_model_release_handle(record);
    }
    Py_XDECREF(books);
    Py_XDECREF(ledger);
    Py_XDECREF(pool);
    Py_XDECREF(kind);
    return NULL;
}

static int
standin_traverse(StandInObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->worker);
    Py_VISIT(self->pool);
    Py_VISIT(self->books);
    Py_VISIT(self->sentinel);
    return 0;
}

static int
standin_clear(StandInObject *self)
{
    Py_CLEAR(self->module);
    Py_CLEAR(self->worker);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->books);
    Py_CLEAR(self->sentinel);
    return 0;
}

static void
standin_dealloc(StandInObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    standin_clear(self);
    Py_CLEAR(self->model_id);
    Py_CLEAR(self->kind);
    if (self->record != NULL) {
        cs_model_release_handle(self->record);
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* A cleared (GC) stand-in has no module; every method guards on it. */
static ModuleObject *
standin_module(StandInObject *self)
{
    return (ModuleObject *)self->module;
}

/* ---- StandIn: what ComfyUI reads --------------------------------------- */

static uint64_t
standin_loaded(StandInObject *self)
{
    ModuleObject *m = standin_module(self);
    return m ? module_loaded(m) : cs_model_loaded(self->record);
}

static PyObject *
standin_model_size(StandInObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(self->size);
}

static PyObject *
standin_loaded_size(StandInObject *self, PyObject *unused)
{
    return PyLong_FromUnsignedLongLong(standin_loaded(self));
}

static PyObject *
standin_current_loaded_device(StandInObject *self, PyObject *unused)
{
    ModuleObject *m = standin_module(self);
    if (m == NULL) {
        Py_RETURN_NONE;
    }
    return module_device(m);
}

static PyObject *
standin_is_dynamic(StandInObject *self, PyObject *unused)
{
    /* Seed, inaccuracy 1: True would open dynamic_pins, whose layout is
     * internal and churns.  Kept False deliberately. */
    Py_RETURN_FALSE;
}

static PyObject *
standin_is_clone(StandInObject *self, PyObject *other)
{
    if (!PyObject_TypeCheck(other, Py_TYPE(self))) {
        Py_RETURN_FALSE;
    }
    StandInObject *o = (StandInObject *)other;
    if (o->worker != self->worker || o->generation != self->generation) {
        Py_RETURN_FALSE;
    }
    int eq = PyUnicode_Compare(o->model_id, self->model_id);
    if (eq == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyBool_FromLong(eq == 0);
}

static PyObject *
standin_none(StandInObject *self, PyObject *unused)
{
    Py_RETURN_NONE;
}

static PyObject *
standin_none_any(StandInObject *self, PyObject *args, PyObject *kwargs)
{
    Py_RETURN_NONE;
}

static PyObject *
standin_empty_list(StandInObject *self, PyObject *unused)
{
    return PyList_New(0);
}

static PyObject *
standin_zero(StandInObject *self, PyObject *unused)
{
    return PyLong_FromLong(0);
}

static PyObject *
standin_receipt(StandInObject *self, PyObject *unused)
{
    cs_receipt r;
    ModuleObject *m = standin_module(self);
    if (m != NULL) {
        module_read(m, &r);
    }
    else {
        cs_model_read(self->record, &r);
    }
    uint64_t now = cs_monotonic_ns();
    double age = now > r.time_ns ? (double)(now - r.time_ns) / 1e9 : 0.0;
    PyObject *seq = r.seq == CS_SEQ_NONE
                        ? Py_NewRef(Py_None)
                        : PyLong_FromLongLong((long long)r.seq);
    if (seq == NULL) {
        return NULL;
    }
    return Py_BuildValue("(KNds)", (unsigned long long)r.loaded, seq, age,
                         cs_source_name(r.source));
}

static PyObject *
standin_not_implemented(StandInObject *self, const char *what)
{
    PyErr_Format(PyExc_NotImplementedError,
                 "model %R lives in a subprocess worker and cannot be %s in "
                 "the host: the host holds no weights, so a %s would be "
                 "silently wrong. Do it inside the node's own environment, "
                 "where a real ModelPatcher holds the weights.",
                 self->model_id, what,
                 strcmp(what, "cloned") == 0 ? "clone" : "patch");
    return NULL;
}

/* Neither object can cross a process boundary or be duplicated: a copy
 * would be a second stand-in for one worker model, outside the pool. */
static PyObject *
refuse_pickle(PyObject *self, PyObject *unused)
{
    PyErr_Format(PyExc_TypeError,
                 "cannot pickle or copy %.100s object: it stands in for a "
                 "model held by a worker process",
                 short_type_name(self));
    return NULL;
}

static PyObject *
standin_clone(StandInObject *self, PyObject *args, PyObject *kwargs)
{
    return standin_not_implemented(self, "cloned");
}

static PyObject *
standin_add_patches(StandInObject *self, PyObject *args, PyObject *kwargs)
{
    return standin_not_implemented(self, "patched");
}

/* ---- StandIn: talking to the worker ------------------------------------ */

/* The byte count to ask for: `cap` unless `value` names a positive amount
 * below it, rounded up (ComfyUI passes 1e32 for "everything"; 0 means the
 * same). */
static uint64_t
requested_bytes(PyObject *value, uint64_t cap)
{
    double d;
    if (value == NULL || value == Py_None) {
        return cap;
    }
    if (PyBool_Check(value) || PyUnicode_Check(value) ||
        PyBytes_Check(value)) {
        return cap;
    }
    if (PyLong_Check(value)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return cap;
        }
        if (overflow != 0 || v <= 0 || (uint64_t)v >= cap) {
            return cap;
        }
        return (uint64_t)v;
    }
    d = PyFloat_AsDouble(value);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return cap;
    }
    if (!(d > 0.0) || isinf(d) || d >= (double)cap) {
        return cap; /* NaN fails d > 0 */
    }
    /* Rounded up: ComfyUI keeps an entry only when freed >= the float it
     * asked for (load_models_gpu's targets are floats), so the truncated
     * figure would always fall short and escalate to a full detach. */
    uint64_t v = (uint64_t)ceil(d);
    return v < cap ? v : cap;
}

/* worker.is_alive(): 1, 0, or -1 with an exception. */
static int
worker_is_alive(StandInObject *self)
{
    PyObject *r =
        PyObject_CallMethodObjArgs(self->worker, state_of((PyObject *)self)
                                                     ->str_is_alive,
                                   NULL);
    if (r == NULL) {
        return -1;
    }
    int alive = PyObject_IsTrue(r);
    Py_DECREF(r);
    return alive;
}

/* On eviction paths: an is_alive() that raises counts as alive, so the
 * send decides; bytes are never reported freed without evidence. */
static int
worker_is_alive_quiet(StandInObject *self)
{
    int alive = worker_is_alive(self);
    if (alive < 0) {
        cs_log_warning("model %R: worker.is_alive() raised; assuming alive",
                       self->model_id);
        PyErr_Clear();
        return 1;
    }
    return alive;
}

/* After a send raised: whether the worker still lives.  The send's
 * exception is set aside while is_alive() runs (no Python call may run
 * with an exception pending); it is dropped when the worker is dead and
 * left pending when it lives, for the caller to read and clear. */
static int
send_failed_worker_alive(StandInObject *self)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    int alive = worker_is_alive_quiet(self);
    if (!alive) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return 0;
    }
    PyErr_Restore(type, value, traceback);
    return 1;
}

static PyObject *
send_command(StandInObject *self, const char *command, PyObject *k1,
             PyObject *v1, PyObject *k2, PyObject *v2)
{
    cs_module_state *state = state_of((PyObject *)self);
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

/* The worker is gone: its VRAM went with the process.  The receipt is
 * zeroed in the core first (so it holds whatever the pool does), then the
 * pool is told so it can keep the stand-ins alive until the boundary. */
static void
standin_worker_gone(StandInObject *self)
{
    if (cs_model_stale(self->record) &&
        cs_worker_generation(cs_model_worker(self->record)) !=
            self->generation) {
        return; /* a restarted worker's new generation is alive */
    }
    cs_worker_gone(cs_model_worker(self->record));
    PyObject *r =
        PyObject_CallMethod(self->pool, "worker_gone", "O", self->worker);
    if (r == NULL) {
        cs_log_warning("model %R: pool.worker_gone() raised; receipts "
                       "zeroed anyway",
                       self->model_id);
        PyErr_Clear();
    }
    Py_XDECREF(r);
}

static void
standin_pressure(StandInObject *self, uint64_t shortfall)
{
    PyObject *callback = PyObject_GetAttrString(self->pool, "on_pressure");
    if (callback == NULL) {
        PyErr_Clear();
        return;
    }
    if (callback != Py_None) {
        PyObject *r = PyObject_CallFunction(callback, "K",
                                            (unsigned long long)shortfall);
        if (r == NULL) {
            cs_log_warning("model %R: on_pressure(%llu) raised; ignored",
                           self->model_id, (unsigned long long)shortfall);
            PyErr_Clear();
        }
        Py_XDECREF(r);
    }
    Py_DECREF(callback);
}

/* Reads reply[key] as a byte count in [0, max].  Returns 1 when present,
 * 0 when absent (or None), -1 with EchoError set when bad. */
static int
reply_bytes(StandInObject *self, PyObject *reply, PyObject *key,
            const char *command, uint64_t max, uint64_t *out)
{
    char field[96];
    PyObject *value = PyDict_GetItemWithError(reply, key);
    if (value == NULL && PyErr_Occurred()) {
        PyErr_Clear(); /* an exact str key cannot fail; be safe anyway */
    }
    if (value == NULL || value == Py_None) {
        return 0;
    }
    int code = cs_value_check(value, max, out);
    if (code != 0) {
        PyOS_snprintf(field, sizeof(field), "reply['%s'] from %s",
                      PyUnicode_AsUTF8(key), command);
        cs_value_error(state_of((PyObject *)self)->echo_error, code, field,
                       value, max);
        return -1;
    }
    return 1;
}

/* Decodes a reply: a dict, `required` present, `other` and `seq` optional.
 * Returns 0, or -1 with EchoError set (nothing applied). */
static int
decode_reply(StandInObject *self, PyObject *reply, const char *command,
             PyObject *required, uint64_t *required_value,
             PyObject *other, uint64_t *other_value, int *has_other,
             int64_t *seq)
{
    cs_module_state *state = state_of((PyObject *)self);
    uint64_t v;
    int r;

    if (!PyDict_Check(reply)) {
        PyErr_Format(state->echo_error,
                     "reply from %s for model %R: expected a dict, got %R",
                     command, self->model_id, reply);
        return -1;
    }
    if (required != NULL) {
        r = reply_bytes(self, reply, required, command, self->size,
                        required_value);
        if (r < 0) {
            return -1;
        }
        if (r == 0) {
            PyErr_Format(state->echo_error,
                         "reply[%R] from %s for model %R: missing", required,
                         command, self->model_id);
            return -1;
        }
    }
    if (other != NULL) {
        r = reply_bytes(self, reply, other, command, self->size,
                        other_value);
        if (r < 0) {
            return -1;
        }
        *has_other = r;
    }
    r = reply_bytes(self, reply, state->str_seq, command, CS_VALUE_MAX, &v);
    if (r < 0) {
        return -1;
    }
    *seq = r ? (int64_t)v : CS_SEQ_NONE;
    return 0;
}

/* Replaces the pending exception with `exc(message)` whose __cause__ is
 * the original. */
static void
raise_from(PyObject *exc, PyObject *message)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    PyObject *error = PyObject_CallOneArg(exc, message);
    if (error == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return;
    }
    if (value != NULL) {
        PyException_SetCause(error, Py_NewRef(value));
        PyException_SetContext(error, value); /* steals */
    }
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    PyErr_SetObject(exc, error);
    Py_DECREF(error);
}

static PyObject *
gone_error(StandInObject *self, int chain)
{
    cs_module_state *state = state_of((PyObject *)self);
    PyObject *message = PyUnicode_FromFormat(
        "the worker of model %R (generation %llu) died or restarted; the "
        "model is no longer available: reload the node that loaded it.",
        self->model_id, (unsigned long long)self->generation);
    if (message == NULL) {
        return NULL;
    }
    if (chain) {
        raise_from(state->worker_gone_error, message);
    }
    else {
        PyErr_SetObject(state->worker_gone_error, message);
    }
    Py_DECREF(message);
    return NULL;
}

static PyObject *
standin_partially_load(StandInObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"device_to", "extra_memory",
                               "force_patch_weights", NULL};
    PyObject *device_to, *extra = NULL, *force = NULL;
    PyObject *want_obj = NULL, *device_str = NULL, *reply = NULL;
    PyObject *result = NULL;
    uint64_t loaded = 0, resident = 0;
    int has_resident = 0;
    int64_t seq;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:partially_load",
                                     keywords, &device_to, &extra, &force)) {
        return NULL;
    }
    if (cs_model_stale(self->record) || self->worker == NULL) {
        /* (worker NULL: cleared by the GC, never to be used again) */
        return gone_error(self, 0);
    }
    int alive = worker_is_alive(self);
    if (alive < 0) {
        return NULL;
    }
    if (!alive) {
        standin_worker_gone(self);
        return gone_error(self, 0);
    }
    if (self->size == 0) {
        return PyLong_FromLong(0);
    }
    uint64_t before = standin_loaded(self);
    want_obj = PyLong_FromUnsignedLongLong(requested_bytes(extra, self->size));
    device_str = PyObject_Str(device_to);
    if (want_obj == NULL || device_str == NULL) {
        goto done;
    }
    reply = send_command(self, "model_partial_load",
                         state_of((PyObject *)self)->str_extra_bytes, want_obj,
                         state_of((PyObject *)self)->str_device, device_str);
    if (reply == NULL) {
        /* Loading is not eviction: failures propagate.  A transport that
         * died is told apart so the caller gets the actionable error, with
         * the transport's exception as its cause.  No Python runs while an
         * exception is pending, so it is set aside meanwhile. */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        alive = worker_is_alive(self);
        if (alive < 0) {
            PyErr_Clear();
        }
        if (alive == 0) {
            standin_worker_gone(self);
        }
        PyErr_Restore(type, value, traceback);
        if (alive == 0) {
            gone_error(self, 1);
        }
        goto done;
    }
    cs_module_state *state = state_of((PyObject *)self);
    if (decode_reply(self, reply, "model_partial_load", state->str_loaded,
                     &loaded, state->str_resident, &resident, &has_resident,
                     &seq) < 0) {
        self->bad_replies++;
        goto done;
    }
    if (!has_resident) {
        /* An older worker: derive it. */
        resident = before + loaded;
        if (resident < before || resident > self->size) {
            resident = self->size;
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

/* partially_unload's body.  Returns the bytes freed; may leave an
 * exception set only for failures of this process (MemoryError), which the
 * caller turns into "freed 0". */
static uint64_t
unload_body(StandInObject *self, PyObject *memory_to_free)
{
    PyObject *want_obj = NULL, *reply = NULL;
    uint64_t freed = 0, resident = 0, result = 0;
    int has_resident = 0;
    int64_t seq;

    if (cs_model_stale(self->record) || self->worker == NULL) {
        return 0; /* reads 0 already: nothing of ours is on the card */
    }
    uint64_t before = standin_loaded(self);
    if (before == 0) {
        return 0;
    }
    uint64_t want = requested_bytes(memory_to_free, before);
    if (!worker_is_alive_quiet(self)) {
        standin_worker_gone(self);
        return before;
    }
    want_obj = PyLong_FromUnsignedLongLong(want);
    if (want_obj == NULL) {
        return 0;
    }
    reply = send_command(self, "model_partial_unload",
                         state_of((PyObject *)self)->str_bytes_to_free,
                         want_obj, NULL, NULL);
    Py_DECREF(want_obj);
    if (reply == NULL) {
        if (!send_failed_worker_alive(self)) {
            standin_worker_gone(self);
            return before;
        }
        cs_log_warning("model %R: model_partial_unload failed on a live "
                       "worker; receipt kept, eviction deferred",
                       self->model_id);
        PyErr_Clear();
        goto deferred;
    }
    cs_module_state *state = state_of((PyObject *)self);
    if (decode_reply(self, reply, "model_partial_unload", state->str_freed,
                     &freed, state->str_resident, &resident, &has_resident,
                     &seq) < 0) {
        self->bad_replies++;
        cs_log_warning("model %R: bad reply ignored", self->model_id);
        PyErr_Clear();
        Py_DECREF(reply);
        goto deferred;
    }
    Py_DECREF(reply);
    if (!has_resident) {
        resident = freed < before ? before - freed : 0;
    }
    (void)cs_model_apply_echo(self->record, resident, seq,
                              CS_SOURCE_UNLOAD_ECHO, false, -1);
    result = freed;
    if (freed < want) {
        standin_pressure(self, want - freed);
    }
    return result;

deferred:
    cs_model_set_eviction_deferred(self->record, true);
    standin_pressure(self, want);
    return 0;
}

static PyObject *
standin_partially_unload(StandInObject *self, PyObject *args,
                         PyObject *kwargs)
{
    static char *keywords[] = {"device_to", "memory_to_free",
                               "force_patch_weights", NULL};
    PyObject *device_to = NULL, *memory = NULL, *force = NULL;

    /* Never raises: it runs inside ComfyUI's free_memory loop, where an
     * exception poisons every later load.  Even bad arguments answer 0. */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OOO:partially_unload",
                                     keywords, &device_to, &memory,
                                     &force)) {
        cs_log_warning("model %R: partially_unload called with bad "
                       "arguments; freed nothing",
                       self->model_id);
        PyErr_Clear();
        return PyLong_FromLong(0);
    }
    uint64_t freed = unload_body(self, memory);
    if (PyErr_Occurred()) {
        cs_log_warning("model %R: partially_unload failed in the host; "
                       "freed nothing",
                       self->model_id);
        PyErr_Clear();
        freed = 0;
    }
    return PyLong_FromUnsignedLongLong(freed);
}

/* Whether the pending exception's text says "not registered".  Leaves
 * the exception pending. */
static int
error_says_not_registered(void)
{
    PyObject *type, *value, *traceback, *text = NULL, *needle = NULL;
    Py_ssize_t at = -1;

    PyErr_Fetch(&type, &value, &traceback);
    if (value != NULL) {
        text = PyObject_Str(value);
    }
    needle = PyUnicode_FromString("not registered");
    if (text != NULL && needle != NULL) {
        at = PyUnicode_Find(text, needle, 0, PY_SSIZE_T_MAX, 1);
    }
    Py_XDECREF(text);
    Py_XDECREF(needle);
    PyErr_Clear();
    PyErr_Restore(type, value, traceback);
    return at >= 0;
}

static void
detach_body(StandInObject *self)
{
    PyObject *device_str = NULL, *reply = NULL;
    uint64_t unused;
    int has_unused;
    int64_t seq;

    if (cs_model_stale(self->record) || self->worker == NULL ||
        standin_loaded(self) == 0) {
        return; /* already off the card (or cleared): no round trip */
    }
    if (!worker_is_alive_quiet(self)) {
        standin_worker_gone(self);
        return;
    }
    device_str = PyObject_Str(standin_module(self)->offload_device);
    if (device_str == NULL) {
        return;
    }
    reply = send_command(self, "model_to_device",
                         state_of((PyObject *)self)->str_device, device_str,
                         NULL, NULL);
    Py_DECREF(device_str);
    if (reply == NULL) {
        if (!send_failed_worker_alive(self)) {
            standin_worker_gone(self);
            return;
        }
        if (error_says_not_registered()) {
            /* comfy-env answers "not registered" after a restart nobody
             * told us about: the model, and its bytes, went with the old
             * process. */
            PyErr_Clear();
            (void)cs_model_apply_echo(self->record, 0, CS_SEQ_NONE,
                                      CS_SOURCE_WORKER_GONE, true, 0);
            return;
        }
        cs_log_warning("model %R: model_to_device failed on a live "
                       "worker; receipt kept, eviction deferred",
                       self->model_id);
        PyErr_Clear();
        cs_model_set_eviction_deferred(self->record, true);
        return;
    }
    if (decode_reply(self, reply, "model_to_device", NULL, &unused, NULL,
                     &unused, &has_unused, &seq) < 0) {
        self->bad_replies++;
        cs_log_warning("model %R: bad reply ignored", self->model_id);
        PyErr_Clear();
        Py_DECREF(reply);
        cs_model_set_eviction_deferred(self->record, true);
        return;
    }
    Py_DECREF(reply);
    (void)cs_model_apply_echo(self->record, 0, seq, CS_SOURCE_DETACH_ECHO,
                              true, -1);
}

static PyObject *
standin_detach(StandInObject *self, PyObject *args, PyObject *kwargs)
{
    /* Never raises (runs inside free_memory); returns the inner module. */
    if (self->module == NULL) {
        Py_RETURN_NONE;
    }
    detach_body(self);
    if (PyErr_Occurred()) {
        cs_log_warning("model %R: detach failed in the host; receipt kept",
                       self->model_id);
        PyErr_Clear();
    }
    return Py_NewRef(self->module);
}

/* ---- StandIn: the live residency board --------------------------------- */

static PyObject *
standin_attach_board(StandInObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"board", "slot", NULL};
    PyObject *board_obj, *slot_obj = Py_None;
    ModuleObject *m = standin_module(self);
    uint32_t slot = 0;
    uint64_t tag = 0;
    size_t id_len;
    const char *id = cs_model_id(self->record, &id_len);

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:attach_board",
                                     keywords, &board_obj, &slot_obj)) {
        return NULL;
    }
    if (m == NULL) {
        PyErr_SetString(PyExc_ValueError, "attach_board: stand-in cleared");
        return NULL;
    }
    /* The slot's identity is the host's (slot, tag): a slot released and
     * given to another model has a new tag, so this stand-in never reads
     * that model's bytes. */
    if (cs_board_attach_model(board_obj, self->model_id, id, id_len,
                              self->size, slot_obj, &slot, &tag) < 0) {
        return NULL;
    }
    Py_XSETREF(m->board, Py_NewRef(board_obj));
    m->board_slot = slot;
    m->board_tag = tag;
    return PyLong_FromUnsignedLong(slot);
}

static PyObject *
standin_detach_board(StandInObject *self, PyObject *unused)
{
    ModuleObject *m = standin_module(self);
    if (m != NULL) {
        Py_CLEAR(m->board);
    }
    Py_RETURN_NONE;
}

static PyObject *
standin_get_board(StandInObject *self, void *closure)
{
    ModuleObject *m = standin_module(self);
    if (m == NULL || m->board == NULL) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Ok)", m->board, (unsigned long)m->board_slot);
}

/* ---- StandIn: attributes ----------------------------------------------- */

static PyObject *
standin_get_load_device(StandInObject *self, void *closure)
{
    ModuleObject *m = standin_module(self);
    return m ? Py_NewRef(m->load_device) : Py_NewRef(Py_None);
}

static PyObject *
standin_get_offload_device(StandInObject *self, void *closure)
{
    ModuleObject *m = standin_module(self);
    return m ? Py_NewRef(m->offload_device) : Py_NewRef(Py_None);
}

static PyObject *
standin_get_model(StandInObject *self, void *closure)
{
    return Py_NewRef(self->module ? self->module : Py_None);
}

static PyObject *
standin_get_sentinel(StandInObject *self, void *closure)
{
    return Py_NewRef(self->sentinel ? self->sentinel : Py_None);
}

static PyObject *
standin_get_size(StandInObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(self->size);
}

static PyObject *
standin_get_worker(StandInObject *self, void *closure)
{
    return Py_NewRef(self->worker ? self->worker : Py_None);
}

static PyObject *
standin_get_pool(StandInObject *self, void *closure)
{
    return Py_NewRef(self->pool ? self->pool : Py_None);
}

static PyObject *
standin_get_generation(StandInObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(self->generation);
}

static PyObject *
standin_get_model_id(StandInObject *self, void *closure)
{
    return Py_NewRef(self->model_id);
}

static PyObject *
standin_get_kind(StandInObject *self, void *closure)
{
    return Py_NewRef(self->kind);
}

static PyObject *
standin_get_stale(StandInObject *self, void *closure)
{
    return PyBool_FromLong(cs_model_stale(self->record));
}

static PyObject *
standin_get_deferred(StandInObject *self, void *closure)
{
    return PyBool_FromLong(cs_model_eviction_deferred(self->record));
}

static PyObject *
standin_get_bad_replies(StandInObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(self->bad_replies);
}

static PyObject *
standin_get_parent(StandInObject *self, void *closure)
{
    Py_RETURN_NONE; /* no clone chains across a process boundary */
}

static PyObject *
standin_get_peak(StandInObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(cs_model_admission_peak(self->record));
}

static PyObject *
standin_get_seq(StandInObject *self, void *closure)
{
    cs_receipt r;
    cs_model_read(self->record, &r);
    return PyLong_FromLongLong((long long)r.seq); /* -1: none, as comfy-env */
}

static PyObject *
standin_repr(StandInObject *self)
{
    return PyUnicode_FromFormat(
        "<StandIn %R (%U) of worker generation %llu: %llu of %llu bytes "
        "loaded%s>",
        self->model_id, self->kind, (unsigned long long)self->generation,
        (unsigned long long)standin_loaded(self),
        (unsigned long long)self->size,
        cs_model_stale(self->record) ? ", stale" : "");
}

static PyGetSetDef standin_getset[] = {
    {"load_device", (getter)standin_get_load_device, NULL,
     "The device the worker loads the model to.", NULL},
    {"offload_device", (getter)standin_get_offload_device, NULL,
     "The device the worker offloads the model to.", NULL},
    {"parent", (getter)standin_get_parent, NULL, "Always None.", NULL},
    {"model", (getter)standin_get_model, NULL,
     "The inner StandInModule (weak-referenceable).", NULL},
    {"clone_base_uuid", (getter)standin_get_sentinel, NULL,
     "A private per-instance sentinel: never equal to a uuid, None, or "
     "another stand-in's.",
     NULL},
    {"size", (getter)standin_get_size, NULL, "Registered size, bytes.",
     NULL},
    {"worker", (getter)standin_get_worker, NULL, "The worker object.", NULL},
    {"pool", (getter)standin_get_pool, NULL, "The pool keeping its books.",
     NULL},
    {"worker_generation", (getter)standin_get_generation, NULL,
     "The worker generation this stand-in belongs to.", NULL},
    {"model_id", (getter)standin_get_model_id, NULL,
     "The worker's id for the model.", NULL},
    {"kind", (getter)standin_get_kind, NULL,
     "\"unet\", \"clip\", \"vae\" or \"other\".", NULL},
    {"stale", (getter)standin_get_stale, NULL,
     "True once the worker died or restarted: reads as offloaded.", NULL},
    {"eviction_deferred", (getter)standin_get_deferred, NULL,
     "True when a live worker refused the last eviction (receipt kept).",
     NULL},
    {"bad_replies", (getter)standin_get_bad_replies, NULL,
     "Malformed replies rejected so far.", NULL},
    {"board", (getter)standin_get_board, NULL,
     "(board, slot) when a residency board is attached, else None.", NULL},
    /* comfy-env's own code reads these off its stand-in (pool.py's
     * held-bytes snapshot, state_sync.held_ceiling, the generation filter
     * of the census apply); read-only views so it can run unchanged. */
    {"_worker", (getter)standin_get_worker, NULL,
     "comfy-env compatibility: worker.", NULL},
    {"_worker_generation", (getter)standin_get_generation, NULL,
     "comfy-env compatibility: worker_generation.", NULL},
    {"_model_id", (getter)standin_get_model_id, NULL,
     "comfy-env compatibility: model_id.", NULL},
    {"_kind", (getter)standin_get_kind, NULL,
     "comfy-env compatibility: kind.", NULL},
    {"_residency_peak", (getter)standin_get_peak, NULL,
     "comfy-env compatibility: the admission peak.", NULL},
    {"_residency_seq", (getter)standin_get_seq, NULL,
     "comfy-env compatibility: the receipt's seq (-1: none).", NULL},
    {NULL},
};

static PyMemberDef standin_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(StandInObject, weakreflist),
     READONLY},
    {NULL},
};

static PyMethodDef standin_methods[] = {
    {"__reduce_ex__", refuse_pickle, METH_O,
     "__reduce_ex__($self, protocol, /)\n--\n\nRaises TypeError."},
    {"model_size", (PyCFunction)standin_model_size, METH_NOARGS,
     "model_size($self, /)\n--\n\nRegistered parameter+buffer bytes."},
    {"loaded_size", (PyCFunction)standin_loaded_size, METH_NOARGS,
     "loaded_size($self, /)\n--\n\nBytes on the card when the worker last "
     "said so (the receipt)."},
    {"current_loaded_device", (PyCFunction)standin_current_loaded_device,
     METH_NOARGS, "current_loaded_device($self, /)\n--\n\nmodel.device."},
    {"is_dynamic", (PyCFunction)standin_is_dynamic, METH_NOARGS,
     "is_dynamic($self, /)\n--\n\nAlways False (seed, inaccuracy 1)."},
    {"is_clone", (PyCFunction)standin_is_clone, METH_O,
     "is_clone($self, other, /)\n--\n\nTrue only for a stand-in of the same "
     "worker, generation and model id."},
    {"model_dtype", (PyCFunction)standin_none, METH_NOARGS,
     "model_dtype($self, /)\n--\n\nNone: the dtype is the worker's."},
    {"model_patches_to", (PyCFunction)(void (*)(void))standin_none_any,
     METH_VARARGS | METH_KEYWORDS,
     "model_patches_to($self, /, *args, **kwargs)\n--\n\nNone; no local "
     "patches to move."},
    {"model_patches_models", (PyCFunction)standin_empty_list, METH_NOARGS,
     "model_patches_models($self, /)\n--\n\n[]"},
    {"get_nested_additional_models", (PyCFunction)standin_empty_list,
     METH_NOARGS, "get_nested_additional_models($self, /)\n--\n\n[]"},
    {"lowvram_patch_counter", (PyCFunction)standin_zero, METH_NOARGS,
     "lowvram_patch_counter($self, /)\n--\n\n0"},
    {"attach_board", (PyCFunction)(void (*)(void))standin_attach_board,
     METH_VARARGS | METH_KEYWORDS,
     "attach_board($self, /, board, slot=None)\n--\n\nReads residency "
     "from a live board (host side): loaded_size() then returns the "
     "board's reading when valid and newer than the receipt.  slot None "
     "finds or assigns the model's slot.  Returns the slot."},
    {"detach_board", (PyCFunction)standin_detach_board, METH_NOARGS,
     "detach_board($self, /)\n--\n\nBack to receipts only."},
    {"receipt", (PyCFunction)standin_receipt, METH_NOARGS,
     "receipt($self, /)\n--\n\n(loaded, seq or None, age in seconds, "
     "source)."},
    {"partially_load", (PyCFunction)(void (*)(void))standin_partially_load,
     METH_VARARGS | METH_KEYWORDS,
     "partially_load($self, /, device_to, extra_memory=0, "
     "force_patch_weights=False)\n--\n\nAsks the worker to load; returns "
     "the bytes it loaded.  Raises WorkerGoneError on a dead worker."},
    {"partially_unload",
     (PyCFunction)(void (*)(void))standin_partially_unload,
     METH_VARARGS | METH_KEYWORDS,
     "partially_unload($self, /, device_to, memory_to_free=0, "
     "force_patch_weights=False)\n--\n\nAsks the worker to free; returns "
     "exactly the bytes freed.  Never raises."},
    {"detach", (PyCFunction)(void (*)(void))standin_detach,
     METH_VARARGS | METH_KEYWORDS,
     "detach($self, /, unpatch_all=True)\n--\n\nFull offload; idempotent; "
     "never raises; returns model."},
    {"clone", (PyCFunction)(void (*)(void))standin_clone,
     METH_VARARGS | METH_KEYWORDS,
     "clone($self, /, *args, **kwargs)\n--\n\nRaises NotImplementedError."},
    {"add_patches", (PyCFunction)(void (*)(void))standin_add_patches,
     METH_VARARGS | METH_KEYWORDS,
     "add_patches($self, /, *args, **kwargs)\n--\n\nRaises "
     "NotImplementedError."},
    {"add_hook_patches", (PyCFunction)(void (*)(void))standin_add_patches,
     METH_VARARGS | METH_KEYWORDS,
     "add_hook_patches($self, /, *args, **kwargs)\n--\n\nRaises "
     "NotImplementedError."},
    {NULL},
};

static PyType_Slot standin_slots[] = {
    {Py_tp_doc,
     "StandIn(worker, worker_generation, model_id, model_size, load_device, "
     "offload_device, kind='other', pool=None)\n--\n\n"
     "A worker-held model as ComfyUI's model_management sees it (DESIGN.md "
     "3.1).  Drop-in for comfy-env's SubprocessModelPatcher."},
    {Py_tp_new, standin_new},
    {Py_tp_traverse, standin_traverse},
    {Py_tp_clear, standin_clear},
    {Py_tp_dealloc, standin_dealloc},
    {Py_tp_getset, standin_getset},
    {Py_tp_members, standin_members},
    {Py_tp_methods, standin_methods},
    {Py_tp_getattro, contract_getattro},
    {Py_tp_repr, standin_repr},
    {0, NULL},
};

static PyType_Spec standin_spec = {
    .name = "comfy_standin._core.StandIn",
    .basicsize = sizeof(StandInObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = standin_slots,
};

/* ---- state sync: apply_echo, apply_residency ---------------------------- */

static StandInObject *
as_standin(PyObject *module, PyObject *object, const char *what)
{
    cs_module_state *state = cs_state_of_module(module);
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
apply_echo(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"standin", "resident", "seq", "unmapped",
                               "in_flight", NULL};
    cs_module_state *state = cs_state_of_module(module);
    PyObject *object, *resident_obj, *seq_obj = Py_None;
    int unmapped = 0, in_flight = 0;
    uint64_t resident, seq_value;
    int64_t seq = CS_SEQ_NONE;
    int code;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|Opp:apply_echo",
                                     keywords, &object, &resident_obj,
                                     &seq_obj, &unmapped, &in_flight)) {
        return NULL;
    }
    StandInObject *s = as_standin(module, object, "standin");
    if (s == NULL) {
        return NULL;
    }
    code = cs_value_check(resident_obj, s->size, &resident);
    if (code != 0) {
        return cs_value_error(state->echo_error, code, "resident",
                              resident_obj, s->size),
               NULL;
    }
    if (seq_obj != Py_None) {
        code = cs_value_check(seq_obj, CS_VALUE_MAX, &seq_value);
        if (code != 0) {
            return cs_value_error(state->echo_error, code, "seq", seq_obj,
                                  CS_VALUE_MAX),
                   NULL;
        }
        seq = (int64_t)seq_value;
    }
    cs_source source = CS_SOURCE_LOAD_ECHO;
    if (unmapped) {
        source = CS_SOURCE_DETACH_ECHO;
    }
    else if (resident < standin_loaded(s)) {
        source = CS_SOURCE_UNLOAD_ECHO;
    }
    cs_status status = cs_model_apply_echo(s->record, resident, seq, source,
                                           unmapped != 0, in_flight != 0);
    return PyBool_FromLong(status == CS_OK);
}

typedef struct {
    StandInObject *standin; /* borrowed from the mapping's value */
    uint64_t resident;
    int64_t seq;
    int has_seq;
} residency_entry;

/* Every value of the map must be a C stand-in filed under its own id,
 * whether or not this census names it: a wrong map is a caller's bug that
 * would otherwise surface only on the census that happens to name it. */
static int
check_standins_map(cs_module_state *state, PyObject *standins)
{
    PyObject *items = PyMapping_Items(standins);
    if (items == NULL) {
        return -1;
    }
    int result = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items) && result == 0; i++) {
        PyObject *pair = PyList_GET_ITEM(items, i);
        PyObject *key = PyTuple_GET_ITEM(pair, 0);
        PyObject *value = PyTuple_GET_ITEM(pair, 1);
        if (!PyObject_TypeCheck(value, state->standin_type)) {
            PyErr_Format(state->echo_error,
                         "standins[%R]: expected a comfy_standin.StandIn (C "
                         "implementation), got %R",
                         key, value);
            result = -1;
            break;
        }
        int same = PyUnicode_Check(key)
                       ? PyUnicode_Compare(((StandInObject *)value)->model_id,
                                           key)
                       : 1;
        if (same == -1 && PyErr_Occurred()) {
            result = -1;
        }
        else if (same != 0) {
            PyErr_Format(state->echo_error,
                         "standins[%R]: the stand-in is for model %R", key,
                         ((StandInObject *)value)->model_id);
            result = -1;
        }
    }
    Py_DECREF(items);
    return result;
}

static PyObject *
apply_residency(PyObject *module, PyObject *args)
{
    cs_module_state *state = cs_state_of_module(module);
    PyObject *standins, *census, *fast = NULL, *seen = NULL, *held = NULL;
    residency_entry *entries = NULL;
    PyObject *result = NULL;
    Py_ssize_t n, applied = 0;

    if (!PyArg_ParseTuple(args, "OO:apply_residency", &standins, &census)) {
        return NULL;
    }
    if (!PyMapping_Check(standins) || PyList_Check(standins) ||
        PyTuple_Check(standins) || PyUnicode_Check(standins) ||
        PyBytes_Check(standins)) {
        PyErr_Format(PyExc_TypeError,
                     "standins: expected a mapping of model id to StandIn, "
                     "got %R",
                     standins);
        return NULL;
    }
    if (check_standins_map(state, standins) < 0) {
        return NULL;
    }
    fast = cs_census_fast(state->echo_error, census);
    if (fast == NULL) {
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(fast);
    entries = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*entries));
    seen = PySet_New(NULL);
    held = PyList_New(0); /* keeps the looked-up stand-ins alive */
    if (entries == NULL || seen == NULL || held == NULL) {
        if (entries == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    /* Validate everything first; nothing is written until all is good. */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id, *value;
        residency_entry *e = &entries[i];
        if (cs_decode_census_entry(state,
                                   PySequence_Fast_GET_ITEM(fast, i), i, &id,
                                   &e->resident, &e->has_seq, &e->seq) < 0) {
            goto done;
        }
        int dup = PySet_Contains(seen, id);
        if (dup < 0) {
            goto done;
        }
        if (dup) {
            PyErr_Format(state->echo_error,
                         "census[%zd]['id']: duplicate model id %R", i, id);
            goto done;
        }
        if (PySet_Add(seen, id) < 0) {
            goto done;
        }
        value = PyObject_GetItem(standins, id);
        if (value == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
                goto done;
            }
            PyErr_Clear();
            PyErr_Format(state->echo_error,
                         "census[%zd]['id']: unknown model id %R (no "
                         "stand-in for it in the mapping)",
                         i, id);
            goto done;
        }
        int appended = PyList_Append(held, value);
        Py_DECREF(value);
        if (appended < 0) {
            goto done;
        }
        if (!PyObject_TypeCheck(value, state->standin_type)) {
            PyErr_Format(state->echo_error,
                         "standins[%R]: expected a comfy_standin.StandIn (C "
                         "implementation), got %R",
                         id, value);
            goto done;
        }
        e->standin = (StandInObject *)value;
        int same = PyUnicode_Compare(e->standin->model_id, id);
        if (same == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (same != 0) {
            PyErr_Format(state->echo_error,
                         "standins[%R]: the stand-in is for model %R", id,
                         e->standin->model_id);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        bool written = false;
        residency_entry *e = &entries[i];
        (void)cs_model_apply_census(e->standin->record, e->has_seq != 0,
                                    e->seq, e->resident, &written);
        applied += written;
    }
    result = PyLong_FromSsize_t(applied);
done:
    PyMem_Free(entries);
    Py_XDECREF(seen);
    Py_XDECREF(held);
    Py_XDECREF(fast);
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
     METH_VARARGS | METH_KEYWORDS,
     "apply_echo(standin, resident, seq=None, unmapped=False, "
     "in_flight=False)\n--\n\nWrites a command echo to the stand-in's "
     "receipt (DESIGN.md 3.3).  Returns False when the stand-in is stale."},
    {"apply_residency", (PyCFunction)apply_residency, METH_VARARGS,
     "apply_residency(standins, census, /)\n--\n\nApplies a node-boundary "
     "census, all or nothing (DESIGN.md 3.3).  Call it at a node boundary, "
     "never inside free_memory.  Returns the entries applied."},
    {NULL},
};

int
cs_standin_exec(PyObject *module, cs_module_state *state)
{
    state->sentinel_type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &sentinel_spec, NULL);
    if (state->sentinel_type == NULL ||
        PyModule_AddType(module, state->sentinel_type) < 0) {
        return -1;
    }
    state->module_type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &module_spec, NULL);
    if (state->module_type == NULL ||
        PyModule_AddType(module, state->module_type) < 0) {
        return -1;
    }
    state->standin_type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &standin_spec, NULL);
    if (state->standin_type == NULL ||
        PyModule_AddType(module, state->standin_type) < 0) {
        return -1;
    }
    return PyModule_AddFunctions(module, sync_functions);
}
