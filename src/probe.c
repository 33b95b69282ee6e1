/*
 * probe.c -- the GPU probe (see include/comfy_standin/probe.h): a small
 * platform layer (dlopen / LoadLibraryExW); the once-only loader, which
 * loads the CUDA driver (probe_cuda.c) and NVML (probe_nvml.c) and builds
 * the device table of things that cannot change in a process's lifetime;
 * and the per-call reader.  probe_internal.h has what the parts share.
 *
 * Thread safety: `cs_probe_state` is written only inside probe_initialize(),
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
 * entry size is measured that way on every call; see probe_nvml.c).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dladdr(), RTLD_NOLOAD */
#endif

#include "probe_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef _WIN32
#include <errno.h>
#else
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>
#endif

probe_static cs_probe_state;

/* ---- small helpers -------------------------------------------------- */

/* snprintf that tolerates truncation (a cut message is still useful) and
 * keeps -Wformat-truncation quiet about it. */
void
probe_message_format(char *buffer, size_t size, const char *format, ...)
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
void
probe_message_set_first(char *buffer, size_t size, const char *text)
{
    if (buffer[0] == '\0') {
        probe_message_format(buffer, size, "%s", text);
    }
}

void
probe_text_copy(char *buffer, size_t size, const char *text)
{
    probe_message_format(buffer, size, "%s", text);
}

uint64_t
probe_monotonic_ns(void)
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



/* Driver answers go into buffers filled with a sentinel first.  Two
 * fill bytes: an answer that is ambiguous under the first (a field that
 * happens to equal it) is measured again under the second.  Neither is
 * 0x00 or 0xFF, the bytes real fields mostly end with. */
const unsigned char probe_sentinel_bytes[2] = {0xA5, 0x5A};

/* How many leading bytes of `buffer` the driver wrote: up to the last one
 * that differs from the fill.  Never more than it wrote; less only when
 * the last bytes it wrote equal the fill. */
size_t
probe_written_extent(const unsigned char *buffer, size_t size,
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



/* The override path `options` gives for `variable` ("" none), or NULL
 * with the reason in `error` when it did not fit. */
const char *
probe_option_path(const char *path, bool too_long, const char *variable,
                  char *error, size_t error_size)
{
    if (too_long) {
        probe_message_format(error, error_size,
                             "%s is longer than %d bytes: not loaded",
                             variable, CS_PROBE_PATH_SIZE - 1);
        return NULL;
    }
    return path;
}

/* ---- platform layer: open a library, find a symbol ------------------ */

#ifdef _WIN32


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
    probe_message_format(buffer, size, "%s (Windows error %lu)",
                         length ? text : "unknown error", (unsigned long)code);
}

void
probe_library_path(library_handle handle, void *symbol, char *buffer,
                   size_t size)
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
library_handle
probe_library_open(const char *override_path, const char *default_name,
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

bool
probe_library_symbol(library_handle handle, const char *name, void *function,
                     size_t function_size)
{
    FARPROC address = GetProcAddress(handle, name);
    if (address == NULL || function_size != sizeof(address)) {
        return false;
    }
    memcpy(function, &address, sizeof(address));
    return true;
}


#else /* POSIX */


void
probe_library_path(library_handle handle, void *symbol, char *buffer,
                   size_t size)
{
    Dl_info info;
    (void)handle;
    if (symbol != NULL && dladdr(symbol, &info) != 0
        && info.dli_fname != NULL) {
        probe_text_copy(buffer, size, info.dli_fname);
    }
}

/* A copy already in the process wins (RTLD_NOLOAD finds it by soname or
 * path): a second libcuda beside the one torch loaded would be a second
 * driver instance.  RTLD_LOCAL keeps its symbols out of the global scope.
 * The handle is never dlclose()d: function pointers into it live as long
 * as the process. */
library_handle
probe_library_open(const char *override_path, const char *default_name,
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
        probe_message_format(error, error_size, "%s",
                             text != NULL ? text : "dlopen failed");
    }
    return handle;
}

/* dlsym() returns an object pointer; copying its bytes into the function
 * pointer is the POSIX-sanctioned conversion and keeps -Wpedantic quiet. */
bool
probe_library_symbol(library_handle handle, const char *name, void *function,
                     size_t function_size)
{
    void *address = dlsym(handle, name);
    if (address == NULL || function_size != sizeof(address)) {
        return false;
    }
    memcpy(function, &address, sizeof(address));
    return true;
}


#endif

