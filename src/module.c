/* comfy_standin._core: placeholder module, filled in by the binding. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "binding.h"

static int
core_exec(PyObject *module)
{
    cs_module_state *state = cs_state_of_module(module);
    if (cs_probe_binding_exec(module, state) < 0) {
        return -1;
    }
    return 0;
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
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&core_module);
}
