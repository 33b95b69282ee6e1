/*
 * board_binding.c -- comfy_standin._core.Board, the Python face of the
 * residency board core (include/comfy_standin/board.h, docs/board.md).
 *
 * A Board object owns one core handle.  Thread safety: the handle is
 * immutable after creation except for what the core guards itself; the
 * only Python-level state is `board` (the handle pointer), which close()
 * clears under the GIL *before* releasing the GIL, so no other thread can
 * pick up a handle that is being closed, and `waiting`.  Nothing here
 * waits with the GIL held: the calls that can wait (a publish another
 * writer holds up, adding or removing a sampler, close) release it.  Not
 * claimed safe for the free-threaded build yet.
 */
#include "board_binding.h"

#include <structmember.h>

#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef __linux__

#define BOARD_DOC_NAME "comfy_standin.Board"

/* Raises the exception that says what `status` means for `what`: a call
 * on `board`, or (NULL) the making or the adoption of one. */
static void
board_raise(cs_board_status status, int os_error, const char *what,
            const cs_board *board)
{
    const char *message = cs_board_status_message(status);
    switch (status) {
    case CS_BOARD_ERR_SYSTEM:
        errno = os_error;
        PyErr_SetFromErrno(PyExc_OSError);
        return;
    case CS_BOARD_ERR_NOMEM:
        PyErr_NoMemory();
        return;
    case CS_BOARD_ERR_RANGE:
        PyErr_Format(PyExc_IndexError, "%s: %s", what, message);
        return;
    case CS_BOARD_ERR_MAGIC:
    case CS_BOARD_ERR_VERSION:
    case CS_BOARD_ERR_SIZE:
    case CS_BOARD_ERR_SEALS:
        PyErr_Format(PyExc_ValueError, "%s: board refused: %s", what,
                     message);
        return;
    case CS_BOARD_ERR_ROLE: {
        bool host = board != NULL && cs_board_is_host(board);
        PyErr_Format(PyExc_RuntimeError,
                     "%s is a %s call; this is the %s side of board %s",
                     what, host ? "worker" : "host", host ? "host" : "worker",
                     board != NULL ? cs_board_name(board) : "?");
        return;
    }
    default:
        PyErr_Format(PyExc_RuntimeError, "%s: %s", what, message);
        return;
    }
}

static cs_board *
board_handle(BoardObject *self, const char *what)
{
    if (self->board == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: the board is closed", what);
    }
    return self->board;
}

/* A byte count or pid: an int (not a bool) in [0, max]. */
static int
board_u64_arg(PyObject *obj, const char *what, const char *arg,
              uint64_t max, uint64_t *out)
{
    char field[96];
    if (cs_value_check(obj, max, out) == 0) {
        return 0; /* the hot path: no message built */
    }
    PyOS_snprintf(field, sizeof(field), "%s: %s", what, arg);
    return cs_value_in_range(obj, field, NULL, 0, max, out);
}

/* A slot index of this board (IndexError when out of range). */
static int
board_slot_arg(cs_board *board, PyObject *obj, const char *what,
               uint32_t *slot)
{
    char field[96];
    uint64_t value = 0;
    uint32_t count = cs_board_slot_count(board);
    if (cs_value_check(obj, (uint64_t)count - 1, &value) == 0) {
        *slot = (uint32_t)value; /* the hot path: no message built */
        return 0;
    }
    PyOS_snprintf(field, sizeof(field), "%s: slot", what);
    if (cs_value_in_range(obj, field, PyExc_IndexError, 0,
                          (uint64_t)cs_board_slot_count(board) - 1,
                          &value) < 0) {
        return -1;
    }
    *slot = (uint32_t)value;
    return 0;
}

/* Refuses a handle inherited across fork() for anything but close. */
static int
board_own(cs_board *board, const char *what)
{
    if (!cs_board_is_own(board)) {
        PyErr_Format(PyExc_RuntimeError, "%s: %s", what,
                     cs_board_status_message(CS_BOARD_ERR_FORKED));
        return -1;
    }
    return 0;
}

static PyObject *
board_wrap(PyTypeObject *type, cs_board *board)
{
    BoardObject *self = PyObject_New(BoardObject, type);
    if (self == NULL) {
        cs_board_close(board);
        return NULL;
    }
    self->board = board;
    atomic_init(&self->waiting, 0);
    self->weakreflist = NULL;
    return (PyObject *)self;
}

/* ---- construction ---------------------------------------------------- */

/* A heartbeat limit argument into *out_ns: None is no check (0), absent
 * (NULL) keeps *out_ns, else seconds in the allowed range.  0, or -1. */
static int
board_limit_arg(PyObject *obj, const char *field, uint64_t *out_ns)
{
    if (obj == Py_None) {
        *out_ns = 0;
        return 0;
    }
    if (obj == NULL) {
        return 0;
    }
    return cs_seconds_in_range(obj, field, CS_BOARD_HEARTBEAT_LIMIT_MIN_NS,
                               CS_BOARD_HEARTBEAT_LIMIT_MAX_NS, out_ns);
}

/* Board.adopt(fd, slots, *, generation=0, heartbeat_limit=5.0): the host
 * side of a board its worker made (cs_board_adopt). */
