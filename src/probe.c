/*
 * probe.c -- the GPU probe (see include/comfy_standin/probe.h).
 *
 * Layout: the few NVML and CUDA driver types the probe needs, declared
 * here from the public API documentation (so the build needs no CUDA
 * toolkit); a small platform layer (dlopen / LoadLibraryExW); the
 * once-only loader, which also builds the device table of things that
 * cannot change in a process's lifetime; and the per-call reader.
 *
 * Thread safety: `probe_state` is written only inside probe_initialize(),
 * which runs exactly once under the once-guard; every reader goes through
 * probe_ensure_initialized() first, so the guard's happens-before makes
 * the whole struct visible and it is read-only from then on.  Per-call
 * data lives on the caller's stack, in the caller's result, or in a heap
 * buffer the call frees.
 *
 * The environment is read only in cs_probe_options_from_environment():
 * the loader works from the options it is handed.
 *
 * Driver structs are never trusted by declaration alone: each answer is
 * written into a sentinel-filled buffer larger than the struct, and how
 * far the driver wrote is checked against the layout (the process list's
 * entry size is measured that way on every call; see read_processes).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr(), RTLD_NOLOAD */
#endif

#include "comfy_standin/probe.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <errno.h>
#include <windows.h>
#else
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>
#endif

/* ---- the public API types the probe uses --------------------------- */

#ifdef _WIN32
#define CS_CUDAAPI __stdcall /* CUDAAPI in cuda.h; no-op on x64 */
#else
#define CS_CUDAAPI
#endif

typedef int cs_cu_result;      /* CUresult; CUDA_SUCCESS is 0 */
typedef int cs_cu_device;      /* CUdevice */
typedef void *cs_cu_context;   /* CUcontext */
typedef struct {
    unsigned char bytes[16];
} cs_cu_uuid;                  /* CUuuid */

#define CS_CUDA_SUCCESS 0

/* The CUDA version whose symbol ABI the probe is written against.  Any
 * driver that exports cuGetProcAddress knows 11.3, so asking for 11030
 * always resolves; it selects the size_t (_v2) variants of
 * cuDeviceTotalMem and cuMemGetInfo, the ones declared below. */
#define CS_CUDA_PINNED_VERSION 11030
#define CS_CU_GET_PROC_ADDRESS_DEFAULT 0

typedef cs_cu_result (CS_CUDAAPI *cs_cu_get_proc_address_fn)(
    const char *symbol, void **function, int cuda_version, uint64_t flags);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_init_fn)(unsigned int flags);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_int_out_fn)(int *value);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_device_get_fn)(cs_cu_device *device,
                                                        int ordinal);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_device_get_name_fn)(
    char *name, int length, cs_cu_device device);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_device_total_mem_fn)(
    size_t *bytes, cs_cu_device device);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_device_get_uuid_fn)(
    cs_cu_uuid *uuid, cs_cu_device device);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_ctx_get_current_fn)(
    cs_cu_context *context);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_ctx_get_device_fn)(
    cs_cu_device *device);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_mem_get_info_fn)(size_t *free_bytes,
                                                          size_t *total);
typedef cs_cu_result (CS_CUDAAPI *cs_cu_get_error_name_fn)(
    cs_cu_result error, const char **name);

typedef int cs_nvml_return;    /* nvmlReturn_t */
typedef void *cs_nvml_device;  /* nvmlDevice_t */

#define CS_NVML_SUCCESS 0
#define CS_NVML_ERROR_INSUFFICIENT_SIZE 7
#define CS_NVML_VALUE_NOT_AVAILABLE (~0ULL)

/* nvmlMemory_t (v1): three 8-byte fields, 24 bytes, no version field.
 * The _v2 call (nvmlMemory_v2_t, with a version field) is not used: its
 * extra "reserved" figure is not needed, and v1's free figure is the same
 * device-wide one.  The answer is still measured (read_memory). */
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} cs_nvml_memory;

/* The process list's entries.  Every layout in the field starts the same
 * way -- pid (4 bytes), padding, usedGpuMemory (8 bytes at offset 8) --
 * and differs in what follows and so in its size, which no entry point
 * reliably implies:
 *   16 bytes  nvmlProcessInfo_v1_t (also seen from _v3 on 550.127)
 *   24 bytes  nvmlProcessInfo_v2_t: + gpuInstanceId, computeInstanceId
 *   32 bytes  R535.54-era _v3: + usedGpuCcProtectedMemory (8 bytes)
 * read_processes measures which one the driver wrote. */
#define CS_NVML_PROCESS_PID 0
#define CS_NVML_PROCESS_USED 8
#define CS_NVML_PROCESS_GPU_INSTANCE 16
#define CS_NVML_PROCESS_COMPUTE_INSTANCE 20
#define CS_NVML_PROCESS_CC_PROTECTED 24
#define CS_NVML_PROCESS_MAX_SIZE 32
/* gpuInstanceId / computeInstanceId without MIG. */
#define CS_NVML_NO_INSTANCE 0xFFFFFFFFu

typedef cs_nvml_return (*cs_nvml_init_fn)(void);
typedef cs_nvml_return (*cs_nvml_get_count_fn)(unsigned int *count);
typedef cs_nvml_return (*cs_nvml_get_handle_fn)(unsigned int index,
                                                cs_nvml_device *device);
typedef cs_nvml_return (*cs_nvml_get_string_fn)(cs_nvml_device device,
                                                char *text,
                                                unsigned int length);
typedef cs_nvml_return (*cs_nvml_get_memory_fn)(cs_nvml_device device,
                                                cs_nvml_memory *memory);
typedef cs_nvml_return (*cs_nvml_get_processes_fn)(cs_nvml_device device,
                                                   unsigned int *count,
                                                   void *infos);
typedef cs_nvml_return (*cs_nvml_int_out_fn)(int *value);
typedef const char *(*cs_nvml_error_string_fn)(cs_nvml_return result);

/* ---- the state built once ------------------------------------------ */

typedef struct {
    cs_cu_get_proc_address_fn get_proc_address;
    cs_cu_init_fn init;
    cs_cu_int_out_fn driver_get_version;
    cs_cu_int_out_fn device_get_count;
    cs_cu_device_get_fn device_get;
    cs_cu_device_get_name_fn device_get_name;
    cs_cu_device_total_mem_fn device_total_mem;
    cs_cu_device_get_uuid_fn device_get_uuid;
    cs_cu_ctx_get_current_fn ctx_get_current;
    cs_cu_ctx_get_device_fn ctx_get_device;
    cs_cu_mem_get_info_fn mem_get_info;
    cs_cu_get_error_name_fn get_error_name;
} cuda_functions;

