/*
 * probe_binding.c -- `comfy_standin._core.probe()`: runs the C probe
 * (src/probe.c) with the GIL released and turns its result into a dict.
 *
 * The environment (the library overrides) is read here, with the GIL
 * held, and handed to the core as a copy: os.environ writes from other
 * threads run under the GIL, and getenv() racing setenv() is undefined
 * (a crash on older glibc).  The core never reads it behind our back.
 *
 * The probe keeps no Python state: the module state is not touched, and
 * the function is safe under free-threading (the core is thread-safe and
 * each call builds fresh objects).
 */
#include "binding.h"

#include "comfy_standin/probe.h"

/* Sets dict[key] = value and drops the caller's reference to value, so a
 * builder can write `dict_set_new(d, "k", PyLong_From...(...))`.  A NULL
 * value means its constructor failed (the exception is set). */
static int
dict_set_new(PyObject *dict, const char *key, PyObject *value)
{
    if (value == NULL) {
        return -1;
    }
    int status = PyDict_SetItemString(dict, key, value);
    Py_DECREF(value);
    return status;
}

static PyObject *
text_or_none(const char *text)
{
    if (text[0] == '\0') {
        Py_RETURN_NONE;
    }
    /* Loader and driver text is not promised to be UTF-8 (a dlerror()
     * path can be anything): never let decoding raise. */
    return PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
}

static PyObject *
library_to_dict(const cs_probe_library *library)
{
    PyObject *dict = PyDict_New();
    if (dict == NULL) {
        return NULL;
    }
    if (dict_set_new(dict, "loaded", PyBool_FromLong(library->loaded)) < 0
        || dict_set_new(dict, "error", text_or_none(library->error)) < 0
        || dict_set_new(dict, "path", text_or_none(library->path)) < 0
        || dict_set_new(dict, "driver_version",
                        library->has_driver_version
                            ? PyLong_FromLong(library->driver_version)
                            : Py_NewRef(Py_None)) < 0
        || dict_set_new(dict, "preloaded",
                        PyBool_FromLong(library->preloaded)) < 0) {
        goto error;
    }
    return dict;

error:
    Py_DECREF(dict);
    return NULL;
}

static PyObject *
processes_to_dict(const cs_probe_device *device)
{
    if (!device->has_processes) {
        Py_RETURN_NONE; /* unknown, which is not "none running" */
    }
    PyObject *processes = PyDict_New();
    PyObject *pid = NULL;
    PyObject *used = NULL;
    if (processes == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < device->process_count; i++) {
        const cs_probe_process *process = &device->processes[i];
        pid = PyLong_FromUnsignedLong(process->pid);
        if (pid == NULL) {
            goto error;
        }
        used = process->used_bytes == CS_PROBE_USED_UNKNOWN
                   ? Py_NewRef(Py_None)
                   : PyLong_FromUnsignedLongLong(process->used_bytes);
        if (used == NULL || PyDict_SetItem(processes, pid, used) < 0) {
            goto error;
        }
        Py_CLEAR(pid);
        Py_CLEAR(used);
    }
    return processes;

error:
    Py_XDECREF(pid);
    Py_XDECREF(used);
    Py_DECREF(processes);
    return NULL;
}

