/*
 * standin.c -- the stand-in type ComfyUI's model_management loads directly
 * (docs/semantics.md), its inner module, the clone_base_uuid sentinel, and
 * the state sync functions apply_echo / apply_residency.
 *
 * Thread safety: the receipt lives in the C core (seqlock; any thread).
 * The PyObject fields below are immutable after construction except
 * ModuleObject.device_assigned and .sentinel, StandInObject.module (made
 * on first use) and the roster links, which are touched only with the GIL
 * held (this module does not claim free-threading support).
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
    PyObject *sentinel; /* the stand-in's clone_base_uuid, or NULL until
                         * first use; GIL */
    PyObject *weakreflist;
} ModuleObject;

/* The size and generation live in the record.  The inner module is made on
 * first use (ComfyUI reads `.model` in a few places only), the sentinel on
 * its first use, in the module; both are kept from then on, so every
 * access returns the same object.  Until the module exists no device was
 * assigned and no board attached, and the stand-in answers from the record
 * and its profile.  Ten pointers: 112 bytes with the GC header, one
 * pymalloc size class below thirteen (bench/RESULTS.md, memory). */
typedef struct StandInObject StandInObject;

/* A pool's roster of one worker's stand-ins, the pool's `_adopted` entry
 * for that worker: the worker, the newest generation adopted, and an
 * intrusive list through the stand-ins, each of which holds its roster
 * strongly and leaves the list when it is cleared or freed, so the roster
 * lists live stand-ins only, as a weak set would, without a weak reference
 * per stand-in.  Touched with the GIL held only, by code that runs no
 * Python while it walks or edits the list. */
typedef struct {
    PyObject_HEAD
    StandInObject *head, *tail; /* borrowed; in adoption order */
    Py_ssize_t count;
    PyObject *worker; /* strong; NULL once GC-cleared */
    uint64_t newest;  /* the newest worker generation adopted; GIL */
    /* Set by Pool.forget() as it drops the roster from `_adopted`: no
     * stand-in made from then on joins it. GIL */
    bool retired;
} RosterObject;

struct StandInObject {
    PyObject_HEAD
    cs_model *record;   /* a handle (cs_model_release_handle); immutable */
    PyObject *module;   /* strong ModuleObject, or NULL until first use */
    PyObject *worker;   /* strong; immutable; NULL once GC-cleared */
    PyObject *pool;     /* strong; immutable */
    PyObject *model_id; /* strong str; immutable */
    /* Strong tuple (load_device, offload_device, kind); immutable; NULL
     * once GC-cleared.  Shared with the stand-in made before it when they
     * hold the same three objects (profile_for). */
    PyObject *profile;
    PyObject *weakreflist;
    RosterObject *roster; /* strong while listed, else NULL; GIL */
    StandInObject *roster_prev, *roster_next; /* borrowed; GIL */
};

static inline cs_module_state *
state_of(PyObject *self)
{
    return (cs_module_state *)PyType_GetModuleState(Py_TYPE(self));
}

enum { PROFILE_LOAD, PROFILE_OFFLOAD, PROFILE_KIND };

/* A field of the profile, borrowed; NULL once GC-cleared. */
static inline PyObject *
profile_item(StandInObject *self, Py_ssize_t index)
{
    return self->profile ? PyTuple_GET_ITEM(self->profile, index) : NULL;
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

/* A GC type: it owns an object (model_id, an exact str today) and is
 * visited like every other owner, so no later change of what it holds can
 * make an uncollectable cycle. */
static int
sentinel_traverse(SentinelObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->model_id);
    return 0;
}

static int
sentinel_clear(SentinelObject *self)
{
    Py_CLEAR(self->model_id);
    return 0;
}

static void
sentinel_dealloc(SentinelObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    sentinel_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
sentinel_repr(SentinelObject *self)
{
    if (self->model_id == NULL) {
        return PyUnicode_FromString("<comfy_standin private clone_base_uuid "
                                    "(cleared; never equals a uuid)>");
    }
    return PyUnicode_FromFormat("<comfy_standin private clone_base_uuid of "
                                "model %R (never equals a uuid)>",
                                self->model_id);
}

static PyObject *refuse_pickle(PyObject *self, PyObject *unused);

/* Refused at dump for every protocol (0 and 1 would otherwise reduce it
 * through copyreg and fail only on load). */
static PyMethodDef sentinel_methods[] = {
    {"__reduce_ex__", refuse_pickle, METH_O,
     "__reduce_ex__($self, protocol, /)\n--\n\nRaises TypeError."},
    {"__reduce__", (PyCFunction)refuse_pickle, METH_NOARGS,
     "__reduce__($self, /)\n--\n\nRaises TypeError."},
    {NULL},
};

static PyType_Slot sentinel_slots[] = {
    {Py_tp_doc, "A stand-in's clone_base_uuid: equal only to itself, so "
                "unload_model_and_clones and the MultiGPU reuse loop never "
                "match it with a host model or another stand-in."},
    {Py_tp_traverse, sentinel_traverse},
    {Py_tp_clear, sentinel_clear},
    {Py_tp_dealloc, sentinel_dealloc},
    {Py_tp_repr, sentinel_repr},
    {Py_tp_methods, sentinel_methods},
    {0, NULL},
};

static PyType_Spec sentinel_spec = {
    .name = "comfy_standin._core.CloneBaseSentinel",
    .basicsize = sizeof(SentinelObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = sentinel_slots,
};

/* ---- the inner module ------------------------------------------------- */

/* What the host knows of the model's residency: the receipt, or the
 * board's reading when one is attached, valid, and newer than the receipt
 * (docs/board.md).  Fills *out when given; its source is "board" when the
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
    PyObject *device = module_loaded(m) > 0 ? m->load_device
                                            : m->offload_device;
    return Py_NewRef(device != NULL ? device : Py_None); /* (GC cleared) */
}

static int
module_traverse(ModuleObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->load_device);
    Py_VISIT(self->offload_device);
    Py_VISIT(self->device_assigned);
    Py_VISIT(self->board);
    Py_VISIT(self->sentinel);
    return 0;
}