static PyObject *
Board_adopt(PyTypeObject *type, PyObject *const *args, Py_ssize_t nargs,
            PyObject *kwnames)
{
    PyObject *argv[4];
    uint64_t fd = 0, slots = 0, generation = 0;
    uint64_t limit = CS_BOARD_DEFAULT_HEARTBEAT_LIMIT_NS;
    cs_module_state *state = cs_state_checked(type);
    /* The arguments are read before the GIL is released and not used
     * after, so borrowed keyword values cannot go stale under them. */
    if (state == NULL ||
        cs_parse_vector(state, CS_SIG_BOARD_ADOPT, args, nargs, kwnames,
                        argv) < 0 ||
        cs_value_in_range(argv[0], "Board.adopt(): fd", NULL, 0, INT_MAX,
                          &fd) < 0 ||
        cs_value_in_range(argv[1], "Board.adopt(): slots", NULL, 1,
                          CS_BOARD_MAX_SLOTS, &slots) < 0 ||
        (argv[2] != NULL &&
         cs_value_in_range(argv[2], "Board.adopt(): generation", NULL, 0,
                           CS_BOARD_VALUE_MAX, &generation) < 0) ||
        board_limit_arg(argv[3], "Board.adopt(): heartbeat_limit",
                        &limit) < 0) {
        return NULL;
    }
    cs_board *board = NULL;
    int os_error = 0;
    cs_board_status status;
    Py_BEGIN_ALLOW_THREADS
    status = cs_board_adopt((int)fd, (uint32_t)slots, generation, limit,
                            &board, &os_error);
    Py_END_ALLOW_THREADS
    if (status != CS_BOARD_OK) {
        board_raise(status, os_error, "Board.adopt()", NULL);
        return NULL;
    }
    return board_wrap(type, board);
}

/* Board.make(slots=64, *, generation=0): the worker side of a board this
 * process makes for its host to adopt; returns (board, fd). */
static PyObject *
Board_make(PyTypeObject *type, PyObject *const *args, Py_ssize_t nargs,
           PyObject *kwnames)
{
    PyObject *argv[2];
    uint64_t slots = 64, generation = 0;
    cs_module_state *state = cs_state_checked(type);
    if (state == NULL ||
        cs_parse_vector(state, CS_SIG_BOARD_MAKE, args, nargs, kwnames,
                        argv) < 0 ||
        (argv[0] != NULL &&
         cs_value_in_range(argv[0], "Board.make(): slots", NULL, 1,
                           CS_BOARD_MAX_SLOTS, &slots) < 0) ||
        (argv[1] != NULL &&
         cs_value_in_range(argv[1], "Board.make(): generation", NULL, 0,
                           CS_BOARD_VALUE_MAX, &generation) < 0)) {
        return NULL;
    }
    cs_board *board = NULL;
    int fd = -1, os_error = 0;
    cs_board_status status;
    Py_BEGIN_ALLOW_THREADS
    status = cs_board_make((uint32_t)slots, generation, &board, &fd,
                           &os_error);
    Py_END_ALLOW_THREADS
    if (status != CS_BOARD_OK) {
        board_raise(status, os_error, "Board.make()", NULL);
        return NULL;
    }
    PyObject *fd_obj = PyLong_FromLong(fd);
    if (fd_obj == NULL) {
        (void)close(fd);
        cs_board_close(board);
        return NULL;
    }
    PyObject *wrapped = board_wrap(type, board); /* closes it on failure */
    if (wrapped == NULL) {
        (void)close(fd);
        Py_DECREF(fd_obj);
        return NULL;
    }
    PyObject *pair = PyTuple_Pack(2, wrapped, fd_obj);
    Py_DECREF(wrapped);
    Py_DECREF(fd_obj);
    if (pair == NULL) {
        (void)close(fd); /* the board goes with `wrapped` */
    }
    return pair;
}

/* Closes the handle (idempotent).  The pointer is cleared first, under the
 * GIL, so no new call takes it; then, without the GIL, the calls still
 * waiting with it come back (each wait is bounded) and the sampler thread
 * is joined. */
static void
board_close_handle(BoardObject *self)
{
    cs_board *board = self->board;
    self->board = NULL;
    if (board != NULL) {
        Py_BEGIN_ALLOW_THREADS
        while (atomic_load_explicit(&self->waiting, memory_order_acquire)) {
            (void)sched_yield();
        }
        cs_board_close(board);
        Py_END_ALLOW_THREADS
    }
}

static void
Board_dealloc(PyObject *op)
{
    BoardObject *self = (BoardObject *)op;
    PyTypeObject *type = Py_TYPE(op);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs(op);
    }
    board_close_handle(self);
    type->tp_free(op);
    Py_DECREF(type);
}

/* The handle of Board `obj`, borrowed: NULL with TypeError (not a Board)
 * or ValueError (closed). */
static cs_board *
board_from_object(PyObject *obj)
{
    /* Board is final (no Py_TPFLAGS_BASETYPE), so its dealloc identifies
     * it without reaching for the module state. */
    if (obj == NULL || Py_TYPE(obj)->tp_dealloc != Board_dealloc) {
        PyErr_Format(PyExc_TypeError, "expected a %s, got %.100s",
                     BOARD_DOC_NAME,
                     obj ? Py_TYPE(obj)->tp_name : "NULL");
        return NULL;
    }
    return board_handle((BoardObject *)obj, BOARD_DOC_NAME);
}

bool
cs_board_object_read(PyObject *board_obj, uint32_t slot, uint64_t tag,
                     uint64_t size, uint64_t *loaded, uint64_t *updated_ns)
{
    if (board_obj == NULL || Py_TYPE(board_obj)->tp_dealloc != Board_dealloc) {
        return false;
    }
    cs_board *board = ((BoardObject *)board_obj)->board;
    return board != NULL &&
           cs_board_read_slot(board, slot, tag, size, loaded, updated_ns);
}

