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
 * Environment (see cs_probe_options), used once, by the first call:
 *   COMFY_STANDIN_LIBCUDA        path of the CUDA driver library to load
 *   COMFY_STANDIN_LIBNVML        path of the NVML library to load
 *   COMFY_STANDIN_PROBE_DISABLE  non-empty and not "0": load nothing, both
 *                                libraries read "not loaded", reason
 *                                "disabled"
 * The environment is read only by cs_probe_options_from_environment()
 * (and cs_probe_run(), which calls it): a caller that shares the process
 * with threads writing the environment (Python's os.environ) reads it
 * while it holds its own lock and hands the copy to cs_probe_run_with().
 *
 * Driver structs: no layout is assumed that was not measured.  The
 * process list's entry size differs between drivers of the same API
 * version (16, 24 and 32 bytes are all seen in the field), so every call
 * measures it (a sentinel-filled buffer: how far the driver wrote for the
 * entries it reports) and cross-checks the entries; a list that fits no
 * known layout is reported unreadable, with the reason in
 * processes_error, never decoded.
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

#define CS_PROBE_ABI_VERSION 3

/* Fixed bounds keep the result a plain struct the caller can place
 * anywhere.  A machine beyond them is reported truncated, never wrong. */
#define CS_PROBE_MAX_DEVICES 16
#define CS_PROBE_MAX_PROCESSES 128
#define CS_PROBE_NAME_SIZE 96
/* NVML_DEVICE_UUID_V2_BUFFER_SIZE: what NVML documents as always enough
 * for nvmlDeviceGetUUID (a MIG device's UUID is longer than a GPU's). */
#define CS_PROBE_UUID_SIZE 96
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
    /* The entry size measured in the driver's answer (16, 24 or 32), 0
     * when there was nothing to measure or the list was not read. */
    uint32_t process_entry_size;
    /* Why there are no per-process readings (has_processes false), ""
     * when the list was read. */
    char processes_error[CS_PROBE_MESSAGE_SIZE];
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

/* What the environment says, copied: the first call's options decide
 * what is loaded (later calls' options are ignored). */
typedef struct cs_probe_options {
    bool disable;            /* COMFY_STANDIN_PROBE_DISABLE set */
    /* Library paths to load instead of the default names ("" none), in
     * the platform's narrow encoding (UTF-8 on Windows).  *_too_long: the
     * variable was set but did not fit; that library is then not loaded,
     * and says so. */
    char libcuda[CS_PROBE_PATH_SIZE];
    bool libcuda_too_long;
    char libnvml[CS_PROBE_PATH_SIZE];
    bool libnvml_too_long;
} cs_probe_options;

/* Reads the three variables into *out.  The only function of the probe
 * that reads the C runtime's environment (on Windows the loader also
 * expands %ProgramFiles%, through the OS call that holds the process
 * environment lock). */
void cs_probe_options_from_environment(cs_probe_options *out);

/* Fills *out.  Never fails: what could not be read is flagged and said
 * in the error fields.  The first call in a process loads the libraries
 * as `options` say (slow: cuInit can take a few hundred milliseconds);
 * later calls read only what changes (free memory, processes).  The
 * result is about 45 KiB: prefer the heap on small thread stacks.
 * options NULL: no variable set. */
void cs_probe_run_with(const cs_probe_options *options,
                       cs_probe_result *out);

/* cs_probe_run_with() with the options read from the environment now. */
void cs_probe_run(cs_probe_result *out);

const char *cs_probe_source_name(cs_probe_source source);

#ifdef __cplusplus
}
#endif

#endif /* COMFY_STANDIN_PROBE_H */
