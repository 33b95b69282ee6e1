/*
 * board_binding.c -- comfy_standin._core.Board, the Python face of the
 * residency board core (include/comfy_standin/board.h, docs/board.md).
 *
 * A Board object owns one core handle.  Thread safety: the handle is
 * immutable after creation except for what the core guards itself; the
 * only Python-level state is `board` (the handle pointer), which close()
 * clears under the GIL *before* releasing the GIL to join the sampler
 * thread, so no other thread can pick up a handle that is being closed.
 * Not claimed safe for the free-threaded build yet.
 */
#include "board_binding.h"

#include <structmember.h>

#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#ifndef _WIN32

typedef struct {
    PyObject_HEAD
    cs_board *board; /* owned; NULL once closed */
    PyObject *weakreflist;
} BoardObject;

#define BOARD_DOC_NAME "comfy_standin.Board"

/* Raises the exception that says what `status` means for `what`. */
static void
board_raise_role(cs_board_status status, int os_error, const char *what,
                 const char *name, bool role_is_host)
{
    const char *message = cs_board_status_message(status);
    switch (status) {
    case CS_BOARD_ERR_SYSTEM:
        errno = os_error;
        if (name != NULL) {
            PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        }
        else {
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return;
    case CS_BOARD_ERR_NOMEM:
        PyErr_NoMemory();
        return;
    case CS_BOARD_ERR_RANGE:
        PyErr_Format(PyExc_IndexError, "%s: %s", what, message);
        return;
    case CS_BOARD_ERR_NAME:
    case CS_BOARD_ERR_MAGIC:
    case CS_BOARD_ERR_VERSION:
    case CS_BOARD_ERR_SIZE:
    case CS_BOARD_ERR_SEALS:
        PyErr_Format(PyExc_ValueError, "%s: board %s refused: %s", what,
                     name ? name : "?", message);
        return;
    case CS_BOARD_ERR_ROLE:
        PyErr_Format(PyExc_RuntimeError,
                     "%s is a %s call; this is the %s side of board %s",
                     what, role_is_host ? "worker" : "host",
                     role_is_host ? "host" : "worker", name ? name : "?");
        return;
    case CS_BOARD_ERR_UNSUPPORTED:
        PyErr_Format(PyExc_NotImplementedError, "%s: %s", what, message);
        return;
    default:
        PyErr_Format(PyExc_RuntimeError, "%s: %s", what, message);
        return;
    }
}

/* The same for a call on an existing board. */
static void
board_raise_on(cs_board *board, cs_board_status status, int os_error,
               const char *what)
{
    board_raise_role(status, os_error, what, cs_board_name(board),
                     cs_board_is_host(board));
}

static void
board_raise(cs_board_status status, int os_error, const char *what,
            const char *name)
{
    board_raise_role(status, os_error, what, name, false);
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
    self->weakreflist = NULL;
    return (PyObject *)self;
}

/* ---- construction ---------------------------------------------------- */

static PyObject *
Board_create(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static const char *keywords[] = {"slots", "generation",
                                     "heartbeat_limit", NULL};
    PyObject *slots_obj = NULL, *generation_obj = NULL, *limit_obj = NULL;
    uint64_t slots = 64, generation = 0;
    uint64_t limit = CS_BOARD_DEFAULT_HEARTBEAT_LIMIT_NS;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O$OO:create",
                                     (char **)keywords, &slots_obj,
                                     &generation_obj, &limit_obj)) {
        return NULL;
    }
    if ((slots_obj != NULL &&
         cs_value_in_range(slots_obj, "Board.create(): slots", NULL, 1,
                           CS_BOARD_MAX_SLOTS, &slots) < 0) ||
        (generation_obj != NULL &&
         cs_value_in_range(generation_obj, "Board.create(): generation",
                           NULL, 0, CS_BOARD_VALUE_MAX, &generation) < 0)) {
        return NULL;
    }
    if (limit_obj == Py_None) {
        limit = 0; /* no heartbeat check */
    }
    else if (limit_obj != NULL &&
             cs_seconds_in_range(limit_obj,
                                 "Board.create(): heartbeat_limit",
                                 CS_BOARD_HEARTBEAT_LIMIT_MIN_NS,
                                 CS_BOARD_HEARTBEAT_LIMIT_MAX_NS,
                                 &limit) < 0) {
        return NULL;
    }
    cs_board *board = NULL;
    int os_error = 0;
    cs_board_status status = cs_board_create((uint32_t)slots, generation,
                                             limit, &board, &os_error);
    if (status != CS_BOARD_OK) {
        board_raise(status, os_error, "Board.create()", NULL);
        return NULL;
    }
    return board_wrap(type, board);
}