int
cs_board_attach_model(PyObject *board_obj, PyObject *model_id,
                      const char *id, size_t id_len, uint64_t size,
                      PyObject *slot_obj, uint32_t *slot, uint64_t *tag)
{
    uint32_t found = 0;
    cs_board *board = board_from_object(board_obj);
    if (board == NULL) {
        return -1;
    }
    if (!cs_board_is_host(board)) {
        PyErr_Format(PyExc_ValueError,
                     "attach_board: model %R needs the host's side of the "
                     "board (Board.adopt), got a worker's handle",
                     model_id);
        return -1;
    }
    if (board_own(board, "attach_board") < 0) {
        return -1;
    }
    if (slot_obj == Py_None) {
        cs_board_status status =
            cs_board_find(board, id, id_len, slot) == CS_BOARD_OK
                ? CS_BOARD_OK
                : cs_board_assign(board, id, id_len, size, slot);
        if (status != CS_BOARD_OK) {
            PyErr_Format(PyExc_ValueError,
                         "attach_board: no slot for model %R: %s", model_id,
                         cs_board_status_message(status));
            return -1;
        }
    }
    else {
        uint64_t value = 0;
        if (cs_value_in_range(slot_obj, "attach_board: slot", NULL, 0,
                              UINT32_MAX, &value) < 0) {
            return -1;
        }
        *slot = (uint32_t)value;
        if (cs_board_find(board, id, id_len, &found) != CS_BOARD_OK ||
            found != *slot) {
            PyErr_Format(PyExc_ValueError,
                         "attach_board: slot %R of the board does not carry "
                         "model %R", slot_obj, model_id);
            return -1;
        }
    }
    if (cs_board_assigned_size(board, *slot) != size) {
        PyErr_Format(PyExc_ValueError,
                     "attach_board: slot %lu is assigned %llu bytes, model "
                     "%R has %llu", (unsigned long)*slot,
                     (unsigned long long)cs_board_assigned_size(board, *slot),
                     model_id, (unsigned long long)size);
        return -1;
    }
    *tag = cs_board_tag(board, *slot);
    return 0;
}

/* ---- methods --------------------------------------------------------- */

/* What each method checks before its own work, one row each: the open
 * handle, its positional arguments, the side of the board it belongs to,
 * and args[0] as a slot of this board.  board_begin() runs the row. */
typedef enum { ANY_SIDE, HOST_SIDE } board_side;

typedef struct {
    const char *what; /* "Board.tag()": every message names the call */
    const char *args; /* "(slot, tag)": the arity message's */
    board_side side;
    int8_t min, max;  /* positional arguments */
    bool slot;        /* args[0] is a slot of this board */
} board_call;

enum {
    CALL_ENTER, CALL_ASSIGN, CALL_RELEASE, CALL_TAG,
    CALL_WORKER_GONE, CALL_POLL_OWNER, CALL_BIND, CALL_ASSIGNED_SIZE,
    CALL_FIND, CALL_PUBLISH, CALL_HEARTBEAT, CALL_READ, CALL_STATUS,
    CALL_ADD_SAMPLER, CALL_REMOVE_SAMPLER, CALL_COUNT
};

static const board_call board_calls[CALL_COUNT] = {
    [CALL_ENTER] = {"Board.__enter__()", "", ANY_SIDE, 0, 0, false},
    [CALL_ASSIGN] = {"Board.assign()", "(model_id, size)", ANY_SIDE, 2, 2,
                     false},
    [CALL_RELEASE] = {"Board.release()", "", ANY_SIDE, 1, 1, true},
    [CALL_TAG] = {"Board.tag()", "", HOST_SIDE, 1, 1, true},
    [CALL_WORKER_GONE] = {"Board.worker_gone()", "", HOST_SIDE, 0, 0,
                          false},
    [CALL_POLL_OWNER] = {"Board.poll_owner()", "", HOST_SIDE, 0, 0, false},
    [CALL_BIND] = {"Board.bind()", "(slot, tag)", ANY_SIDE, 2, 2, true},
    [CALL_ASSIGNED_SIZE] = {"Board.assigned_size()", "", ANY_SIDE, 1, 1,
                            true},
    [CALL_FIND] = {"Board.find()", "", ANY_SIDE, 1, 1, false},
    [CALL_PUBLISH] = {"Board.publish()", "(slot, loaded)", ANY_SIDE, 2, 2,
                      true},
    [CALL_HEARTBEAT] = {"Board.heartbeat()", "", ANY_SIDE, 0, 0, false},
    [CALL_READ] = {"Board.read()", "(slot, size=None, tag=None)",
                   HOST_SIDE, 1, 3, true},
    [CALL_STATUS] = {"Board.status()", "(slot, size=None, tag=None)",
                     HOST_SIDE, 1, 3, true},
    [CALL_ADD_SAMPLER] = {"Board.add_sampler()",
                          "(slot, fn_address, ctx_address=0)", ANY_SIDE, 2,
                          3, true},
    [CALL_REMOVE_SAMPLER] = {"Board.remove_sampler()", "", ANY_SIDE, 1, 1,
                             true},
};

/* Runs row `id` of board_calls for a call with `args` (a METH_O method
 * passes its one argument, a METH_NOARGS one none): the board, with
 * *slot set when the row reads one, or NULL with the exception that says
 * what did not fit. */
static cs_board *
board_begin(PyObject *op, int id, PyObject *const *args, Py_ssize_t nargs,
            uint32_t *slot)
{
    const board_call *call = &board_calls[id];
    cs_board *board = board_handle((BoardObject *)op, call->what);
    *slot = 0;
    if (board == NULL) {
        return NULL;
    }
    if (nargs < call->min || nargs > call->max) {
        if (call->min == call->max) {
            PyErr_Format(PyExc_TypeError, "%s takes %d arguments %s, got %zd",
                         call->what, call->min, call->args, nargs);
        }
        else {
            PyErr_Format(PyExc_TypeError,
                         "%s takes %d to %d arguments %s, got %zd",
                         call->what, call->min, call->max, call->args,
                         nargs);
        }
        return NULL;
    }
    if (call->side == HOST_SIDE && !cs_board_is_host(board)) {
        board_raise(CS_BOARD_ERR_ROLE, 0, call->what, board);
        return NULL;
    }
    /* A slot row's min is at least 1: args[0] exists. */
    if (call->slot && nargs > 0
        && board_slot_arg(board, args[0], call->what, slot) < 0) {
        return NULL;
    }
    return board;
}