typedef struct {
    cs_nvml_init_fn init;
    cs_nvml_get_count_fn device_get_count;
    cs_nvml_get_handle_fn device_get_handle_by_index;
    cs_nvml_get_string_fn device_get_name;
    cs_nvml_get_string_fn device_get_uuid;
    cs_nvml_get_memory_fn device_get_memory_info;
    cs_nvml_get_processes_fn device_get_processes;
    const char *processes_symbol;
    cs_nvml_int_out_fn system_get_cuda_driver_version;
    cs_nvml_error_string_fn error_string;
} nvml_functions;

/* What never changes about a device while the process lives. */
typedef struct {
    uint32_t index;
    bool has_cuda_device;
    cs_cu_device cuda_device;
    bool has_cuda_total;
    uint64_t cuda_total;
    int nvml_index;
    cs_nvml_device nvml_device;
    char name[CS_PROBE_NAME_SIZE];
    char uuid[CS_PROBE_UUID_SIZE];
    char error[CS_PROBE_MESSAGE_SIZE];
} device_static;

static struct {
    cs_probe_library cuda_library; /* as every result starts out */
    cs_probe_library nvml_library;
    cuda_functions cuda;
    nvml_functions nvml;
    size_t device_count;
    bool devices_truncated;
    /* The driver enumerated (even zero devices): the table is CUDA's and
     * NVML only fills in; devices hidden from CUDA stay out. */
    bool devices_from_cuda;
    device_static devices[CS_PROBE_MAX_DEVICES];
} probe_state;

/* ---- small helpers -------------------------------------------------- */

/* snprintf that tolerates truncation (a cut message is still useful) and
 * keeps -Wformat-truncation quiet about it. */
static void
message_format(char *buffer, size_t size, const char *format, ...)
{
    va_list arguments;
    va_start(arguments, format);
    int written = vsnprintf(buffer, size, format, arguments);
    va_end(arguments);
    if (written < 0 && size > 0) {
        buffer[0] = '\0';
    }
}

/* Keeps the first failure: later ones are usually consequences. */
static void
message_set_first(char *buffer, size_t size, const char *text)
{
    if (buffer[0] == '\0') {
        message_format(buffer, size, "%s", text);
    }
}

static void
text_copy(char *buffer, size_t size, const char *text)
{
    message_format(buffer, size, "%s", text);
}

static uint64_t
monotonic_ns(void)
{
#ifdef _WIN32
    LARGE_INTEGER counter, frequency;
    if (!QueryPerformanceCounter(&counter)
        || !QueryPerformanceFrequency(&frequency)
        || frequency.QuadPart <= 0) {
        return 0;
    }
    uint64_t ticks = (uint64_t)counter.QuadPart;
    uint64_t per_second = (uint64_t)frequency.QuadPart;
    return (ticks / per_second) * 1000000000u
           + (ticks % per_second) * 1000000000u / per_second;
#else
    struct timespec now;
    if (clock_gettime(CLOCK_MONOTONIC, &now) != 0) {
        return 0;
    }
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
#endif
}

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
    text_copy(buffer, size, text);
}

static bool
uuid_equal(const char *a, const char *b)
{
    if (a[0] == '\0' || b[0] == '\0') {
        return false;
    }
    for (;; a++, b++) {
        char x = *a, y = *b;
        if (x >= 'A' && x <= 'Z') {
            x = (char)(x - 'A' + 'a');
        }
        if (y >= 'A' && y <= 'Z') {
            y = (char)(y - 'A' + 'a');
        }
        if (x != y) {
            return false;
        }
        if (x == '\0') {
            return true;
        }
    }
}

/* Driver answers go into buffers filled with a sentinel first.  Two
 * fill bytes: an answer that is ambiguous under the first (a field that
 * happens to equal it) is measured again under the second.  Neither is
 * 0x00 or 0xFF, the bytes real fields mostly end with. */
static const unsigned char sentinel_bytes[2] = {0xA5, 0x5A};

/* How many leading bytes of `buffer` the driver wrote: up to the last one
 * that differs from the fill.  Never more than it wrote; less only when
 * the last bytes it wrote equal the fill. */
static size_t
written_extent(const unsigned char *buffer, size_t size,
               unsigned char sentinel)
{
    /* Eight bytes a step over the untouched tail (most of the buffer),
     * then byte by byte. */
    uint64_t fill;
    memset(&fill, sentinel, sizeof(fill));
    while (size >= sizeof(fill)) {
        uint64_t word;
        memcpy(&word, buffer + size - sizeof(fill), sizeof(word));
        if (word != fill) {
            break;
        }
        size -= sizeof(fill);
    }
    while (size > 0 && buffer[size - 1] == sentinel) {
        size--;
    }
    return size;
}

static void
cuda_describe(cs_cu_result result, const char *call, char *buffer,
              size_t size)
{
    const char *name = NULL;
    /* cuGetErrorName needs no context and no cuInit. */
    if (probe_state.cuda.get_error_name == NULL
        || probe_state.cuda.get_error_name(result, &name) != CS_CUDA_SUCCESS
        || name == NULL) {
        name = "unknown error";
    }
    message_format(buffer, size, "%s: %s (CUDA error %d)", call, name,
                   result);
}

static void
nvml_describe(cs_nvml_return result, const char *call, char *buffer,
              size_t size)
{
    const char *text = NULL;
    if (probe_state.nvml.error_string != NULL) {
        text = probe_state.nvml.error_string(result);
    }
    if (text == NULL) {
        text = "unknown error";
    }
    message_format(buffer, size, "%s: %s (NVML error %d)", call, text,
                   result);
}

/* The override path `options` gives for `variable` ("" none), or NULL
 * with the reason in `error` when it did not fit. */
static const char *
option_path(const char *path, bool too_long, const char *variable,
            char *error, size_t error_size)
{
    if (too_long) {
        message_format(error, error_size,
                       "%s is longer than %d bytes: not loaded", variable,
                       CS_PROBE_PATH_SIZE - 1);
        return NULL;
    }
    return path;
}

/* ---- platform layer: open a library, find a symbol ------------------ */

#ifdef _WIN32

typedef HMODULE library_handle;

static void
windows_error_text(DWORD code, char *buffer, size_t size)
{
    char text[CS_PROBE_MESSAGE_SIZE];
    DWORD length = FormatMessageA(
        FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS, NULL,
        code, 0, text, (DWORD)sizeof(text), NULL);
    /* FormatMessage ends its text with "\r\n". */
    while (length > 0
           && (text[length - 1] == '\n' || text[length - 1] == '\r')) {
        length--;
    }
    text[length] = '\0';
    message_format(buffer, size, "%s (Windows error %lu)",
                   length ? text : "unknown error", (unsigned long)code);
}

