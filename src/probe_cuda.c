/*
 * probe_cuda.c -- the CUDA driver half of the GPU probe (probe.c): the
 * driver loaded from its library with its symbols at a pinned ABI, and
 * the device table it enumerates.  Runs once, under the loader's guard.
 */
#include "probe_internal.h"

#include <string.h>

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", NVML's spelling of the same
 * 16 bytes, so CUDA and NVML devices can be matched whatever their order
 * (CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES). */
static void
uuid_format(const cs_cu_uuid *uuid, char *buffer, size_t size)
{
    static const char digits[] = "0123456789abcdef";
    char text[4 + 32 + 4 + 1];
    size_t at = 0;
    memcpy(text, "GPU-", 4);
    at = 4;
    for (size_t i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10) {
            text[at++] = '-';
        }
        text[at++] = digits[uuid->bytes[i] >> 4];
        text[at++] = digits[uuid->bytes[i] & 0xf];
    }
    text[at] = '\0';
    probe_text_copy(buffer, size, text);
}

void
probe_cuda_describe(cs_cu_result result, const char *call, char *buffer,
                    size_t size)
{
    const char *name = NULL;
    /* cuGetErrorName needs no context and no cuInit. */
    if (cs_probe_state.cuda.get_error_name == NULL
        || cs_probe_state.cuda.get_error_name(result, &name) != CS_CUDA_SUCCESS
        || name == NULL) {
        name = "unknown error";
    }
    probe_message_format(buffer, size, "%s: %s (CUDA error %d)", call, name,
                         result);
}

/* ---- CUDA driver ---------------------------------------------------- */

/* A driver symbol at the pinned ABI: through cuGetProcAddress when the
 * driver has it, else by its explicitly versioned export name (e.g.
 * cuDeviceTotalMem_v2), never the unversioned name whose ABI the header
 * macros would have picked. */
static bool
cuda_resolve(library_handle handle, const char *base_name,
             const char *export_name, void *function, size_t function_size)
{
    if (cs_probe_state.cuda.get_proc_address != NULL) {
        void *address = NULL;
        cs_cu_result result = cs_probe_state.cuda.get_proc_address(
            base_name, &address, CS_CUDA_PINNED_VERSION,
            CS_CU_GET_PROC_ADDRESS_DEFAULT);
        if (result == CS_CUDA_SUCCESS && address != NULL
            && function_size == sizeof(address)) {
            memcpy(function, &address, sizeof(address));
            return true;
        }
    }
    return probe_library_symbol(handle, export_name, function, function_size);
}

#define CUDA_RESOLVE(handle, base, export, target) \
    cuda_resolve((handle), (base), (export), &(target), sizeof(target))

/* The driver's entry points at the pinned ABI; false (with the library's
 * error set) when a required one is missing. */
static bool
cuda_resolve_all(library_handle handle, cs_probe_library *library,
                 cuda_functions *cuda)
{
    const char *missing = NULL;

    /* Optional: without it every symbol comes from its versioned name. */
    (void)LIBRARY_SYMBOL(handle, "cuGetProcAddress", cuda->get_proc_address);
    if (!CUDA_RESOLVE(handle, "cuInit", "cuInit", cuda->init)) {
        missing = "cuInit";
    }
    else if (!CUDA_RESOLVE(handle, "cuDeviceGetCount", "cuDeviceGetCount",
                           cuda->device_get_count)) {
        missing = "cuDeviceGetCount";
    }
    else if (!CUDA_RESOLVE(handle, "cuDeviceGet", "cuDeviceGet",
                           cuda->device_get)) {
        missing = "cuDeviceGet";
    }
    if (missing != NULL) {
        probe_message_format(library->error, sizeof(library->error),
                             "symbol %s not found", missing);
        return false;
    }
    /* Optional symbols: a missing one costs only the figure it reads. */
    (void)CUDA_RESOLVE(handle, "cuGetErrorName", "cuGetErrorName",
                       cuda->get_error_name);
    (void)CUDA_RESOLVE(handle, "cuDriverGetVersion", "cuDriverGetVersion",
                       cuda->driver_get_version);
    (void)CUDA_RESOLVE(handle, "cuDeviceGetName", "cuDeviceGetName",
                       cuda->device_get_name);
    (void)CUDA_RESOLVE(handle, "cuDeviceTotalMem", "cuDeviceTotalMem_v2",
                       cuda->device_total_mem);
    (void)CUDA_RESOLVE(handle, "cuDeviceGetUuid", "cuDeviceGetUuid",
                       cuda->device_get_uuid);
    (void)CUDA_RESOLVE(handle, "cuCtxGetCurrent", "cuCtxGetCurrent",
                       cuda->ctx_get_current);
    (void)CUDA_RESOLVE(handle, "cuCtxGetDevice", "cuCtxGetDevice",
                       cuda->ctx_get_device);
    (void)CUDA_RESOLVE(handle, "cuMemGetInfo", "cuMemGetInfo_v2",
                       cuda->mem_get_info);
    return true;
}

