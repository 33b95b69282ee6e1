/*
 * standin.c -- the stand-in type ComfyUI's model_management loads directly
 * (docs/semantics.md): construction, lifetime, and everything ComfyUI
 * reads.  Its inner module and sentinel are in inner.c, the roster in
 * roster.c, the commands to the worker in commands.c, the state sync in
 * sync.c; standin.h has the object layouts they share.
 */
#include "standin.h"

#include "board_binding.h"

#include <string.h>
#include <structmember.h>

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

/* __getattr__: what an unknown attribute raises.  Attribute lookup itself
 * is CPython's own (tp_getattro stays PyObject_GenericGetAttr), because
 * any other tp_getattro stops 3.11+ from specialising `s.loaded_size()`
 * (and 3.10 from calling it without a bound method): every method call on
 * ComfyUI's eviction path would build a bound method.  CPython calls
 * __getattr__ only after its own lookup failed, through the slot it gives
 * a type with __getattr__, which 3.12+ still specialises method loads
 * past; 3.10 and 3.11 do not, so there the stand-in type keeps CPython's
 * own message (it names the attribute too) and only the inner module,
 * which has no method on a hot path, gets this one (cs_standin_exec).
 * Dunders stay plain so copy, pickle and weakref probes and getattr(x,
 * name, default) behave. */