#define LIBRARY_SYMBOL(handle, name, target) \
    probe_library_symbol((handle), (name), &(target), sizeof(target))

static void
probe_initialize(const cs_probe_options *options)
{
    memset(&cs_probe_state, 0, sizeof(cs_probe_state));
    if (options->disable) {
        probe_text_copy(cs_probe_state.cuda_library.error,
                        sizeof(cs_probe_state.cuda_library.error), "disabled");
        probe_text_copy(cs_probe_state.nvml_library.error,
                        sizeof(cs_probe_state.nvml_library.error), "disabled");
        return;
    }
    probe_cuda_load(options);
    probe_nvml_load(options);
    if (cs_probe_state.cuda_library.loaded) {
        probe_cuda_enumerate();
    }
    if (cs_probe_state.nvml_library.loaded) {
        probe_nvml_enumerate();
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
static void
read_device(const device_static *source, cs_probe_device *device,
            bool context_known, cs_cu_device context_device)
{
    char message[CS_PROBE_MESSAGE_SIZE];

    device->index = source->index;
    device->nvml_index = source->nvml_index;
    probe_text_copy(device->name, sizeof(device->name), source->name);
    probe_text_copy(device->uuid, sizeof(device->uuid), source->uuid);
    probe_text_copy(device->error, sizeof(device->error), source->error);
    device->source = CS_PROBE_SOURCE_NONE;

    if (source->has_cuda_total) {
        device->has_total = true;
        device->total_bytes = source->cuda_total;
        device->source = CS_PROBE_SOURCE_CUDA;
    }
    if (source->nvml_index >= 0) {
        probe_read_memory(source, device);
        probe_read_processes(source, device);
    }
    else {
        probe_text_copy(device->processes_error,
                        sizeof(device->processes_error),
                        cs_probe_state.nvml_library.loaded
                            ? "no NVML device matched"
                            : "NVML not loaded");
    }
    /* The driver's free figure needs a context; only one the calling
     * thread already has is used, and only for its own device. */
    if (!device->has_free && context_known && source->has_cuda_device
        && source->cuda_device == context_device
        && cs_probe_state.cuda.mem_get_info != NULL) {
        size_t free_bytes = 0, total = 0;
        cs_cu_result result = cs_probe_state.cuda.mem_get_info(&free_bytes,
                                                               &total);
        if (result == CS_CUDA_SUCCESS) {
            device->has_free = true;
            device->free_bytes = (uint64_t)free_bytes;
            device->has_total = true;
            device->total_bytes = (uint64_t)total;
            device->source = CS_PROBE_SOURCE_CUDA;
        }
        else {
            probe_cuda_describe(result, "cuMemGetInfo", message,
                                sizeof(message));
            probe_message_set_first(device->error, sizeof(device->error),
                                    message);
        }
    }
}

void
cs_probe_run_with(const cs_probe_options *options, cs_probe_result *out)
{
    static const cs_probe_options no_options;
    uint64_t start = probe_monotonic_ns();
    bool context_known = false;
    cs_cu_device context_device = 0;

    probe_ensure_initialized(options != NULL ? options : &no_options);
    memset(out, 0, sizeof(*out));
    out->cuda = cs_probe_state.cuda_library;
    out->nvml = cs_probe_state.nvml_library;
    out->devices_truncated = cs_probe_state.devices_truncated;

    if (cs_probe_state.cuda_library.loaded
        && cs_probe_state.cuda.ctx_get_current != NULL
        && cs_probe_state.cuda.ctx_get_device != NULL) {
        cs_cu_context context = NULL;
        cs_cu_result result = cs_probe_state.cuda.ctx_get_current(&context);
        if (result != CS_CUDA_SUCCESS) {
            char message[CS_PROBE_MESSAGE_SIZE];
            probe_cuda_describe(result, "cuCtxGetCurrent", message,
                                sizeof(message));
            probe_message_set_first(out->cuda.error, sizeof(out->cuda.error),
                                    message);
        }
        else if (context != NULL
                 && cs_probe_state.cuda.ctx_get_device(&context_device)
                        == CS_CUDA_SUCCESS) {
            context_known = true;
        }
    }
    for (size_t i = 0; i < cs_probe_state.device_count; i++) {
        read_device(&cs_probe_state.devices[i], &out->devices[i],
                    context_known, context_device);
    }
    out->device_count = cs_probe_state.device_count;
    out->elapsed_ns = probe_monotonic_ns() - start;
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