static int
module_clear(ModuleObject *self)
{
    Py_CLEAR(self->load_device);
    Py_CLEAR(self->offload_device);
    Py_CLEAR(self->device_assigned);
    Py_CLEAR(self->board);
    Py_CLEAR(self->sentinel);
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

/* ---- the pool's roster ------------------------------------------------ */

static PyObject *str_adopted; /* "_adopted", interned at module exec */
static PyObject *str_ledger;  /* "_ledger" */
static PyObject *str_adopt;   /* "_adopt" */
static PyObject *str_lock;    /* "_lock" */
static PyObject *str_acquire; /* "acquire" */
static PyObject *str_release; /* "release" */
static PyObject *str_roster;  /* "_Roster" */

static void
roster_link(RosterObject *roster, StandInObject *s)
{
    s->roster = (RosterObject *)Py_NewRef((PyObject *)roster);
    s->roster_prev = roster->tail;
    s->roster_next = NULL;
    if (roster->tail != NULL) {
        roster->tail->roster_next = s;
    }
    else {
        roster->head = s;
    }
    roster->tail = s;
    roster->count++;
}

static void
roster_unlink(StandInObject *s)
{
    RosterObject *roster = s->roster;
    if (roster == NULL) {
        return;
    }
    if (s->roster_prev != NULL) {
        s->roster_prev->roster_next = s->roster_next;
    }
    else {
        roster->head = s->roster_next;
    }
    if (s->roster_next != NULL) {
        s->roster_next->roster_prev = s->roster_prev;
    }
    else {
        roster->tail = s->roster_prev;
    }
    roster->count--;
    s->roster = NULL;
    s->roster_prev = s->roster_next = NULL;
    Py_DECREF(roster);
}

static void roster_dealloc(RosterObject *self);

static int
is_roster(PyObject *obj)
{
    return Py_TYPE(obj)->tp_dealloc == (destructor)roster_dealloc;
}

/* A roster of `worker` whose newest generation is `newest`: no Python
 * runs (a GC allocation may start a collection, as any allocation). */
static PyObject *
roster_make(PyTypeObject *type, PyObject *worker, uint64_t newest)
{
    RosterObject *self = (RosterObject *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->head = self->tail = NULL;
        self->count = 0;
        self->worker = Py_NewRef(worker);
        self->newest = newest;
        self->retired = false;
    }
    return (PyObject *)self;
}

static PyObject *
roster_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *worker, *newest_obj;
    uint64_t newest;
    static char *keywords[] = {"worker", "newest", NULL};

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:_Roster", keywords,
                                     &worker, &newest_obj)) {
        return NULL;
    }
    int code = cs_value_check(newest_obj, CS_VALUE_MAX, &newest);
    if (code != 0) {
        return cs_value_error(NULL, code, "newest", newest_obj,
                              CS_VALUE_MAX),
               NULL;
    }
    return roster_make(type, worker, newest);
}

static int
roster_traverse(RosterObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->worker);
    return 0;
}

static int
roster_clear(RosterObject *self)
{
    Py_CLEAR(self->worker);
    return 0;
}

static void
roster_dealloc(RosterObject *self)
{
    /* Every listed stand-in holds the roster: none is left here. */
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    roster_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
roster_get_worker(RosterObject *self, void *closure)
{
    return Py_NewRef(self->worker ? self->worker : Py_None);
}

static PyObject *
roster_get_newest(RosterObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(self->newest);
}

static int
roster_set_newest(RosterObject *self, PyObject *value, void *closure)
{
    uint64_t newest;
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "newest cannot be deleted");
        return -1;
    }
    int code = cs_value_check(value, CS_VALUE_MAX, &newest);
    if (code != 0) {
        cs_value_error(NULL, code, "newest", value, CS_VALUE_MAX);
        return -1;
    }
    self->newest = newest;
    return 0;
}

static PyObject *
roster_get_retired(RosterObject *self, void *closure)
{
    return PyBool_FromLong(self->retired);
}

static int
roster_set_retired(RosterObject *self, PyObject *value, void *closure)
{
    if (value == NULL || !PyBool_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "retired: expected a bool");
        return -1;
    }
    self->retired = value == Py_True;
    return 0;
}

static PyGetSetDef roster_getset[] = {
    {"worker", (getter)roster_get_worker, NULL,
     "The worker whose stand-ins this lists (None once GC-cleared).",
     NULL},
    {"newest", (getter)roster_get_newest, (setter)roster_set_newest,
     "The newest worker generation adopted.", NULL},
    {"retired", (getter)roster_get_retired, (setter)roster_set_retired,
     "Set when the pool drops this roster (forget()).", NULL},
    {NULL},
};

static Py_ssize_t
roster_len(RosterObject *self)
{
    return self->count;
}

/* A snapshot: the list of stand-ins listed now, strongly. */
static PyObject *
roster_iter(RosterObject *self)
{
    PyObject *list = PyList_New(self->count);
    if (list == NULL) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (StandInObject *s = self->head; s != NULL; s = s->roster_next) {
        PyList_SET_ITEM(list, i++, Py_NewRef((PyObject *)s));
    }
    PyObject *it = PyObject_GetIter(list);
    Py_DECREF(list);
    return it;
}

static PyTypeObject *standin_type_of_roster(PyObject *roster);

