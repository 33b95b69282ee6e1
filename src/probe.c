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
 * data lives on the caller's stack or in the caller's result.
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

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} cs_nvml_memory;              /* nvmlMemory_t (v1) */

/* nvmlProcessInfo_v1_t: what the unsuffixed
 * nvmlDeviceGetComputeRunningProcesses fills. */
typedef struct {
    unsigned int pid;
    unsigned long long used_gpu_memory;
} cs_nvml_process_v1;

/* nvmlProcessInfo_v2_t, also the layout the _v3 entry point fills. */
typedef struct {
    unsigned int pid;
    unsigned long long used_gpu_memory;
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;
} cs_nvml_process_v2;

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
    size_t process_entry_size; /* of what device_get_processes fills */
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

static bool
environment_flag(const char *name)
{
    const char *value = getenv(name);
    return value != NULL && value[0] != '\0' && strcmp(value, "0") != 0;
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

static library_handle
library_open(const char *override_variable, const char *default_name,
             bool *preloaded, char *error, size_t error_size)
{
    const wchar_t *override = NULL;
    wchar_t override_name[CS_PROBE_PATH_SIZE];
    size_t count = 0;
    if (override_variable != NULL) {
        /* _wgetenv_s keeps non-ASCII paths intact. */
        wchar_t variable[64];
        if (MultiByteToWideChar(CP_UTF8, 0, override_variable, -1, variable,
                                64) != 0
            && _wgetenv_s(&count, override_name, CS_PROBE_PATH_SIZE,
                          variable) == 0
            && count > 1) {
            override = override_name;
        }
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
library_open(const char *override_variable, const char *default_name,
             bool *preloaded, char *error, size_t error_size)
{
    const char *override = getenv(override_variable);
    const char *name = (override != NULL && override[0] != '\0')
                           ? override : default_name;
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
cuda_load(void)
{
    cs_probe_library *library = &probe_state.cuda_library;
    cuda_functions *cuda = &probe_state.cuda;
    library_handle handle = library_open(
        "COMFY_STANDIN_LIBCUDA", CS_LIBCUDA_DEFAULT, &library->preloaded,
        library->error, sizeof(library->error));
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
nvml_load(void)
{
    cs_probe_library *library = &probe_state.nvml_library;
    nvml_functions *nvml = &probe_state.nvml;
    library_handle handle = library_open(
        "COMFY_STANDIN_LIBNVML", CS_LIBNVML_DEFAULT, &library->preloaded,
        library->error, sizeof(library->error));
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
    /* Newest layout first; _v3 and _v2 fill nvmlProcessInfo_v2_t, the
     * unversioned one the two-field v1 struct. */
    if (LIBRARY_SYMBOL(handle, "nvmlDeviceGetComputeRunningProcesses_v3",
                       nvml->device_get_processes)) {
        nvml->process_entry_size = sizeof(cs_nvml_process_v2);
        nvml->processes_symbol = "nvmlDeviceGetComputeRunningProcesses_v3";
    }
    else if (LIBRARY_SYMBOL(handle,
                            "nvmlDeviceGetComputeRunningProcesses_v2",
                            nvml->device_get_processes)) {
        nvml->process_entry_size = sizeof(cs_nvml_process_v2);
        nvml->processes_symbol = "nvmlDeviceGetComputeRunningProcesses_v2";
    }
    else if (LIBRARY_SYMBOL(handle, "nvmlDeviceGetComputeRunningProcesses",
                            nvml->device_get_processes)) {
        nvml->process_entry_size = sizeof(cs_nvml_process_v1);
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
            cs_cu_uuid uuid;
            result = cuda->device_get_uuid(&uuid, device->cuda_device);
            if (result == CS_CUDA_SUCCESS) {
                uuid_format(&uuid, device->uuid, sizeof(device->uuid));
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
probe_initialize(void)
{
    memset(&probe_state, 0, sizeof(probe_state));
    if (environment_flag("COMFY_STANDIN_PROBE_DISABLE")) {
        text_copy(probe_state.cuda_library.error,
                  sizeof(probe_state.cuda_library.error), "disabled");
        text_copy(probe_state.nvml_library.error,
                  sizeof(probe_state.nvml_library.error), "disabled");
        return;
    }
    cuda_load();
    nvml_load();
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
    (void)parameter;
    (void)context;
    probe_initialize();
    return TRUE;
}

static void
probe_ensure_initialized(void)
{
    (void)InitOnceExecuteOnce(&probe_once, probe_initialize_once, NULL,
                              NULL);
}
#else
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;

static void
probe_ensure_initialized(void)
{
    /* Only fails for an invalid once object; nothing to do about it. */
    (void)pthread_once(&probe_once, probe_initialize);
}
#endif

/* ---- per call ------------------------------------------------------- */

/* Fills the process list with the usual protocol: call with a buffer,
 * and on INSUFFICIENT_SIZE (count now holds the need) grow and retry.
 * Processes can start between two calls, so the buffer gets headroom and
 * the loop a bound. */
static void
read_processes(const device_static *source, cs_probe_device *device)
{
    enum { STACK_ENTRIES = 64, ATTEMPTS = 4 };
    const nvml_functions *nvml = &probe_state.nvml;
    cs_nvml_process_v2 stack_buffer[STACK_ENTRIES];
    unsigned char *buffer = (unsigned char *)stack_buffer;
    unsigned char *heap_buffer = NULL;
    unsigned int capacity = STACK_ENTRIES;
    size_t stride = nvml->process_entry_size;
    char message[CS_PROBE_MESSAGE_SIZE];
    cs_nvml_return result = CS_NVML_ERROR_INSUFFICIENT_SIZE;
    unsigned int count = 0;

    if (nvml->device_get_processes == NULL) {
        message_set_first(device->error, sizeof(device->error),
                          "symbol nvmlDeviceGetComputeRunningProcesses "
                          "not found");
        return;
    }
    for (int attempt = 0; attempt < ATTEMPTS; attempt++) {
        count = capacity;
        result = nvml->device_get_processes(source->nvml_device, &count,
                                            buffer);
        if (result != CS_NVML_ERROR_INSUFFICIENT_SIZE) {
            break;
        }
        if (count < capacity || count > UINT32_MAX / 2) {
            /* A library that asks for less than it had is broken. */
            break;
        }
        capacity = count + count / 2 + 8;
        unsigned char *grown = realloc(heap_buffer, (size_t)capacity
                                                        * stride);
        if (grown == NULL) {
            message_set_first(device->error, sizeof(device->error),
                              "out of memory reading the process list");
            goto done;
        }
        heap_buffer = grown;
        buffer = heap_buffer;
    }
    if (result != CS_NVML_SUCCESS) {
        nvml_describe(result, nvml->processes_symbol, message,
                      sizeof(message));
        message_set_first(device->error, sizeof(device->error), message);
        goto done;
    }
    if (count > capacity) {
        count = capacity; /* never trust a count beyond the buffer */
    }
    device->has_processes = true;
    device->process_count = 0;
    for (unsigned int i = 0; i < count; i++) {
        unsigned int pid;
        unsigned long long used;
        const unsigned char *entry = buffer + (size_t)i * stride;
        /* Both layouts start with pid then usedGpuMemory at the same
         * offsets; memcpy reads them without aliasing the stack array. */
        memcpy(&pid, entry + offsetof(cs_nvml_process_v1, pid), sizeof(pid));
        memcpy(&used, entry + offsetof(cs_nvml_process_v1, used_gpu_memory),
               sizeof(used));
        if (device->process_count == CS_PROBE_MAX_PROCESSES) {
            device->processes_truncated = true;
            break;
        }
        cs_probe_process *process =
            &device->processes[device->process_count++];
        process->pid = pid;
        process->used_bytes = used == CS_NVML_VALUE_NOT_AVAILABLE
                                  ? CS_PROBE_USED_UNKNOWN
                                  : (uint64_t)used;
    }

done:
    free(heap_buffer);
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
        const nvml_functions *nvml = &probe_state.nvml;
        if (nvml->device_get_memory_info == NULL) {
            message_set_first(device->error, sizeof(device->error),
                              "symbol nvmlDeviceGetMemoryInfo not found");
        }
        else {
            cs_nvml_memory memory;
            cs_nvml_return result =
                nvml->device_get_memory_info(source->nvml_device, &memory);
            if (result == CS_NVML_SUCCESS) {
                device->has_total = true;
                device->total_bytes = memory.total;
                device->has_free = true;
                device->free_bytes = memory.free;
                device->source = CS_PROBE_SOURCE_NVML;
            }
            else {
                nvml_describe(result, "nvmlDeviceGetMemoryInfo", message,
                              sizeof(message));
                message_set_first(device->error, sizeof(device->error),
                                  message);
            }
        }
        read_processes(source, device);
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
cs_probe_run(cs_probe_result *out)
{
    uint64_t start = monotonic_ns();
    bool context_known = false;
    cs_cu_device context_device = 0;

    probe_ensure_initialized();
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
