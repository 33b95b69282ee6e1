/*
 * board_binding.h -- what other parts of the extension module may use of
 * the Board type: the C handle behind a Board object.
 */
#ifndef COMFY_STANDIN_BOARD_BINDING_H
#define COMFY_STANDIN_BOARD_BINDING_H

#include "binding.h"
#include "comfy_standin/board.h"

/* The core handle of a Board object, borrowed: valid while `obj` is alive
 * and not closed.  Closing needs the GIL (or, on a free-threaded build,
 * the object's critical section), so a caller that holds it and calls no
 * Python code in between may use the handle; do not keep it longer.  NULL
 * with TypeError (not a Board) or ValueError (closed) set. */
cs_board *cs_board_from_object(PyObject *obj);

#endif /* COMFY_STANDIN_BOARD_BINDING_H */