static PyObject *
roster_add(RosterObject *self, PyObject *standin)
{
    PyTypeObject *tp = standin_type_of_roster((PyObject *)self);
    if (tp == NULL) {
        return NULL;
    }
    if (!PyObject_TypeCheck(standin, tp)) {
        PyErr_Format(PyExc_TypeError, "_Roster.add: expected a StandIn, "
                     "got %R", standin);
        return NULL;
    }
    StandInObject *s = (StandInObject *)standin;
    if (s->roster == self || s->worker == NULL) {
        Py_RETURN_NONE; /* listed already, or GC-cleared */
    }
    /* On a roster the pool dropped (forget()): this one lists it now. */
    roster_unlink(s);
    roster_link(self, s);
    Py_RETURN_NONE;
}

static PyMethodDef roster_methods[] = {
    {"add", (PyCFunction)roster_add, METH_O,
     "add($self, standin, /)\n--\n\nLists the stand-in (idempotent)."},
    {NULL},
};

static PyType_Slot roster_slots[] = {
    {Py_tp_doc, "_Roster(worker, newest)\n--\n\nThe pool's entry for one "
                "worker (C implementation): its live stand-ins (add(), "
                "len(), iter()), the worker and the newest generation "
                "adopted."},
    {Py_tp_new, roster_new},
    {Py_tp_dealloc, roster_dealloc},
    {Py_tp_traverse, roster_traverse},
    {Py_tp_clear, roster_clear},
    {Py_tp_getset, roster_getset},
    {Py_tp_iter, roster_iter},
    {Py_sq_length, roster_len},
    {Py_tp_methods, roster_methods},
    {0, NULL},
};

static PyType_Spec roster_spec = {
    .name = "comfy_standin._core._Roster",
    .basicsize = sizeof(RosterObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = roster_slots,
};

static PyTypeObject *
standin_type_of_roster(PyObject *roster)
{
    cs_module_state *state = state_of(roster);
    if (state == NULL || state->standin_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "comfy_standin._core: the module was cleared");
        return NULL;
    }
    return state->standin_type;
}

/* Pool._adopt for a worker the pool has not adopted yet: under the pool's
 * lock, if it can be had without waiting, makes the worker's entry (its
 * roster) and lists the stand-in.  Returns 1 when
 * done, 0 when Pool._adopt must run (the lock is busy, or anything is not
 * as expected), -1 with a BaseException that is not an Exception. */
static int
adopt_new_worker(StandInObject *self, PyObject *adopted, PyObject *key)
{
    PyObject *lock = NULL, *got, *roster = NULL;
    PyObject *module, *roster_type = NULL;
    PyObject *type, *value, *traceback;
    int done = 0;

    /* Made before the lock is taken: these allocations may run the
     * collector, whose finalizers must not find the pool's lock held by
     * this thread. */
    if (self->roster != NULL ||
        (module = PyType_GetModule(Py_TYPE(self))) == NULL ||
        (roster_type = PyObject_GetAttr(module, str_roster)) == NULL ||
        !PyType_Check(roster_type) ||
        ((PyTypeObject *)roster_type)->tp_dealloc !=
            (destructor)roster_dealloc ||
        (roster = roster_make((PyTypeObject *)roster_type, self->worker,
                              cs_model_generation(self->record))) == NULL) {
        goto out;
    }
    lock = PyObject_GetAttr(self->pool, str_lock);
    if (lock == NULL) {
        goto out;
    }
    got = PyObject_CallMethodOneArg(lock, str_acquire, Py_False);
    if (got != Py_True) { /* busy: Pool._adopt waits, GIL released */
        Py_XDECREF(got);
        goto out;
    }
    Py_DECREF(got);
    /* Under the lock: an int key into an exact dict; no Python runs and
     * nothing here allocates a tracked object. */
    if (PyDict_GetItemWithError(adopted, key) == NULL && !PyErr_Occurred() &&
        self->roster == NULL && PyDict_SetItem(adopted, key, roster) == 0) {
        roster_link((RosterObject *)roster, self);
        done = 1;
    }
    PyErr_Fetch(&type, &value, &traceback);
    got = PyObject_CallMethodNoArgs(lock, str_release);
    Py_XDECREF(got);
    if (type != NULL) {
        if (got == NULL && !PyErr_ExceptionMatches(PyExc_Exception)) {
            /* A KeyboardInterrupt from release wins over an Exception. */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            goto out; /* still pending: out returns -1 */
        }
        PyErr_Clear();
        PyErr_Restore(type, value, traceback); /* the first failure wins */
    }
out:
    Py_XDECREF(lock);
    Py_XDECREF(roster_type);
    Py_XDECREF(roster);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return -1;
        }
        PyErr_Clear(); /* listed, or let Pool._adopt decide and raise */
        return done;
    }
    return done;
}

/* What Pool._adopt does, without running Python when the pool already has
 * a roster for the stand-in's worker at this generation or a newer one
 * (the common case): lists the stand-in there.  Returns 1 when done, 0
 * when Pool._adopt must run, -1 with an exception.  Nothing called here
 * runs Python (an exact dict, tuple and list, an int key), so the pool's
 * lock is never needed: no other thread can run in between. */
