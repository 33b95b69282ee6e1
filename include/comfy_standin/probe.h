/*
 * comfy_standin/probe.h -- the GPU probe: per device total, device-wide
 * free, and used bytes per process id, read through NVML and the CUDA
 * driver, both loaded at run time (docs/probe.md).
 *
 * Plain C11, no Python.  The libraries are opened on the first call, once
 * per process, and never closed; nothing links against them, so a machine
 * with no GPU and no CUDA toolkit runs the probe and gets "not loaded" with
 * the loader's reason.
 *
 * Rules the probe keeps (each has a test):
 *   - it never creates a CUDA context: device-wide free memory comes from
 *     NVML; the driver is asked only what needs no context (cuInit,
 *     device count, name, total, UUID) and for cuMemGetInfo only when the
 *     calling thread already has a current context;
 *   - it prefers a libcuda.so.1 that is already loaded in the process and
 *     resolves driver symbols with their ABI version pinned
 *     (cuGetProcAddress, else the explicit _v2 names);
 *   - nothing fails loudly: every failure becomes a message in the result.
 *
 * Environment, read once on the first call:
 *   COMFY_STANDIN_LIBCUDA        path of the CUDA driver library to load
 *   COMFY_STANDIN_LIBNVML        path of the NVML library to load
 *   COMFY_STANDIN_PROBE_DISABLE  non-empty and not "0": load nothing, both
 *                                libraries read "not loaded", reason
 *                                "disabled"
 *
 * Thread safety: cs_probe_run() may be called from any number of threads
 * at once, with or without the GIL.  Loading and the device table (names,
 * totals, UUIDs, NVML handles) are built once under a once-guard
 * (pthread_once / InitOnceExecuteOnce) and are read-only afterwards; each
 * call writes only its own result.  NVML and the CUDA driver API are
 * thread-safe themselves.
 */
#ifndef COMFY_STANDIN_PROBE_H
#define COMFY_STANDIN_PROBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CS_PROBE_ABI_VERSION 1

/* Fixed bounds keep the result a plain struct the caller can place
 * anywhere.  A machine beyond them is reported truncated, never wrong. */
#define CS_PROBE_MAX_DEVICES 16
#define CS_PROBE_MAX_PROCESSES 128
#define CS_PROBE_NAME_SIZE 96
#define CS_PROBE_UUID_SIZE 48
#define CS_PROBE_MESSAGE_SIZE 256
#define CS_PROBE_PATH_SIZE 512

/* A process whose usage the driver does not expose (NVML's
 * NVML_VALUE_NOT_AVAILABLE: Windows WDDM, some containers). */
#define CS_PROBE_USED_UNKNOWN UINT64_MAX

typedef enum cs_probe_source {
    CS_PROBE_SOURCE_NONE = 0, /* no memory figure could be read */
    CS_PROBE_SOURCE_NVML,     /* total/free from nvmlDeviceGetMemoryInfo */
    CS_PROBE_SOURCE_CUDA      /* from the driver (cuDeviceTotalMem, and
                                 cuMemGetInfo under a current context) */
} cs_probe_source;

/* What one library gave. */
typedef struct cs_probe_library {
    bool loaded;          /* opened, initialised, required symbols found */
    bool preloaded;       /* it was already in the process (CUDA only) */
    bool has_driver_version;
    int driver_version;   /* CUDA version number, e.g. 12040 */
    /* Why it is not loaded (dlerror text, "disabled", the failing call),
     * or, when loaded, the first library-level failure of this call
     * (e.g. the device count).  "" when nothing went wrong. */
    char error[CS_PROBE_MESSAGE_SIZE];
    /* The file it was loaded from ("" when not loaded). */
    char path[CS_PROBE_PATH_SIZE];
} cs_probe_library;

typedef struct cs_probe_process {
    uint32_t pid;        /* as NVML sees it: the host's pid namespace */
    uint64_t used_bytes; /* or CS_PROBE_USED_UNKNOWN */
} cs_probe_process;

typedef struct cs_probe_device {
    /* The CUDA ordinal (what torch calls cuda:N) when the driver loaded,
     * else NVML's index. */
    uint32_t index;
    int nvml_index;          /* -1 when no NVML device matched */
    char name[CS_PROBE_NAME_SIZE];
    char uuid[CS_PROBE_UUID_SIZE]; /* "GPU-..." or "" when unknown */
    cs_probe_source source;
    bool has_total;
    uint64_t total_bytes;
    bool has_free;
    uint64_t free_bytes;     /* device-wide */
    bool has_processes;      /* the process list could be read */
    bool processes_truncated;
    size_t process_count;
    cs_probe_process processes[CS_PROBE_MAX_PROCESSES];
    /* The first failure reading this device, "" when none. */
    char error[CS_PROBE_MESSAGE_SIZE];
} cs_probe_device;

typedef struct cs_probe_result {
    cs_probe_library cuda;
    cs_probe_library nvml;
    size_t device_count;
    bool devices_truncated;
    cs_probe_device devices[CS_PROBE_MAX_DEVICES];
    uint64_t elapsed_ns; /* how long this call took (monotonic clock) */
} cs_probe_result;

/* Fills *out.  Never fails: what could not be read is flagged and said
 * in the error fields.  The first call in a process loads the libraries
 * (slow: cuInit can take a few hundred milliseconds); later calls read
 * only what changes (free memory, processes).  The result is about 40 KiB:
 * prefer the heap on small thread stacks. */
void cs_probe_run(cs_probe_result *out);

const char *cs_probe_source_name(cs_probe_source source);

#ifdef __cplusplus
}
#endif

#endif /* COMFY_STANDIN_PROBE_H */
