/* comfy_standin._core: placeholder module, filled in by the binding. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyModuleDef_Slot core_slots[] = {
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "comfy_standin._core",
    .m_doc = "C core of comfy_standin.",
    .m_size = 0,
    .m_slots = core_slots,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModuleDef_Init(&core_module);
}