static int
adopt_fast(StandInObject *self)
{
    PyObject *key = NULL, *slot;
    int done = 0;

    /* Stand-ins come in runs on one worker: the one made last, of the same
     * worker and pool, is on the roster that is the pool's entry for the
     * worker unless forget() retired it since (nothing else takes an entry
     * out of `_adopted`).  No Python runs on this path. */
    StandInObject *last = state_of((PyObject *)self)->last_standin;
    if (last != NULL && last != self && last->worker == self->worker &&
        last->pool == self->pool && last->roster != NULL &&
        !last->roster->retired && self->roster == NULL &&
        cs_model_generation(self->record) <= last->roster->newest) {
        roster_link(last->roster, self);
        return 1;
    }
    /* The only step that may run Python (a Pool subclass's descriptor). */
    PyObject *adopted = PyObject_GetAttr(self->pool, str_adopted);
    if (adopted == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return -1;
        }
        PyErr_Clear(); /* let Pool._adopt decide */
        return 0;
    }
    if (!PyDict_CheckExact(adopted) || self->worker == NULL) {
        Py_DECREF(adopted);
        return 0;
    }
    key = PyLong_FromVoidPtr(self->worker);
    if (key == NULL) {
        Py_DECREF(adopted);
        return -1;
    }
    slot = PyDict_GetItemWithError(adopted, key);
    if (slot == NULL && !PyErr_Occurred()) {
        done = adopt_new_worker(self, adopted, key);
    }
    else if (slot != NULL && is_roster(slot) &&
             ((RosterObject *)slot)->worker == self->worker &&
             self->roster == NULL &&
             cs_model_generation(self->record) <=
                 ((RosterObject *)slot)->newest) {
        roster_link((RosterObject *)slot, self);
        done = 1;
    }
    Py_DECREF(key);
    Py_DECREF(adopted);
    if (PyErr_Occurred()) {
        if (done || !PyErr_ExceptionMatches(PyExc_Exception)) {
            return done ? 1 : -1;
        }
        PyErr_Clear(); /* let Pool._adopt decide */
    }
    return done;
}

/* ---- StandIn: construction and lifetime ------------------------------- */

static int
check_worker(PyObject *worker, cs_module_state *state)
{
    PyObject *names[2] = {state->str_send_command, state->str_is_alive};
    for (int i = 0; i < 2; i++) {
        PyObject *method = PyObject_GetAttr(worker, names[i]);
        if (method == NULL && !PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1; /* the worker's own error, KeyboardInterrupt too */
        }
        if (method == NULL || !PyCallable_Check(method)) {
            Py_XDECREF(method);
            PyErr_Clear(); /* an AttributeError, or nothing */
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

/* The profile tuple (load_device, offload_device, kind), a new reference:
 * the last made stand-in's when it holds these very objects (stand-ins are
 * made in runs with the same devices and kind), else a new one.  Identity
 * only: no caller code runs. */
static PyObject *
profile_for(cs_module_state *state, PyObject *load_device,
            PyObject *offload_device, PyObject *kind)
{
    StandInObject *last = state->last_standin;
    PyObject *profile = last != NULL ? last->profile : NULL;
    if (profile != NULL &&
        PyTuple_GET_ITEM(profile, PROFILE_LOAD) == load_device &&
        PyTuple_GET_ITEM(profile, PROFILE_OFFLOAD) == offload_device &&
        PyTuple_GET_ITEM(profile, PROFILE_KIND) == kind) {
        return Py_NewRef(profile);
    }
    return PyTuple_Pack(3, load_device, offload_device, kind);
}

static PyObject *
resolve_pool(PyObject *pool, cs_module_state *state, PyObject **ledger)
{
    if (pool == NULL || pool == Py_None) {
        PyObject *package = PyImport_ImportModule("comfy_standin");
        if (package == NULL) {
            return NULL;
        }
        PyObject *factory = cs_getattr_interned(package, "default_pool");
        Py_DECREF(package);
        if (factory == NULL) {
            return NULL;
        }
        pool = PyObject_CallNoArgs(factory);
        Py_DECREF(factory);
        if (pool == NULL) {
            return NULL;
        }
    }
    else {
        Py_INCREF(pool);
    }
    *ledger = PyObject_GetAttr(pool, str_ledger);
    if (*ledger == NULL && !PyErr_ExceptionMatches(PyExc_Exception)) {
        Py_DECREF(pool);
        return NULL; /* KeyboardInterrupt and the like propagate */
    }
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

#define STANDIN_NARGS 8
#define STANDIN_NREQUIRED 6
static const char *const standin_keywords[STANDIN_NARGS] = {
    "worker",      "worker_generation", "model_id", "model_size",
    "load_device", "offload_device",    "kind",     "pool"};
/* Interned at module exec; process-wide constants. */
static PyObject *standin_keyword_str[STANDIN_NARGS];

/* StandIn's arguments into out[] (borrowed; NULL when not given), with
 * PyArg_ParseTupleAndKeywords's checks and messages.  Keyword names match
 * the interned constants by pointer first (what a call site passes), so
 * the common call builds no string; comparing str runs no Python. */
/* One keyword argument into out[]; 0, or -1 with TypeError. */
static int
standin_keyword(PyObject *key, PyObject *value, PyObject **out)
{
    int j = 0;
    if (!PyUnicode_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "keywords must be strings");
        return -1;
    }
    while (j < STANDIN_NARGS && key != standin_keyword_str[j]) {
        j++;
    }
    for (int k = 0; j == STANDIN_NARGS && k < STANDIN_NARGS; k++) {
        if (PyUnicode_Compare(key, standin_keyword_str[k]) == 0) {
            j = k;
        }
    }
    if (j == STANDIN_NARGS) {
        PyErr_Format(PyExc_TypeError,
                     "%R is an invalid keyword argument for StandIn()", key);
        return -1;
    }
    if (out[j] != NULL) {
        PyErr_Format(PyExc_TypeError,
                     "argument for StandIn() given by name ('%s') and "
                     "position (%d)",
                     standin_keywords[j], j + 1);
        return -1;
    }
    out[j] = value;
    return 0;
}

static int
standin_check_required(PyObject **out)
{
    for (int i = 0; i < STANDIN_NREQUIRED; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "StandIn() missing required argument '%s' (pos %d)",
                         standin_keywords[i], i + 1);
            return -1;
        }
    }
    return 0;
}

static int
standin_too_many(Py_ssize_t nargs, Py_ssize_t nkw)
{
    if (nargs + nkw > STANDIN_NARGS) {
        PyErr_Format(PyExc_TypeError,
                     "StandIn() takes at most %d %sarguments (%zd given)",
                     STANDIN_NARGS, nargs == 0 ? "keyword " : "",
                     nargs + nkw);
        return -1;
    }
    return 0;
}

/* The vectorcall form of standin_parse: positional args[0..nargs), then
 * one value per name in kwnames.  No tuple or dict is made for the call. */
static int
standin_parse_vector(PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames, PyObject **out)
{
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    if (standin_too_many(nargs, nkw) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < STANDIN_NARGS; i++) {
        out[i] = i < nargs ? args[i] : NULL;
    }
    for (Py_ssize_t i = 0; i < nkw; i++) {
        if (standin_keyword(PyTuple_GET_ITEM(kwnames, i), args[nargs + i],
                            out) < 0) {
            return -1;
        }
    }
    return standin_check_required(out);
}

static int
standin_parse(PyObject *args, PyObject *kwargs, PyObject **out)
{
    Py_ssize_t nargs = PyTuple_GET_SIZE(args), pos = 0;
    Py_ssize_t nkw = kwargs != NULL ? PyDict_GET_SIZE(kwargs) : 0;
    PyObject *key, *value;

    if (standin_too_many(nargs, nkw) < 0) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < STANDIN_NARGS; i++) {
        out[i] = i < nargs ? PyTuple_GET_ITEM(args, i) : NULL;
    }
    /* Nothing in this loop runs Python (keys compared as str). */
    while (nkw > 0 && PyDict_Next(kwargs, &pos, &key, &value)) {
        if (standin_keyword(key, value, out) < 0) {
            return -1;
        }
    }
    return standin_check_required(out);
}