static PyObject *
bytes_or_none(bool known, uint64_t value)
{
    if (!known) {
        Py_RETURN_NONE;
    }
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *
device_to_dict(const cs_probe_device *device)
{
    PyObject *dict = PyDict_New();
    if (dict == NULL) {
        return NULL;
    }
    if (dict_set_new(dict, "index", PyLong_FromUnsignedLong(device->index))
            < 0
        || dict_set_new(dict, "nvml_index",
                        device->nvml_index >= 0
                            ? PyLong_FromLong(device->nvml_index)
                            : Py_NewRef(Py_None)) < 0
        || dict_set_new(dict, "name", text_or_none(device->name)) < 0
        || dict_set_new(dict, "uuid", text_or_none(device->uuid)) < 0
        || dict_set_new(dict, "total",
                        bytes_or_none(device->has_total,
                                      device->total_bytes)) < 0
        || dict_set_new(dict, "free",
                        bytes_or_none(device->has_free,
                                      device->free_bytes)) < 0
        || dict_set_new(dict, "processes", processes_to_dict(device)) < 0
        || dict_set_new(dict, "processes_truncated",
                        PyBool_FromLong(device->processes_truncated)) < 0
        || dict_set_new(dict, "processes_error",
                        text_or_none(device->processes_error)) < 0
        || dict_set_new(dict, "process_entry_size",
                        device->process_entry_size != 0
                            ? PyLong_FromUnsignedLong(
                                  device->process_entry_size)
                            : Py_NewRef(Py_None)) < 0
        || dict_set_new(dict, "source",
                        device->source == CS_PROBE_SOURCE_NONE
                            ? Py_NewRef(Py_None)
                            : PyUnicode_FromString(
                                  cs_probe_source_name(device->source)))
               < 0
        || dict_set_new(dict, "error", text_or_none(device->error)) < 0) {
        goto error;
    }
    return dict;

error:
    Py_DECREF(dict);
    return NULL;
}

static PyObject *
result_to_dict(const cs_probe_result *result)
{
    PyObject *dict = PyDict_New();
    PyObject *devices = NULL;
    if (dict == NULL) {
        return NULL;
    }
    devices = PyList_New((Py_ssize_t)result->device_count);
    if (devices == NULL) {
        goto error;
    }
    for (size_t i = 0; i < result->device_count; i++) {
        PyObject *device = device_to_dict(&result->devices[i]);
        if (device == NULL) {
            goto error;
        }
        PyList_SET_ITEM(devices, (Py_ssize_t)i, device); /* steals */
    }
    if (dict_set_new(dict, "cuda", library_to_dict(&result->cuda)) < 0
        || dict_set_new(dict, "nvml", library_to_dict(&result->nvml)) < 0
        || PyDict_SetItemString(dict, "devices", devices) < 0
        || dict_set_new(dict, "devices_truncated",
                        PyBool_FromLong(result->devices_truncated)) < 0
        || dict_set_new(dict, "elapsed_ns",
                        PyLong_FromUnsignedLongLong(result->elapsed_ns))
               < 0) {
        goto error;
    }
    Py_DECREF(devices);
    return dict;

error:
    Py_XDECREF(devices);
    Py_DECREF(dict);
    return NULL;
}

PyDoc_STRVAR(probe_doc,
"probe()\n"
"--\n"
"\n"
"Read the GPUs through NVML and the CUDA driver, loaded on first use.\n"
"\n"
"Returns a dict: 'cuda' and 'nvml' ({'loaded', 'error', 'path',\n"
"'driver_version', 'preloaded'}), 'devices' (a list of {'index',\n"
"'nvml_index', 'name', 'uuid', 'total', 'free', 'processes' ({pid:\n"
"used bytes or None}, or None when unreadable), 'processes_truncated',\n"
"'processes_error' (why 'processes' is None), 'process_entry_size',\n"
"'source' ('nvml', 'cuda' or None), 'error'}), 'devices_truncated' and\n"
"'elapsed_ns'.  Never raises (bar MemoryError) and never creates a CUDA\n"
"context.  See docs/probe.md.");

static PyObject *
probe_probe(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    /* About 45 KiB: too much for small thread stacks. */
    cs_probe_result *result = PyMem_RawMalloc(sizeof(*result));
    cs_probe_options options;
    PyObject *dict;
    if (result == NULL) {
        return PyErr_NoMemory();
    }
    /* With the GIL held: no os.environ write can run meanwhile. */
    cs_probe_options_from_environment(&options);
    /* The first call dlopens and runs cuInit/nvmlInit (hundreds of ms);
     * later calls are driver ioctls.  Neither needs the GIL. */
    Py_BEGIN_ALLOW_THREADS
    cs_probe_run_with(&options, result);
    Py_END_ALLOW_THREADS
    dict = result_to_dict(result);
    PyMem_RawFree(result);
    return dict;
}

static PyMethodDef probe_methods[] = {
    {"probe", probe_probe, METH_NOARGS, probe_doc},
    {NULL, NULL, 0, NULL},
};

int
cs_probe_binding_exec(PyObject *module, cs_module_state *state)
{
    (void)state; /* the probe keeps nothing in the module state */
    return PyModule_AddFunctions(module, probe_methods);
}
