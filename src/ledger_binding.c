/*
 * ledger_binding.c -- the Python face of the ledger: `Ledger` (one per
 * Pool) and `WorkerBooks` (one per worker process).  Pool (pool.py) keeps
 * the Python-object logic; every number lives in the C core.
 */
#include "standin.h"

#include "comfy_standin/ledger.h"

#include <stdint.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    cs_ledger *ledger; /* owned; immutable after construction */
    /* {id(worker): WorkerBooks}; strong.  Keyed by identity: a worker is a
     * process handle, and two handles that compare equal are still two
     * processes. */
    PyObject *books;
    /* Strong, or NULL: the books found or made last (stand-ins are made in
     * runs on one worker), always an entry of `books`: forget() and clear
     * drop it with the entry. */
    PyObject *last_books;
} LedgerObject;

/* The module state, or NULL with RuntimeError once the module was
 * cleared. */
static inline cs_module_state *
state_of(PyObject *self)
{
    return cs_state_checked(Py_TYPE(self));
}

static PyObject *
cleared_error(const char *what)
{
    PyErr_Format(PyExc_RuntimeError,
                 "%s was cleared by the garbage collector (it was part of "
                 "an unreachable cycle) and can no longer be used",
                 what);
    return NULL;
}

/* ---- WorkerBooks ----------------------------------------------------- */

/* Books with no worker yet, untracked: allocated before anything is
 * looked up or added, because the allocation may run the collector (and
 * so any Python); books_attach() then gives them their C record and
 * tracks them without running any. */
static BooksObject *
books_alloc(cs_module_state *state)
{
    BooksObject *self = PyObject_GC_New(BooksObject, state->books_type);
    if (self == NULL) {
        return NULL;
    }
    self->worker = NULL;
    self->key = NULL;
    self->floor = 0;
    self->roster = (cs_roster){NULL, 0, 0, 0};
    self->weakreflist = NULL;
    return self;
}

/* The C record of `key`'s charges on `ledger`, made in the books, which
 * are then tracked: 0, or -1 with MemoryError.  Runs no Python. */
static int
books_attach(BooksObject *self, cs_ledger *ledger, PyObject *key,
             uint64_t generation)
{
    cs_worker *worker = cs_ledger_add_worker(ledger, generation);
    if (worker == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->worker = worker; /* the reference cs_ledger_add_worker gave */
    cs_worker_set_data(worker, self); /* how a stand-in finds its books */
    self->key = Py_NewRef(key);
    self->floor = cs_ledger_floor(ledger);
    PyObject_GC_Track(self);
    return 0;
}

static int
books_traverse(BooksObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->key);
    return 0;
}

static int
books_clear(BooksObject *self)
{
    Py_CLEAR(self->key);
    return 0;
}