static PyObject *standin_make(PyTypeObject *type, PyObject **argv);

static PyObject *
standin_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *argv[STANDIN_NARGS];
    if (standin_parse(args, kwargs, argv) < 0) {
        return NULL;
    }
    /* The keyword dict may be one caller code still holds (PyObject_Call
     * from C, StandIn.__new__(StandIn, **d) paths): own the values across
     * the checks, which run the worker's code (cs_args_hold). */
    cs_args_hold(argv, STANDIN_NARGS);
    PyObject *made = standin_make(type, argv);
    cs_args_release(argv, STANDIN_NARGS);
    return made;
}

/* StandIn(...) itself: the type's vectorcall, so a call makes no argument
 * tuple or keyword dict (StandIn is not subclassable: `type` is it). */
static PyObject *
standin_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                   PyObject *kwnames)
{
    PyObject *argv[STANDIN_NARGS];
    if (standin_parse_vector(args, PyVectorcall_NARGS(nargsf), kwnames,
                             argv) < 0) {
        return NULL;
    }
    return standin_make((PyTypeObject *)type, argv);
}

/* The constructor proper, from parsed arguments (borrowed). */
static PyObject *
standin_make(PyTypeObject *type, PyObject **argv)
{
    cs_module_state *state = PyType_GetModuleState(type);
    PyObject *worker, *generation_obj, *model_id, *size_obj, *load_device,
        *offload_device, *kind = NULL, *pool_arg = NULL, *profile = NULL;
    PyObject *pool = NULL, *ledger = NULL, *books = NULL, *r = NULL;
    StandInObject *self = NULL;
    uint64_t generation, size;
    cs_model *record = NULL;
    Py_ssize_t id_len;
    const char *id;
    int code;

    worker = argv[0];
    generation_obj = argv[1];
    model_id = argv[2];
    size_obj = argv[3];
    load_device = argv[4];
    offload_device = argv[5];
    kind = argv[6];
    pool_arg = argv[7];
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

    /* An exact str copy (no caller code runs): a str subclass's __hash__,
     * __eq__ or attributes never reach the worker, the table or a cycle. */
    model_id = PyUnicode_FromObject(model_id);
    if (model_id == NULL) {
        goto error;
    }
    id = PyUnicode_AsUTF8AndSize(model_id, &id_len);
    if (id == NULL) {
        goto error;
    }
    profile = profile_for(state, load_device, offload_device, kind);
    if (profile == NULL) {
        goto error;
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

    self = (StandInObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        goto error;
    }
    self->record = record;
    record = NULL;
    self->profile = profile;
    profile = NULL;
    self->worker = Py_NewRef(worker);
    self->pool = pool;
    pool = NULL;
    self->model_id = Py_NewRef(model_id);

    /* The pool keeps the stand-in for its graveyard (docs/architecture.md). */
    code = adopt_fast(self);
    if (code < 0) {
        goto error;
    }
    if (code == 0) {
        r = PyObject_CallMethodOneArg(self->pool, str_adopt,
                                      (PyObject *)self);
        if (r == NULL) {
            goto error;
        }
        Py_DECREF(r);
    }
    Py_DECREF(books);
    Py_DECREF(ledger);
    Py_DECREF(model_id);
    Py_DECREF(kind);
    state->last_standin = self; /* cleared by standin_clear */
    return (PyObject *)self;

error:
    Py_XDECREF(model_id);
    Py_XDECREF(self);
    if (record != NULL) {
        cs_model_release_handle(record);
    }
    Py_XDECREF(books);
    Py_XDECREF(ledger);
    Py_XDECREF(pool);
    Py_XDECREF(kind);
    Py_XDECREF(profile);
    return NULL;
}

static int
standin_traverse(StandInObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->worker);
    Py_VISIT(self->pool);
    Py_VISIT(self->profile);
    Py_VISIT(self->roster);
    Py_VISIT(self->model_id);
    return 0;
}