static void
library_path(library_handle handle, void *symbol, char *buffer, size_t size)
{
    wchar_t wide[CS_PROBE_PATH_SIZE];
    (void)symbol; /* the module handle names the file on Windows */
    DWORD length = GetModuleFileNameW(handle, wide, CS_PROBE_PATH_SIZE);
    if (length == 0 || length >= CS_PROBE_PATH_SIZE
        || WideCharToMultiByte(CP_UTF8, 0, wide, -1, buffer, (int)size, NULL,
                               NULL) == 0) {
        buffer[0] = '\0';
    }
}

/* Tries the already loaded module first (GetModuleHandleExW takes a
 * reference, which is never dropped: the probe never unloads), then loads
 * it: an override path as given, a bare name from System32 only (so the
 * current directory cannot plant a DLL). */
static library_handle
library_open_one(const wchar_t *name, bool is_path, bool *preloaded,
                 char *error, size_t error_size)
{
    HMODULE handle = NULL;
    if (GetModuleHandleExW(0, name, &handle) && handle != NULL) {
        *preloaded = true;
        return handle;
    }
    DWORD flags = is_path ? LOAD_WITH_ALTERED_SEARCH_PATH
                          : LOAD_LIBRARY_SEARCH_SYSTEM32;
    handle = LoadLibraryExW(name, NULL, flags);
    if (handle == NULL) {
        windows_error_text(GetLastError(), error, error_size);
    }
    return handle;
}

/* `override_path` is UTF-8 ("" none): the options carry what _wgetenv_s
 * read, so non-ASCII paths stay intact. */
static library_handle
library_open(const char *override_path, const char *default_name,
             bool *preloaded, char *error, size_t error_size)
{
    const wchar_t *override = NULL;
    wchar_t override_name[CS_PROBE_PATH_SIZE];
    if (override_path[0] != '\0') {
        if (MultiByteToWideChar(CP_UTF8, 0, override_path, -1,
                                override_name, CS_PROBE_PATH_SIZE) == 0) {
            windows_error_text(GetLastError(), error, error_size);
            return NULL;
        }
        override = override_name;
    }
    if (override != NULL) {
        return library_open_one(override, true, preloaded, error,
                                error_size);
    }
    if (strcmp(default_name, "nvml") == 0) {
        /* nvml.dll sits in System32 with DCH drivers, in NVSMI with older
         * ones. */
        library_handle handle = library_open_one(L"nvml.dll", false,
                                                 preloaded, error,
                                                 error_size);
        wchar_t nvsmi[CS_PROBE_PATH_SIZE];
        DWORD length;
        if (handle != NULL) {
            return handle;
        }
        /* The one environment read outside the options: the OS's own
         * call, which holds the process environment lock. */
        length = ExpandEnvironmentStringsW(
            L"%ProgramFiles%\\NVIDIA Corporation\\NVSMI\\nvml.dll", nvsmi,
            CS_PROBE_PATH_SIZE);
        if (length == 0 || length > CS_PROBE_PATH_SIZE) {
            return NULL;
        }
        handle = library_open_one(nvsmi, true, preloaded, error,
                                  error_size);
        return handle;
    }
    return library_open_one(L"nvcuda.dll", false, preloaded, error,
                            error_size);
}

static bool
library_symbol(library_handle handle, const char *name, void *function,
               size_t function_size)
{
    FARPROC address = GetProcAddress(handle, name);
    if (address == NULL || function_size != sizeof(address)) {
        return false;
    }
    memcpy(function, &address, sizeof(address));
    return true;
}

#define CS_LIBCUDA_DEFAULT "cuda"
#define CS_LIBNVML_DEFAULT "nvml"

#else /* POSIX */

typedef void *library_handle;

static void
library_path(library_handle handle, void *symbol, char *buffer, size_t size)
{
    Dl_info info;
    (void)handle;
    if (symbol != NULL && dladdr(symbol, &info) != 0
        && info.dli_fname != NULL) {
        text_copy(buffer, size, info.dli_fname);
    }
}

/* A copy already in the process wins (RTLD_NOLOAD finds it by soname or
 * path): a second libcuda beside the one torch loaded would be a second
 * driver instance.  RTLD_LOCAL keeps its symbols out of the global scope.
 * The handle is never dlclose()d: function pointers into it live as long
 * as the process. */
static library_handle
library_open(const char *override_path, const char *default_name,
             bool *preloaded, char *error, size_t error_size)
{
    const char *name = override_path[0] != '\0' ? override_path
                                                : default_name;
    void *handle = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (handle != NULL) {
        *preloaded = true;
        return handle;
    }
    (void)dlerror(); /* a failed NOLOAD is not the error to report */
    handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        const char *text = dlerror();
        message_format(error, error_size, "%s",
                       text != NULL ? text : "dlopen failed");
    }
    return handle;
}

/* dlsym() returns an object pointer; copying its bytes into the function
 * pointer is the POSIX-sanctioned conversion and keeps -Wpedantic quiet. */
static bool
library_symbol(library_handle handle, const char *name, void *function,
               size_t function_size)
{
    void *address = dlsym(handle, name);
    if (address == NULL || function_size != sizeof(address)) {
        return false;
    }
    memcpy(function, &address, sizeof(address));
    return true;
}

#define CS_LIBCUDA_DEFAULT "libcuda.so.1"
#define CS_LIBNVML_DEFAULT "libnvidia-ml.so.1"

#endif

#define LIBRARY_SYMBOL(handle, name, target) \
    library_symbol((handle), (name), &(target), sizeof(target))

/* ---- CUDA driver ---------------------------------------------------- */

/* A driver symbol at the pinned ABI: through cuGetProcAddress when the
 * driver has it, else by its explicitly versioned export name (e.g.
 * cuDeviceTotalMem_v2), never the unversioned name whose ABI the header
 * macros would have picked. */
static bool
cuda_resolve(library_handle handle, const char *base_name,
             const char *export_name, void *function, size_t function_size)
{
    if (probe_state.cuda.get_proc_address != NULL) {
        void *address = NULL;
        cs_cu_result result = probe_state.cuda.get_proc_address(
            base_name, &address, CS_CUDA_PINNED_VERSION,
            CS_CU_GET_PROC_ADDRESS_DEFAULT);
        if (result == CS_CUDA_SUCCESS && address != NULL
            && function_size == sizeof(address)) {
            memcpy(function, &address, sizeof(address));
            return true;
        }
    }
    return library_symbol(handle, export_name, function, function_size);
}

#define CUDA_RESOLVE(handle, base, export, target) \
    cuda_resolve((handle), (base), (export), &(target), sizeof(target))

