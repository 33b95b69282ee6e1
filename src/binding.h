/*
 * binding.h -- what the parts of the extension module comfy_standin._core
 * share: the module state and each part's exec hook.
 *
 * Each binding source file (standin.c, ledger_binding.c, probe_binding.c,
 * board_binding.c) adds its types and functions to the module from one
 * `cs_<part>_exec(module, state)` called by module.c's Py_mod_exec slot.
 * No PyObject * lives in a C static: every type and exception object is in
 * the module state (PEP 489 / PEP 630).
 */
#ifndef COMFY_STANDIN_BINDING_H
#define COMFY_STANDIN_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    /* Types (strong references, created from specs in the exec hooks). */
    PyTypeObject *ledger_type;
    PyTypeObject *books_type;
    PyTypeObject *standin_type;
    PyTypeObject *module_type;   /* the inner StandInModule */
    PyTypeObject *sentinel_type; /* clone_base_uuid sentinels */
    PyTypeObject *board_type;
    /* Exceptions. */
    PyObject *echo_error;        /* EchoError(ValueError) */
    PyObject *worker_gone_error; /* WorkerGoneError(RuntimeError) */
    /* Interned strings used on hot paths. */
    PyObject *str_send_command;
    PyObject *str_is_alive;
} cs_module_state;

/* The module state of the module that defined `type`'s module (heap types
 * only) or of `module` itself. */
static inline cs_module_state *
cs_state_of_module(PyObject *module)
{
    return (cs_module_state *)PyModule_GetState(module);
}

int cs_ledger_binding_exec(PyObject *module, cs_module_state *state);
int cs_standin_exec(PyObject *module, cs_module_state *state);
int cs_probe_binding_exec(PyObject *module, cs_module_state *state);
int cs_board_binding_exec(PyObject *module, cs_module_state *state);

int cs_state_traverse(cs_module_state *state, visitproc visit, void *arg);
void cs_state_clear(cs_module_state *state);

#endif /* COMFY_STANDIN_BINDING_H */