/* model_id is kept: every message and accessor reads it, and a cycle
 * through it also runs through the other party (a str subclass's __dict__
 * or slots), whose own clear breaks it.  The profile goes (a device may be
 * any object, a tuple with no clear of its own): a cleared stand-in's
 * devices and kind read None. */
static int
standin_clear(StandInObject *self)
{
    cs_module_state *state = state_of((PyObject *)self);
    if (state != NULL && state->last_standin == self) {
        state->last_standin = NULL;
    }
    roster_unlink(self); /* first: the roster lists live stand-ins only */
    Py_CLEAR(self->module);
    Py_CLEAR(self->worker);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->profile);
    return 0;
}

static void
standin_dealloc(StandInObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    roster_unlink(self); /* before any weakref callback can walk it */
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    standin_clear(self);
    Py_CLEAR(self->model_id);
    if (self->record != NULL) {
        cs_model_release_handle(self->record);
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* The module if it was made, else NULL: no device was assigned and no
 * board attached yet.  Readers answer from the record then. */
static ModuleObject *
standin_module(StandInObject *self)
{
    return (ModuleObject *)self->module;
}

/* The module, made on first use; a new reference.  None for a GC-cleared
 * stand-in (worker NULL), NULL with an exception on failure.  Allocation
 * may run the collector, which may run Python that makes the module
 * first or clears this stand-in: whoever made it first wins. */
static PyObject *
standin_module_get(StandInObject *self)
{
    if (self->module != NULL) {
        return Py_NewRef(self->module);
    }
    if (self->worker == NULL) {
        Py_RETURN_NONE;
    }
    cs_module_state *state = state_of((PyObject *)self);
    ModuleObject *m = PyObject_GC_New(ModuleObject, state->module_type);
    if (m == NULL) {
        return NULL;
    }
    cs_model_incref(self->record);
    m->record = self->record;
    m->load_device = Py_XNewRef(profile_item(self, PROFILE_LOAD));
    m->offload_device = Py_XNewRef(profile_item(self, PROFILE_OFFLOAD));
    m->device_assigned = NULL;
    m->device_assigned_at = 0;
    m->board = NULL;
    m->board_slot = 0;
    m->board_tag = 0;
    m->sentinel = NULL;
    m->weakreflist = NULL;
    PyObject_GC_Track(m);
    if (self->module != NULL || self->worker == NULL) {
        Py_DECREF(m);
        return Py_NewRef(self->module ? self->module : Py_None);
    }
    self->module = Py_NewRef((PyObject *)m);
    return (PyObject *)m;
}

/* The clone_base_uuid sentinel, made on first use and kept in the module
 * (made too if need be); as standin_module_get.  None once GC-cleared. */
static PyObject *
standin_sentinel_get(StandInObject *self)
{
    PyObject *module = standin_module_get(self);
    if (module == NULL || module == Py_None) {
        return module;
    }
    ModuleObject *m = (ModuleObject *)module;
    if (m->sentinel == NULL) {
        cs_module_state *state = state_of((PyObject *)self);
        SentinelObject *o =
            PyObject_GC_New(SentinelObject, state->sentinel_type);
        if (o == NULL) {
            Py_DECREF(module);
            return NULL;
        }
        o->model_id = Py_NewRef(self->model_id);
        PyObject_GC_Track(o);
        /* The allocation may have run the collector and Python that made
         * the sentinel first: whoever made it first wins.  (cppcheck does
         * not know that PyObject_GC_New can run Python.) */
        // cppcheck-suppress knownConditionTrueFalse
        if (m->sentinel == NULL) {
            m->sentinel = (PyObject *)o;
        }
        else {
            Py_DECREF(o);
        }
    }
    PyObject *sentinel = Py_NewRef(m->sentinel);
    Py_DECREF(module);
    return sentinel;
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
    return PyLong_FromUnsignedLongLong(cs_model_size(self->record));
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
    if (m != NULL) {
        return module_device(m);
    }
    if (self->worker == NULL) {
        Py_RETURN_NONE; /* GC-cleared */
    }
    PyObject *device = cs_model_loaded(self->record) > 0
                           ? profile_item(self, PROFILE_LOAD)
                           : profile_item(self, PROFILE_OFFLOAD);
    return Py_NewRef(device != NULL ? device : Py_None);
}

static PyObject *
standin_is_dynamic(StandInObject *self, PyObject *unused)
{
    /* docs/architecture.md, inaccuracy 1: True would open dynamic_pins, whose
     * layout is internal and churns.  Kept False deliberately. */
    Py_RETURN_FALSE;
}

static PyObject *
standin_is_clone(StandInObject *self, PyObject *other)
{
    if (!PyObject_TypeCheck(other, Py_TYPE(self))) {
        Py_RETURN_FALSE;
    }
    StandInObject *o = (StandInObject *)other;
    if (o->worker != self->worker ||
        cs_model_generation(o->record) !=
            cs_model_generation(self->record)) {
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
    cs_module_state *state = state_of((PyObject *)self);
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
    if (!PyErr_ExceptionMatches(state_of((PyObject *)self)->echo_error)) {
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
    uint64_t before = standin_loaded(self);
    if (requested_bytes(extra, cs_model_size(self->record), &want) < 0) {
        return NULL;
    }
    want_obj = PyLong_FromUnsignedLongLong(want);
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
    cs_module_state *state = state_of((PyObject *)self);
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

static PyObject *
standin_partially_load(StandInObject *self, PyObject *args, PyObject *kwargs)
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
    uint64_t before = standin_loaded(self);
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
                         state_of((PyObject *)self)->str_bytes_to_free,
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
    cs_module_state *state = state_of((PyObject *)self);
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

static PyObject *
standin_partially_unload(StandInObject *self, PyObject *args,
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
        standin_loaded(self) == 0) {
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
    offload = profile_item(self, PROFILE_OFFLOAD);
    device_str = PyObject_Str(offload != NULL ? offload : Py_None);
    if (device_str == NULL) {
        return;
    }
    reply = send_command(self, "model_to_device",
                         state_of((PyObject *)self)->str_device, device_str,
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
static PyObject *
standin_mark_worker_gone(StandInObject *self, PyObject *unused)
{
    if (!cs_model_stale(self->record)) {
        cs_worker_gone(cs_model_worker(self->record));
        cs_model_gone(self->record);
    }
    Py_RETURN_NONE;
}

static PyObject *
standin_detach(StandInObject *self, PyObject *args, PyObject *kwargs)
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
    PyObject *module = standin_module_get(self);
    if (module == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear(); /* never raises an Exception: None, as if cleared */
        Py_RETURN_NONE;
    }
    return module;
}

/* ---- StandIn: the live residency board --------------------------------- */

/* attach_board's body, on owned arguments. */
static PyObject *
attach_body(StandInObject *self, PyObject *board_obj, PyObject *slot_obj)
{
    PyObject *module;
    ModuleObject *m;
    uint32_t slot = 0;
    uint64_t tag = 0;
    size_t id_len;
    const char *id = cs_model_id(self->record, &id_len);

    if (self->worker == NULL) {
        PyErr_SetString(PyExc_ValueError, "attach_board: stand-in cleared");
        return NULL;
    }
    /* The slot's identity is the host's (slot, tag): a slot released and
     * given to another model has a new tag, so this stand-in never reads
     * that model's bytes. */
    if (cs_board_attach_model(board_obj, self->model_id, id, id_len,
                              cs_model_size(self->record), slot_obj, &slot,
                              &tag) < 0) {
        return NULL;
    }
    module = standin_module_get(self); /* the board is read through it */
    if (module == NULL) {
        return NULL;
    }
    if (module == Py_None) {
        Py_DECREF(module);
        PyErr_SetString(PyExc_ValueError, "attach_board: stand-in cleared");
        return NULL;
    }
    m = (ModuleObject *)module;
    Py_XSETREF(m->board, Py_NewRef(board_obj));
    m->board_slot = slot;
    m->board_tag = tag;
    Py_DECREF(module);
    return PyLong_FromUnsignedLong(slot);
}

static PyObject *
standin_attach_board(StandInObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"board", "slot", NULL};
    PyObject *argv[2] = {NULL, Py_None};

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O:attach_board",
                                     keywords, &argv[0], &argv[1])) {
        return NULL;
    }
    /* Owned until the board is stored: making the module allocates, and
     * an allocation may run the collector (cs_args_hold). */
    cs_args_hold(argv, 2);
    PyObject *result = attach_body(self, argv[0], argv[1]);
    cs_args_release(argv, 2);
    return result;
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
    PyObject *device = profile_item(self, PROFILE_LOAD);
    return Py_NewRef(device ? device : Py_None);
}

static PyObject *
standin_get_offload_device(StandInObject *self, void *closure)
{
    PyObject *device = profile_item(self, PROFILE_OFFLOAD);
    return Py_NewRef(device ? device : Py_None);
}

static PyObject *
standin_get_model(StandInObject *self, void *closure)
{
    return standin_module_get(self);
}

static PyObject *
standin_get_sentinel(StandInObject *self, void *closure)
{
    return standin_sentinel_get(self);
}

static PyObject *
standin_get_size(StandInObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(cs_model_size(self->record));
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
    return PyLong_FromUnsignedLongLong(cs_model_generation(self->record));
}

static PyObject *
standin_get_model_id(StandInObject *self, void *closure)
{
    return Py_NewRef(self->model_id);
}

static PyObject *
standin_get_kind(StandInObject *self, void *closure)
{
    PyObject *kind = profile_item(self, PROFILE_KIND);
    return Py_NewRef(kind ? kind : Py_None);
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

/* comfy-env's boundary writes False once it listed a refused stand-in
 * again; only a bool is taken (docs/semantics.md, "eviction_deferred"). */
static int
standin_set_deferred(StandInObject *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "eviction_deferred cannot be deleted");
        return -1;
    }
    if (!PyBool_Check(value)) {
        PyErr_Format(PyExc_TypeError,
                     "eviction_deferred: expected a bool, got %R", value);
        return -1;
    }
    cs_model_set_eviction_deferred(self->record, value == Py_True);
    return 0;
}

static PyObject *
standin_get_bad_replies(StandInObject *self, void *closure)
{
    return PyLong_FromUnsignedLong(cs_model_bad_replies(self->record));
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
    PyObject *kind = profile_item(self, PROFILE_KIND);
    if (kind == NULL) { /* GC-cleared */
        return PyUnicode_FromFormat("<StandIn %R (cleared)>",
                                    self->model_id);
    }
    return PyUnicode_FromFormat(
        "<StandIn %R (%U) of worker generation %llu: %llu of %llu bytes "
        "loaded%s>",
        self->model_id, kind,
        (unsigned long long)cs_model_generation(self->record),
        (unsigned long long)standin_loaded(self),
        (unsigned long long)cs_model_size(self->record),
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
    {"eviction_deferred", (getter)standin_get_deferred,
     (setter)standin_set_deferred,
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
     "is_dynamic($self, /)\n--\n\nAlways False (docs/architecture.md, "
     "inaccuracy 1)."},
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
     "partially_unload($self, /, device_to=None, memory_to_free=0, "
     "force_patch_weights=False)\n--\n\nAsks the worker to free; returns "
     "exactly the bytes freed.  Never raises an Exception (bad arguments "
     "free nothing); a BaseException propagates."},
    {"detach", (PyCFunction)(void (*)(void))standin_detach,
     METH_VARARGS | METH_KEYWORDS,
     "detach($self, /, unpatch_all=True)\n--\n\nFull offload; idempotent; "
     "ignores its arguments; never raises an Exception; returns model."},
    {"_worker_gone", (PyCFunction)standin_mark_worker_gone, METH_NOARGS,
     "_worker_gone($self, /)\n--\n\nFor the pool: the worker's process "
     "died; this stand-in reads 0 and is stale from now on."},
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
     "A worker-held model as ComfyUI's model_management sees it "
     "(docs/semantics.md).  Drop-in for comfy-env's SubprocessModelPatcher."},
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

/* apply_echo's body, on owned arguments: argv is (standin, resident,
 * seq, unmapped, in_flight), the flags NULL when not given. */
static PyObject *
echo_body(PyObject *module, PyObject *const *argv)
{
    PyObject *object = argv[0], *resident_obj = argv[1], *seq_obj = argv[2];
    uint64_t resident, seq_value;
    int64_t seq = CS_SEQ_NONE;
    int code;

    /* The flags' __bool__ is user code: it runs first, before anything is
     * read from the stand-in. */
    int unmapped = argv[3] != NULL ? PyObject_IsTrue(argv[3]) : 0;
    if (unmapped < 0) {
        return NULL;
    }
    int in_flight = argv[4] != NULL ? PyObject_IsTrue(argv[4]) : 0;
    if (in_flight < 0) {
        return NULL;
    }
    StandInObject *s = as_standin(module, object, "standin");
    if (s == NULL) {
        return NULL;
    }
    cs_module_state *state = cs_state_of_module(module);
    code = cs_value_check(resident_obj, cs_model_size(s->record), &resident);
    if (code != 0) {
        return cs_value_error(state->echo_error, code, "resident",
                              resident_obj, cs_model_size(s->record)),
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
    return PyBool_FromLong(status == CS_OK);
}

static PyObject *
apply_echo(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"standin", "resident", "seq", "unmapped",
                               "in_flight", NULL};
    PyObject *argv[5] = {NULL, NULL, Py_None, NULL, NULL};

    /* The flags are parsed as objects ("p" would run their __bool__
     * inside the parser, on borrowed references) and tested once every
     * argument is owned (cs_args_hold). */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|OOO:apply_echo",
                                     keywords, &argv[0], &argv[1], &argv[2],
                                     &argv[3], &argv[4])) {
        return NULL;
    }
    cs_args_hold(argv, 5);
    PyObject *result = echo_body(module, argv);
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
    PyObject *model_id = ((StandInObject *)value)->model_id;
    /* Compares the characters: no __eq__ of a str subclass runs. */
    int same = PyUnicode_Check(key) && model_id != NULL
                   ? PyUnicode_Compare(model_id, key)
                   : 1;
    if (same == -1 && PyErr_Occurred()) {
        goto done;
    }
    if (same != 0) {
        PyErr_Format(state->echo_error,
                     "standins[%R]: the stand-in is for model %R", key,
                     model_id ? model_id : Py_None);
        goto done;
    }
    PyObject *exact = PyUnicode_FromObject(key);
    if (exact == NULL) {
        goto done;
    }
    result = PyDict_SetItem(table, exact, value);
    Py_DECREF(exact);
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
     METH_VARARGS | METH_KEYWORDS,
     "apply_echo(standin, resident, seq=None, unmapped=False, "
     "in_flight=False)\n--\n\nWrites a command echo to the stand-in's "
     "receipt (docs/semantics.md).  Returns False when the stand-in is "
     "stale."},
    {"apply_residency", (PyCFunction)apply_residency, METH_VARARGS,
     "apply_residency(standins, census, /)\n--\n\nApplies a node-boundary "
     "census, all or nothing (docs/semantics.md).  Call it at a node "
     "boundary, never inside free_memory.  Returns the entries applied."},
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
    if (state->standin_type == NULL) {
        return -1;
    }
    /* Calls of the type go straight to standin_vectorcall (the type is
     * final and immutable; tp_new stays for StandIn.__new__). */
    state->standin_type->tp_vectorcall = standin_vectorcall;
    if (PyModule_AddType(module, state->standin_type) < 0) {
        return -1;
    }
    PyObject *roster_type = PyType_FromModuleAndSpec(module, &roster_spec,
                                                     NULL);
    if (roster_type == NULL) {
        return -1;
    }
    if (PyModule_AddObjectRef(module, "_Roster", roster_type) < 0) {
        Py_DECREF(roster_type);
        return -1;
    }
    Py_DECREF(roster_type);
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {{&str_adopted, "_adopted"}, {&str_ledger, "_ledger"},
                 {&str_adopt, "_adopt"},     {&str_lock, "_lock"},
                 {&str_acquire, "acquire"},  {&str_release, "release"},
                 {&str_roster, "_Roster"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (*names[i].slot == NULL) {
            /* Process-wide constants, kept for the process's life. */
            *names[i].slot = PyUnicode_InternFromString(names[i].text);
            if (*names[i].slot == NULL) {
                return -1;
            }
        }
    }
    for (int i = 0; i < STANDIN_NARGS; i++) {
        if (standin_keyword_str[i] == NULL) {
            standin_keyword_str[i] =
                PyUnicode_InternFromString(standin_keywords[i]);
            if (standin_keyword_str[i] == NULL) {
                return -1;
            }
        }
    }
    return PyModule_AddFunctions(module, sync_functions);
}