/* Board.adopt(fd, slots, *, generation=0, heartbeat_limit=5.0): the host
 * side of a board its worker made (cs_board_adopt). */
static PyObject *
Board_adopt(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static const char *keywords[] = {"fd", "slots", "generation",
                                     "heartbeat_limit", NULL};
    PyObject *fd_obj = NULL, *slots_obj = NULL, *generation_obj = NULL;
    PyObject *limit_obj = NULL;
    uint64_t fd = 0, slots = 0, generation = 0;
    uint64_t limit = CS_BOARD_DEFAULT_HEARTBEAT_LIMIT_NS;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|$OO:adopt",
                                     (char **)keywords, &fd_obj, &slots_obj,
                                     &generation_obj, &limit_obj)) {
        return NULL;
    }
    /* The arguments are read before the GIL is released and not used
     * after, so borrowed keyword values cannot go stale under them. */
    if (cs_value_in_range(fd_obj, "Board.adopt(): fd", NULL, 0, INT_MAX,
                          &fd) < 0 ||
        cs_value_in_range(slots_obj, "Board.adopt(): slots", NULL, 1,
                          CS_BOARD_MAX_SLOTS, &slots) < 0 ||
        (generation_obj != NULL &&
         cs_value_in_range(generation_obj, "Board.adopt(): generation",
                           NULL, 0, CS_BOARD_VALUE_MAX, &generation) < 0)) {
        return NULL;
    }
    if (limit_obj == Py_None) {
        limit = 0;
    }
    else if (limit_obj != NULL &&
             cs_seconds_in_range(limit_obj, "Board.adopt(): heartbeat_limit",
                                 CS_BOARD_HEARTBEAT_LIMIT_MIN_NS,
                                 CS_BOARD_HEARTBEAT_LIMIT_MAX_NS,
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
        board_raise(status, os_error, "Board.adopt()", "received");
        return NULL;
    }
    return board_wrap(type, board);
}

/* Board.make(slots=64, *, generation=0): the worker side of a board this
 * process makes for its host to adopt; returns (board, fd). */
static PyObject *
Board_make(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static const char *keywords[] = {"slots", "generation", NULL};
    PyObject *slots_obj = NULL, *generation_obj = NULL;
    uint64_t slots = 64, generation = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O$O:make",
                                     (char **)keywords, &slots_obj,
                                     &generation_obj)) {
        return NULL;
    }
    if ((slots_obj != NULL &&
         cs_value_in_range(slots_obj, "Board.make(): slots", NULL, 1,
                           CS_BOARD_MAX_SLOTS, &slots) < 0) ||
        (generation_obj != NULL &&
         cs_value_in_range(generation_obj, "Board.make(): generation", NULL,
                           0, CS_BOARD_VALUE_MAX, &generation) < 0)) {
        return NULL;
    }
    cs_board *board = NULL;
    int fd = -1, os_error = 0;
    cs_board_status status = cs_board_make((uint32_t)slots, generation,
                                           &board, &fd, &os_error);
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

/* Board.open's body, on owned arguments (period_obj may be NULL). */
static PyObject *
open_body(PyTypeObject *type, PyObject *source, PyObject *period_obj)
{
    uint64_t period = 0, fd = 0;
    const char *name = NULL;
    if (PyUnicode_Check(source)) {
        name = PyUnicode_AsUTF8(source);
        if (name == NULL) {
            return NULL;
        }
    }
    else if (cs_value_in_range(source, "Board.open(): source (a file "
                               "descriptor or a name)", NULL, 0, INT_MAX,
                               &fd) < 0) {
        return NULL;
    }
    if (period_obj != NULL &&
        cs_seconds_in_range(period_obj, "Board.open(): period",
                            UINT64_C(1000000), UINT64_C(3600000000000),
                            &period) < 0) {
        return NULL;
    }
    cs_board *board = NULL;
    int os_error = 0;
    cs_board_status status;
    Py_BEGIN_ALLOW_THREADS
    status = name != NULL ? cs_board_open(name, &board, &os_error)
                          : cs_board_open_fd((int)fd, &board, &os_error);
    Py_END_ALLOW_THREADS
    if (status != CS_BOARD_OK) {
        if (status == CS_BOARD_ERR_UNSUPPORTED) {
            PyErr_Format(PyExc_ValueError,
                         "Board.open(): boards have no names on this "
                         "platform; pass the board's file descriptor "
                         "(Board.fd on the host, inherited or sent), got "
                         "%R", source);
            return NULL;
        }
        board_raise(status, os_error, "Board.open()", name);
        return NULL;
    }
    if (period != 0 && cs_board_set_period(board, period) != CS_BOARD_OK) {
        cs_board_close(board);
        PyErr_SetString(PyExc_ValueError,
                        "Board.open(): period must be in [0.001, 3600] "
                        "seconds");
        return NULL;
    }
    return board_wrap(type, board);
}

