/*
 * probe_internal.h -- what the probe's three parts share (private to the
 * core): the NVML and CUDA driver types the probe needs, declared from the
 * public API documentation (so the build needs no CUDA toolkit), the state
 * built once, and the helpers each part calls.
 *
 *   probe.c       the once-only loader, the platform layer (dlopen /
 *                 LoadLibraryExW), the per-call reader and the options
 *   probe_cuda.c  the CUDA driver half: loading it, its device table
 *   probe_nvml.c  the NVML half: loading it, matching its devices, and the
 *                 per-call memory and process readings
 *
 * Thread safety: cs_probe_state is written only inside the loader, which
 * runs exactly once under the once-guard (probe.c); every reader goes
 * through that guard first, so the whole struct is visible and read-only
 * from then on.
 */
#ifndef COMFY_STANDIN_PROBE_INTERNAL_H
#define COMFY_STANDIN_PROBE_INTERNAL_H

#include "comfy_standin/probe.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
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

typedef struct {
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
} probe_static;

extern probe_static cs_probe_state;

/* ---- the platform layer (probe.c) ------------------------------------ */

#ifdef _WIN32
typedef HMODULE library_handle;
#define CS_LIBCUDA_DEFAULT "cuda"
#define CS_LIBNVML_DEFAULT "nvml"
#else
typedef void *library_handle;
#define CS_LIBCUDA_DEFAULT "libcuda.so.1"
#define CS_LIBNVML_DEFAULT "libnvidia-ml.so.1"
#endif

/* Opens the library at `override_path` when not "", else the one already
 * in the process by `default_name`, else loads it; NULL with the reason in
 * `error`.  *preloaded says whether the process had it already. */
library_handle probe_library_open(const char *override_path,
                                  const char *default_name, bool *preloaded,
                                  char *error, size_t error_size);
/* The address of `name` into *function (`function_size` bytes). */
bool probe_library_symbol(library_handle handle, const char *name,
                          void *function, size_t function_size);
/* The path of the library holding `symbol`, into `buffer`. */
void probe_library_path(library_handle handle, void *symbol, char *buffer,
                        size_t size);

#define LIBRARY_SYMBOL(handle, name, target)                                  \
    probe_library_symbol((handle), (name), &(target), sizeof(target))

/* ---- helpers (probe.c) ----------------------------------------------- */

/* snprintf that tolerates truncation (a cut message is still useful). */
void probe_message_format(char *buffer, size_t size, const char *format,
                          ...);
/* Keeps the first failure: later ones are usually consequences. */
void probe_message_set_first(char *buffer, size_t size, const char *text);
void probe_text_copy(char *buffer, size_t size, const char *text);
uint64_t probe_monotonic_ns(void);

/* Driver answers go into buffers filled with a sentinel first.  Two
 * fill bytes: an answer that is ambiguous under the first (a field that
 * happens to equal it) is measured again under the second.  Neither is
 * 0x00 or 0xFF, the bytes real fields mostly end with. */
extern const unsigned char probe_sentinel_bytes[2];
/* How many leading bytes of `buffer` the driver wrote: up to the last one
 * that differs from the fill. */
size_t probe_written_extent(const unsigned char *buffer, size_t size,
                            unsigned char sentinel);
/* The override path `options` gives for `variable` ("" none), or NULL
 * with the reason in `error` when it did not fit. */
const char *probe_option_path(const char *path, bool too_long,
                              const char *variable, char *error,
                              size_t error_size);

/* ---- the CUDA driver half (probe_cuda.c) ----------------------------- */

void probe_cuda_describe(cs_cu_result result, const char *call,
                         char *buffer, size_t size);
void probe_cuda_load(const cs_probe_options *options);
/* The device table from the driver's enumeration. */
void probe_cuda_enumerate(void);

/* ---- the NVML half (probe_nvml.c) ------------------------------------ */

void probe_nvml_describe(cs_nvml_return result, const char *call,
                         char *buffer, size_t size);
void probe_nvml_load(const cs_probe_options *options);
/* Matches NVML devices to the CUDA table by UUID, or, when the driver
 * gave no table, makes the table from NVML's own enumeration. */
void probe_nvml_enumerate(void);
/* The per-call readings of one device: its memory, its process list. */
void probe_read_memory(const device_static *source,
                       cs_probe_device *device);
void probe_read_processes(const device_static *source,
                          cs_probe_device *device);

#endif /* COMFY_STANDIN_PROBE_INTERNAL_H */