static void
books_dealloc(BooksObject *self)
{
    /* Every listed stand-in holds its books: the roster is empty here. */
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    books_clear(self);
    cs_roster_free(&self->roster);
    if (self->worker != NULL) {
        cs_worker_set_data(self->worker, NULL);
        cs_worker_decref(self->worker);
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* What a getter's closure points at: which field it reads. */
enum { BOOKS_GENERATION, BOOKS_ALIVE, BOOKS_IN_FLIGHT, BOOKS_READING };
static int books_fields[] = {0, 1, 2, 3};

/* One getter for the worker's figures: the closure points at the field. */
static PyObject *
books_get(BooksObject *self, void *closure)
{
    const cs_worker *w = self->worker;
    switch (*(const int *)closure) {
    case BOOKS_GENERATION:
        return PyLong_FromUnsignedLongLong(cs_worker_generation(w));
    case BOOKS_ALIVE:
        return PyBool_FromLong(cs_worker_alive(w));
    case BOOKS_IN_FLIGHT:
        return PyLong_FromUnsignedLong(cs_worker_in_flight(w));
    default:
        return PyLong_FromUnsignedLongLong(cs_worker_reading(w));
    }
}

static PyObject *
books_get_report(BooksObject *self, void *closure)
{
    uint64_t held, pinned, overhead;
    cs_worker_report(self->worker, &held, &pinned, &overhead);
    return Py_BuildValue("(KKK)", (unsigned long long)held,
                         (unsigned long long)pinned,
                         (unsigned long long)overhead);
}

static PyObject *
books_get_key(BooksObject *self, void *closure)
{
    if (self->key == NULL) {
        return cleared_error("WorkerBooks");
    }
    return Py_NewRef(self->key);
}

static PyObject *
books_bump(BooksObject *self, PyObject *arg)
{
    uint64_t generation;
    int code = cs_value_check(arg, CS_VALUE_MAX, &generation);
    if (code != 0) {
        return cs_value_error(NULL, code, "generation", arg, CS_VALUE_MAX),
               NULL;
    }
    if (cs_worker_bump_generation(self->worker, generation) != CS_OK) {
        PyErr_Format(PyExc_ValueError,
                     "generation: a restart must raise the generation "
                     "above %llu, got %R",
                     (unsigned long long)cs_worker_generation(self->worker),
                     arg);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
books_gone(BooksObject *self, PyObject *unused)
{
    cs_worker_gone(self->worker);
    Py_RETURN_NONE;
}

static PyObject *
books_begin_call(BooksObject *self, PyObject *unused)
{
    cs_worker_begin_call(self->worker);
    Py_RETURN_NONE;
}

static PyObject *
books_end_call(BooksObject *self, PyObject *unused)
{
    if (cs_worker_end_call(self->worker) != CS_OK) {
        PyErr_SetString(PyExc_RuntimeError,
                        "end_call() without a matching begin_call()");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
books_set_report(BooksObject *self, PyObject *const *args, Py_ssize_t nargs,
                 PyObject *kwnames)
{
    static const char *const names[3] = {"held", "pinned", "overhead"};
    PyObject *objects[3];
    uint64_t values[3];
    const uint64_t *pointers[3] = {NULL, NULL, NULL};
    cs_module_state *state = state_of((PyObject *)self);

    if (state == NULL ||
        cs_parse_vector(state, CS_SIG_SET_REPORT, args, nargs, kwnames,
                        objects) < 0) {
        return NULL;
    }
    for (int i = 0; i < 3; i++) {
        if (objects[i] == NULL || objects[i] == Py_None) {
            continue;
        }
        int code = cs_value_check(objects[i], CS_VALUE_MAX, &values[i]);
        if (code != 0) {
            return cs_value_error(state->echo_error, code, names[i],
                                  objects[i], CS_VALUE_MAX),
                   NULL;
        }
        pointers[i] = &values[i];
    }
    cs_worker_set_report(self->worker, pointers[0], pointers[1],
                         pointers[2]);
    Py_RETURN_NONE;
}

static PyObject *
books_set_reading(BooksObject *self, PyObject *arg)
{
    uint64_t used;
    int code = cs_value_check(arg, CS_VALUE_MAX, &used);
    if (code != 0) {
        return cs_value_error(NULL, code, "used", arg, CS_VALUE_MAX),
               NULL;
    }
    cs_worker_set_reading(self->worker, used);
    Py_RETURN_NONE;
}

static PyObject *
books_apply_census(BooksObject *self, PyObject *census)
{
    cs_module_state *state = state_of((PyObject *)self);
    cs_census_snapshot snapshot;
    size_t applied = 0, bad = 0;
    PyObject *result = NULL;

    if (state == NULL) {
        return NULL;
    }
    /* Everything user-defined (mapping entries, str-subclass keys) runs
     * here; what follows works on C memory and exact strs only. */
    if (cs_census_snapshot_take(state, census, &snapshot) < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < snapshot.n; i++) {
        cs_census_entry *e = &snapshot.entries[i];
        cs_model *known = cs_worker_find_model(self->worker, e->id,
                                               e->id_len);
        cs_model_decref(known);
        if (known == NULL) {
            PyErr_Format(state->echo_error,
                         "census[%zd]['id']: unknown model id %R (no "
                         "stand-in is registered for it on this worker)",
                         i, snapshot.ids[i]);
            goto done;
        }
    }
    cs_status status = cs_worker_apply_census(
        self->worker, snapshot.entries, (size_t)snapshot.n, &applied, &bad);
    if (status == CS_ERR_UNKNOWN_ID || status == CS_ERR_DUPLICATE_ID) {
        /* A model left the table since the check (another thread). */
        PyErr_Format(state->echo_error,
                     status == CS_ERR_UNKNOWN_ID
                         ? "census[%zd]['id']: unknown model id %R (no "
                           "stand-in is registered for it on this worker)"
                         : "census[%zd]['id']: duplicate model id %R",
                     (Py_ssize_t)bad, snapshot.ids[bad]);
        goto done;
    }
    if (status != CS_OK) {
        PyErr_Format(state->echo_error, "census[%zd]: %s", (Py_ssize_t)bad,
                     cs_status_message(status));
        goto done;
    }
    result = PyLong_FromSize_t(applied);
done:
    cs_census_snapshot_release(&snapshot);
    return result;
}

static PyObject *
charge_to_dict(const cs_charge *c)
{
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsIsIsOsO}", "charge", (unsigned long long)c->charge,
        "sum_sizes", (unsigned long long)c->sum_sizes, "sum_loaded",
        (unsigned long long)c->sum_loaded, "sum_peak",
        (unsigned long long)c->sum_peak, "held", (unsigned long long)c->held,
        "reading", (unsigned long long)c->reading, "floor",
        (unsigned long long)c->floor, "in_flight", (unsigned int)c->in_flight,
        "models", (unsigned int)c->models, "alive",
        c->alive ? Py_True : Py_False, "held_from_reading",
        c->held_from_reading ? Py_True : Py_False);
}

static PyObject *
books_standins(BooksObject *self, PyObject *unused)
{
    return cs_roster_snapshot(&self->roster);
}

/* The charge counts each model at the figure its stand-ins answer
 * loaded_size() with (a board reading newer than the receipt included):
 * the roster, here with the books, says which read a board. */
static PyObject *
books_charge(BooksObject *self, PyObject *unused)
{
    cs_charge charge;
    cs_figures figures = {NULL, 0, 0};
    if (cs_figures_add_roster(&figures, &self->roster) < 0) {
        return NULL;
    }
    cs_figures_sort(&figures);
    cs_worker_charge(self->worker, self->floor, figures.items,
                          figures.n, &charge);
    cs_figures_release(&figures);
    return charge_to_dict(&charge);
}


/* ---- ModelRecord ----------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    cs_model *model; /* a handle (released on dealloc); immutable */
    PyObject *books; /* strong; immutable */
} RecordObject;

static int
record_traverse(RecordObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->books);
    return 0;
}

static int
record_clear(RecordObject *self)
{
    Py_CLEAR(self->books);
    return 0;
}

static void
record_dealloc(RecordObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    record_clear(self);
    /* The last holder out takes the model off its worker's table. */
    cs_model_release_handle(self->model);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
record_get_model_id(RecordObject *self, void *closure)
{
    size_t len;
    const char *id = cs_model_id(self->model, &len);
    return PyUnicode_DecodeUTF8(id, (Py_ssize_t)len, "surrogatepass");
}

/* What a getter's closure points at: which field it reads. */
enum {
    RECORD_SIZE,
    RECORD_GENERATION,
    RECORD_LOADED,
    RECORD_PEAK,
    RECORD_WRITES,
    RECORD_STALE,
    RECORD_DEFERRED
};
static int record_fields[] = {0, 1, 2, 3, 4, 5, 6};

/* One getter for the record's figures: the closure points at the field. */
static PyObject *
record_get(RecordObject *self, void *closure)
{
    const cs_model *m = self->model;
    switch (*(const int *)closure) {
    case RECORD_SIZE:
        return PyLong_FromUnsignedLongLong(cs_model_size(m));
    case RECORD_GENERATION:
        return PyLong_FromUnsignedLongLong(cs_model_generation(m));
    case RECORD_LOADED:
        return PyLong_FromUnsignedLongLong(cs_model_loaded(m));
    case RECORD_PEAK:
        return PyLong_FromUnsignedLongLong(cs_model_admission_peak(m));
    case RECORD_WRITES:
        return PyLong_FromUnsignedLong(cs_model_version(m) / 2);
    case RECORD_STALE:
        return PyBool_FromLong(cs_model_stale(m));
    default:
        return PyBool_FromLong(cs_model_eviction_deferred(m));
    }
}

static PyObject *
record_read(RecordObject *self, PyObject *unused)
{
    cs_receipt r;
    cs_model_read(self->model, &r);
    PyObject *seq = r.seq == CS_SEQ_NONE
                        ? Py_NewRef(Py_None)
                        : PyLong_FromLongLong((long long)r.seq);
    if (seq == NULL) {
        return NULL;
    }
    return Py_BuildValue("(KNKs)", (unsigned long long)r.loaded, seq,
                         (unsigned long long)r.time_ns,
                         cs_source_name(r.source));
}

static PyObject *
record_repr(RecordObject *self)
{
    cs_receipt r;
    size_t len;
    const char *id = cs_model_id(self->model, &len);
    cs_model_read(self->model, &r);
    return PyUnicode_FromFormat("<ModelRecord '%.200s' gen %llu: %llu/%llu "
                                "bytes, %s>",
                                id,
                                (unsigned long long)cs_model_generation(
                                    self->model),
                                (unsigned long long)r.loaded,
                                (unsigned long long)cs_model_size(self->model),
                                cs_source_name(r.source));
}

#define RECORD_FIELD(name, field, doc)                                        \
    {name, (getter)record_get, NULL, doc, &record_fields[field]}

static PyGetSetDef record_getset[] = {
    {"model_id", (getter)record_get_model_id, NULL, NULL, NULL},
    RECORD_FIELD("size", RECORD_SIZE, NULL),
    RECORD_FIELD("generation", RECORD_GENERATION, NULL),
    RECORD_FIELD("stale", RECORD_STALE,
                 "The model's generation is over, or its worker is gone."),
    RECORD_FIELD("loaded", RECORD_LOADED, NULL),
    RECORD_FIELD("peak", RECORD_PEAK, "The admission peak."),
    RECORD_FIELD("eviction_deferred", RECORD_DEFERRED, NULL),
    RECORD_FIELD("write_count", RECORD_WRITES, "Receipts written so far."),
    {NULL},
};

static PyMethodDef record_methods[] = {
    {"read", (PyCFunction)record_read, METH_NOARGS,
     "read($self, /)\n--\n\n(loaded, seq or None, monotonic ns, source)."},
    {NULL},
};

static PyType_Slot record_slots[] = {
    {Py_tp_doc, "One worker model's receipt, shared by every holder of "
                "that (worker, generation, id)."},
    {Py_tp_traverse, record_traverse},
    {Py_tp_clear, record_clear},
    {Py_tp_dealloc, record_dealloc},
    {Py_tp_getset, record_getset},
    {Py_tp_methods, record_methods},
    {Py_tp_repr, record_repr},
    {0, NULL},
};

static PyType_Spec record_spec = {
    .name = "comfy_standin._core.ModelRecord",
    .basicsize = sizeof(RecordObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = record_slots,
};

static PyObject *
books_register(BooksObject *self, PyObject *args)
{
    cs_module_state *state = state_of((PyObject *)self);
    PyObject *id_obj, *size_obj, *generation_obj;
    uint64_t size, generation;
    Py_ssize_t id_len;
    const char *id;
    cs_model *model = NULL;
    int code;

    if (state == NULL ||
        !PyArg_ParseTuple(args, "OOO:register", &id_obj, &size_obj,
                          &generation_obj)) {
        return NULL;
    }
    if (cs_check_model_id(id_obj) < 0) {
        return NULL;
    }
    code = cs_value_check(size_obj, CS_VALUE_MAX, &size);
    if (code != 0) {
        return cs_value_error(NULL, code, "size", size_obj, CS_VALUE_MAX),
               NULL;
    }
    code = cs_value_check(generation_obj, CS_VALUE_MAX, &generation);
    if (code != 0) {
        return cs_value_error(NULL, code, "generation", generation_obj,
                              CS_VALUE_MAX),
               NULL;
    }
    id = PyUnicode_AsUTF8AndSize(id_obj, &id_len);
    if (id == NULL) {
        return NULL;
    }
    if (cs_register_model(self->worker, generation, id_obj, id,
                          (size_t)id_len, size, size_obj, &model) < 0) {
        return NULL;
    }
    RecordObject *record =
        PyObject_GC_New(RecordObject, state->record_type);
    if (record == NULL) {
        cs_model_release_handle(model);
        return NULL;
    }
    record->model = model;
    record->books = Py_NewRef((PyObject *)self);
    PyObject_GC_Track(record);
    return (PyObject *)record;
}

static PyObject *
books_find(BooksObject *self, PyObject *id_obj)
{
    Py_ssize_t id_len;
    const char *id;
    if (!PyUnicode_Check(id_obj)) {
        Py_RETURN_NONE;
    }
    switch (cs_model_id_utf8(id_obj, &id, &id_len)) {
    case 0:
        break;
    case 1:
        Py_RETURN_NONE; /* no model has an id without a UTF-8 form */
    default:
        return NULL;
    }
    cs_model *model = cs_worker_find_model(self->worker, id, (size_t)id_len);
    if (model == NULL) {
        Py_RETURN_NONE;
    }
    /* A new handle on the same model: the record keeps it on the table
     * while it lives, like any holder. */
    PyObject *r = NULL;
    PyObject *method = cs_getattr_interned((PyObject *)self, "register");
    if (method != NULL) {
        r = PyObject_CallFunction(method, "OKK", id_obj,
                                  (unsigned long long)cs_model_size(model),
                                  (unsigned long long)
                                      cs_model_generation(model));
        Py_DECREF(method);
    }
    cs_model_decref(model);
    return r;
}

#define BOOKS_FIELD(name, field, doc)                                         \
    {name, (getter)books_get, NULL, doc, &books_fields[field]}

static PyGetSetDef books_getset[] = {
    BOOKS_FIELD("generation", BOOKS_GENERATION,
                "The worker's current generation (bumped on restart)."),
    BOOKS_FIELD("alive", BOOKS_ALIVE, "False once the worker is gone."),
    BOOKS_FIELD("in_flight", BOOKS_IN_FLIGHT,
                "Calls in flight (begin_call minus end_call)."),
    {"report", (getter)books_get_report, NULL,
     "(held, pinned, overhead) from the last _vram_report.", NULL},
    BOOKS_FIELD("reading", BOOKS_READING,
                "The probe's per-pid reading of the worker (0: none)."),
    {"key", (getter)books_get_key, NULL, "The worker object.", NULL},
    {NULL},
};

static PyMethodDef books_methods[] = {
    {"register", (PyCFunction)books_register, METH_VARARGS,
     "register($self, model_id, size, generation, /)\n--\n\nThe model's "
     "record, shared by every holder of (worker, generation, id)."},
    {"find", (PyCFunction)books_find, METH_O,
     "find($self, model_id, /)\n--\n\nThe current generation's record of "
     "model_id, or None."},
    {"bump", (PyCFunction)books_bump, METH_O,
     "bump($self, generation, /)\n--\n\nA restart: the old generation's "
     "models read 0 (\"worker gone\")."},
    {"gone", (PyCFunction)books_gone, METH_NOARGS,
     "gone($self, /)\n--\n\nThe worker died: every model reads 0."},
    {"begin_call", (PyCFunction)books_begin_call, METH_NOARGS,
     "begin_call($self, /)\n--\n\nA call to the worker starts."},
    {"end_call", (PyCFunction)books_end_call, METH_NOARGS,
     "end_call($self, /)\n--\n\nA call to the worker ended."},
    {"set_report", (PyCFunction)(void (*)(void))books_set_report,
     METH_FASTCALL | METH_KEYWORDS,
     "set_report($self, /, held=None, pinned=None, overhead=None)\n--\n\n"
     "The scalar part of a _vram_report; None leaves a figure."},
    {"set_reading", (PyCFunction)books_set_reading, METH_O,
     "set_reading($self, used, /)\n--\n\nThe probe's per-pid reading."},
    {"apply_census", (PyCFunction)books_apply_census, METH_O,
     "apply_census($self, census, /)\n--\n\nApplies a census by model id, "
     "all or nothing; returns the entries applied."},
    {"charge", (PyCFunction)books_charge, METH_NOARGS,
     "charge($self, /)\n--\n\nWhat the worker costs the card, and why."},
    {"standins", (PyCFunction)books_standins, METH_NOARGS,
     "standins($self, /)\n--\n\nThe worker's live stand-ins (its "
     "roster), in adoption order: a new list."},
    {NULL},
};

static PyObject *
books_repr(BooksObject *self)
{
    if (self->key == NULL) {
        return PyUnicode_FromString("<WorkerBooks (cleared)>");
    }
    return PyUnicode_FromFormat(
        "<WorkerBooks of %R: generation %llu, %s, %u in flight>", self->key,
        (unsigned long long)cs_worker_generation(self->worker),
        cs_worker_alive(self->worker) ? "alive" : "gone",
        cs_worker_in_flight(self->worker));
}

static PyMemberDef books_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(BooksObject, weakreflist),
     READONLY},
    {NULL},
};

static PyType_Slot books_slots[] = {
    {Py_tp_doc, "The pool's books for one worker process."},
    {Py_tp_traverse, books_traverse},
    {Py_tp_clear, books_clear},
    {Py_tp_dealloc, books_dealloc},
    {Py_tp_getset, books_getset},
    {Py_tp_members, books_members},
    {Py_tp_methods, books_methods},
    {Py_tp_repr, books_repr},
    {0, NULL},
};

static PyType_Spec books_spec = {
    .name = "comfy_standin._core.WorkerBooks",
    .basicsize = sizeof(BooksObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = books_slots,
};

/* ---- Ledger ---------------------------------------------------------- */

static PyObject *
ledger_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *floor_obj;
    uint64_t floor = CS_DEFAULT_FLOOR;
    LedgerObject *self;
    cs_module_state *state = cs_state_checked(type);

    if (state == NULL ||
        cs_parse_tuple(state, CS_SIG_LEDGER, args, kwargs, &floor_obj) < 0) {
        return NULL;
    }
    if (floor_obj != NULL) {
        int code = cs_value_check(floor_obj, CS_VALUE_MAX, &floor);
        if (code != 0) {
            return cs_value_error(NULL, code, "floor", floor_obj,
                                  CS_VALUE_MAX),
                   NULL;
        }
    }
    /* The table and the C ledger first: the object's allocation may run a
     * collection, and the collector must never reach a Ledger without
     * them. */
    PyObject *books = PyDict_New();
    if (books == NULL) {
        return NULL;
    }
    cs_ledger *ledger = cs_ledger_new(floor);
    if (ledger == NULL) {
        Py_DECREF(books);
        return PyErr_NoMemory();
    }
    self = (LedgerObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        cs_ledger_free(ledger);
        Py_DECREF(books);
        return NULL;
    }
    self->books = books;
    self->ledger = ledger;
    return (PyObject *)self;
}

static int
ledger_traverse(LedgerObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->books);
    Py_VISIT(self->last_books);
    return 0;
}

static int
ledger_clear(LedgerObject *self)
{
    Py_CLEAR(self->last_books);
    Py_CLEAR(self->books);
    return 0;
}

static void
ledger_dealloc(LedgerObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    ledger_clear(self);
    cs_ledger_free(self->ledger);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* The books of `key`, borrowed from the table, or NULL (with an exception
 * only when one was raised).  Runs no Python: the key is an int. */
static PyObject *
ledger_find_books(LedgerObject *self, PyObject *key)
{
    if (self->books == NULL) {
        return cleared_error("Ledger");
    }
    BooksObject *last = (BooksObject *)self->last_books;
    if (last != NULL && last->key == key) {
        return (PyObject *)last;
    }
    PyObject *id = PyLong_FromVoidPtr(key);
    if (id == NULL) {
        return NULL;
    }
    PyObject *books = PyDict_GetItemWithError(self->books, id);
    Py_DECREF(id);
    if (books != NULL) {
        /* The entry holds them, so the old cache entry stays alive too. */
        Py_XSETREF(self->last_books, Py_NewRef(books));
    }
    return books;
}

/* Files `books` under `key`: 0, or -1 with an exception.  Runs no Python
 * (an int key; a dict resize allocates no tracked object). */
static int
ledger_insert(LedgerObject *self, PyObject *key, PyObject *books)
{
    PyObject *id = PyLong_FromVoidPtr(key);
    if (id == NULL) {
        return -1;
    }
    int r = PyDict_SetItem(self->books, id, books);
    Py_DECREF(id);
    if (r == 0) {
        Py_XSETREF(self->last_books, Py_NewRef(books));
    }
    return r;
}

PyObject *
cs_ledger_books_for(PyObject *ledger, PyObject *key, uint64_t generation)
{
    LedgerObject *self = (LedgerObject *)ledger;
    cs_module_state *state = cs_state_checked(Py_TYPE(ledger));
    if (state == NULL) {
        return NULL;
    }
    PyObject *books = ledger_find_books(self, key);
    if (books == NULL && !PyErr_Occurred()) {
        /* One step: the Python object first (its allocation may run the
         * collector, and a finalizer may make this worker's books
         * meanwhile: the second look finds those), then, running no
         * Python, its C record and its entry. */
        BooksObject *fresh = books_alloc(state);
        if (fresh == NULL) {
            return NULL;
        }
        books = ledger_find_books(self, key);
        if (books == NULL && !PyErr_Occurred()) {
            if (books_attach(fresh, self->ledger, key, generation) < 0 ||
                ledger_insert(self, key, (PyObject *)fresh) < 0) {
                if (fresh->worker != NULL) {
                    cs_ledger_forget_worker(self->ledger, fresh->worker);
                }
                Py_DECREF(fresh);
                return NULL;
            }
            return (PyObject *)fresh;
        }
        Py_DECREF(fresh); /* no record, no key: frees without Python */
    }
    if (books == NULL) {
        return NULL;
    }
    BooksObject *b = (BooksObject *)books;
    if (generation > cs_worker_generation(b->worker)) {
        cs_worker_bump_generation(b->worker, generation);
    }
    return Py_NewRef(books);
}

/* The books of `key`, a new reference, or NULL (with an exception only if
 * one was raised).  Runs no Python. */
static PyObject *
books_of(PyObject *ledger, PyObject *key)
{
    PyObject *books = ledger_find_books((LedgerObject *)ledger, key);
    return Py_XNewRef(books);
}

/* The profile of the stand-in listed last on `books` when it holds these
 * objects, borrowed, else NULL. */
static PyObject *
roster_tail_profile(PyObject *books, const PyObject *load_device,
                    const PyObject *offload_device, const PyObject *kind)
{
    cs_roster *roster = books ? cs_books_roster(books) : NULL;
    if (roster == NULL || roster->used == 0) {
        return NULL;
    }
    PyObject *profile = roster->items[roster->used - 1]->profile;
    if (profile != NULL &&
        PyTuple_GET_ITEM(profile, PROFILE_LOAD) == load_device &&
        PyTuple_GET_ITEM(profile, PROFILE_OFFLOAD) == offload_device &&
        PyTuple_GET_ITEM(profile, PROFILE_KIND) == kind) {
        return profile;
    }
    return NULL;
}

PyObject *
cs_ledger_profile(PyObject *ledger, PyObject *worker, PyObject *load_device,
                  PyObject *offload_device, PyObject *kind,
                  PyObject **books)
{
    LedgerObject *self = (LedgerObject *)ledger;
    /* Both are entries of the table, which holds them: no Python runs. */
    PyObject *previous = self->last_books;
    PyObject *found = self->books ? ledger_find_books(self, worker) : NULL;
    if (found == NULL && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *profile =
        roster_tail_profile(found, load_device, offload_device, kind);
    if (profile == NULL && previous != found) {
        profile = roster_tail_profile(previous, load_device, offload_device,
                                      kind);
    }
    if (profile != NULL) {
        *books = Py_XNewRef(found);
        return Py_NewRef(profile);
    }
    profile = PyTuple_Pack(3, load_device, offload_device, kind);
    /* The allocation may have run Python: look again. */
    *books = profile ? books_of(ledger, worker) : NULL;
    if (*books == NULL && PyErr_Occurred()) {
        Py_CLEAR(profile);
    }
    return profile;
}


static PyObject *
ledger_worker(LedgerObject *self, PyObject *args)
{
    PyObject *key, *generation_obj;
    uint64_t generation;

    if (!PyArg_ParseTuple(args, "OO:worker", &key, &generation_obj)) {
        return NULL;
    }
    int code = cs_value_check(generation_obj, CS_VALUE_MAX, &generation);
    if (code != 0) {
        return cs_value_error(NULL, code, "generation", generation_obj,
                              CS_VALUE_MAX),
               NULL;
    }
    return cs_ledger_books_for((PyObject *)self, key, generation);
}

static PyObject *
ledger_find(LedgerObject *self, PyObject *key)
{
    PyObject *books = ledger_find_books(self, key);
    if (books == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    return Py_NewRef(books);
}

/* Takes the books of `key` off the ledger, roster and all, in one step:
 * returns them (a new reference), or None when there were none. */
static PyObject *
ledger_forget(LedgerObject *self, PyObject *key)
{
    if (self->books == NULL) {
        return cleared_error("Ledger");
    }
    PyObject *id = PyLong_FromVoidPtr(key);
    if (id == NULL) {
        return NULL;
    }
    PyObject *books = PyDict_GetItemWithError(self->books, id);
    if (books == NULL) {
        Py_DECREF(id);
        if (PyErr_Occurred()) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    Py_INCREF(books);
    if (self->last_books == books) {
        Py_CLEAR(self->last_books); /* not the last reference */
    }
    int r = PyDict_DelItem(self->books, id);
    Py_DECREF(id);
    if (r < 0) {
        Py_DECREF(books);
        return NULL;
    }
    cs_ledger_forget_worker(self->ledger, ((BooksObject *)books)->worker);
    return books;
}

/* The entries of the table, in insertion order, as a new list built by
 * appending: a list's allocation may run the collector, whose finalizers
 * may add or forget books, so nothing is sized before it is made. */
static PyObject *
ledger_entries(LedgerObject *self, int want_keys)
{
    if (self->books == NULL) {
        return cleared_error("Ledger");
    }
    PyObject *list = PyList_New(0);
    if (list == NULL) {
        return NULL;
    }
    PyObject *id, *books;
    Py_ssize_t pos = 0;
    while (PyDict_Next(self->books, &pos, &id, &books)) {
        PyObject *item = books;
        if (want_keys) {
            item = ((BooksObject *)books)->key;
            if (item == NULL) {
                Py_DECREF(list);
                return cleared_error("WorkerBooks");
            }
        }
        /* Appending grows the array with PyMem: no collection, no
         * Python, so the table cannot change under this walk. */
        if (PyList_Append(list, item) < 0) {
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

static PyObject *
ledger_keys(LedgerObject *self, PyObject *unused)
{
    return ledger_entries(self, 1);
}

static PyObject *
ledger_all_books(LedgerObject *self, PyObject *unused)
{
    return ledger_entries(self, 0);
}

/* The figures of every worker's roster (as books_charge), sorted: 0, or
 * -1 with MemoryError.  Runs no Python. */
static int
ledger_figures(LedgerObject *self, cs_figures *figures)
{
    PyObject *id, *books;
    Py_ssize_t pos = 0;
    /* A cleared ledger has no rosters left to read: receipts only. */
    while (self->books != NULL &&
           PyDict_Next(self->books, &pos, &id, &books)) {
        if (cs_figures_add_roster(figures,
                                  &((BooksObject *)books)->roster) < 0) {
            cs_figures_release(figures);
            return -1;
        }
    }
    cs_figures_sort(figures);
    return 0;
}

static PyObject *
ledger_reserve(LedgerObject *self, PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames)
{
    PyObject *argv[3];
    uint64_t base, total;
    int code;
    cs_module_state *state = state_of((PyObject *)self);

    if (state == NULL ||
        cs_parse_vector(state, CS_SIG_RESERVE, args, nargs, kwnames, argv) <
            0) {
        return NULL;
    }
    PyObject *base_obj = argv[0], *total_obj = argv[1], *local_obj = argv[2];
    if (!PyBool_Check(local_obj)) {
        PyErr_Format(PyExc_TypeError,
                     "process_local: expected a bool, got %R", local_obj);
        return NULL;
    }
    int process_local = local_obj == Py_True;
    code = cs_value_check(base_obj, CS_VALUE_MAX, &base);
    if (code != 0) {
        return cs_value_error(NULL, code, "base", base_obj, CS_VALUE_MAX),
               NULL;
    }
    code = cs_value_check(total_obj, CS_VALUE_MAX, &total);
    if (code != 0) {
        return cs_value_error(NULL, code, "total", total_obj, CS_VALUE_MAX),
               NULL;
    }
    cs_figures figures = {NULL, 0, 0};
    if (process_local && ledger_figures(self, &figures) < 0) {
        return NULL;
    }
    uint64_t reserve;
    Py_BEGIN_ALLOW_THREADS
    reserve = cs_ledger_reserve(self->ledger, base, total,
                                     process_local != 0, figures.items,
                                     figures.n);
    Py_END_ALLOW_THREADS
    cs_figures_release(&figures);
    return PyLong_FromUnsignedLongLong(reserve);
}

static PyObject *
ledger_total_charge(LedgerObject *self, PyObject *unused)
{
    cs_figures figures = {NULL, 0, 0};
    if (ledger_figures(self, &figures) < 0) {
        return NULL;
    }
    uint64_t total = cs_ledger_total_charge(self->ledger, figures.items,
                                                 figures.n);
    cs_figures_release(&figures);
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *
ledger_reread_boards(LedgerObject *self, PyObject *unused)
{
    cs_standin_reread_boards();
    Py_RETURN_NONE;
}

static PyObject *
ledger_get_floor(LedgerObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(cs_ledger_floor(self->ledger));
}

static PyGetSetDef ledger_getset[] = {
    {"floor", (getter)ledger_get_floor, NULL,
     "Per-process floor (CUDA context and handles), bytes.", NULL},
    {NULL},
};

static PyMethodDef ledger_methods[] = {
    {"worker", (PyCFunction)ledger_worker, METH_VARARGS,
     "worker($self, key, generation, /)\n--\n\nThe books of a worker, "
     "created or bumped to `generation`."},
    {"find", (PyCFunction)ledger_find, METH_O,
     "find($self, key, /)\n--\n\nThe books of a worker, or None."},
    {"forget", (PyCFunction)ledger_forget, METH_O,
     "forget($self, key, /)\n--\n\nTakes a worker's books (and their "
     "roster) off the ledger; returns them, or None."},
    {"keys", (PyCFunction)ledger_keys, METH_NOARGS,
     "keys($self, /)\n--\n\nThe workers on the books, oldest first."},
    {"books", (PyCFunction)ledger_all_books, METH_NOARGS,
     "books($self, /)\n--\n\nEvery worker's books, oldest first."},
    {"reserve", (PyCFunction)(void (*)(void))ledger_reserve,
     METH_FASTCALL | METH_KEYWORDS,
     "reserve($self, /, base, total, process_local)\n--\n\nThe reserve to "
     "publish (docs/reserve.md)."},
    {"total_charge", (PyCFunction)ledger_total_charge, METH_NOARGS,
     "total_charge($self, /)\n--\n\nSum of every worker's charge."},
    {"reread_boards", (PyCFunction)ledger_reread_boards, METH_NOARGS,
     "reread_boards($self, /)\n--\n\nEvery stand-in that reads a board "
     "decides its reading again at its next loaded_size(), the heartbeat's "
     "age included (the pool calls it where ComfyUI decides)."},
    {NULL},
};

static PyType_Slot ledger_slots[] = {
    {Py_tp_doc, "Ledger(floor=300 << 20)\n--\n\nThe C residency ledger "
                "behind a Pool."},
    {Py_tp_new, ledger_new},
    {Py_tp_traverse, ledger_traverse},
    {Py_tp_clear, ledger_clear},
    {Py_tp_dealloc, ledger_dealloc},
    {Py_tp_getset, ledger_getset},
    {Py_tp_methods, ledger_methods},
    {0, NULL},
};

static PyType_Spec ledger_spec = {
    .name = "comfy_standin._core.Ledger",
    .basicsize = sizeof(LedgerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = ledger_slots,
};

static PyObject *
live_counts(PyObject *module, PyObject *unused)
{
    int64_t workers, models;
    cs_ledger_live_counts(&workers, &models);
    return Py_BuildValue("(LL)", (long long)workers, (long long)models);
}

static PyMethodDef ledger_functions[] = {
    {"_live_counts", live_counts, METH_NOARGS,
     "_live_counts()\n--\n\n(workers, models) of the C core not yet freed, "
     "process-wide: for leak tests."},
    {NULL},
};

int
cs_ledger_binding_exec(PyObject *module, cs_module_state *state)
{
    if (PyModule_AddFunctions(module, ledger_functions) < 0) {
        return -1;
    }
    state->record_type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &record_spec, NULL);
    if (state->record_type == NULL ||
        PyModule_AddType(module, state->record_type) < 0) {
        return -1;
    }
    state->books_type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &books_spec, NULL);
    if (state->books_type == NULL ||
        PyModule_AddType(module, state->books_type) < 0) {
        return -1;
    }
    state->ledger_type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &ledger_spec, NULL);
    if (state->ledger_type == NULL ||
        PyModule_AddType(module, state->ledger_type) < 0) {
        return -1;
    }
    return 0;
}