static PyObject *
Board_open(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static const char *keywords[] = {"source", "period", NULL};
    PyObject *argv[2] = {NULL, NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$O:open",
                                     (char **)keywords, &argv[0],
                                     &argv[1])) {
        return NULL;
    }
    /* Owned while the GIL is released: another thread may empty a keyword
     * dict its caller holds, and the name's UTF-8 lives in the source
     * (cs_args_hold). */
    cs_args_hold(argv, 2);
    PyObject *result = open_body(type, argv[0], argv[1]);
    cs_args_release(argv, 2);
    return result;
}

/* Closes the handle (idempotent).  The pointer is cleared first, under the
 * GIL, then the GIL is released while the sampler thread is joined. */
static void
board_close_handle(BoardObject *self)
{
    cs_board *board = self->board;
    self->board = NULL;
    if (board != NULL) {
        Py_BEGIN_ALLOW_THREADS
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

cs_board *
cs_board_from_object(PyObject *obj)
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
    cs_board *board = cs_board_from_object(board_obj);
    if (board == NULL) {
        return -1;
    }
    if (!cs_board_is_host(board)) {
        PyErr_Format(PyExc_ValueError,
                     "attach_board: model %R needs the host's side of the "
                     "board (Board.create), got a worker's handle",
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

static PyObject *
Board_close(PyObject *op, PyObject *unused)
{
    board_close_handle((BoardObject *)op);
    Py_RETURN_NONE;
}

static PyObject *
Board_enter(PyObject *op, PyObject *unused)
{
    if (board_handle((BoardObject *)op, "Board.__enter__()") == NULL) {
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

static PyObject *
Board_unlink(PyObject *op, PyObject *unused)
{
    cs_board *board = board_handle((BoardObject *)op, "Board.unlink()");
    if (board == NULL) {
        return NULL;
    }
    int os_error = 0;
    cs_board_status status = cs_board_unlink(board, &os_error);
    if (status != CS_BOARD_OK) {
        board_raise_on(board, status, os_error, "Board.unlink()");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Board_assign(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    const char *what = "Board.assign()";
    cs_board *board = board_handle((BoardObject *)op, what);
    if (board == NULL) {
        return NULL;
    }
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError,
                     "%s takes 2 arguments (model_id, size), got %zd", what,
                     nargs);
        return NULL;
    }
    if (!PyUnicode_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "%s: model_id must be a str, not %.100s",
                     what, Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    Py_ssize_t id_len;
    const char *id = PyUnicode_AsUTF8AndSize(args[0], &id_len);
    uint64_t size;
    if (id == NULL || board_own(board, what) < 0 ||
        board_u64_arg(args[1], what, "size", CS_BOARD_VALUE_MAX, &size) < 0) {
        return NULL;
    }
    uint32_t slot = 0;
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
        board_raise_on(board, status, 0, what);
        return NULL;
    }
    return PyLong_FromUnsignedLong(slot);
}

static PyObject *
Board_release(PyObject *op, PyObject *arg)
{
    const char *what = "Board.release()";
    cs_board *board = board_handle((BoardObject *)op, what);
    uint32_t slot;
    if (board == NULL || board_slot_arg(board, arg, what, &slot) < 0) {
        return NULL;
    }
    cs_board_status status = cs_board_release(board, slot);
    if (status != CS_BOARD_OK) {
        board_raise_on(board, status, 0, what);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Board_tag(PyObject *op, PyObject *arg)
{
    const char *what = "Board.tag()";
    cs_board *board = board_handle((BoardObject *)op, what);
    uint32_t slot;
    if (board == NULL || board_slot_arg(board, arg, what, &slot) < 0) {
        return NULL;
    }
    if (!cs_board_is_host(board)) {
        board_raise_on(board, CS_BOARD_ERR_ROLE, 0, what);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(cs_board_tag(board, slot));
}

static PyObject *
Board_worker_gone(PyObject *op, PyObject *unused)
{
    const char *what = "Board.worker_gone()";
    cs_board *board = board_handle((BoardObject *)op, what);
    if (board == NULL) {
        return NULL;
    }
    if (!cs_board_is_host(board)) {
        board_raise_on(board, CS_BOARD_ERR_ROLE, 0, what);
        return NULL;
    }
    cs_board_owner_gone(board);
    Py_RETURN_NONE;
}

static PyObject *
Board_poll_owner(PyObject *op, PyObject *unused)
{
    const char *what = "Board.poll_owner()";
    cs_board *board = board_handle((BoardObject *)op, what);
    if (board == NULL) {
        return NULL;
    }
    if (!cs_board_is_host(board)) {
        board_raise_on(board, CS_BOARD_ERR_ROLE, 0, what);
        return NULL;
    }
    return PyBool_FromLong(cs_board_poll_owner(board));
}

static PyObject *
Board_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    const char *what = "Board.bind()";
    cs_board *board = board_handle((BoardObject *)op, what);
    if (board == NULL) {
        return NULL;
    }
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError,
                     "%s takes 2 arguments (slot, tag), got %zd", what,
                     nargs);
        return NULL;
    }
    uint32_t slot;
    uint64_t tag;
    if (board_slot_arg(board, args[0], what, &slot) < 0 ||
        board_u64_arg(args[1], what, "tag", CS_BOARD_VALUE_MAX, &tag) < 0) {
        return NULL;
    }
    cs_board_status status = cs_board_bind(board, slot, tag);
    if (status != CS_BOARD_OK) {
        board_raise_on(board, status, 0, what);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Board_assigned_size(PyObject *op, PyObject *arg)
{
    const char *what = "Board.assigned_size()";
    cs_board *board = board_handle((BoardObject *)op, what);
    uint32_t slot;
    if (board == NULL || board_slot_arg(board, arg, what, &slot) < 0) {
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
    const char *what = "Board.find()";
    cs_board *board = board_handle((BoardObject *)op, what);
    if (board == NULL) {
        return NULL;
    }
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s: model_id must be a str, not %.100s",
                     what, Py_TYPE(arg)->tp_name);
        return NULL;
    }
    Py_ssize_t id_len;
    const char *id = PyUnicode_AsUTF8AndSize(arg, &id_len);
    if (id == NULL) {
        return NULL;
    }
    uint32_t slot;
    cs_board_status status = cs_board_find(board, id, (size_t)id_len, &slot);
    if (status == CS_BOARD_ERR_RANGE) {
        Py_RETURN_NONE;
    }
    if (status != CS_BOARD_OK) {
        /* A worker (the segment holds no ids) or a forked child. */
        board_raise_on(board, status, 0, what);
        return NULL;
    }
    return PyLong_FromUnsignedLong(slot);
}

static PyObject *
Board_publish(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    const char *what = "Board.publish()";
    cs_board *board = board_handle((BoardObject *)op, what);
    if (board == NULL) {
        return NULL;
    }
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError,
                     "%s takes 2 arguments (slot, loaded), got %zd", what,
                     nargs);
        return NULL;
    }
    uint32_t slot;
    uint64_t loaded;
    if (board_slot_arg(board, args[0], what, &slot) < 0 ||
        board_u64_arg(args[1], what, "loaded", CS_BOARD_VALUE_MAX, &loaded) <
            0) {
        return NULL;
    }
    cs_board_status status = cs_board_publish(board, slot, loaded);
    if (status != CS_BOARD_OK) {
        board_raise_on(board, status, 0, "Board.publish()");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Board_heartbeat(PyObject *op, PyObject *unused)
{
    cs_board *board = board_handle((BoardObject *)op, "Board.heartbeat()");
    if (board == NULL) {
        return NULL;
    }
    cs_board_status status = cs_board_heartbeat(board);
    if (status != CS_BOARD_OK) {
        board_raise_on(board, status, 0, "Board.heartbeat()");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* read() and status() share their argument handling:
 * (slot, size=None, tag=None). */
static int
board_read_args(cs_board *board, PyObject *const *args, Py_ssize_t nargs,
                const char *what, uint32_t *slot, uint64_t *size,
                uint64_t *tag)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_Format(PyExc_TypeError,
                     "%s takes 1 to 3 arguments (slot, size=None, "
                     "tag=None), got %zd", what, nargs);
        return -1;
    }
    if (!cs_board_is_host(board)) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s is a host call; this is the worker side of board "
                     "%s", what, cs_board_name(board));
        return -1;
    }
    if (board_slot_arg(board, args[0], what, slot) < 0) {
        return -1;
    }
    *tag = 0;
    if (nargs == 3 && args[2] != Py_None &&
        board_u64_arg(args[2], what, "tag", CS_BOARD_VALUE_MAX, tag) < 0) {
        return -1;
    }
    if (nargs >= 2 && args[1] != Py_None) {
        return board_u64_arg(args[1], what, "size", CS_BOARD_VALUE_MAX,
                             size);
    }
    *size = cs_board_assigned_size(board, *slot);
    return 0;
}

static PyObject *
Board_read(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    const char *what = "Board.read()";
    cs_board *board = board_handle((BoardObject *)op, what);
    uint32_t slot;
    uint64_t size, loaded, stamp, tag;
    if (board == NULL ||
        board_read_args(board, args, nargs, what, &slot, &size, &tag) < 0) {
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
    const char *what = "Board.status()";
    cs_board *board = board_handle((BoardObject *)op, what);
    uint32_t slot;
    uint64_t size, loaded, stamp, tag;
    if (board == NULL ||
        board_read_args(board, args, nargs, what, &slot, &size, &tag) < 0) {
        return NULL;
    }
    cs_board_reading reading = cs_board_read_slot_status(
        board, slot, tag, size, &loaded, &stamp);
    return PyUnicode_FromString(cs_board_reading_name(reading));
}

static PyObject *
Board_add_sampler(PyObject *op, PyObject *const *args, Py_ssize_t nargs)
{
    const char *what = "Board.add_sampler()";
    cs_board *board = board_handle((BoardObject *)op, what);
    if (board == NULL) {
        return NULL;
    }
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError,
                     "%s takes 2 or 3 arguments (slot, fn_address, "
                     "ctx_address=0), got %zd", what, nargs);
        return NULL;
    }
    uint32_t slot;
    if (board_slot_arg(board, args[0], what, &slot) < 0) {
        return NULL;
    }
    void *fn_address = NULL, *context = NULL;
    if (!PyLong_Check(args[1]) ||
        (nargs == 3 && args[2] != Py_None && !PyLong_Check(args[2]))) {
        PyErr_Format(PyExc_TypeError,
                     "%s: fn_address and ctx_address must be int addresses "
                     "(e.g. ctypes.cast(f, ctypes.c_void_p).value)", what);
        return NULL;
    }
    fn_address = PyLong_AsVoidPtr(args[1]);
    if (fn_address == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "%s: fn_address is NULL", what);
        }
        return NULL;
    }
    if (nargs == 3 && args[2] != Py_None) {
        context = PyLong_AsVoidPtr(args[2]);
        if (context == NULL && PyErr_Occurred()) {
            return NULL;
        }
    }
    /* POSIX guarantees data and function pointers convert; C11 does not
     * say so, hence the copy. */
    cs_board_sampler_fn fn;
    static_assert(sizeof(fn) == sizeof(fn_address), "function pointers");
    memcpy(&fn, &fn_address, sizeof(fn));
    int os_error = 0;
    cs_board_status status;
    /* Waits for a running sampler pass; that never needs the GIL, since
     * samplers are native code (documented), so holding it is safe. */
    status = cs_board_add_sampler(board, slot, fn, context, &os_error);
    if (status != CS_BOARD_OK) {
        board_raise_on(board, status, os_error, "Board.add_sampler()");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
Board_remove_sampler(PyObject *op, PyObject *arg)
{
    const char *what = "Board.remove_sampler()";
    cs_board *board = board_handle((BoardObject *)op, what);
    uint32_t slot;
    if (board == NULL || board_slot_arg(board, arg, what, &slot) < 0) {
        return NULL;
    }
    cs_board_status status = cs_board_remove_sampler(board, slot);
    if (status != CS_BOARD_OK) {
        board_raise_on(board, status, 0, "Board.remove_sampler()");
        return NULL;
    }
    Py_RETURN_NONE;
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
        "<comfy_standin.Board %s %s slots=%u generation=%llu%s%s>",
        cs_board_is_host(board) ? "host" : "worker", cs_board_name(board),
        (unsigned)cs_board_slot_count(board),
        (unsigned long long)cs_board_generation(board),
        cs_board_attached(board) ? " attached" : "",
        cs_board_is_host(board) && !cs_board_linked(board) ? " unlinked"
                                                           : "");
}

/* ---- properties ------------------------------------------------------ */

#define BOARD_GETTER(attr)                                                  \
    static PyObject *Board_get_##attr(PyObject *op, void *closure)          \
    {                                                                       \
        cs_board *board = board_handle((BoardObject *)op,                   \
                                       "Board." #attr);                     \
        if (board == NULL) {                                                \
            return NULL;                                                    \
        }                                                                   \
        return Board_value_##attr(board);                                   \
    }

static PyObject *
Board_value_name(cs_board *board)
{
    return PyUnicode_FromString(cs_board_name(board));
}

static PyObject *
Board_value_is_host(cs_board *board)
{
    return PyBool_FromLong(cs_board_is_host(board));
}

static PyObject *
Board_value_slots(cs_board *board)
{
    return PyLong_FromUnsignedLong(cs_board_slot_count(board));
}

static PyObject *
Board_value_generation(cs_board *board)
{
    return PyLong_FromUnsignedLongLong(cs_board_generation(board));
}

static PyObject *
Board_value_attached(cs_board *board)
{
    return PyBool_FromLong(cs_board_attached(board));
}

static PyObject *
Board_value_linked(cs_board *board)
{
    return PyBool_FromLong(cs_board_is_host(board) &&
                           cs_board_linked(board));
}

static PyObject *
Board_value_owner_pid(cs_board *board)
{
    int64_t pid = cs_board_owner_pid(board);
    if (pid <= 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong(pid);
}

static PyObject *
Board_value_heartbeat_limit(cs_board *board)
{
    uint64_t limit = cs_board_heartbeat_limit(board);
    if (!cs_board_is_host(board) || limit == 0) {
        Py_RETURN_NONE;
    }
    return PyFloat_FromDouble((double)limit / 1e9);
}

static PyObject *
Board_value_sampler_passes(cs_board *board)
{
    return PyLong_FromUnsignedLongLong(cs_board_sampler_passes(board));
}

static PyObject *
Board_value_fd(cs_board *board)
{
    int fd = cs_board_fd(board);
    if (fd < 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLong(fd);
}

static PyObject *
Board_value_owner_is_gone(cs_board *board)
{
    return PyBool_FromLong(cs_board_is_host(board) &&
                           cs_board_owner_is_gone(board));
}

BOARD_GETTER(fd)
BOARD_GETTER(owner_is_gone)
BOARD_GETTER(name)
BOARD_GETTER(is_host)
BOARD_GETTER(slots)
BOARD_GETTER(generation)
BOARD_GETTER(attached)
BOARD_GETTER(linked)
BOARD_GETTER(owner_pid)
BOARD_GETTER(heartbeat_limit)
BOARD_GETTER(sampler_passes)

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
    {"create", (PyCFunction)(void (*)(void))Board_create,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "create($type, /, slots=64, *, generation=0, heartbeat_limit=5.0)\n"
     "--\n\n"
     "Host side: make a new board.  On Linux a sealed memfd with no\n"
     "name: hand Board.fd to the worker (pass_fds or SCM_RIGHTS).\n"
     "heartbeat_limit: seconds (0.01 .. 86400) a worker's heartbeat may\n"
     "age before its board is ignored; None: never."},
    {"adopt", (PyCFunction)(void (*)(void))Board_adopt,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "adopt($type, /, fd, slots, *, generation=0, heartbeat_limit=5.0)\n"
     "--\n\n"
     "Host side: take the board a worker made (Board.make) and sent.\n"
     "fd must be a memfd of exactly `slots` slots, sealed against\n"
     "resizing, later writable mappings and seal changes, with this\n"
     "layout's header; it is mapped read-only and stays the caller's:\n"
     "close it once this returns.  Linux only."},
    {"make", (PyCFunction)(void (*)(void))Board_make,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "make($type, /, slots=64, *, generation=0)\n--\n\n"
     "Worker side: make a board for the host to adopt.  Returns\n"
     "(board, fd): send fd to the host (SCM_RIGHTS) and close it.  No\n"
     "process but this one can write the board.  Linux only."},
    {"open", (PyCFunction)(void (*)(void))Board_open,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "open($type, /, source, *, period=0.01)\n--\n\n"
     "Worker side: open the board the host made, by file descriptor (an\n"
     "int; Linux) or by name (a str; where boards have names).  The\n"
     "descriptor stays the caller's.  Refuses a segment that is not\n"
     "sealed (Linux) or not a board of this layout.\n"
     "period: seconds between sampler passes."},
    {"close", Board_close, METH_NOARGS,
     "close($self, /)\n--\n\n"
     "Stop the sampler (joined), detach (worker) or drop the host's\n"
     "descriptor or name (host), unmap.  In a fork() child only the\n"
     "child's mapping goes.  Idempotent."},
    {"unlink", Board_unlink, METH_NOARGS,
     "unlink($self, /)\n--\n\n"
     "Host side: drop the host's way in (close Board.fd, or remove the\n"
     "name) once the worker has the board.  The mappings keep working.\n"
     "Idempotent."},
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
     "gone.  On Linux, setting expected_owner keeps a pidfd of it and\n"
     "this polls it (no wait); an exited worker then reads 'dead owner'."},
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
     "bound tag, stamped now."},
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

static PyGetSetDef Board_getset[] = {
    {"name", Board_get_name, NULL,
     "The segment's name (informative for a memfd board).", NULL},
    {"fd", Board_get_fd, NULL,
     "Host side: the descriptor to hand the worker, or None (a named\n"
     "board, or after unlink()/close()).", NULL},
    {"owner_is_gone", Board_get_owner_is_gone, NULL,
     "Host side: True once worker_gone() was called.", NULL},
    {"is_host", Board_get_is_host, NULL, "True on the host side.", NULL},
    {"slots", Board_get_slots, NULL, "Number of slots.", NULL},
    {"generation", Board_get_generation, NULL,
     "The worker generation the board was made for.", NULL},
    {"closed", Board_get_closed, NULL, "True once closed.", NULL},
    {"attached", Board_get_attached, NULL,
     "True while a worker has the board open.", NULL},
    {"linked", Board_get_linked, NULL,
     "Host side: True while the host holds a way in (fd or name).",
     NULL},
    {"owner_pid", Board_get_owner_pid, NULL,
     "The pid the header names as owner (untrusted), or None.", NULL},
    {"expected_owner", Board_get_expected_owner, Board_set_expected_owner,
     "Host side: the worker pid reads require (None: any).", NULL},
    {"heartbeat_limit", Board_get_heartbeat_limit, NULL,
     "Host side: seconds a heartbeat may age, or None.", NULL},
    {"period", Board_get_period, Board_set_period,
     "Worker side: seconds between sampler passes.", NULL},
    {"sampler_passes", Board_get_sampler_passes, NULL,
     "Worker side: sampler passes completed.", NULL},
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
    "between messages.  Make one with Board.create() (host) or\n"
    "Board.open(name) (worker); see docs/board.md.");

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

#else /* _WIN32 */

/* No board on Windows (docs/board.md): the package imports, the type
 * exists, and making one says why not.  The core is not built. */

typedef struct {
    PyObject_HEAD
} BoardObject;

static PyObject *
Board_unsupported(PyObject *cls, PyObject *args, PyObject *kwargs)
{
    PyErr_SetString(PyExc_NotImplementedError,
                    "comfy_standin.Board: no residency board on Windows "
                    "(stand-ins use receipts)");
    return NULL;
}

cs_board *
cs_board_from_object(PyObject *obj)
{
    (void)Board_unsupported(NULL, NULL, NULL);
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
    {"create", (PyCFunction)(void (*)(void))Board_unsupported,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Not on Windows: raises NotImplementedError."},
    {"open", (PyCFunction)(void (*)(void))Board_unsupported,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Not on Windows: raises NotImplementedError."},
    {"adopt", (PyCFunction)(void (*)(void))Board_unsupported,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Not on Windows: raises NotImplementedError."},
    {"make", (PyCFunction)(void (*)(void))Board_unsupported,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "Not on Windows: raises NotImplementedError."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Board_doc,
    "A live residency board: not available on Windows (docs/board.md).");

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

#endif /* _WIN32 */

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
