/*
 * module.c -- comfy_standin._core: module state, multi-phase init (PEP 489),
 * and the exceptions every part raises.  The types and functions live in
 * the part files (ledger_binding.c, standin.c, probe_binding.c,
 * board_binding.c), each adding itself from its exec hook.
 */
#include "binding.h"

#include "comfy_standin/ledger.h"

static int
state_traverse(cs_module_state *state, visitproc visit, void *arg)
{
    Py_VISIT(state->ledger_type);
    Py_VISIT(state->books_type);
    Py_VISIT(state->record_type);
    Py_VISIT(state->standin_type);
    Py_VISIT(state->sentinel_type);
    Py_VISIT(state->board_type);
    Py_VISIT(state->echo_error);
    Py_VISIT(state->worker_gone_error);
    Py_VISIT(state->mapping_abc);
    Py_VISIT(state->package);
    Py_VISIT(state->default_pool);
    Py_VISIT(state->default_ledger);
    Py_VISIT(state->worker_type);
    return 0;
}

static void
state_clear(cs_module_state *state)
{
    Py_CLEAR(state->ledger_type);
    Py_CLEAR(state->books_type);
    Py_CLEAR(state->record_type);
    Py_CLEAR(state->standin_type);
    Py_CLEAR(state->sentinel_type);
    Py_CLEAR(state->board_type);
    Py_CLEAR(state->echo_error);
    Py_CLEAR(state->worker_gone_error);
    Py_CLEAR(state->str_send_command);
    Py_CLEAR(state->str_is_alive);
    Py_CLEAR(state->str_model_id);
    Py_CLEAR(state->str_extra_bytes);
    Py_CLEAR(state->str_bytes_to_free);
    Py_CLEAR(state->str_device);
    Py_CLEAR(state->str_loaded);
    Py_CLEAR(state->str_resident);
    Py_CLEAR(state->str_freed);
    Py_CLEAR(state->str_moved);
    Py_CLEAR(state->str_seq);
    Py_CLEAR(state->str_id);
    Py_CLEAR(state->str_get);
    Py_CLEAR(state->str_ledger);
    Py_CLEAR(state->str_restarted);
    Py_CLEAR(state->str_default_pool);
    Py_CLEAR(state->mapping_abc);
    Py_CLEAR(state->package);
    Py_CLEAR(state->default_pool);
    Py_CLEAR(state->default_ledger);
    Py_CLEAR(state->worker_type);
    cs_args_clear(state);
    state->ready = 0;
}

static int
core_traverse(PyObject *module, visitproc visit, void *arg)
{
    return state_traverse(cs_state_of_module(module), visit, arg);
}

static int
core_clear(PyObject *module)
{
    state_clear(cs_state_of_module(module));
    return 0;
}

static void
core_free(void *module)
{
    core_clear((PyObject *)module);
}

static int
add_exception(PyObject *module, PyObject **slot, const char *name,
              const char *doc, PyObject *base)
{
    *slot = PyErr_NewExceptionWithDoc(name, doc, base, NULL);
    if (*slot == NULL) {
        return -1;
    }
    /* The short name after the last dot. */
    const char *attr = strrchr(name, '.') + 1;
    return PyModule_AddObjectRef(module, attr, *slot);
}

static int
add_u64_constant(PyObject *module, const char *name, uint64_t value)
{
    PyObject *number = PyLong_FromUnsignedLongLong(value);
    if (number == NULL) {
        return -1;
    }
    int r = PyModule_AddObjectRef(module, name, number);
    Py_DECREF(number);
    return r;
}

static int
core_exec(PyObject *module)
{
    cs_module_state *state = cs_state_of_module(module);

    if (add_exception(module, &state->echo_error,
                      "comfy_standin.EchoError",
                      "A bad echo, census, report or command reply from a "
                      "worker.\n\nNothing of it was applied; the message "
                      "names the field and the value.",
                      PyExc_ValueError) < 0) {
        return -1;
    }
    if (add_exception(module, &state->worker_gone_error,
                      "comfy_standin.WorkerGoneError",
                      "A load was asked of a model whose worker died or "
                      "restarted; reload the node.",
                      PyExc_RuntimeError) < 0) {
        return -1;
    }
    struct {
        PyObject **slot;
        const char *text;
    } strings[] = {
        {&state->str_send_command, "send_command"},
        {&state->str_is_alive, "is_alive"},
        {&state->str_model_id, "model_id"},
        {&state->str_extra_bytes, "extra_bytes"},
        {&state->str_bytes_to_free, "bytes_to_free"},
        {&state->str_device, "device"},
        {&state->str_loaded, "loaded"},
        {&state->str_resident, "resident"},
        {&state->str_freed, "freed"},
        {&state->str_moved, "moved"},
        {&state->str_seq, "seq"},
        {&state->str_id, "id"},
        {&state->str_get, "get"},
        {&state->str_ledger, "_ledger"},
        {&state->str_restarted, "restarted"},
        {&state->str_default_pool, "_default_pool"},
    };
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++) {
        *strings[i].slot = PyUnicode_InternFromString(strings[i].text);
        if (*strings[i].slot == NULL) {
            return -1;
        }
    }
    if (cs_args_exec(state) < 0) {
        return -1;
    }
    PyObject *abc = PyImport_ImportModule("collections.abc");
    if (abc == NULL) {
        return -1;
    }
    state->mapping_abc = PyObject_GetAttrString(abc, "Mapping");
    Py_DECREF(abc);
    if (state->mapping_abc == NULL) {
        return -1;
    }
    /* PyModule_AddIntConstant takes a C long: 32 bits on LLP64 (Windows),
     * which would make VALUE_MAX -1. */
    if (PyModule_AddIntConstant(module, "ABI_VERSION",
                                CS_LEDGER_ABI_VERSION) < 0 ||
        add_u64_constant(module, "VALUE_MAX", CS_VALUE_MAX) < 0 ||
        add_u64_constant(module, "DEFAULT_FLOOR", CS_DEFAULT_FLOOR) < 0) {
        return -1;
    }
    if (cs_ledger_binding_exec(module, state) < 0 ||
        cs_standin_exec(module, state) < 0 ||
        cs_probe_binding_exec(module, state) < 0 ||
        cs_board_binding_exec(module, state) < 0) {
        return -1;
    }
    state->ready = 1;
    return 0;
}

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* All state is per module: safe in subinterpreters with their own GIL.
     * Free-threaded builds are not claimed (Py_mod_gil is not set), because
     * the Python-object fields rely on the GIL. */
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "comfy_standin._core",
    .m_doc = "C core of comfy_standin: the residency ledger, the stand-in "
             "type and the state sync.",
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
