/* comfy_standin._core: placeholder module, filled in by the binding.
 *
 * Minimal multi-phase init (PEP 489) so the board's exec hook can run; the
 * lead's rewrite replaces this file. */
#include "binding.h"

static int
core_exec(PyObject *module)
{
    cs_module_state *state = cs_state_of_module(module);
    if (cs_board_binding_exec(module, state) < 0) {
        return -1;
    }
    return 0;
}

int
cs_state_traverse(cs_module_state *state, visitproc visit, void *arg)
{
    Py_VISIT(state->ledger_type);
    Py_VISIT(state->books_type);
    Py_VISIT(state->standin_type);
    Py_VISIT(state->module_type);
    Py_VISIT(state->sentinel_type);
    Py_VISIT(state->board_type);
    Py_VISIT(state->echo_error);
    Py_VISIT(state->worker_gone_error);
    return 0;
}

void
cs_state_clear(cs_module_state *state)
{
    Py_CLEAR(state->ledger_type);
    Py_CLEAR(state->books_type);
    Py_CLEAR(state->standin_type);
    Py_CLEAR(state->module_type);
    Py_CLEAR(state->sentinel_type);
    Py_CLEAR(state->board_type);
    Py_CLEAR(state->echo_error);
    Py_CLEAR(state->worker_gone_error);
    Py_CLEAR(state->str_send_command);
    Py_CLEAR(state->str_is_alive);
}

static int
core_traverse(PyObject *module, visitproc visit, void *arg)
{
    return cs_state_traverse(cs_state_of_module(module), visit, arg);
}

static int
core_clear(PyObject *module)
{
    cs_state_clear(cs_state_of_module(module));
    return 0;
}

static void
core_free(void *module)
{
    (void)core_clear((PyObject *)module);
}

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "comfy_standin._core",
    .m_doc = "C core of comfy_standin.",
    .m_size = sizeof(cs_module_state),
    .m_slots = core_slots,
    .m_traverse = core_traverse,
    .m_clear = core_clear,
    .m_free = core_free,
};

PyMODINIT_FUNC PyInit__core(void);

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&core_module);
}
