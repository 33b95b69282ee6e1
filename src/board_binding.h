/*
 * board_binding.h -- what the stand-in type uses of the Board type.
 */
#ifndef COMFY_STANDIN_BOARD_BINDING_H
#define COMFY_STANDIN_BOARD_BINDING_H

#include "binding.h"
#include "comfy_standin/board.h"

#ifdef __linux__
typedef struct {
    PyObject_HEAD
    cs_board *board; /* owned; NULL once closed (under the GIL) */
    /* Calls using `board` that released the GIL to wait: close() waits
     * (without the GIL) until they are done with it. */
    _Atomic int waiting;
    PyObject *weakreflist;
} BoardObject;

/* Board `obj`'s core handle, borrowed, NULL once closed; `obj` must be a
 * Board (attach_board checked it).  For the stand-in's read path: no
 * call, no Python, no exception. */
static inline cs_board *
cs_board_object_handle(PyObject *obj)
{
    return ((BoardObject *)obj)->board;
}
#endif

/* For the stand-in type: which (slot, tag) of the host board `board_obj`
 * carries model `id` of `size` bytes.  slot_obj None assigns one (or finds
 * the one the model has); an int must be the slot the host gave the
 * model.  0, or -1 with an exception naming what did not fit. */
int cs_board_attach_model(PyObject *board_obj, PyObject *model_id,
                          const char *id, size_t id_len, uint64_t size,
                          PyObject *slot_obj, uint32_t *slot,
                          uint64_t *tag);

/* The read path of a stand-in: a valid reading of (slot, tag) clamped to
 * `size`, or false (closed board, not a Board, or anything doubtful).
 * Never raises, never blocks, no system call. */
bool cs_board_object_read(PyObject *board_obj, uint32_t slot, uint64_t tag,
                          uint64_t size, uint64_t *loaded,
                          uint64_t *updated_ns);

#endif /* COMFY_STANDIN_BOARD_BINDING_H */