static PyObject *
contract_getattr(PyObject *self, PyObject *name)
{
    if (!PyUnicode_Check(name) || is_dunder(name)) {
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

static PyMethodDef contract_getattr_def = {
    "__getattr__", contract_getattr, METH_O,
    "__getattr__($self, name, /)\n--\n\nRaises AttributeError: the stand-in "
    "answers only the members ComfyUI is known to touch.",
};

/* Makes `type` from `spec` with contract_getattr as its __getattr__ when
 * `with_getattr`, then immutable.  Assigning __getattr__ to the type is
 * what gives it CPython's lookup-then-__getattr__ slot; a type is
 * mutable until that is done. */
PyTypeObject *
cs_make_type(PyObject *module, PyType_Spec *spec, bool with_getattr)
{
    PyTypeObject *type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, spec, NULL);
    if (type == NULL || !with_getattr) {
        return type;
    }
    PyObject *method = PyDescr_NewMethod(type, &contract_getattr_def);
    int failed = method == NULL ||
                 PyObject_SetAttrString((PyObject *)type, "__getattr__",
                                        method) < 0;
    Py_XDECREF(method);
    if (failed) {
        Py_DECREF(type);
        return NULL;
    }
    type->tp_flags |= Py_TPFLAGS_IMMUTABLETYPE;
    PyType_Modified(type);
    return type;
}

/* ---- StandIn: construction and lifetime ------------------------------- */

/* The worker has a callable send_command and is_alive: methods of its
 * class, looked up there (no bound method made) when the class keeps
 * Python's own attribute lookup, and kept, so the next worker of that
 * class is not looked at again; else attributes of the worker (its own,
 * its __getattr__'s).  0, or -1 with TypeError or the worker's own
 * exception. */
static int
check_worker(PyObject *worker, cs_module_state *state)
{
    PyObject *names[2] = {state->str_send_command, state->str_is_alive};
    PyObject *type = (PyObject *)Py_TYPE(worker);
    bool of_class = Py_TYPE(worker)->tp_getattro == PyObject_GenericGetAttr;
    if (type == state->worker_type) {
        return 0;
    }
    for (int i = 0; i < 2; i++) {
        PyObject *method =
            of_class ? PyObject_GetAttr(type, names[i]) : NULL;
        if (method == NULL &&
            (!of_class || PyErr_ExceptionMatches(PyExc_AttributeError))) {
            PyErr_Clear();
            of_class = false;
            method = PyObject_GetAttr(worker, names[i]);
        }
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
    if (of_class) {
        Py_XSETREF(state->worker_type, Py_NewRef(type));
    }
    return 0;
}

/* comfy_standin.default_pool(), a new reference: the package's
 * _default_pool once it is made (what the function then returns, without
 * taking its lock), else the function's answer.  The package is imported
 * once and kept in the module state. */
static PyObject *
default_pool(cs_module_state *state)
{
    if (state->package == NULL) {
        PyObject *package = PyImport_ImportModule("comfy_standin");
        if (package == NULL) {
            return NULL;
        }
        Py_XSETREF(state->package, package);
    }
    PyObject *pool = PyDict_GetItemWithError(
        PyModule_GetDict(state->package), state->str_default_pool);
    if (pool != NULL && pool != Py_None) {
        return Py_NewRef(pool);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    PyObject *factory = cs_getattr_interned(state->package, "default_pool");
    pool = factory ? PyObject_CallNoArgs(factory) : NULL;
    Py_XDECREF(factory);
    return pool;
}

static PyObject *
resolve_pool(PyObject *pool, cs_module_state *state, PyObject **ledger)
{
    bool by_default = pool == NULL || pool == Py_None;
    pool = by_default ? default_pool(state) : Py_NewRef(pool);
    if (pool == NULL) {
        return NULL;
    }
    if (by_default && pool == state->default_pool) {
        *ledger = Py_NewRef(state->default_ledger);
        return pool;
    }
    *ledger = PyObject_GetAttr(pool, state->str_ledger);
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
    if (by_default) {
        /* Kept: a pool's ledger is made once, in its __init__. */
        Py_XSETREF(state->default_ledger, Py_NewRef(*ledger));
        Py_XSETREF(state->default_pool, Py_NewRef(pool));
    }
    return pool;
}

#define STANDIN_NARGS 8

static PyObject *standin_make(PyTypeObject *type, cs_module_state *state,
                              PyObject **argv);

static PyObject *
standin_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *argv[STANDIN_NARGS];
    cs_module_state *state = cs_state_checked(type);
    if (state == NULL ||
        cs_parse_tuple(state, CS_SIG_STANDIN, args, kwargs, argv) < 0) {
        return NULL;
    }
    /* The keyword dict may be one caller code still holds (PyObject_Call
     * from C, StandIn.__new__(StandIn, **d) paths): own the values across
     * the checks, which run the worker's code (cs_args_hold). */
    cs_args_hold(argv, STANDIN_NARGS);
    PyObject *made = standin_make(type, state, argv);
    cs_args_release(argv, STANDIN_NARGS);
    return made;
}

/* StandIn(...) itself: the type's vectorcall, so a call makes no argument
 * tuple or keyword dict (StandIn is not subclassable: `type` is it).  The
 * arguments are the caller's frame's, owned for the whole call. */
static PyObject *
standin_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf,
                   PyObject *kwnames)
{
    PyObject *argv[STANDIN_NARGS];
    cs_module_state *state = cs_state_checked((PyTypeObject *)type);
    if (state == NULL ||
        cs_parse_vector(state, CS_SIG_STANDIN, args,
                        PyVectorcall_NARGS(nargsf), kwnames, argv) < 0) {
        return NULL;
    }
    return standin_make((PyTypeObject *)type, state, argv);
}

/* A stand-in of a generation newer than its worker's books: the worker
 * restarted, and registering its model is how the host learns it.  The
 * pool's restarted() runs first (it buries the older generation's
 * stand-ins, releases their registrations and closes the old process's
 * board), as for any restart.  0, or -1 with an exception. */
static int
restart_if_newer(cs_module_state *state, PyObject *pool, PyObject *books,
                 PyObject *worker, PyObject *generation_obj,
                 uint64_t generation)
{
    if (books == NULL ||
        generation <= cs_worker_generation(cs_books_worker(books))) {
        return 0;
    }
    PyObject *r = PyObject_CallMethodObjArgs(pool, state->str_restarted,
                                             worker, generation_obj, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* The constructor's checks, in the order a caller meets them: the worker,
 * the generation, the id, the size, the kind.  Fills *generation, *size,
 * *kind (a new reference; "other" when not given) and *model_id (an exact
 * str copy, new: a str subclass's __repr__ never runs in a message).  0,
 * or -1 with an exception and nothing owned. */
static int
standin_args(cs_module_state *state, PyObject **argv, uint64_t *generation,
             uint64_t *size, PyObject **kind, PyObject **model_id)
{
    int code;
    if (check_worker(argv[0], state) < 0) {
        return -1;
    }
    code = cs_value_check(argv[1], CS_VALUE_MAX, generation);
    if (code != 0) {
        (void)cs_value_error(NULL, code, "worker_generation", argv[1],
                             CS_VALUE_MAX);
        return -1;
    }
    if (cs_check_model_id(argv[2]) < 0) {
        return -1;
    }
    code = cs_value_check(argv[3], CS_VALUE_MAX, size);
    if (code != 0) {
        (void)cs_value_error(NULL, code, "model_size", argv[3],
                             CS_VALUE_MAX);
        return -1;
    }
    if (argv[6] != NULL && !PyUnicode_Check(argv[6])) {
        PyErr_Format(PyExc_TypeError, "kind: expected a str, got %R",
                     argv[6]);
        return -1;
    }
    *kind = argv[6] != NULL ? Py_NewRef(argv[6])
                            : PyUnicode_InternFromString("other");
    *model_id = *kind != NULL ? PyUnicode_FromObject(argv[2]) : NULL;
    if (*model_id == NULL) {
        Py_CLEAR(*kind);
        return -1;
    }
    return 0;
}

/* The constructor proper, from parsed arguments (borrowed, and owned by
 * the caller for the whole call).  The object stays untracked until it is
 * whole: making the books may run a collection, and a gc.callbacks hook
 * must not find a stand-in without its record. */
static PyObject *
standin_make(PyTypeObject *type, cs_module_state *state, PyObject **argv)
{
    PyObject *worker = argv[0], *size_obj = argv[3];
    PyObject *kind = NULL, *model_id = NULL, *pool = NULL, *ledger = NULL;
    PyObject *profile = NULL, *size_int = NULL, *books = NULL;
    StandInObject *self = NULL;
    uint64_t generation = 0, size = 0;

    if (standin_args(state, argv, &generation, &size, &kind, &model_id) <
        0) {
        return NULL;
    }
    pool = resolve_pool(argv[7], state, &ledger);
    profile = pool ? cs_ledger_profile(ledger, worker, argv[4], argv[5],
                                       kind, &books)
                   : NULL;
    if (profile == NULL ||
        restart_if_newer(state, pool, books, worker, argv[1], generation) <
            0) {
        goto error;
    }
    Py_CLEAR(books);
    /* An exact int (an int subclass is read from its digits, never kept). */
    size_int = PyLong_CheckExact(size_obj) ? Py_NewRef(size_obj)
                                           : PyLong_FromUnsignedLongLong(size);
    if (size_int == NULL) {
        goto error;
    }
    self = PyObject_GC_New(StandInObject, type);
    if (self == NULL) {
        goto error;
    }
    memset((char *)self + sizeof(PyObject), 0,
           sizeof(StandInObject) - sizeof(PyObject));
    self->profile = profile;
    self->pool = pool;
    self->size_int = size_int;
    profile = pool = size_int = NULL;
    if (cs_standin_enlist(self, ledger, worker, model_id, generation, size,
                          size_obj) < 0) {
        goto error;
    }
    PyObject_GC_Track(self);
    Py_DECREF(model_id);
    Py_DECREF(ledger);
    Py_DECREF(kind);
    return (PyObject *)self;

error:
    Py_XDECREF(self);
    Py_XDECREF(model_id);
    Py_XDECREF(ledger);
    Py_XDECREF(pool);
    Py_XDECREF(kind);
    Py_XDECREF(profile);
    Py_XDECREF(size_int);
    Py_XDECREF(books);
    return NULL;
}

static int
standin_traverse(StandInObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    int code = cs_standin_extra_traverse(self, visit, arg);
    if (code != 0) {
        return code;
    }
    Py_VISIT(cs_standin_books(self));
    Py_VISIT(self->pool);
    Py_VISIT(self->profile);
    return 0;
}

/* The profile goes (a device may be any object, a tuple with no clear of
 * its own): a cleared stand-in's devices and kind read None. */
static int
standin_clear(StandInObject *self)
{
    cs_roster_unlink(self); /* first: the roster lists live ones only */
    cs_standin_extra_clear(self);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->profile);
    return 0;
}

static void
standin_dealloc(StandInObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    cs_roster_unlink(self); /* before any weakref callback can walk it */
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    standin_clear(self);
    Py_CLEAR(self->size_int);
    Py_CLEAR(self->answer);
    if (self->record != NULL) {
        cs_model_release_handle(self->record);
    }
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* ---- StandIn: what ComfyUI reads --------------------------------------- */

uint64_t
cs_standin_loaded(StandInObject *self)
{
    return cs_standin_read(self, NULL);
}

static PyObject *
standin_model_size(StandInObject *self, PyObject *unused)
{
    return Py_NewRef(self->size_int);
}

/* `loaded` as an int: the size's when fully loaded, else a new one (small
 * ones are CPython's cached ints).  Runs no Python. */
static PyObject *
loaded_int(StandInObject *self, uint64_t loaded)
{
    if (loaded == cs_model_size(self->record)) {
        return Py_NewRef(self->size_int);
    }
    return PyLong_FromUnsignedLongLong(loaded);
}

/* Out of line, so loaded_size()'s kept answer needs no stack frame. */
#if defined(__GNUC__)
#define CS_COLD __attribute__((noinline, cold))
#else
#define CS_COLD
#endif

/* What loaded_size() answers from the receipt, kept in `answer` with the
 * version it was read at.  Runs no Python. */
static PyObject *
receipt_answer(StandInObject *self)
{
    cs_receipt r;
    uint32_t version = cs_model_read(self->record, &r);
    PyObject *answer = loaded_int(self, r.loaded);
    if (answer != NULL) {
        Py_XSETREF(self->answer, Py_NewRef(answer)); /* an int: no Python */
        self->answered = version;
    }
    return answer;
}

/* What loaded_size() answers now, kept in `answer`: from the receipt, at
 * a version; or, for a stand-in that reads a board, the board's figure,
 * kept in `answer` while it is the same.  Runs no Python. */
CS_COLD static PyObject *
standin_answer(StandInObject *self)
{
    uint64_t loaded;
    if (!self->reads_board || !cs_standin_board_figure(self, &loaded)) {
        self->reads_board = 0; /* none any more, or closed: receipts */
        return receipt_answer(self);
    }
    /* 2**31 writes ahead of any read: never met (the seqlock's bound). */
    self->answered = cs_model_version(self->record) - 2;
    cs_board_link *board = cs_standin_board(self);
    if (board->answered == loaded) {
        return Py_NewRef(self->answer);
    }
    PyObject *answer = loaded_int(self, loaded);
    if (answer != NULL) {
        Py_XSETREF(self->answer, Py_NewRef(answer)); /* an int: no Python */
        board->answered = loaded;
    }
    return answer;
}

int
cs_standin_answer_init(StandInObject *self)
{
    PyObject *answer = standin_answer(self);
    Py_XDECREF(answer);
    return answer ? 0 : -1;
}

/* loaded_size(): the answer kept while the receipt's version has not
 * moved (ComfyUI asks each candidate several times per pass), else what it
 * is now.  A stand-in that reads a board keeps `answered` behind the
 * version, so it answers through standin_answer() every time. */
static PyObject *
standin_loaded_size(StandInObject *self, PyObject *unused)
{
    if (cs_model_version(self->record) == self->answered) {
        return Py_NewRef(self->answer);
    }
#ifdef __linux__
    /* A board's verdict that still holds, already answered. */
    cs_board_link *board = cs_standin_board(self);
    if (self->reads_board && board != NULL &&
        cs_board_verdict_holds(board, self->record) &&
        board->answered == board->verdict.loaded) {
        return Py_NewRef(self->answer);
    }
#endif
    return standin_answer(self);
}

static PyObject *
standin_current_loaded_device(StandInObject *self, PyObject *unused)
{
    return cs_standin_device(self);
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
    if (cs_standin_worker(o) != cs_standin_worker(self) ||
        cs_model_generation(o->record) !=
            cs_model_generation(self->record)) {
        Py_RETURN_FALSE;
    }
    size_t len, other_len;
    const char *id = cs_model_id(self->record, &len);
    const char *other_id = cs_model_id(o->record, &other_len);
    return PyBool_FromLong(len == other_len && memcmp(id, other_id, len) == 0);
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
    cs_standin_read(self, &r);
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
    PyObject *id = cs_standin_model_id(self);
    if (id != NULL) {
        PyErr_Format(PyExc_NotImplementedError,
                     "model %R lives in a subprocess worker and cannot be "
                     "%s in the host: the host holds no weights, so a %s "
                     "would be silently wrong. Do it inside the node's own "
                     "environment, where a real ModelPatcher holds the "
                     "weights.",
                     id, what,
                     strcmp(what, "cloned") == 0 ? "clone" : "patch");
        Py_DECREF(id);
    }
    return NULL;
}

PyObject *
cs_standin_model_id(StandInObject *self)
{
    size_t len;
    const char *id = cs_model_id(self->record, &len);
    return PyUnicode_DecodeUTF8(id, (Py_ssize_t)len, NULL);
}

/* Neither object can cross a process boundary or be duplicated: a copy
 * would be a second stand-in for one worker model, outside the pool. */
PyObject *
cs_refuse_pickle(PyObject *self, PyObject *unused)
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

/* ---- StandIn: the live residency board --------------------------------- */

static PyObject *
standin_attach_board(StandInObject *self, PyObject *const *args,
                     Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *argv[2], *model_id = NULL, *result = NULL;
    uint32_t slot = 0;
    uint64_t tag = 0;
    size_t id_len;
    const char *id = cs_model_id(self->record, &id_len);
    cs_module_state *state = cs_state_checked(Py_TYPE(self));
    if (state == NULL ||
        cs_parse_vector(state, CS_SIG_ATTACH_BOARD, args, nargs, kwnames,
                        argv) < 0) {
        return NULL;
    }
    if (argv[1] == NULL) {
        argv[1] = Py_None;
    }
    /* Owned until the board is stored: attaching allocates, and an
     * allocation may run the collector (cs_args_hold). */
    cs_args_hold(argv, 2);
    if (cs_standin_worker(self) == NULL) {
        PyErr_SetString(PyExc_ValueError, "attach_board: stand-in cleared");
        goto done;
    }
    /* The slot's identity is the host's (slot, tag): a slot released and
     * given to another model has a new tag, so this stand-in never reads
     * that model's bytes. */
    model_id = cs_standin_model_id(self); /* for messages */
    if (model_id == NULL ||
        cs_board_attach_model(argv[0], model_id, id, id_len,
                              cs_model_size(self->record), argv[1], &slot,
                              &tag) < 0) {
        goto done;
    }
    /* The attach may have run Python that cleared the stand-in or closed
     * the board. */
    if (cs_standin_worker(self) == NULL) {
        PyErr_SetString(PyExc_ValueError, "attach_board: stand-in cleared");
        goto done;
    }
    if (cs_standin_set_board(self, argv[0], slot, tag) < 0) {
        goto done;
    }
    self->reads_board = 1;
    self->answered = cs_model_version(self->record) - 2; /* answer again */
    result = PyLong_FromUnsignedLong(slot);
done:
    Py_XDECREF(model_id);
    cs_args_release(argv, 2);
    return result;
}

static PyObject *
standin_detach_board(StandInObject *self, PyObject *unused)
{
    self->reads_board = 0;
    cs_standin_drop_board(self);
    return cs_standin_answer_init(self) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *
standin_get_board(StandInObject *self, void *closure)
{
    cs_board_link *board = cs_standin_board(self);
    if (board == NULL) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Ok)", board->object, (unsigned long)board->slot);
}

/* ---- StandIn: attributes ----------------------------------------------- */

/* What a getter's closure points at: which field it reads. */
enum { FIELD_GENERATION, FIELD_PEAK, FIELD_BAD_REPLIES, FIELD_SEQ,
       FIELD_STALE, FIELD_DEFERRED, FIELD_COUNT };
static int fields[FIELD_COUNT] = {0, 1, 2, 3, 4, 5};
static Py_ssize_t profile_items[] = {PROFILE_LOAD, PROFILE_OFFLOAD,
                                     PROFILE_KIND};

/* load_device, offload_device and kind: the closure points at the
 * profile's index; None once GC-cleared. */
static PyObject *
standin_get_profile(StandInObject *self, void *closure)
{
    PyObject *item = cs_profile_item(self, *(const Py_ssize_t *)closure);
    return Py_NewRef(item ? item : Py_None);
}

/* The record's figures: the closure points at the field. */
static PyObject *
standin_get_record(StandInObject *self, void *closure)
{
    cs_receipt r;
    const cs_model *m = self->record;
    switch (*(const int *)closure) {
    case FIELD_GENERATION:
        return PyLong_FromUnsignedLongLong(cs_model_generation(m));
    case FIELD_PEAK:
        return PyLong_FromUnsignedLongLong(cs_model_admission_peak(m));
    case FIELD_BAD_REPLIES:
        return PyLong_FromUnsignedLong(cs_model_bad_replies(m));
    case FIELD_SEQ:
        cs_model_read(m, &r);
        return PyLong_FromLongLong((long long)r.seq); /* -1: none */
    case FIELD_STALE:
        return PyBool_FromLong(cs_model_stale(m));
    default:
        return PyBool_FromLong(cs_model_eviction_deferred(m));
    }
}

/* A stand-in is its own inner module; None once GC-cleared. */
static PyObject *
standin_get_model(StandInObject *self, void *closure)
{
    if (cs_standin_worker(self) == NULL) {
        Py_RETURN_NONE;
    }
    return Py_NewRef(self);
}

static PyObject *
standin_get_sentinel(StandInObject *self, void *closure)
{
    return cs_standin_sentinel_get(self);
}

static PyObject *
standin_get_size(StandInObject *self, void *closure)
{
    return Py_NewRef(self->size_int);
}

static PyObject *
standin_get_worker(StandInObject *self, void *closure)
{
    PyObject *worker = cs_standin_worker(self);
    return Py_NewRef(worker ? worker : Py_None);
}

static PyObject *
standin_get_pool(StandInObject *self, void *closure)
{
    return Py_NewRef(self->pool ? self->pool : Py_None);
}

static PyObject *
standin_get_model_id(StandInObject *self, void *closure)
{
    return cs_standin_model_id(self);
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

/* The parent (no clone chains across a process boundary) and
 * current_weight_patches_uuid. */
static PyObject *
standin_get_none(StandInObject *self, void *closure)
{
    Py_RETURN_NONE;
}

/* model_lowvram: a worker model's lowvram state is the worker's. */
static PyObject *
standin_get_false(StandInObject *self, void *closure)
{
    Py_RETURN_FALSE;
}

/* model_offload_buffer_memory. */
static PyObject *
standin_get_zero(StandInObject *self, void *closure)
{
    return PyLong_FromLong(0);
}

static PyObject *
standin_repr(StandInObject *self)
{
    PyObject *kind = cs_profile_item(self, PROFILE_KIND);
    PyObject *id = cs_standin_model_id(self), *text;
    if (id == NULL) {
        return NULL;
    }
    if (kind == NULL) { /* GC-cleared */
        text = PyUnicode_FromFormat("<StandIn %R (cleared)>", id);
    }
    else {
        text = PyUnicode_FromFormat(
            "<StandIn %R (%U) of worker generation %llu: %llu of %llu "
            "bytes loaded%s>",
            id, kind, (unsigned long long)cs_model_generation(self->record),
            (unsigned long long)cs_standin_loaded(self),
            (unsigned long long)cs_model_size(self->record),
            cs_model_stale(self->record) ? ", stale" : "");
    }
    Py_DECREF(id);
    return text;
}

#define PROFILE(name, index, doc)                                             \
    {name, (getter)standin_get_profile, NULL, doc, &profile_items[index]}
#define RECORD(name, field, doc)                                              \
    {name, (getter)standin_get_record, NULL, doc, &fields[field]}

static PyGetSetDef standin_getset[] = {
    PROFILE("load_device", PROFILE_LOAD,
            "The device the worker loads the model to."),
    PROFILE("offload_device", PROFILE_OFFLOAD,
            "The device the worker offloads the model to."),
    {"parent", (getter)standin_get_none, NULL, "Always None.", NULL},
    {"model", (getter)standin_get_model, NULL,
     "The stand-in itself: it answers what ComfyUI reads on its inner "
     "module.",
     NULL},
    {"device", (getter)cs_inner_get_device, (setter)cs_inner_set_device,
     "load_device while loaded > 0, else offload_device; an assignment "
     "holds until the next receipt.",
     NULL},
    {"model_loaded_weight_memory", (getter)cs_inner_get_loaded,
     (setter)cs_inner_set_loaded,
     "What loaded_size() answers; assigning writes a receipt "
     "(\"assigned\").",
     NULL},
    {"model_lowvram", (getter)standin_get_false, NULL, "Always False.",
     NULL},
    {"current_weight_patches_uuid", (getter)standin_get_none, NULL,
     "Always None.", NULL},
    {"model_offload_buffer_memory", (getter)standin_get_zero, NULL,
     "Always 0.", NULL},
    {"clone_base_uuid", (getter)standin_get_sentinel, NULL,
     "A private per-instance sentinel: never equal to a uuid, None, or "
     "another stand-in's.",
     NULL},
    {"size", (getter)standin_get_size, NULL, "Registered size, bytes.",
     NULL},
    {"worker", (getter)standin_get_worker, NULL, "The worker object.", NULL},
    {"pool", (getter)standin_get_pool, NULL, "The pool keeping its books.",
     NULL},
    RECORD("worker_generation", FIELD_GENERATION,
           "The worker generation this stand-in belongs to."),
    {"model_id", (getter)standin_get_model_id, NULL,
     "The worker's id for the model.", NULL},
    PROFILE("kind", PROFILE_KIND,
            "\"unet\", \"clip\", \"vae\" or \"other\"."),
    RECORD("stale", FIELD_STALE,
           "True once the worker died or restarted: reads as offloaded."),
    {"eviction_deferred", (getter)standin_get_record,
     (setter)standin_set_deferred,
     "True when a live worker refused the last eviction (receipt kept).",
     &fields[FIELD_DEFERRED]},
    RECORD("bad_replies", FIELD_BAD_REPLIES,
           "Malformed replies rejected so far."),
    {"board", (getter)standin_get_board, NULL,
     "(board, slot) when a residency board is attached, else None.", NULL},
    /* comfy-env's own code reads these off its stand-in (pool.py's
     * held-bytes snapshot, state_sync.held_ceiling, the generation filter
     * of the census apply); read-only views so it can run unchanged. */
    {"_worker", (getter)standin_get_worker, NULL,
     "comfy-env compatibility: worker.", NULL},
    RECORD("_worker_generation", FIELD_GENERATION,
           "comfy-env compatibility: worker_generation."),
    {"_model_id", (getter)standin_get_model_id, NULL,
     "comfy-env compatibility: model_id.", NULL},
    PROFILE("_kind", PROFILE_KIND, "comfy-env compatibility: kind."),
    RECORD("_residency_peak", FIELD_PEAK,
           "comfy-env compatibility: the admission peak."),
    RECORD("_residency_seq", FIELD_SEQ,
           "comfy-env compatibility: the receipt's seq (-1: none)."),
    {NULL},
};

static PyMemberDef standin_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(StandInObject, weakreflist),
     READONLY},
    {NULL},
};

static PyMethodDef standin_methods[] = {
    {"__reduce_ex__", cs_refuse_pickle, METH_O,
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
     METH_FASTCALL | METH_KEYWORDS,
     "attach_board($self, /, board, slot=None)\n--\n\nReads residency "
     "from a live board (host side): loaded_size() then returns the "
     "board's reading when valid and newer than the receipt.  slot None "
     "finds or assigns the model's slot.  Returns the slot."},
    {"detach_board", (PyCFunction)standin_detach_board, METH_NOARGS,
     "detach_board($self, /)\n--\n\nBack to receipts only."},
    {"receipt", (PyCFunction)standin_receipt, METH_NOARGS,
     "receipt($self, /)\n--\n\n(loaded, seq or None, age in seconds, "
     "source)."},
    {"partially_load",
     (PyCFunction)(void (*)(void))cs_standin_partially_load,
     METH_FASTCALL | METH_KEYWORDS,
     "partially_load($self, /, device_to, extra_memory=0, "
     "force_patch_weights=False)\n--\n\nAsks the worker to load; returns "
     "the bytes it loaded.  Raises WorkerGoneError on a dead worker."},
    {"partially_unload",
     (PyCFunction)(void (*)(void))cs_standin_partially_unload,
     METH_FASTCALL | METH_KEYWORDS,
     "partially_unload($self, /, device_to=None, memory_to_free=0, "
     "force_patch_weights=False)\n--\n\nAsks the worker to free; returns "
     "exactly the bytes freed.  Never raises an Exception (bad arguments "
     "free nothing); a BaseException propagates."},
    {"detach", (PyCFunction)(void (*)(void))cs_standin_detach,
     METH_FASTCALL | METH_KEYWORDS,
     "detach($self, /, unpatch_all=True)\n--\n\nFull offload; idempotent; "
     "ignores its arguments; never raises an Exception; returns model."},
    {"_worker_gone", (PyCFunction)cs_standin_mark_worker_gone, METH_NOARGS,
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
    {Py_tp_repr, standin_repr},
    {0, NULL},
};

/* Immutable once made (make_type).  On 3.12+ it gets __getattr__; on
 * 3.10 and 3.11 that would cost every method call a bound method. */
#if PY_VERSION_HEX >= 0x030C0000
#define STANDIN_HAS_GETATTR true
#define STANDIN_FLAGS 0
#else
#define STANDIN_HAS_GETATTR false
#define STANDIN_FLAGS Py_TPFLAGS_IMMUTABLETYPE
#endif

static PyType_Spec standin_spec = {
    .name = "comfy_standin._core.StandIn",
    .basicsize = sizeof(StandInObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | STANDIN_FLAGS,
    .slots = standin_slots,
};

int
cs_standin_exec(PyObject *module, cs_module_state *state)
{
    if (cs_inner_exec(module, state) < 0) {
        return -1;
    }
    state->standin_type =
        cs_make_type(module, &standin_spec, STANDIN_HAS_GETATTR);
    if (state->standin_type == NULL) {
        return -1;
    }
    /* Calls of the type go straight to standin_vectorcall (the type is
     * final and immutable; tp_new stays for StandIn.__new__). */
    state->standin_type->tp_vectorcall = standin_vectorcall;
    if (PyModule_AddType(module, state->standin_type) < 0) {
        return -1;
    }
    return cs_sync_exec(module, state);
}
