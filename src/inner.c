/*
 * inner.c -- what a stand-in answers as its own inner module
 * (`model.model` is the stand-in): the device ComfyUI assigns, the
 * residency board it reads (docs/board.md), and its clone_base_uuid
 * sentinel.  They live in the stand-in's `extra`, made on first need;
 * standin.h has the layouts.
 */
#include "standin.h"

#include "board_binding.h"

#include <stdatomic.h>
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

/* ---- the board a stand-in reads ----------------------------------------- */

/* The full read: the receipt, or the board's reading when it is valid and
 * newer than the receipt (docs/board.md).  Never blocks: the board read is
 * wait-free with bounded retries, and an untrustworthy board (closed, a
 * slot reassigned since, torn, dead or stale owner) leaves the receipt. */
static void
board_read(const cs_model *record, cs_board_link *board, cs_receipt *out)
{
    uint64_t loaded, updated_ns;
    cs_model_read(record, out);
    if (!cs_model_stale(record) &&
        cs_board_object_read(board->object, board->slot, board->tag,
                             cs_model_size(record), &loaded,
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
board_decide(const cs_model *record, cs_board_link *board,
             cs_receipt *scratch)
{
    cs_board *handle = cs_board_object_handle(board->object);
    if (handle == NULL || handle != board->handle) {
        board_read(record, board, scratch);
        return scratch;
    }
    cs_board_seen now;
    board_look(board, handle, record, &now);
    if (!board->decided || !board_seen_same(&now, &board->seen)) {
        board_read(record, board, &board->verdict);
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
board_decide(const cs_model *record, cs_board_link *board,
             cs_receipt *scratch)
{
    board_read(record, board, scratch);
    return scratch;
}

static bool
board_closed(const cs_board_link *board)
{
    return true;
}

#endif

/* ---- what the stand-in keeps for them ---------------------------------- */

/* The stand-in's extra, made if need be: NULL with MemoryError.  Runs no
 * Python. */
static cs_standin_extra *
extra_get(StandInObject *self)
{
    if (self->extra == NULL) {
        self->extra = PyMem_Calloc(1, sizeof(cs_standin_extra));
        if (self->extra == NULL) {
            PyErr_NoMemory();
        }
    }
    return self->extra;
}

int
cs_standin_extra_traverse(StandInObject *self, visitproc visit, void *arg)
{
    cs_standin_extra *extra = self->extra;
    if (extra != NULL) {
        Py_VISIT(extra->device_assigned);
        if (extra->board != NULL) {
            Py_VISIT(extra->board->object);
        }
        Py_VISIT(extra->sentinel);
    }
    return 0;
}

void
cs_standin_extra_clear(StandInObject *self)
{
    cs_standin_extra *extra = self->extra;
    if (extra != NULL) {
        self->extra = NULL; /* first: the decrefs may run Python */
        self->reads_board = 0;
        cs_board_link *board = extra->board;
        PyObject *device = extra->device_assigned;
        PyObject *sentinel = extra->sentinel;
        PyMem_Free(extra);
        if (board != NULL) {
            PyObject *object = board->object;
            PyMem_Free(board);
            Py_DECREF(object);
        }
        Py_XDECREF(device);
        Py_XDECREF(sentinel);
    }
}

uint64_t
cs_standin_read(StandInObject *self, cs_receipt *out)
{
    cs_receipt local;
    cs_board_link *board = cs_standin_board(self);
    if (board == NULL && out == NULL) {
        return cs_model_loaded(self->record);
    }
    if (out == NULL) {
        out = &local;
    }
    if (board == NULL) {
        cs_model_read(self->record, out);
    }
    else {
        const cs_receipt *verdict = board_decide(self->record, board, out);
        if (verdict != out) {
            *out = *verdict;
        }
    }
    return out->loaded;
}

bool
cs_standin_board_figure(StandInObject *self, uint64_t *figure)
{
    cs_receipt scratch;
    cs_board_link *board = cs_standin_board(self);
    if (board == NULL || board_closed(board)) {
        return false;
    }
    *figure = board_decide(self->record, board, &scratch)->loaded;
    return true;
}

int
cs_standin_set_board(StandInObject *self, PyObject *board_obj,
                     uint32_t slot, uint64_t tag)
{
#ifdef __linux__
    cs_board *handle = cs_board_object_handle(board_obj);
    if (handle == NULL) {
        PyErr_SetString(PyExc_ValueError, "attach_board: the board was "
                        "closed");
        return -1;
    }
#endif
    cs_standin_extra *extra = extra_get(self);
    if (extra == NULL) {
        return -1;
    }
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
    cs_board_link *old = extra->board;
    extra->board = board;
    if (old != NULL) {
        PyObject *object = old->object;
        PyMem_Free(old);
        Py_DECREF(object); /* may run Python: last */
    }
    return 0;
}

void
cs_standin_drop_board(StandInObject *self)
{
    cs_board_link *board = cs_standin_board(self);
    if (board != NULL) {
        PyObject *object = board->object;
        self->extra->board = NULL;
        PyMem_Free(board);
        Py_DECREF(object);
    }
}

/* ---- device and model_loaded_weight_memory ---------------------------- */

PyObject *
cs_standin_device(StandInObject *self)
{
    /* An assignment holds until the next receipt; then the receipt rules. */
    cs_standin_extra *extra = self->extra;
    if (extra != NULL && extra->device_assigned != NULL &&
        cs_model_version(self->record) == extra->device_assigned_at) {
        return Py_NewRef(extra->device_assigned);
    }
    PyObject *device = cs_profile_item(self, cs_standin_read(self, NULL) > 0
                                                 ? PROFILE_LOAD
                                                 : PROFILE_OFFLOAD);
    return Py_NewRef(device != NULL ? device : Py_None); /* (GC cleared) */
}

PyObject *
cs_inner_get_device(StandInObject *self, void *closure)
{
    return cs_standin_device(self);
}

int
cs_inner_set_device(StandInObject *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "device cannot be deleted");
        return -1;
    }
    cs_standin_extra *extra = extra_get(self);
    if (extra == NULL) {
        return -1;
    }
    Py_XSETREF(extra->device_assigned, Py_NewRef(value));
    extra->device_assigned_at = cs_model_version(self->record);
    return 0;
}

PyObject *
cs_inner_get_loaded(StandInObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(cs_standin_read(self, NULL));
}

int
cs_inner_set_loaded(StandInObject *self, PyObject *value, void *closure)
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

/* ---- the sentinel ------------------------------------------------------- */

/* Made on first use and kept: every read returns the same object.  The
 * allocation may run the collector, which may run Python that makes the
 * sentinel first or clears this stand-in: whoever made it first wins. */
PyObject *
cs_standin_sentinel_get(StandInObject *self)
{
    if (self->extra != NULL && self->extra->sentinel != NULL) {
        return Py_NewRef(self->extra->sentinel);
    }
    if (cs_standin_worker(self) == NULL) {
        Py_RETURN_NONE; /* GC-cleared */
    }
    cs_module_state *state = cs_state_checked(Py_TYPE(self));
    SentinelObject *o = state == NULL
                            ? NULL
                            : PyObject_GC_New(SentinelObject,
                                              state->sentinel_type);
    if (o == NULL) {
        return NULL;
    }
    o->model_id = cs_standin_model_id(self);
    if (o->model_id == NULL) {
        Py_DECREF(o);
        return NULL;
    }
    PyObject_GC_Track(o);
    if (cs_standin_worker(self) == NULL) {
        Py_DECREF(o);
        Py_RETURN_NONE; /* cleared meanwhile */
    }
    cs_standin_extra *extra = extra_get(self);
    if (extra == NULL) {
        Py_DECREF(o);
        return NULL;
    }
    if (extra->sentinel == NULL) {
        extra->sentinel = (PyObject *)o;
    }
    else {
        Py_DECREF(o); /* made first by Python the allocation ran */
    }
    return Py_NewRef(extra->sentinel);
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
    return 0;
}