static void
cuda_load(const cs_probe_options *options)
{
    cs_probe_library *library = &probe_state.cuda_library;
    cuda_functions *cuda = &probe_state.cuda;
    const char *path = option_path(
        options->libcuda, options->libcuda_too_long, "COMFY_STANDIN_LIBCUDA",
        library->error, sizeof(library->error));
    library_handle handle =
        path == NULL ? NULL
                     : library_open(path, CS_LIBCUDA_DEFAULT,
                                    &library->preloaded, library->error,
                                    sizeof(library->error));
    const char *missing = NULL;
    cs_cu_result result;

    if (handle == NULL) {
        goto error;
    }
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
        message_format(library->error, sizeof(library->error),
                       "symbol %s not found", missing);
        goto error;
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

    /* cuInit creates no context; it is idempotent, so calling it in a
     * process where torch already did is harmless. */
    result = cuda->init(0);
    if (result != CS_CUDA_SUCCESS) {
        cuda_describe(result, "cuInit", library->error,
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
    library_path(handle, symbol, library->path, sizeof(library->path));
    library->loaded = true;
    return;

error:
    /* The handle (if any) stays open: unloading a driver library that
     * another part of the process may share is never safe. */
    memset(cuda, 0, sizeof(*cuda));
    library->loaded = false;
    library->preloaded = false;
}

/* ---- NVML ----------------------------------------------------------- */

static void
nvml_load(const cs_probe_options *options)
{
    cs_probe_library *library = &probe_state.nvml_library;
    nvml_functions *nvml = &probe_state.nvml;
    const char *path = option_path(
        options->libnvml, options->libnvml_too_long, "COMFY_STANDIN_LIBNVML",
        library->error, sizeof(library->error));
    library_handle handle =
        path == NULL ? NULL
                     : library_open(path, CS_LIBNVML_DEFAULT,
                                    &library->preloaded, library->error,
                                    sizeof(library->error));
    const char *missing = NULL;
    const char *init_name = "nvmlInit_v2";
    cs_nvml_return result;

    if (handle == NULL) {
        goto error;
    }
    (void)LIBRARY_SYMBOL(handle, "nvmlErrorString", nvml->error_string);
    /* The _v2 entry points count and index every device, including ones
     * the caller may not have permission to use; the unversioned ones are
     * the fallback for drivers that predate them. */
    if (!LIBRARY_SYMBOL(handle, "nvmlInit_v2", nvml->init)) {
        init_name = "nvmlInit";
        if (!LIBRARY_SYMBOL(handle, "nvmlInit", nvml->init)) {
            missing = "nvmlInit_v2";
        }
    }
    if (missing == NULL
        && !LIBRARY_SYMBOL(handle, "nvmlDeviceGetCount_v2",
                           nvml->device_get_count)
        && !LIBRARY_SYMBOL(handle, "nvmlDeviceGetCount",
                           nvml->device_get_count)) {
        missing = "nvmlDeviceGetCount_v2";
    }
    if (missing == NULL
        && !LIBRARY_SYMBOL(handle, "nvmlDeviceGetHandleByIndex_v2",
                           nvml->device_get_handle_by_index)
        && !LIBRARY_SYMBOL(handle, "nvmlDeviceGetHandleByIndex",
                           nvml->device_get_handle_by_index)) {
        missing = "nvmlDeviceGetHandleByIndex_v2";
    }
    if (missing != NULL) {
        message_format(library->error, sizeof(library->error),
                       "symbol %s not found", missing);
        goto error;
    }
    (void)LIBRARY_SYMBOL(handle, "nvmlDeviceGetName", nvml->device_get_name);
    (void)LIBRARY_SYMBOL(handle, "nvmlDeviceGetUUID", nvml->device_get_uuid);
    (void)LIBRARY_SYMBOL(handle, "nvmlDeviceGetMemoryInfo",
                         nvml->device_get_memory_info);
    (void)LIBRARY_SYMBOL(handle, "nvmlSystemGetCudaDriverVersion",
                         nvml->system_get_cuda_driver_version);
    /* Newest entry point first.  Which layout it writes is not taken
     * from its name: drivers differ (see CS_NVML_PROCESS_*), so each
     * answer is measured. */
    if (LIBRARY_SYMBOL(handle, "nvmlDeviceGetComputeRunningProcesses_v3",
                       nvml->device_get_processes)) {
        nvml->processes_symbol = "nvmlDeviceGetComputeRunningProcesses_v3";
    }
    else if (LIBRARY_SYMBOL(handle,
                            "nvmlDeviceGetComputeRunningProcesses_v2",
                            nvml->device_get_processes)) {
        nvml->processes_symbol = "nvmlDeviceGetComputeRunningProcesses_v2";
    }
    else if (LIBRARY_SYMBOL(handle, "nvmlDeviceGetComputeRunningProcesses",
                            nvml->device_get_processes)) {
        nvml->processes_symbol = "nvmlDeviceGetComputeRunningProcesses";
    }

    /* Never paired with nvmlShutdown: NVML counts init calls, so this
     * reference cannot pull NVML from under another user in the process,
     * and keeping it makes every later probe cheap. */
    result = nvml->init();
    if (result != CS_NVML_SUCCESS) {
        nvml_describe(result, init_name, library->error,
                      sizeof(library->error));
        goto error;
    }
    if (nvml->system_get_cuda_driver_version != NULL) {
        int version = 0;
        if (nvml->system_get_cuda_driver_version(&version)
            == CS_NVML_SUCCESS) {
            library->has_driver_version = true;
            library->driver_version = version;
        }
    }
    /* A function pointer as an object pointer, the ISO C way: the POSIX
     * path lookup (dladdr) needs an address inside the library. */
    void *symbol = NULL;
    memcpy(&symbol, &nvml->init, sizeof(symbol));
    library_path(handle, symbol, library->path, sizeof(library->path));
    library->loaded = true;
    return;

error:
    memset(nvml, 0, sizeof(*nvml));
    library->loaded = false;
    library->preloaded = false;
}

/* ---- the device table ----------------------------------------------- */

static void
cuda_enumerate(void)
{
    cuda_functions *cuda = &probe_state.cuda;
    int count = 0;
    cs_cu_result result = cuda->device_get_count(&count);

    if (result != CS_CUDA_SUCCESS) {
        cuda_describe(result, "cuDeviceGetCount",
                      probe_state.cuda_library.error,
                      sizeof(probe_state.cuda_library.error));
        return;
    }
    if (count > CS_PROBE_MAX_DEVICES) {
        probe_state.devices_truncated = true;
        count = CS_PROBE_MAX_DEVICES;
    }
    for (int ordinal = 0; ordinal < count; ordinal++) {
        device_static *device = &probe_state.devices[ordinal];
        char message[CS_PROBE_MESSAGE_SIZE];
        device->index = (uint32_t)ordinal;
        device->nvml_index = -1;
        result = cuda->device_get(&device->cuda_device, ordinal);
        if (result != CS_CUDA_SUCCESS) {
            cuda_describe(result, "cuDeviceGet", device->error,
                          sizeof(device->error));
            continue;
        }
        device->has_cuda_device = true;
        if (cuda->device_get_name != NULL) {
            result = cuda->device_get_name(device->name,
                                           (int)sizeof(device->name),
                                           device->cuda_device);
            if (result != CS_CUDA_SUCCESS) {
                device->name[0] = '\0';
                cuda_describe(result, "cuDeviceGetName", message,
                              sizeof(message));
                message_set_first(device->error, sizeof(device->error),
                                  message);
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
                cuda_describe(result, "cuDeviceTotalMem", message,
                              sizeof(message));
                message_set_first(device->error, sizeof(device->error),
                                  message);
            }
        }
        if (cuda->device_get_uuid != NULL) {
            /* CUuuid is 16 bytes; room beyond it shows a driver that
             * wrote more. */
            union {
                cs_cu_uuid uuid;
                unsigned char bytes[32];
            } answer;
            memset(answer.bytes, sentinel_bytes[0], sizeof(answer.bytes));
            result = cuda->device_get_uuid(&answer.uuid, device->cuda_device);
            if (result == CS_CUDA_SUCCESS
                && written_extent(answer.bytes, sizeof(answer.bytes),
                                  sentinel_bytes[0])
                       > sizeof(cs_cu_uuid)) {
                message_set_first(device->error, sizeof(device->error),
                                  "cuDeviceGetUuid: the driver wrote beyond "
                                  "the 16 bytes of CUuuid");
            }
            else if (result == CS_CUDA_SUCCESS) {
                uuid_format(&answer.uuid, device->uuid, sizeof(device->uuid));
            }
            else {
                cuda_describe(result, "cuDeviceGetUuid", message,
                              sizeof(message));
                message_set_first(device->error, sizeof(device->error),
                                  message);
            }
        }
    }
    probe_state.device_count = (size_t)count;
    probe_state.devices_from_cuda = true;
}

/* Matches NVML devices to the CUDA table by UUID, or, when the driver
 * gave no table, makes the table from NVML's own enumeration. */
static void
nvml_enumerate(void)
{
    nvml_functions *nvml = &probe_state.nvml;
    bool from_cuda = probe_state.devices_from_cuda;
    unsigned int count = 0;
    cs_nvml_return result = nvml->device_get_count(&count);

    if (result != CS_NVML_SUCCESS) {
        nvml_describe(result, "nvmlDeviceGetCount",
                      probe_state.nvml_library.error,
                      sizeof(probe_state.nvml_library.error));
        return;
    }
    if (!from_cuda && count > CS_PROBE_MAX_DEVICES) {
        probe_state.devices_truncated = true;
        count = CS_PROBE_MAX_DEVICES;
    }
    for (unsigned int index = 0; index < count; index++) {
        cs_nvml_device handle = NULL;
        char name[CS_PROBE_NAME_SIZE] = "";
        char uuid[CS_PROBE_UUID_SIZE] = "";
        char message[CS_PROBE_MESSAGE_SIZE] = "";
        device_static *device = NULL;

        result = nvml->device_get_handle_by_index(index, &handle);
        if (result != CS_NVML_SUCCESS) {
            nvml_describe(result, "nvmlDeviceGetHandleByIndex", message,
                          sizeof(message));
        }
        else if (nvml->device_get_uuid != NULL) {
            result = nvml->device_get_uuid(handle, uuid,
                                           (unsigned int)sizeof(uuid));
            if (result != CS_NVML_SUCCESS) {
                uuid[0] = '\0';
                nvml_describe(result, "nvmlDeviceGetUUID", message,
                              sizeof(message));
            }
            uuid[sizeof(uuid) - 1] = '\0';
        }
        if (result == CS_NVML_SUCCESS && nvml->device_get_name != NULL) {
            result = nvml->device_get_name(handle, name,
                                           (unsigned int)sizeof(name));
            if (result != CS_NVML_SUCCESS) {
                name[0] = '\0';
            }
            name[sizeof(name) - 1] = '\0';
        }

        if (from_cuda) {
            for (size_t i = 0; i < probe_state.device_count; i++) {
                if (uuid_equal(probe_state.devices[i].uuid, uuid)) {
                    device = &probe_state.devices[i];
                    break;
                }
            }
            if (device == NULL) {
                /* Hidden from this process (CUDA_VISIBLE_DEVICES) or
                 * unreadable: torch cannot use it either. */
                continue;
            }
        }
        else {
            device = &probe_state.devices[probe_state.device_count++];
            device->index = index;
            device->nvml_index = -1;
            text_copy(device->uuid, sizeof(device->uuid), uuid);
            message_set_first(device->error, sizeof(device->error),
                              message);
        }
        if (handle == NULL) {
            continue;
        }
        device->nvml_index = (int)index;
        device->nvml_device = handle;
        if (device->name[0] == '\0') {
            text_copy(device->name, sizeof(device->name), name);
        }
    }
    if (from_cuda) {
        for (size_t i = 0; i < probe_state.device_count; i++) {
            device_static *device = &probe_state.devices[i];
            if (device->nvml_index < 0) {
                message_set_first(device->error, sizeof(device->error),
                                  device->uuid[0] == '\0'
                                      ? "no UUID from the CUDA driver to "
                                        "match an NVML device by"
                                      : "no NVML device with this UUID");
            }
        }
    }
}

static void
probe_initialize(const cs_probe_options *options)
{
    memset(&probe_state, 0, sizeof(probe_state));
    if (options->disable) {
        text_copy(probe_state.cuda_library.error,
                  sizeof(probe_state.cuda_library.error), "disabled");
        text_copy(probe_state.nvml_library.error,
                  sizeof(probe_state.nvml_library.error), "disabled");
        return;
    }
    cuda_load(options);
    nvml_load(options);
    if (probe_state.cuda_library.loaded) {
        cuda_enumerate();
    }
    if (probe_state.nvml_library.loaded) {
        nvml_enumerate();
    }
}

#ifdef _WIN32
static INIT_ONCE probe_once = INIT_ONCE_STATIC_INIT;

static BOOL CALLBACK
probe_initialize_once(PINIT_ONCE once, PVOID parameter, PVOID *context)
{
    (void)once;
    (void)context;
    probe_initialize((const cs_probe_options *)parameter);
    return TRUE;
}

static void
probe_ensure_initialized(const cs_probe_options *options)
{
    (void)InitOnceExecuteOnce(&probe_once, probe_initialize_once,
                              (PVOID)options, NULL);
}
#else
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
/* pthread_once's routine takes no argument: the thread that runs it finds
 * its own caller's options here. */
static _Thread_local const cs_probe_options *probe_pending_options;

static void
probe_initialize_pending(void)
{
    probe_initialize(probe_pending_options);
}

static void
probe_ensure_initialized(const cs_probe_options *options)
{
    probe_pending_options = options;
    /* Only fails for an invalid once object; nothing to do about it. */
    (void)pthread_once(&probe_once, probe_initialize_pending);
    probe_pending_options = NULL;
}
#endif

/* ---- per call ------------------------------------------------------- */

/* ---- the process list: measured, never assumed ---------------------- */

enum {
    PROCESS_FIRST_CAPACITY = 64,
    /* Far beyond any real machine; a count above it is a broken answer,
     * and bounds the allocation (2 MiB). */
    PROCESS_MAX_CAPACITY = 1 << 16,
    /* Calls per read: growing the buffer while processes start, and one
     * second measurement with the other sentinel. */
    PROCESS_ATTEMPTS = 6,
    /* Slack past the last entry the driver was allowed: a driver that
     * writes beyond what it was given lands here, is seen, and is
     * refused (it cannot be stopped, only caught). */
    PROCESS_GUARD_BYTES = 512,
    /* gpuInstanceId / computeInstanceId under MIG are small indices. */
    PROCESS_INSTANCE_LIMIT = 4096,
};

static const size_t process_entry_sizes[3] = {16, 24, 32};

typedef struct {
    uint32_t pid;
    uint32_t gpu_instance;
    uint32_t compute_instance;
} process_key;

static int
process_key_compare(const void *a, const void *b)
{
    const process_key *x = a, *y = b;
    if (x->pid != y->pid) {
        return x->pid < y->pid ? -1 : 1;
    }
    if (x->gpu_instance != y->gpu_instance) {
        return x->gpu_instance < y->gpu_instance ? -1 : 1;
    }
    if (x->compute_instance != y->compute_instance) {
        return x->compute_instance < y->compute_instance ? -1 : 1;
    }
    return 0;
}

static uint32_t
load_u32(const unsigned char *at)
{
    uint32_t value;
    memcpy(&value, at, sizeof(value));
    return value;
}

static uint64_t
load_u64(const unsigned char *at)
{
    uint64_t value;
    memcpy(&value, at, sizeof(value));
    return value;
}

static bool
plausible_bytes(uint64_t value, uint64_t bound)
{
    return value == CS_NVML_VALUE_NOT_AVAILABLE || value <= bound;
}

/* Decides the entry size of an answer of `count` entries written into
 * `buffer` (`size` bytes, filled with `sentinel` before the call), and
 * checks every entry is plausible under it.  Returns the size, or 0 with
 * the reason in `reason`.  `bound`: the most bytes a process can hold. */
static size_t
process_entry_size(const unsigned char *buffer, size_t size,
                   unsigned int count, unsigned char sentinel,
                   uint64_t bound, char *reason, size_t reason_size)
{
    size_t extent = written_extent(buffer, size, sentinel);
    size_t stride = 0;
    process_key *keys = NULL;

    if (count == 0) {
        if (extent != 0) {
            message_format(reason, reason_size,
                           "the driver wrote %zu bytes for 0 processes",
                           extent);
        }
        return 0;
    }
    /* Every field of every layout ends the entry, and its last byte is
     * the top byte of a count or an id (0x00 or 0xFF in any real
     * answer): the driver's extent is exactly count * size.  One entry
     * measures as well as many. */
    for (size_t i = 0; i < sizeof(process_entry_sizes)
                               / sizeof(process_entry_sizes[0]); i++) {
        if (extent == (size_t)count * process_entry_sizes[i]) {
            stride = process_entry_sizes[i];
        }
    }
    if (stride == 0) {
        message_format(reason, reason_size,
                       "unknown process entry layout: the driver wrote %zu "
                       "bytes for %u processes (entries of 16, 24 or 32 "
                       "bytes expected)",
                       extent, count);
        return 0;
    }
    keys = malloc((size_t)count * sizeof(*keys));
    if (keys == NULL) {
        message_format(reason, reason_size,
                       "out of memory checking the process list");
        return 0;
    }
    for (unsigned int i = 0; i < count; i++) {
        const unsigned char *entry = buffer + (size_t)i * stride;
        uint32_t pid = load_u32(entry + CS_NVML_PROCESS_PID);
        uint64_t used = load_u64(entry + CS_NVML_PROCESS_USED);
        const char *wrong = NULL;
        keys[i].pid = pid;
        keys[i].gpu_instance = CS_NVML_NO_INSTANCE;
        keys[i].compute_instance = CS_NVML_NO_INSTANCE;
        if (entry[stride - 1] == sentinel) {
            wrong = "is not written to its end";
        }
        else if (pid == 0 || pid > (uint32_t)INT32_MAX) {
            wrong = "has an impossible pid";
        }
        else if (!plausible_bytes(used, bound)) {
            wrong = "uses more memory than the device has";
        }
        if (wrong == NULL && stride >= 24) {
            keys[i].gpu_instance =
                load_u32(entry + CS_NVML_PROCESS_GPU_INSTANCE);
            keys[i].compute_instance =
                load_u32(entry + CS_NVML_PROCESS_COMPUTE_INSTANCE);
            if ((keys[i].gpu_instance != CS_NVML_NO_INSTANCE
                 && keys[i].gpu_instance >= PROCESS_INSTANCE_LIMIT)
                || (keys[i].compute_instance != CS_NVML_NO_INSTANCE
                    && keys[i].compute_instance >= PROCESS_INSTANCE_LIMIT)) {
                wrong = "has an impossible MIG instance id";
            }
        }
        if (wrong == NULL && stride >= 32
            && !plausible_bytes(
                load_u64(entry + CS_NVML_PROCESS_CC_PROTECTED), bound)) {
            wrong = "has more protected memory than the device has";
        }
        if (wrong != NULL) {
            message_format(reason, reason_size,
                           "process entry %u of %u %s under the "
                           "%zu-byte layout the driver's answer measures",
                           i, count, wrong, stride);
            free(keys);
            return 0;
        }
    }
    /* A pid twice on one device happens only under MIG, in different
     * instances; the same pid in the same instance twice is a misread. */
    qsort(keys, count, sizeof(*keys), process_key_compare);
    for (unsigned int i = 1; i < count; i++) {
        if (process_key_compare(&keys[i - 1], &keys[i]) == 0) {
            message_format(reason, reason_size,
                           "pid %u listed twice under the %zu-byte layout "
                           "the driver's answer measures",
                           keys[i].pid, stride);
            free(keys);
            return 0;
        }
    }
    free(keys);
    return stride;
}

/* Copies the checked entries into the result, in the driver's order; a
 * pid listed in several MIG instances is summed. */
static void
process_store(const unsigned char *buffer, unsigned int count,
              size_t stride, cs_probe_device *device)
{
    device->has_processes = true;
    device->process_count = 0;
    device->process_entry_size = (uint32_t)stride;
    for (unsigned int i = 0; i < count; i++) {
        const unsigned char *entry = buffer + (size_t)i * stride;
        uint32_t pid = load_u32(entry + CS_NVML_PROCESS_PID);
        uint64_t used = load_u64(entry + CS_NVML_PROCESS_USED);
        uint64_t bytes = used == CS_NVML_VALUE_NOT_AVAILABLE
                             ? CS_PROBE_USED_UNKNOWN
                             : used;
        cs_probe_process *process = NULL;
        for (size_t j = 0; j < device->process_count; j++) {
            if (device->processes[j].pid == pid) {
                process = &device->processes[j];
                break;
            }
        }
        if (process != NULL) {
            if (process->used_bytes == CS_PROBE_USED_UNKNOWN
                || bytes == CS_PROBE_USED_UNKNOWN) {
                process->used_bytes = CS_PROBE_USED_UNKNOWN;
            }
            else {
                process->used_bytes =
                    bytes > CS_PROBE_USED_UNKNOWN - 1 - process->used_bytes
                        ? CS_PROBE_USED_UNKNOWN - 1
                        : process->used_bytes + bytes;
            }
            continue;
        }
        if (device->process_count == CS_PROBE_MAX_PROCESSES) {
            device->processes_truncated = true;
            continue;
        }
        process = &device->processes[device->process_count++];
        process->pid = pid;
        process->used_bytes = bytes;
    }
}

/* Reads the process list with NVML's protocol (call with a capacity; on
 * INSUFFICIENT_SIZE, count holds the need: grow and call again), into a
 * heap buffer that leaves room for the largest known entry and a guard
 * zone, filled with a sentinel before every call.  The entry size is
 * measured from each answer (process_entry_size); an answer that fits no
 * layout is measured once more under the other sentinel, then refused.
 * A refused or unreadable list leaves has_processes false and says why
 * in processes_error (and device->error, if it is the first failure). */
static void
read_processes(const device_static *source, cs_probe_device *device)
{
    const nvml_functions *nvml = &probe_state.nvml;
    unsigned char *buffer = NULL;
    unsigned int capacity = PROCESS_FIRST_CAPACITY;
    size_t allocated = 0;
    unsigned int failed_measures = 0;
    uint64_t bound = device->has_total ? device->total_bytes
                                       : (uint64_t)1 << 50;
    char *reason = device->processes_error;
    size_t reason_size = sizeof(device->processes_error);

    reason[0] = '\0';
    if (nvml->device_get_processes == NULL) {
        message_format(reason, reason_size,
                       "symbol nvmlDeviceGetComputeRunningProcesses "
                       "not found");
        goto done;
    }
    for (int attempt = 0; attempt < PROCESS_ATTEMPTS; attempt++) {
        size_t needed = (size_t)capacity * CS_NVML_PROCESS_MAX_SIZE
                        + PROCESS_GUARD_BYTES;
        unsigned char sentinel = sentinel_bytes[failed_measures & 1];
        unsigned int count = capacity;
        cs_nvml_return result;
        size_t stride;

        if (needed > allocated) {
            unsigned char *grown = realloc(buffer, needed);
            if (grown == NULL) {
                message_format(reason, reason_size,
                               "out of memory reading the process list");
                goto done;
            }
            buffer = grown;
            allocated = needed;
        }
        memset(buffer, sentinel, allocated);
        result = nvml->device_get_processes(source->nvml_device, &count,
                                            buffer);
        if (result == CS_NVML_ERROR_INSUFFICIENT_SIZE) {
            if (count <= capacity) {
                message_format(reason, reason_size,
                               "%s: asked for %u entries when given %u",
                               nvml->processes_symbol, count, capacity);
                goto done;
            }
            if (count > PROCESS_MAX_CAPACITY) {
                message_format(reason, reason_size,
                               "%s: reports %u processes, more than %d",
                               nvml->processes_symbol, count,
                               PROCESS_MAX_CAPACITY);
                goto done;
            }
            /* Headroom for processes starting before the next call. */
            capacity = count + count / 2 + 8;
            if (capacity > PROCESS_MAX_CAPACITY) {
                capacity = PROCESS_MAX_CAPACITY;
            }
            continue;
        }
        if (result != CS_NVML_SUCCESS) {
            nvml_describe(result, nvml->processes_symbol, reason,
                          reason_size);
            goto done;
        }
        if (count > capacity) {
            message_format(reason, reason_size,
                           "%s: reports %u processes written into room "
                           "for %u",
                           nvml->processes_symbol, count, capacity);
            goto done;
        }
        reason[0] = '\0';
        stride = process_entry_size(buffer, allocated, count, sentinel,
                                    bound, reason, reason_size);
        if (reason[0] == '\0') {
            process_store(buffer, count, stride, device);
            goto done;
        }
        if (++failed_measures == 2) {
            goto done;
        }
    }
    message_format(reason, reason_size,
                   "%s: the list changed on each of %d calls",
                   nvml->processes_symbol, PROCESS_ATTEMPTS);

done:
    free(buffer);
    if (!device->has_processes) {
        if (reason[0] == '\0') {
            text_copy(reason, reason_size, "the process list was not read");
        }
        message_set_first(device->error, sizeof(device->error), reason);
    }
}

/* nvmlDeviceGetMemoryInfo into a sentinel-filled buffer larger than
 * nvmlMemory_t: the driver must have written exactly its 24 bytes, and
 * the figures must agree with each other. */
static void
read_memory(const device_static *source, cs_probe_device *device)
{
    const nvml_functions *nvml = &probe_state.nvml;
    union {
        cs_nvml_memory memory;
        unsigned char bytes[64];
    } answer;
    char message[CS_PROBE_MESSAGE_SIZE];
    cs_nvml_return result;
    size_t extent;

    if (nvml->device_get_memory_info == NULL) {
        message_set_first(device->error, sizeof(device->error),
                          "symbol nvmlDeviceGetMemoryInfo not found");
        return;
    }
    memset(answer.bytes, sentinel_bytes[0], sizeof(answer.bytes));
    result = nvml->device_get_memory_info(source->nvml_device,
                                          &answer.memory);
    if (result != CS_NVML_SUCCESS) {
        nvml_describe(result, "nvmlDeviceGetMemoryInfo", message,
                      sizeof(message));
        message_set_first(device->error, sizeof(device->error), message);
        return;
    }
    extent = written_extent(answer.bytes, sizeof(answer.bytes),
                            sentinel_bytes[0]);
    if (extent != sizeof(cs_nvml_memory)) {
        message_format(message, sizeof(message),
                       "nvmlDeviceGetMemoryInfo: the driver wrote %zu bytes, "
                       "not the %zu of nvmlMemory_t",
                       extent, sizeof(cs_nvml_memory));
        message_set_first(device->error, sizeof(device->error), message);
        return;
    }
    if (answer.memory.total == 0 || answer.memory.free > answer.memory.total
        || answer.memory.used > answer.memory.total) {
        message_format(message, sizeof(message),
                       "nvmlDeviceGetMemoryInfo: inconsistent figures "
                       "(total %llu, free %llu, used %llu)",
                       answer.memory.total, answer.memory.free,
                       answer.memory.used);
        message_set_first(device->error, sizeof(device->error), message);
        return;
    }
    device->has_total = true;
    device->total_bytes = answer.memory.total;
    device->has_free = true;
    device->free_bytes = answer.memory.free;
    device->source = CS_PROBE_SOURCE_NVML;
}

static void
read_device(const device_static *source, cs_probe_device *device,
            bool context_known, cs_cu_device context_device)
{
    char message[CS_PROBE_MESSAGE_SIZE];

    device->index = source->index;
    device->nvml_index = source->nvml_index;
    text_copy(device->name, sizeof(device->name), source->name);
    text_copy(device->uuid, sizeof(device->uuid), source->uuid);
    text_copy(device->error, sizeof(device->error), source->error);
    device->source = CS_PROBE_SOURCE_NONE;

    if (source->has_cuda_total) {
        device->has_total = true;
        device->total_bytes = source->cuda_total;
        device->source = CS_PROBE_SOURCE_CUDA;
    }
    if (source->nvml_index >= 0) {
        read_memory(source, device);
        read_processes(source, device);
    }
    else {
        text_copy(device->processes_error, sizeof(device->processes_error),
                  probe_state.nvml_library.loaded
                      ? "no NVML device matched"
                      : "NVML not loaded");
    }
    /* The driver's free figure needs a context; only one the calling
     * thread already has is used, and only for its own device. */
    if (!device->has_free && context_known && source->has_cuda_device
        && source->cuda_device == context_device
        && probe_state.cuda.mem_get_info != NULL) {
        size_t free_bytes = 0, total = 0;
        cs_cu_result result = probe_state.cuda.mem_get_info(&free_bytes,
                                                            &total);
        if (result == CS_CUDA_SUCCESS) {
            device->has_free = true;
            device->free_bytes = (uint64_t)free_bytes;
            device->has_total = true;
            device->total_bytes = (uint64_t)total;
            device->source = CS_PROBE_SOURCE_CUDA;
        }
        else {
            cuda_describe(result, "cuMemGetInfo", message, sizeof(message));
            message_set_first(device->error, sizeof(device->error),
                              message);
        }
    }
}

void
cs_probe_run_with(const cs_probe_options *options, cs_probe_result *out)
{
    static const cs_probe_options no_options;
    uint64_t start = monotonic_ns();
    bool context_known = false;
    cs_cu_device context_device = 0;

    probe_ensure_initialized(options != NULL ? options : &no_options);
    memset(out, 0, sizeof(*out));
    out->cuda = probe_state.cuda_library;
    out->nvml = probe_state.nvml_library;
    out->devices_truncated = probe_state.devices_truncated;

    if (probe_state.cuda_library.loaded
        && probe_state.cuda.ctx_get_current != NULL
        && probe_state.cuda.ctx_get_device != NULL) {
        cs_cu_context context = NULL;
        cs_cu_result result = probe_state.cuda.ctx_get_current(&context);
        if (result != CS_CUDA_SUCCESS) {
            char message[CS_PROBE_MESSAGE_SIZE];
            cuda_describe(result, "cuCtxGetCurrent", message,
                          sizeof(message));
            message_set_first(out->cuda.error, sizeof(out->cuda.error),
                              message);
        }
        else if (context != NULL
                 && probe_state.cuda.ctx_get_device(&context_device)
                        == CS_CUDA_SUCCESS) {
            context_known = true;
        }
    }
    for (size_t i = 0; i < probe_state.device_count; i++) {
        read_device(&probe_state.devices[i], &out->devices[i],
                    context_known, context_device);
    }
    out->device_count = probe_state.device_count;
    out->elapsed_ns = monotonic_ns() - start;
}

#ifdef _WIN32
/* _wgetenv_s then UTF-8: non-ASCII paths stay intact. */
static bool
environment_read(const char *name, char *buffer, size_t size)
{
    wchar_t variable[64];
    wchar_t value[CS_PROBE_PATH_SIZE];
    size_t count = 0;
    buffer[0] = '\0';
    if (MultiByteToWideChar(CP_UTF8, 0, name, -1, variable, 64) == 0) {
        return true;
    }
    errno_t status = _wgetenv_s(&count, value, CS_PROBE_PATH_SIZE, variable);
    if (status == ERANGE || (status == 0 && count > CS_PROBE_PATH_SIZE)) {
        return false;
    }
    if (status != 0 || count <= 1) {
        return true;
    }
    if (WideCharToMultiByte(CP_UTF8, 0, value, -1, buffer, (int)size, NULL,
                            NULL) == 0) {
        buffer[0] = '\0';
        return false;
    }
    return true;
}
#else
static bool
environment_read(const char *name, char *buffer, size_t size)
{
    const char *value = getenv(name);
    size_t length = value != NULL ? strlen(value) : 0;
    buffer[0] = '\0';
    if (length >= size) {
        return false;
    }
    if (length > 0) {
        memcpy(buffer, value, length + 1);
    }
    return true;
}
#endif

void
cs_probe_options_from_environment(cs_probe_options *out)
{
    char flag[8];
    bool flag_fits;
    memset(out, 0, sizeof(*out));
    out->libcuda_too_long = !environment_read(
        "COMFY_STANDIN_LIBCUDA", out->libcuda, sizeof(out->libcuda));
    out->libnvml_too_long = !environment_read(
        "COMFY_STANDIN_LIBNVML", out->libnvml, sizeof(out->libnvml));
    flag_fits = environment_read("COMFY_STANDIN_PROBE_DISABLE", flag,
                                 sizeof(flag));
    /* Set, non-empty and not "0" (a long value is set and not "0"). */
    out->disable = !flag_fits || (flag[0] != '\0' && strcmp(flag, "0") != 0);
}

void
cs_probe_run(cs_probe_result *out)
{
    cs_probe_options options;
    cs_probe_options_from_environment(&options);
    cs_probe_run_with(&options, out);
}

const char *
cs_probe_source_name(cs_probe_source source)
{
    switch (source) {
    case CS_PROBE_SOURCE_NVML:
        return "nvml";
    case CS_PROBE_SOURCE_CUDA:
        return "cuda";
    case CS_PROBE_SOURCE_NONE:
    default:
        return "none";
    }
}