/* None, or the exception `status` means for the row's call. */
static PyObject *
board_done(cs_board *board, int id, cs_board_status status, int os_error)
{
    if (status != CS_BOARD_OK) {
        board_raise(status, os_error, board_calls[id].what, board);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Board_close(PyObject *op, PyObject *unused)
{
    board_close_handle((BoardObject *)op);
    Py_RETURN_NONE;
}

static PyObject *
Board_enter(PyObject *op, PyObject *unused)
{
    uint32_t slot;
    if (board_begin(op, CALL_ENTER, NULL, 0, &slot) == NULL) {
        return NULL;
    }
    return Py_NewRef(op);
}

static PyObject *
Board_exit(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    board_close_handle((BoardObject *)op);
    Py_RETURN_FALSE;
}

/* A model id argument: its UTF-8, or NULL with TypeError naming `what`. */
static const char *
board_id_arg(PyObject *obj, const char *what, Py_ssize_t *len)
{
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: model_id must be a str, not %.100s",
                     what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return PyUnicode_AsUTF8AndSize(obj, len);
}

static PyObject *
Board_assign(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    const char *what = board_calls[CALL_ASSIGN].what;
    uint32_t slot = 0;
    uint64_t size;
    Py_ssize_t id_len;
    cs_board *board = board_begin(op, CALL_ASSIGN, args, nargs, &slot);
    const char *id = board ? board_id_arg(args[0], what, &id_len) : NULL;
    if (id == NULL || board_own(board, what) < 0 ||
        board_u64_arg(args[1], what, "size", CS_BOARD_VALUE_MAX, &size) < 0) {
        return NULL;
    }
    cs_board_status status = cs_board_assign(board, id, (size_t)id_len, size,
                                             &slot);
    if (status == CS_BOARD_ERR_SIZE) {
        uint32_t have = 0;
        (void)cs_board_find(board, id, (size_t)id_len, &have);
        PyErr_Format(PyExc_ValueError,
                     "%s: %R already has slot %u with size %llu, not %llu",
                     what, args[0], (unsigned)have,
                     (unsigned long long)cs_board_assigned_size(board, have),
                     (unsigned long long)size);
        return NULL;
    }
    if (status != CS_BOARD_OK) {
        return board_done(board, CALL_ASSIGN, status, 0);
    }
    return PyLong_FromUnsignedLong(slot);
}

static PyObject *
Board_release(PyObject *op, PyObject *arg)
{
    uint32_t slot;
    cs_board *board = board_begin(op, CALL_RELEASE, &arg, 1, &slot);
    return board == NULL ? NULL
                         : board_done(board, CALL_RELEASE,
                                      cs_board_release(board, slot), 0);
}

static PyObject *
Board_tag(PyObject *op, PyObject *arg)
{
    uint32_t slot;
    cs_board *board = board_begin(op, CALL_TAG, &arg, 1, &slot);
    return board == NULL
               ? NULL
               : PyLong_FromUnsignedLongLong(cs_board_tag(board, slot));
}

static PyObject *
Board_worker_gone(PyObject *op, PyObject *unused)
{
    uint32_t slot;
    cs_board *board = board_begin(op, CALL_WORKER_GONE, NULL, 0, &slot);
    if (board == NULL) {
        return NULL;
    }
    cs_board_owner_gone(board);
    Py_RETURN_NONE;
}

static PyObject *
Board_poll_owner(PyObject *op, PyObject *unused)
{
    uint32_t slot;
    cs_board *board = board_begin(op, CALL_POLL_OWNER, NULL, 0, &slot);
    return board == NULL ? NULL
                         : PyBool_FromLong(cs_board_poll_owner(board));
}

static PyObject *
Board_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t slot;
    uint64_t tag;
    cs_board *board = board_begin(op, CALL_BIND, args, nargs, &slot);
    if (board == NULL ||
        board_u64_arg(args[1], board_calls[CALL_BIND].what, "tag",
                      CS_BOARD_VALUE_MAX, &tag) < 0) {
        return NULL;
    }
    return board_done(board, CALL_BIND, cs_board_bind(board, slot, tag), 0);
}

static PyObject *
Board_assigned_size(PyObject *op, PyObject *arg)
{
    uint32_t slot;
    cs_board *board = board_begin(op, CALL_ASSIGNED_SIZE, &arg, 1, &slot);
    if (board == NULL) {
        return NULL;
    }
    uint64_t size = cs_board_assigned_size(board, slot);
    if (size == 0 && !cs_board_is_host(board)) {
        Py_RETURN_NONE;
    }
    return PyLong_FromUnsignedLongLong(size);
}

static PyObject *
Board_find(PyObject *op, PyObject *arg)
{
    uint32_t slot;
    Py_ssize_t id_len;
    cs_board *board = board_begin(op, CALL_FIND, &arg, 1, &slot);
    const char *id =
        board ? board_id_arg(arg, board_calls[CALL_FIND].what, &id_len)
              : NULL;
    if (id == NULL) {
        return NULL;
    }
    cs_board_status status = cs_board_find(board, id, (size_t)id_len, &slot);
    if (status == CS_BOARD_ERR_RANGE) {
        Py_RETURN_NONE;
    }
    if (status != CS_BOARD_OK) {
        /* A worker (the segment holds no ids) or a forked child. */
        return board_done(board, CALL_FIND, status, 0);
    }
    return PyLong_FromUnsignedLong(slot);
}

/* How long Board.publish waits for another writer of the slot. */
#define PUBLISH_WAIT_NS UINT64_C(100000000)

static uint64_t
board_now_ns(void)
{
    struct timespec ts;
    (void)clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

static PyObject *
Board_publish(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    BoardObject *self = (BoardObject *)op;
    uint32_t slot;
    uint64_t loaded;
    cs_board *board = board_begin(op, CALL_PUBLISH, args, nargs, &slot);
    if (board == NULL ||
        board_u64_arg(args[1], board_calls[CALL_PUBLISH].what, "loaded",
                      CS_BOARD_VALUE_MAX, &loaded) < 0) {
        return NULL;
    }
    cs_board_status status = cs_board_publish(board, slot, loaded);
    bool waited = status == CS_BOARD_ERR_BUSY;
    if (waited) {
        /* Another thread of this worker is inside the slot's write (the
         * sampler thread, preempted there): wait for it, bounded, without
         * the GIL. */
        atomic_fetch_add_explicit(&self->waiting, 1, memory_order_relaxed);
        Py_BEGIN_ALLOW_THREADS
        uint64_t give_up = board_now_ns() + PUBLISH_WAIT_NS;
        do {
            (void)sched_yield();
            status = cs_board_publish(board, slot, loaded);
        } while (status == CS_BOARD_ERR_BUSY && board_now_ns() < give_up);
        Py_END_ALLOW_THREADS
    }
    PyObject *result = board_done(board, CALL_PUBLISH, status, 0);
    if (waited) {
        atomic_fetch_sub_explicit(&self->waiting, 1, memory_order_release);
    }
    return result;
}

static PyObject *
Board_heartbeat(PyObject *op, PyObject *unused)
{
    uint32_t slot;
    cs_board *board = board_begin(op, CALL_HEARTBEAT, NULL, 0, &slot);
    return board == NULL ? NULL
                         : board_done(board, CALL_HEARTBEAT,
                                      cs_board_heartbeat(board), 0);
}

/* read() and status(): (slot, size=None, tag=None) after the row's
 * checks; the size defaults to the slot's assigned size. */
static cs_board *
board_read_args(PyObject *op, int id, PyObject *const *args,
                Py_ssize_t nargs, uint32_t *slot, uint64_t *size,
                uint64_t *tag)
{
    const char *what = board_calls[id].what;
    cs_board *board = board_begin(op, id, args, nargs, slot);
    if (board == NULL) {
        return NULL;
    }
    *tag = 0;
    if (nargs == 3 && args[2] != Py_None &&
        board_u64_arg(args[2], what, "tag", CS_BOARD_VALUE_MAX, tag) < 0) {
        return NULL;
    }
    if (nargs >= 2 && args[1] != Py_None) {
        return board_u64_arg(args[1], what, "size", CS_BOARD_VALUE_MAX,
                             size) < 0
                   ? NULL
                   : board;
    }
    *size = cs_board_assigned_size(board, *slot);
    return board;
}

static PyObject *
Board_read(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t slot;
    uint64_t size, loaded, stamp, tag;
    cs_board *board = board_read_args(op, CALL_READ, args, nargs, &slot,
                                      &size, &tag);
    if (board == NULL) {
        return NULL;
    }
    if (!cs_board_read_slot(board, slot, tag, size, &loaded, &stamp)) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(KK)", (unsigned long long)loaded,
                         (unsigned long long)stamp);
}

static PyObject *
Board_status(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t slot;
    uint64_t size, loaded, stamp, tag;
    cs_board *board = board_read_args(op, CALL_STATUS, args, nargs, &slot,
                                      &size, &tag);
    if (board == NULL) {
        return NULL;
    }
    cs_board_reading reading = cs_board_read_slot_status(
        board, slot, tag, size, &loaded, &stamp);
    return PyUnicode_FromString(cs_board_reading_name(reading));
}

/* An address argument of add_sampler: 0, or -1 with an exception. */
static int
board_address_arg(PyObject *obj, const char *what, bool required,
                  void **out)
{
    *out = NULL;
    if (!required && (obj == NULL || obj == Py_None)) {
        return 0;
    }
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "%s: fn_address and ctx_address must be int addresses "
                     "(e.g. ctypes.cast(f, ctypes.c_void_p).value)", what);
        return -1;
    }
    *out = PyLong_AsVoidPtr(obj);
    if (*out != NULL || PyErr_Occurred()) {
        return *out == NULL ? -1 : 0;
    }
    if (required) {
        PyErr_Format(PyExc_ValueError, "%s: fn_address is NULL", what);
        return -1;
    }
    return 0;
}

