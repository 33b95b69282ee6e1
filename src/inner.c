/*
 * inner.c -- what a stand-in holds for ComfyUI's reads beside itself: its
 * inner module (`model.model`, weak-referenceable, the device ComfyUI
 * assigns), its clone_base_uuid sentinel, and the residency board the
 * module reads (docs/board.md).  Both are made on a stand-in's first use of
 * them (standin.c); standin.h has their layouts.
 */
#include "standin.h"

#include "board_binding.h"

#include <stdatomic.h>
#include <structmember.h>
#ifdef __linux__
#include <pthread.h>
#endif

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

/* Refused at dump for every protocol (0 and 1 would otherwise reduce it
 * through copyreg and fail only on load). */
static PyMethodDef sentinel_methods[] = {
    {"__reduce_ex__", cs_refuse_pickle, METH_O,
     "__reduce_ex__($self, protocol, /)\n--\n\nRaises TypeError."},
    {"__reduce__", (PyCFunction)cs_refuse_pickle, METH_NOARGS,
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

/* ---- the board an inner module reads ----------------------------------- */

/* The full read: the receipt, or the board's reading when it is valid and
 * newer than the receipt (docs/board.md).  Never blocks: the board read is
 * wait-free with bounded retries, and an untrustworthy board (closed, a
 * slot reassigned since, torn, dead or stale owner) leaves the receipt. */
static void
board_read(ModuleObject *m, cs_board_link *board, cs_receipt *out)
{
    uint64_t loaded, updated_ns;
    cs_model_read(m->record, out);
    if (!cs_model_stale(m->record) &&
        cs_board_object_read(board->object, board->slot, board->tag,
                             cs_model_size(m->record), &loaded,
                             &updated_ns) &&
        updated_ns > out->time_ns) {
        out->loaded = loaded;
        out->time_ns = updated_ns;
        out->source = CS_SOURCE_BOARD;
    }
}

#ifdef __linux__

/* Bumped by Ledger.reread_boards() (the pool, where ComfyUI decides: its
 * boundary and relist) and in a fork() child. */
_Atomic uint64_t cs_board_epoch;

void
cs_standin_reread_boards(void)
{
    atomic_fetch_add_explicit(&cs_board_epoch, 1, memory_order_release);
}

static void
board_epoch_install(void)
{
    (void)pthread_atfork(NULL, NULL, cs_standin_reread_boards);
}

static bool
board_closed(const cs_board_link *board)
{
    return cs_board_object_handle(board->object) == NULL;
}

static uint64_t
board_word(const _Atomic uint64_t *word)
{
    return atomic_load_explicit(word, memory_order_acquire);
}

/* What a verdict on `board` depends on, but the clock. */
static void
board_look(const cs_board_link *board, cs_board *handle,
           const cs_model *record, cs_board_seen *out)
{
    out->version = cs_model_version(record);
    out->seq = board_word(board->seq_word);
    out->heartbeat = board_word(board->heartbeat_word);
    out->owner = board_word(board->owner_word);
    out->changes = board_word(board->changes_word);
    out->epoch = atomic_load_explicit(&cs_board_epoch, memory_order_acquire);
}

static bool
board_seen_same(const cs_board_seen *a, const cs_board_seen *b)
{
    return a->version == b->version && a->seq == b->seq &&
           a->heartbeat == b->heartbeat && a->owner == b->owner &&
           a->changes == b->changes && a->epoch == b->epoch;
}

/* The board's verdict: the one kept while nothing it was decided from
 * moved but the clock (a heartbeat that went stale is noticed at the next
 * reread_boards() at the latest: docs/semantics.md, "Which word wins"),
 * else the full read, kept; in `scratch` when none is kept (a closed
 * board).  Runs no Python. */
static const cs_receipt *
board_decide(ModuleObject *m, cs_board_link *board, cs_receipt *scratch)
{
    cs_board *handle = cs_board_object_handle(board->object);
    if (handle == NULL || handle != board->handle) {
        board_read(m, board, scratch);
        return scratch;
    }
    cs_board_seen now;
    board_look(board, handle, m->record, &now);
    if (!board->decided || !board_seen_same(&now, &board->seen)) {
        board_read(m, board, &board->verdict);
        board->seen = now;
        board->decided = true;
    }
    return &board->verdict;
}

/* Points `board` at the words of its Board's segment. */
static void
board_link_words(cs_board_link *board, cs_board *handle)
{
    size_t length;
    unsigned char *base = cs_board_memory(handle, &length);
    unsigned char *slot = base + CS_BOARD_HEADER_SIZE +
                          (size_t)board->slot * CS_BOARD_SLOT_SIZE;
    board->handle = handle;
    board->seq_word = (const _Atomic uint64_t *)(void *)(
        slot + CS_BOARD_SLOT_OFF_SEQ);
    board->heartbeat_word =
        (const _Atomic uint64_t *)(void *)(base + CS_BOARD_OFF_HEARTBEAT);
    board->owner_word =
        (const _Atomic uint64_t *)(void *)(base + CS_BOARD_OFF_OWNER_PID);
    board->changes_word = cs_board_changes(handle);
}

#else /* no boards off Linux (attach_board refuses) */

void
cs_standin_reread_boards(void)
{
}

static const cs_receipt *
board_decide(ModuleObject *m, cs_board_link *board, cs_receipt *scratch)
{
    board_read(m, board, scratch);
    return scratch;
}

static bool
board_closed(const cs_board_link *board)
{
    return true;
}

#endif

/* What the host knows of the model's residency: the receipt, or the
 * board's verdict when a board is attached.  Fills *out when given; its
 * source is "board" when the board won.  Runs no Python. */
uint64_t
cs_module_read(ModuleObject *m, cs_receipt *out)
{
    cs_receipt local;
    if (m->board == NULL && out == NULL) {
        return cs_model_loaded(m->record);
    }
    if (out == NULL) {
        out = &local;
    }
    if (m->board == NULL) {
        cs_model_read(m->record, out);
    }
    else {
        const cs_receipt *verdict = board_decide(m, m->board, out);
        if (verdict != out) {
            *out = *verdict;
        }
    }
    return out->loaded;
}

bool
cs_module_board_figure(ModuleObject *m, uint64_t *figure)
{
    cs_receipt scratch;
    if (m->board == NULL || board_closed(m->board)) {
        return false;
    }
    *figure = board_decide(m, m->board, &scratch)->loaded;
    return true;
}

int
cs_module_set_board(ModuleObject *m, PyObject *board_obj, uint32_t slot,
                    uint64_t tag)
{
#ifdef __linux__
    cs_board *handle = cs_board_object_handle(board_obj);
    if (handle == NULL) {
        PyErr_SetString(PyExc_ValueError, "attach_board: the board was "
                        "closed");
        return -1;
    }
#endif
    cs_board_link *board = PyMem_Calloc(1, sizeof(cs_board_link));
    if (board == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    board->object = Py_NewRef(board_obj);
    board->slot = slot;
    board->tag = tag;
    board->answered = UINT64_MAX; /* no figure is */
#ifdef __linux__
    board_link_words(board, handle);
#endif
    cs_board_link *old = m->board;
    m->board = board;
    if (old != NULL) {
        PyObject *object = old->object;
        PyMem_Free(old);
        Py_DECREF(object); /* may run Python: last */
    }
    return 0;
}

static uint64_t
module_loaded(ModuleObject *m)
{
    return cs_module_read(m, NULL);
}

PyObject *
cs_module_device(ModuleObject *m)
{
    /* An assignment holds until the next receipt; then the receipt rules. */
    if (m->device_assigned != NULL &&
        cs_model_version(m->record) == m->device_assigned_at) {
        return Py_NewRef(m->device_assigned);
    }
    PyObject *device = module_loaded(m) > 0 ? m->load_device
                                            : m->offload_device;
    return Py_NewRef(device != NULL ? device : Py_None); /* (GC cleared) */
}

void
cs_module_drop_board(ModuleObject *m)
{
    cs_board_link *board = m->board;
    if (board != NULL) {
        PyObject *object = board->object;
        m->board = NULL;
        PyMem_Free(board);
        Py_DECREF(object);
    }
}

static int
module_traverse(ModuleObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->load_device);
    Py_VISIT(self->offload_device);
    Py_VISIT(self->device_assigned);
    if (self->board != NULL) {
        Py_VISIT(self->board->object);
    }
    Py_VISIT(self->sentinel);
    return 0;
}

static int
module_clear(ModuleObject *self)
{
    Py_CLEAR(self->load_device);
    Py_CLEAR(self->offload_device);
    Py_CLEAR(self->device_assigned);
    cs_module_drop_board(self);
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
    return cs_module_device(self);
}

static int
module_set_device(ModuleObject *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "device cannot be deleted");
        return -1;
    }
    Py_XSETREF(self->device_assigned, Py_NewRef(value));
    self->device_assigned_at = cs_model_version(self->record);
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
    {"__reduce_ex__", cs_refuse_pickle, METH_O,
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
    {Py_tp_repr, module_repr},
    {0, NULL},
};

/* Immutable once its __getattr__ is set (make_type). */
static PyType_Spec module_spec = {
    .name = "comfy_standin._core.StandInModule",
    .basicsize = sizeof(ModuleObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = module_slots,
};

/* The module, made on first use; a new reference.  None for a GC-cleared
 * stand-in, NULL with an exception on failure.  Allocation
 * may run the collector, which may run Python that makes the module
 * first or clears this stand-in: whoever made it first wins. */
PyObject *
cs_standin_module_get(StandInObject *self)
{
    if (self->module != NULL) {
        return Py_NewRef(self->module);
    }
    if (cs_standin_worker(self) == NULL) {
        Py_RETURN_NONE;
    }
    cs_module_state *state = cs_state_checked(Py_TYPE(self));
    ModuleObject *m = state == NULL ? NULL
                                    : PyObject_GC_New(ModuleObject,
                                                      state->module_type);
    if (m == NULL) {
        return NULL;
    }
    cs_model_incref(self->record);
    m->record = self->record;
    m->load_device = Py_XNewRef(cs_profile_item(self, PROFILE_LOAD));
    m->offload_device = Py_XNewRef(cs_profile_item(self, PROFILE_OFFLOAD));
    m->device_assigned = NULL;
    m->device_assigned_at = 0;
    m->board = NULL;
    m->sentinel = NULL;
    m->weakreflist = NULL;
    PyObject_GC_Track(m);
    if (self->module != NULL || cs_standin_worker(self) == NULL) {
        Py_DECREF(m);
        return Py_NewRef(self->module ? self->module : Py_None);
    }
    self->module = Py_NewRef((PyObject *)m);
    return (PyObject *)m;
}

/* The clone_base_uuid sentinel, made on first use and kept in the module
 * (made too if need be); as cs_standin_module_get.  None once GC-cleared. */
PyObject *
cs_standin_sentinel_get(StandInObject *self)
{
    PyObject *module = cs_standin_module_get(self);
    if (module == NULL || module == Py_None) {
        return module;
    }
    ModuleObject *m = (ModuleObject *)module;
    if (m->sentinel == NULL) {
        cs_module_state *state = cs_state_checked(Py_TYPE(self));
        SentinelObject *o =
            state == NULL ? NULL
                          : PyObject_GC_New(SentinelObject,
                                            state->sentinel_type);
        if (o == NULL) {
            Py_DECREF(module);
            return NULL;
        }
        o->model_id = cs_standin_model_id(self);
        if (o->model_id == NULL) {
            Py_DECREF(o);
            Py_DECREF(module);
            return NULL;
        }
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


int
cs_inner_exec(PyObject *module, cs_module_state *state)
{
#ifdef __linux__
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    (void)pthread_once(&once, board_epoch_install);
#endif
    state->sentinel_type = (PyTypeObject *)PyType_FromModuleAndSpec(
        module, &sentinel_spec, NULL);
    if (state->sentinel_type == NULL ||
        PyModule_AddType(module, state->sentinel_type) < 0) {
        return -1;
    }
    state->module_type = cs_make_type(module, &module_spec, true);
    if (state->module_type == NULL ||
        PyModule_AddType(module, state->module_type) < 0) {
        return -1;
    }
    return 0;
}