void
probe_cuda_load(const cs_probe_options *options)
{
    cs_probe_library *library = &cs_probe_state.cuda_library;
    cuda_functions *cuda = &cs_probe_state.cuda;
    const char *path = probe_option_path(
        options->libcuda, options->libcuda_too_long, "COMFY_STANDIN_LIBCUDA",
        library->error, sizeof(library->error));
    library_handle handle =
        path == NULL ? NULL
                     : probe_library_open(path, CS_LIBCUDA_DEFAULT,
                                          &library->preloaded, library->error,
                                          sizeof(library->error));
    cs_cu_result result;

    if (handle == NULL || !cuda_resolve_all(handle, library, cuda)) {
        goto error;
    }
    /* cuInit creates no context; it is idempotent, so calling it in a
     * process where torch already did is harmless. */
    result = cuda->init(0);
    if (result != CS_CUDA_SUCCESS) {
        probe_cuda_describe(result, "cuInit", library->error,
                            sizeof(library->error));
        goto error;
    }
    if (cuda->driver_get_version != NULL) {
        int version = 0;
        if (cuda->driver_get_version(&version) == CS_CUDA_SUCCESS) {
            library->has_driver_version = true;
            library->driver_version = version;
        }
    }
    /* A function pointer as an object pointer, the ISO C way: the POSIX
     * path lookup (dladdr) needs an address inside the library. */
    void *symbol = NULL;
    memcpy(&symbol, &cuda->init, sizeof(symbol));
    probe_library_path(handle, symbol, library->path, sizeof(library->path));
    library->loaded = true;
    return;

error:
    /* The handle (if any) stays open: unloading a driver library that
     * another part of the process may share is never safe. */
    memset(cuda, 0, sizeof(*cuda));
    library->loaded = false;
    library->preloaded = false;
}

/* ---- the device table ----------------------------------------------- */

/* A failed query's message, kept only when the device has none yet. */
static void
cuda_device_error(device_static *device, cs_cu_result result,
                  const char *call)
{
    char message[CS_PROBE_MESSAGE_SIZE];
    probe_cuda_describe(result, call, message, sizeof(message));
    probe_message_set_first(device->error, sizeof(device->error), message);
}

static void
cuda_device_uuid(const cuda_functions *cuda, device_static *device)
{
    /* CUuuid is 16 bytes; room beyond it shows a driver that wrote more. */
    union {
        cs_cu_uuid uuid;
        unsigned char bytes[32];
    } answer;
    cs_cu_result result;

    memset(answer.bytes, probe_sentinel_bytes[0], sizeof(answer.bytes));
    result = cuda->device_get_uuid(&answer.uuid, device->cuda_device);
    if (result != CS_CUDA_SUCCESS) {
        cuda_device_error(device, result, "cuDeviceGetUuid");
    }
    else if (probe_written_extent(answer.bytes, sizeof(answer.bytes),
                                  probe_sentinel_bytes[0])
             > sizeof(cs_cu_uuid)) {
        probe_message_set_first(device->error, sizeof(device->error),
                                "cuDeviceGetUuid: the driver wrote beyond "
                                "the 16 bytes of CUuuid");
    }
    else {
        uuid_format(&answer.uuid, device->uuid, sizeof(device->uuid));
    }
}

/* One device's static facts: its handle, name, total memory and UUID. */
static void
cuda_device_read(const cuda_functions *cuda, device_static *device,
                 int ordinal)
{
    cs_cu_result result;

    device->index = (uint32_t)ordinal;
    device->nvml_index = -1;
    result = cuda->device_get(&device->cuda_device, ordinal);
    if (result != CS_CUDA_SUCCESS) {
        probe_cuda_describe(result, "cuDeviceGet", device->error,
                            sizeof(device->error));
        return;
    }
    device->has_cuda_device = true;
    if (cuda->device_get_name != NULL) {
        result = cuda->device_get_name(device->name,
                                       (int)sizeof(device->name),
                                       device->cuda_device);
        if (result != CS_CUDA_SUCCESS) {
            device->name[0] = '\0';
            cuda_device_error(device, result, "cuDeviceGetName");
        }
        device->name[sizeof(device->name) - 1] = '\0';
    }
    if (cuda->device_total_mem != NULL) {
        size_t total = 0;
        result = cuda->device_total_mem(&total, device->cuda_device);
        if (result == CS_CUDA_SUCCESS) {
            device->has_cuda_total = true;
            device->cuda_total = (uint64_t)total;
        }
        else {
            cuda_device_error(device, result, "cuDeviceTotalMem");
        }
    }
    if (cuda->device_get_uuid != NULL) {
        cuda_device_uuid(cuda, device);
    }
}

void
probe_cuda_enumerate(void)
{
    cuda_functions *cuda = &cs_probe_state.cuda;
    int count = 0;
    cs_cu_result result = cuda->device_get_count(&count);

    if (result != CS_CUDA_SUCCESS) {
        probe_cuda_describe(result, "cuDeviceGetCount",
                            cs_probe_state.cuda_library.error,
                            sizeof(cs_probe_state.cuda_library.error));
        return;
    }
    if (count > CS_PROBE_MAX_DEVICES) {
        cs_probe_state.devices_truncated = true;
        count = CS_PROBE_MAX_DEVICES;
    }
    for (int ordinal = 0; ordinal < count; ordinal++) {
        cuda_device_read(cuda, &cs_probe_state.devices[ordinal], ordinal);
    }
    cs_probe_state.device_count = (size_t)count;
    cs_probe_state.devices_from_cuda = true;
}