static PyObject *
Board_add_sampler(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    BoardObject *self = (BoardObject *)op;
    const char *what = board_calls[CALL_ADD_SAMPLER].what;
    uint32_t slot;
    void *fn_address, *context;
    cs_board *board = board_begin(op, CALL_ADD_SAMPLER, args, nargs, &slot);
    if (board == NULL ||
        board_address_arg(args[1], what, true, &fn_address) < 0 ||
        board_address_arg(nargs == 3 ? args[2] : NULL, what, false,
                          &context) < 0) {
        return NULL;
    }
    /* POSIX guarantees data and function pointers convert; C11 does not
     * say so, hence the copy. */
    cs_board_sampler_fn fn;
    static_assert(sizeof(fn) == sizeof(fn_address), "function pointers");
    memcpy(&fn, &fn_address, sizeof(fn));
    int os_error = 0;
    cs_board_status status;
    /* Waits for a running sampler pass, without the GIL. */
    atomic_fetch_add_explicit(&self->waiting, 1, memory_order_relaxed);
    Py_BEGIN_ALLOW_THREADS
    status = cs_board_add_sampler(board, slot, fn, context, &os_error);
    Py_END_ALLOW_THREADS
    PyObject *result = board_done(board, CALL_ADD_SAMPLER, status, os_error);
    atomic_fetch_sub_explicit(&self->waiting, 1, memory_order_release);
    return result;
}

static PyObject *
Board_remove_sampler(PyObject *op, PyObject *arg)
{
    BoardObject *self = (BoardObject *)op;
    uint32_t slot;
    cs_board_status status;
    cs_board *board = board_begin(op, CALL_REMOVE_SAMPLER, &arg, 1, &slot);
    if (board == NULL) {
        return NULL;
    }
    /* Waits for a running sampler pass, without the GIL. */
    atomic_fetch_add_explicit(&self->waiting, 1, memory_order_relaxed);
    Py_BEGIN_ALLOW_THREADS
    status = cs_board_remove_sampler(board, slot);
    Py_END_ALLOW_THREADS
    PyObject *result = board_done(board, CALL_REMOVE_SAMPLER, status, 0);
    atomic_fetch_sub_explicit(&self->waiting, 1, memory_order_release);
    return result;
}

static PyObject *
Board_repr(PyObject *op)
{
    BoardObject *self = (BoardObject *)op;
    if (self->board == NULL) {
        return PyUnicode_FromString("<comfy_standin.Board closed>");
    }
    cs_board *board = self->board;
    return PyUnicode_FromFormat(
        "<comfy_standin.Board %s %s slots=%u generation=%llu%s>",
        cs_board_is_host(board) ? "host" : "worker", cs_board_name(board),
        (unsigned)cs_board_slot_count(board),
        (unsigned long long)cs_board_generation(board),
        cs_board_attached(board) ? " attached" : "");
}

/* ---- properties ------------------------------------------------------ */

/* The read-only values of an open board, one getter for all: its closure
 * is the value's row here. */
enum {
    VALUE_NAME, VALUE_OWNER_IS_GONE, VALUE_IS_HOST, VALUE_SLOTS,
    VALUE_GENERATION, VALUE_ATTACHED, VALUE_OWNER_PID,
    VALUE_HEARTBEAT_LIMIT, VALUE_SAMPLER_PASSES, VALUE_COUNT
};

static const char *const board_value_names[VALUE_COUNT] = {
    [VALUE_NAME] = "Board.name",
    [VALUE_OWNER_IS_GONE] = "Board.owner_is_gone",
    [VALUE_IS_HOST] = "Board.is_host",
    [VALUE_SLOTS] = "Board.slots",
    [VALUE_GENERATION] = "Board.generation",
    [VALUE_ATTACHED] = "Board.attached",
    [VALUE_OWNER_PID] = "Board.owner_pid",
    [VALUE_HEARTBEAT_LIMIT] = "Board.heartbeat_limit",
    [VALUE_SAMPLER_PASSES] = "Board.sampler_passes",
};

/* An int, or None when it is not positive (no owner). */
static PyObject *
positive_or_none(int64_t value)
{
    if (value <= 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong(value);
}

static PyObject *
Board_get_value(PyObject *op, void *closure)
{
    int which = (int)((const char *const *)closure - board_value_names);
    cs_board *board = board_handle((BoardObject *)op,
                                   board_value_names[which]);
    if (board == NULL) {
        return NULL;
    }
    bool host = cs_board_is_host(board);
    uint64_t limit;
    switch (which) {
    case VALUE_NAME:
        return PyUnicode_FromString(cs_board_name(board));
    case VALUE_OWNER_IS_GONE:
        return PyBool_FromLong(host && cs_board_owner_is_gone(board));
    case VALUE_IS_HOST:
        return PyBool_FromLong(host);
    case VALUE_SLOTS:
        return PyLong_FromUnsignedLong(cs_board_slot_count(board));
    case VALUE_GENERATION:
        return PyLong_FromUnsignedLongLong(cs_board_generation(board));
    case VALUE_ATTACHED:
        return PyBool_FromLong(cs_board_attached(board));
    case VALUE_OWNER_PID:
        return positive_or_none(cs_board_owner_pid(board));
    case VALUE_HEARTBEAT_LIMIT:
        limit = cs_board_heartbeat_limit(board);
        return !host || limit == 0 ? Py_NewRef(Py_None)
                                   : PyFloat_FromDouble((double)limit / 1e9);
    default: /* VALUE_SAMPLER_PASSES */
        return PyLong_FromUnsignedLongLong(cs_board_sampler_passes(board));
    }
}

static PyObject *
Board_get_closed(PyObject *op, void *closure)
{
    return PyBool_FromLong(((BoardObject *)op)->board == NULL);
}

static PyObject *
Board_get_expected_owner(PyObject *op, void *closure)
{
    cs_board *board = board_handle((BoardObject *)op, "Board.expected_owner");
    if (board == NULL) {
        return NULL;
    }
    int64_t pid = cs_board_expected_owner(board);
    if (pid == 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong(pid);
}

static int
Board_set_expected_owner(PyObject *op, PyObject *value, void *closure)
{
    const char *what = "Board.expected_owner";
    cs_board *board = board_handle((BoardObject *)op, what);
    if (board == NULL) {
        return -1;
    }
    uint64_t pid = 0;
    if (value != NULL && value != Py_None &&
        board_u64_arg(value, what, "pid", INT32_MAX, &pid) < 0) {
        return -1;
    }
    cs_board_expect_owner(board, (int64_t)pid);
    return 0;
}

static PyObject *
Board_get_period(PyObject *op, void *closure)
{
    cs_board *board = board_handle((BoardObject *)op, "Board.period");
    if (board == NULL) {
        return NULL;
    }
    return PyFloat_FromDouble((double)cs_board_period(board) / 1e9);
}

static int
Board_set_period(PyObject *op, PyObject *value, void *closure)
{
    const char *what = "Board.period";
    cs_board *board = board_handle((BoardObject *)op, what);
    uint64_t period;
    if (board == NULL) {
        return -1;
    }
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "Board.period: cannot delete");
        return -1;
    }
    if (cs_seconds_in_range(value, what, UINT64_C(1000000),
                            UINT64_C(3600000000000), &period) < 0) {
        return -1;
    }
    if (cs_board_set_period(board, period) != CS_BOARD_OK) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be in [0.001, 3600] seconds, got %R", what,
                     value);
        return -1;
    }
    return 0;
}

/* ---- the type -------------------------------------------------------- */

static PyMethodDef Board_methods[] = {
    {"adopt", (PyCFunction)(void (*)(void))Board_adopt,
     METH_FASTCALL | METH_KEYWORDS | METH_CLASS,
     "adopt($type, /, fd, slots, *, generation=0, heartbeat_limit=5.0)\n"
     "--\n\n"
     "Host side: take the board a worker made (Board.make) and sent.\n"
     "fd must be a memfd of exactly `slots` slots, sealed against\n"
     "resizing, later writable mappings and seal changes, with this\n"
     "layout's header; it is mapped read-only and stays the caller's:\n"
     "close it once this returns.  heartbeat_limit: seconds (0.01 ..\n"
     "86400) the worker's heartbeat may age before its board is\n"
     "ignored; None: never."},
    {"make", (PyCFunction)(void (*)(void))Board_make,
     METH_FASTCALL | METH_KEYWORDS | METH_CLASS,
     "make($type, /, slots=64, *, generation=0)\n--\n\n"
     "Worker side: make a board for the host to adopt.  Returns\n"
     "(board, fd): send fd to the host (SCM_RIGHTS) and close it.  No\n"
     "process but this one can write the board."},
    {"close", Board_close, METH_NOARGS,
     "close($self, /)\n--\n\n"
     "Stop the sampler (joined), detach (worker), unmap.  In a fork()\n"
     "child only the child's mapping goes.  Idempotent."},
    {"assign", (PyCFunction)(void (*)(void))Board_assign, METH_FASTCALL,
     "assign($self, model_id, size, /)\n--\n\n"
     "Host side: the slot for model_id (a new one with a fresh tag, or\n"
     "the one it has).  Tell the worker (slot, board.tag(slot))."},
    {"tag", Board_tag, METH_O,
     "tag($self, slot, /)\n--\n\n"
     "Host side: the tag of the slot's current assignment (0: none).\n"
     "A reading counts only when the worker published under it."},
    {"worker_gone", Board_worker_gone, METH_NOARGS,
     "worker_gone($self, /)\n--\n\n"
     "Host side: the worker is known dead; reads say 'dead owner'."},
    {"poll_owner", Board_poll_owner, METH_NOARGS,
     "poll_owner($self, /)\n--\n\n"
     "Host side, off the read path: whether the expected owner is known\n"
     "gone.  Setting expected_owner keeps a pidfd of it and this polls\n"
     "it (no wait); an exited worker then reads 'dead owner'."},
    {"bind", (PyCFunction)(void (*)(void))Board_bind, METH_FASTCALL,
     "bind($self, slot, tag, /)\n--\n\n"
     "Worker side: publish the slot under the tag the host gave it."},
    {"release", Board_release, METH_O,
     "release($self, slot, /)\n--\n\nHost side: free a slot."},
    {"assigned_size", Board_assigned_size, METH_O,
     "assigned_size($self, slot, /)\n--\n\n"
     "Host side: the size given to the slot's model (0: unassigned)."},
    {"find", Board_find, METH_O,
     "find($self, model_id, /)\n--\n\n"
     "Host side: the slot carrying model_id, or None."},
    {"publish", (PyCFunction)(void (*)(void))Board_publish, METH_FASTCALL,
     "publish($self, slot, loaded, /)\n--\n\n"
     "Worker side: publish the model's resident bytes under the slot's\n"
     "bound tag, stamped now.  Waits (without the GIL) up to 0.1 s for\n"
     "another writer of the slot (the sampler thread)."},
    {"heartbeat", Board_heartbeat, METH_NOARGS,
     "heartbeat($self, /)\n--\n\nWorker side: say the worker is alive."},
    {"read", (PyCFunction)(void (*)(void))Board_read, METH_FASTCALL,
     "read($self, slot, size=None, tag=None, /)\n--\n\n"
     "Host side: (loaded, updated_ns) or None when the board cannot be\n"
     "trusted now.  loaded is clamped to size (default: the assigned\n"
     "size); tag (default: the slot's current one) must be the slot's;\n"
     "updated_ns is time.monotonic_ns()-comparable.  Never blocks."},
    {"status", (PyCFunction)(void (*)(void))Board_status, METH_FASTCALL,
     "status($self, slot, size=None, tag=None, /)\n--\n\n"
     "Host side: why read() would or would not give a reading ('valid',\n"
     "'torn', 'tag mismatch', 'dead owner', 'stale heartbeat', ...)."},
    {"add_sampler", (PyCFunction)(void (*)(void))Board_add_sampler,
     METH_FASTCALL,
     "add_sampler($self, slot, fn_address, ctx_address=0, /)\n--\n\n"
     "Worker side: call the native `int fn(void *ctx, uint64_t *loaded)`\n"
     "every period on a background thread without the GIL and publish\n"
     "what it returns.  fn must be native code (not a ctypes callback\n"
     "into Python); keep it and ctx alive until remove_sampler/close."},
    {"remove_sampler", Board_remove_sampler, METH_O,
     "remove_sampler($self, slot, /)\n--\n\n"
     "Worker side: stop sampling the slot; on return the sampler will\n"
     "not run again."},
    {"__enter__", Board_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Board_exit, METH_FASTCALL,
     NULL},
    {NULL, NULL, 0, NULL},
};

/* A getter's closure: its row of board_value_names (an address, so no
 * integer becomes a pointer). */
#define VALUE(n) ((void *)&board_value_names[(n)])

static PyGetSetDef Board_getset[] = {
    {"name", Board_get_value, NULL,
     "The memfd's label, as /proc/<pid>/maps shows it (never a path).",
     VALUE(VALUE_NAME)},
    {"owner_is_gone", Board_get_value, NULL,
     "Host side: True once worker_gone() was called.",
     VALUE(VALUE_OWNER_IS_GONE)},
    {"is_host", Board_get_value, NULL, "True on the host side.",
     VALUE(VALUE_IS_HOST)},
    {"slots", Board_get_value, NULL, "Number of slots.", VALUE(VALUE_SLOTS)},
    {"generation", Board_get_value, NULL,
     "The worker generation the board was made for.",
     VALUE(VALUE_GENERATION)},
    {"closed", Board_get_closed, NULL, "True once closed.", NULL},
    {"attached", Board_get_value, NULL,
     "True while a worker has the board open.", VALUE(VALUE_ATTACHED)},
    {"owner_pid", Board_get_value, NULL,
     "The pid the header names as owner (untrusted), or None.",
     VALUE(VALUE_OWNER_PID)},
    {"expected_owner", Board_get_expected_owner, Board_set_expected_owner,
     "Host side: the worker pid reads require (None: any).", NULL},
    {"heartbeat_limit", Board_get_value, NULL,
     "Host side: seconds a heartbeat may age, or None.",
     VALUE(VALUE_HEARTBEAT_LIMIT)},
    {"period", Board_get_period, Board_set_period,
     "Worker side: seconds between sampler passes.", NULL},
    {"sampler_passes", Board_get_value, NULL,
     "Worker side: sampler passes completed.",
     VALUE(VALUE_SAMPLER_PASSES)},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Board_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(BoardObject, weakreflist),
     READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(Board_doc,
    "A live residency board: a shared-memory segment in which a worker\n"
    "publishes its models' resident bytes and the host reads them\n"
    "between messages.  The worker makes it (Board.make) and sends it to\n"
    "the host, which adopts it (Board.adopt); see docs/board.md.");

static PyType_Slot Board_slots[] = {
    {Py_tp_doc, (void *)Board_doc},
    {Py_tp_dealloc, Board_dealloc},
    {Py_tp_repr, Board_repr},
    {Py_tp_methods, Board_methods},
    {Py_tp_getset, Board_getset},
    {Py_tp_members, Board_members},
    {0, NULL},
};

static PyType_Spec Board_spec = {
    .name = "comfy_standin._core.Board",
    .basicsize = sizeof(BoardObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Board_slots,
};

#else /* __linux__ */

/* No board off Linux (docs/board.md): the package imports, the type
 * exists, and making one says why not.  The core is not built. */

typedef struct {
    PyObject_HEAD
} BoardObject;

static PyObject *
Board_unsupported(PyObject *cls, PyObject *args, PyObject *kwargs)
{
    PyErr_SetString(PyExc_NotImplementedError,
                    "comfy_standin.Board: the residency board is a sealed "
                    "memfd, Linux only (stand-ins use receipts)");
    return NULL;
}

int
cs_board_attach_model(PyObject *board_obj, PyObject *model_id,
                      const char *id, size_t id_len, uint64_t size,
                      PyObject *slot_obj, uint32_t *slot, uint64_t *tag)
{
    (void)Board_unsupported(NULL, NULL, NULL);
    return -1;
}

bool
cs_board_object_read(PyObject *board_obj, uint32_t slot, uint64_t tag,
                     uint64_t size, uint64_t *loaded, uint64_t *updated_ns)
{
    return false;
}

static PyMethodDef Board_methods[] = {
    {"adopt", (PyCFunction)(void (*)(void))Board_unsupported,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Not off Linux: raises NotImplementedError."},
    {"make", (PyCFunction)(void (*)(void))Board_unsupported,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Not off Linux: raises NotImplementedError."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Board_doc,
    "A live residency board: Linux only (docs/board.md).");

static PyType_Slot Board_slots[] = {
    {Py_tp_doc, (void *)Board_doc},
    {Py_tp_methods, Board_methods},
    {0, NULL},
};

static PyType_Spec Board_spec = {
    .name = "comfy_standin._core.Board",
    .basicsize = sizeof(BoardObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Board_slots,
};

#endif /* __linux__ */

int
cs_board_binding_exec(PyObject *module, cs_module_state *state)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &Board_spec, NULL);
    if (type == NULL) {
        return -1;
    }
    state->board_type = (PyTypeObject *)type;
    if (PyModule_AddObjectRef(module, "Board", type) < 0 ||
        PyModule_AddIntConstant(module, "BOARD_LAYOUT_VERSION",
                                CS_BOARD_LAYOUT_VERSION) < 0 ||
        PyModule_AddIntConstant(module, "BOARD_HEADER_SIZE",
                                CS_BOARD_HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(module, "BOARD_SLOT_SIZE",
                                CS_BOARD_SLOT_SIZE) < 0 ||
        PyModule_AddIntConstant(module, "BOARD_MAX_SLOTS",
                                CS_BOARD_MAX_SLOTS) < 0) {
        return -1;
    }
    PyObject *magic = PyLong_FromUnsignedLongLong(CS_BOARD_MAGIC);
    if (magic == NULL) {
        return -1;
    }
    int rc = PyModule_AddObjectRef(module, "BOARD_MAGIC", magic);
    Py_DECREF(magic);
    return rc;
}
