/*
 * test_probe.c -- C unit test of the probe core (src/probe.c), no Python.
 *
 *   test_probe CUDA_STUB NVML_STUB SCRIPT_PATH SCENARIO
 *
 * CUDA_STUB and NVML_STUB are the stub libraries of tests/c/stubs/ (built
 * by tests/test_probe_c.py); SCRIPT_PATH is where this program writes the
 * stubs' script.  One scenario per process, because the probe loads once
 * per process:
 *
 *   full      two devices; eight threads race the first call (the
 *             once-guard) and keep probing; every result is checked, and
 *             the stubs' counters show no context was created
 *   disabled  COMFY_STANDIN_PROBE_DISABLE=1: nothing loads, reason
 *             "disabled"
 *   missing   both paths point nowhere: not loaded, dlerror()'s reason
 *   layouts   process lists of 16-, 24- and 32-byte entries (1, 3, 49 and
 *             200 processes) and lying lists, read by four threads: each
 *             gives exactly the scripted pids and bytes, or no list and a
 *             reason (run under ASan by CI: no overflow either)
 *   options   cs_probe_run_with(): the options given decide, whatever
 *             the environment says
 *
 * Prints "ok" and exits 0 when every check held.
 */
#define _GNU_SOURCE /* RTLD_NOLOAD */

#include "comfy_standin/probe.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_int failures;

#define CHECK(condition)                                                  \
    do {                                                                  \
        if (!(condition)) {                                               \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__,        \
                    __LINE__, #condition);                                \
            atomic_fetch_add(&failures, 1);                               \
        }                                                                 \
    } while (0)

#define GIB ((uint64_t)1 << 30)

static const char full_script[] =
    "devices 2\n"
    "name 0 Stub Zero 24G\n"
    "name 1 Stub One 8G\n"
    "total 0 25769803776\n"
    "free 0 20000000000\n"
    "total 1 8589934592\n"
    "free 1 1000\n"
    "proc 0 1234 1048576\n"
    "proc 0 42 na\n"
    "procs 1 100 5000 4096\n"
    "cuda_devices 1 0\n"
    "driver_version 12040\n";

static int
write_file(const char *path, const char *text)
{
    FILE *file = fopen(path, "w");
    if (file == NULL) {
        perror(path);
        return -1;
    }
    int status = fputs(text, file) < 0 ? -1 : 0;
    if (fclose(file) != 0) {
        status = -1;
    }
    return status;
}

/* Reads a stub counter through the copy the probe loaded. */
static long
stub_count(const char *library, const char *function, const char *name)
{
    void *handle = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
    void *symbol;
    long (*count)(const char *);
    if (handle == NULL) {
        return -2; /* the probe never loaded it */
    }
    symbol = dlsym(handle, function);
    if (symbol == NULL) {
        return -3;
    }
    memcpy(&count, &symbol, sizeof(count));
    return count(name);
}

static const cs_probe_process *
find_process(const cs_probe_device *device, uint32_t pid)
{
    for (size_t i = 0; i < device->process_count; i++) {
        if (device->processes[i].pid == pid) {
            return &device->processes[i];
        }
    }
    return NULL;
}

static void
check_full(const cs_probe_result *result, const char *cuda_path,
           const char *nvml_path)
{
    CHECK(result->cuda.loaded);
    CHECK(!result->cuda.preloaded);
    CHECK(result->cuda.error[0] == '\0');
    CHECK(strcmp(result->cuda.path, cuda_path) == 0);
    CHECK(result->cuda.has_driver_version);
    CHECK(result->cuda.driver_version == 12040);
    CHECK(result->nvml.loaded);
    CHECK(result->nvml.error[0] == '\0');
    CHECK(strcmp(result->nvml.path, nvml_path) == 0);
    CHECK(result->nvml.driver_version == 12040);
    CHECK(!result->devices_truncated);
    CHECK(result->device_count == 2);
    if (result->device_count != 2) {
        return;
    }

    /* CUDA ordinal 0 is NVML device 1: matched by UUID. */
    const cs_probe_device *one = &result->devices[0];
    CHECK(one->index == 0);
    CHECK(one->nvml_index == 1);
    CHECK(strcmp(one->name, "Stub One 8G") == 0);
    CHECK(strcmp(one->uuid, "GPU-00000000-0000-0000-0000-000000000002")
          == 0);
    CHECK(one->source == CS_PROBE_SOURCE_NVML);
    CHECK(strcmp(cs_probe_source_name(one->source), "nvml") == 0);
    CHECK(one->has_total && one->total_bytes == 8 * GIB);
    CHECK(one->has_free && one->free_bytes == 1000);
    CHECK(one->has_processes);
    /* 100 processes: more than the first buffer, so the grow loop ran. */
    CHECK(one->process_count == 100);
    CHECK(!one->processes_truncated);
    for (uint32_t pid = 5000; pid < 5100; pid++) {
        const cs_probe_process *process = find_process(one, pid);
        CHECK(process != NULL && process->used_bytes == 4096);
    }
    CHECK(one->error[0] == '\0');

    const cs_probe_device *zero = &result->devices[1];
    CHECK(zero->index == 1);
    CHECK(zero->nvml_index == 0);
    CHECK(strcmp(zero->name, "Stub Zero 24G") == 0);
    CHECK(zero->has_total && zero->total_bytes == 24 * GIB);
    CHECK(zero->has_free && zero->free_bytes == 20000000000u);
    CHECK(zero->process_count == 2);
    const cs_probe_process *known = find_process(zero, 1234);
    const cs_probe_process *unknown = find_process(zero, 42);
    CHECK(known != NULL && known->used_bytes == 1048576);
    CHECK(unknown != NULL && unknown->used_bytes == CS_PROBE_USED_UNKNOWN);
    CHECK(zero->error[0] == '\0');
}

typedef struct {
    const char *cuda_path;
    const char *nvml_path;
    pthread_barrier_t *barrier;
} thread_arguments;

enum { THREADS = 8, CALLS_PER_THREAD = 100 };

static void *
probe_thread(void *raw)
{
    thread_arguments *arguments = raw;
    cs_probe_result *result = malloc(sizeof(*result));
    CHECK(result != NULL);
    if (result == NULL) {
        return NULL;
    }
    /* All threads leave the barrier together and race the first call
     * into the once-guard. */
    int status = pthread_barrier_wait(arguments->barrier);
    CHECK(status == 0 || status == PTHREAD_BARRIER_SERIAL_THREAD);
    for (int i = 0; i < CALLS_PER_THREAD; i++) {
        cs_probe_run(result);
        check_full(result, arguments->cuda_path, arguments->nvml_path);
    }
    free(result);
    return NULL;
}

static void
scenario_full(const char *cuda_path, const char *nvml_path)
{
    pthread_t threads[THREADS];
    pthread_barrier_t barrier;
    thread_arguments arguments = {cuda_path, nvml_path, &barrier};
    int started = 0;

    CHECK(pthread_barrier_init(&barrier, NULL, THREADS) == 0);
    for (; started < THREADS; started++) {
        if (pthread_create(&threads[started], NULL, probe_thread,
                           &arguments) != 0) {
            break;
        }
    }
    CHECK(started == THREADS);
    for (int i = 0; i < started; i++) {
        CHECK(pthread_join(threads[i], NULL) == 0);
    }
    CHECK(pthread_barrier_destroy(&barrier) == 0);

    /* Loaded once; no context created, none needed. */
    CHECK(stub_count(cuda_path, "stub_cuda_count", "cuInit") == 1);
    CHECK(stub_count(cuda_path, "stub_cuda_count", "cuCtxCreate") == 0);
    CHECK(stub_count(cuda_path, "stub_cuda_count",
                     "cuDevicePrimaryCtxRetain") == 0);
    CHECK(stub_count(cuda_path, "stub_cuda_count", "cuCtxSetCurrent")
          == 0);
    CHECK(stub_count(cuda_path, "stub_cuda_count", "cuCtxPushCurrent")
          == 0);
    CHECK(stub_count(cuda_path, "stub_cuda_count", "cuMemGetInfo") == 0);
    CHECK(stub_count(cuda_path, "stub_cuda_count",
                     "cuGetProcAddress.version") == 11030);
    CHECK(stub_count(nvml_path, "stub_nvml_count", "nvmlInit") == 1);
    CHECK(stub_count(nvml_path, "stub_nvml_count", "nvmlShutdown") == 0);
}

static void
check_unloaded(const cs_probe_library *library)
{
    CHECK(!library->loaded);
    CHECK(!library->preloaded);
    CHECK(!library->has_driver_version);
    CHECK(library->path[0] == '\0');
}

static void
scenario_disabled(const char *cuda_path, const char *nvml_path)
{
    cs_probe_result *result = malloc(sizeof(*result));
    CHECK(result != NULL);
    if (result == NULL) {
        return;
    }
    cs_probe_run(result);
    check_unloaded(&result->cuda);
    check_unloaded(&result->nvml);
    CHECK(strcmp(result->cuda.error, "disabled") == 0);
    CHECK(strcmp(result->nvml.error, "disabled") == 0);
    CHECK(result->device_count == 0);
    /* Not even opened. */
    CHECK(stub_count(cuda_path, "stub_cuda_count", "cuInit") == -2);
    CHECK(stub_count(nvml_path, "stub_nvml_count", "nvmlInit") == -2);
    free(result);
}

static void
scenario_missing(void)
{
    cs_probe_result *result = malloc(sizeof(*result));
    CHECK(result != NULL);
    if (result == NULL) {
        return;
    }
    for (int call = 0; call < 3; call++) {
        cs_probe_run(result);
        check_unloaded(&result->cuda);
        check_unloaded(&result->nvml);
        CHECK(strstr(result->cuda.error, "/nonexistent/libcuda.so.1")
              != NULL);
        CHECK(strstr(result->nvml.error, "No such file") != NULL);
        CHECK(result->device_count == 0);
    }
    free(result);
}

/* Device i of the layouts script: its entry size (0: a liar) and count. */
static const struct {
    unsigned int layout;
    unsigned int count;
    const char *lie;
    const char *reason; /* what a liar must be refused with */
} layout_devices[] = {
    {16, 1, NULL, NULL},   {16, 3, NULL, NULL},   {16, 49, NULL, NULL},
    {16, 200, NULL, NULL}, {24, 1, NULL, NULL},   {24, 3, NULL, NULL},
    {24, 49, NULL, NULL},  {24, 200, NULL, NULL}, {32, 1, NULL, NULL},
    {32, 3, NULL, NULL},   {32, 49, NULL, NULL},  {32, 200, NULL, NULL},
    {32, 0, NULL, NULL},
    {32, 200, "overrun 4",
     "unknown process entry layout: the driver wrote 2176 bytes for 64 "
     "processes (entries of 16, 24 or 32 bytes expected)"},
    {24, 3, "grow",
     "nvmlDeviceGetComputeRunningProcesses_v3: the list changed on each of "
     "6 calls"},
    {20, 3, NULL,
     "unknown process entry layout: the driver wrote 60 bytes for 3 "
     "processes (entries of 16, 24 or 32 bytes expected)"},
};

enum {
    LAYOUT_DEVICES = sizeof(layout_devices) / sizeof(layout_devices[0])
};

static uint32_t
layout_pid(size_t device, unsigned int i)
{
    return (uint32_t)(100000 * (device + 1) + 7 * i + 1);
}

static uint64_t
layout_used(size_t device, unsigned int i)
{
    return ((uint64_t)i + 1) * 1048576 + 4096 * (uint64_t)i + device;
}

static int
write_layouts_script(const char *path)
{
    FILE *file = fopen(path, "w");
    if (file == NULL) {
        perror(path);
        return -1;
    }
    fprintf(file, "devices %d\n", (int)LAYOUT_DEVICES);
    for (size_t d = 0; d < LAYOUT_DEVICES; d++) {
        fprintf(file, "total %zu 25769803776\nfree %zu 1000\n", d, d);
        fprintf(file, "proc_layout %zu %u\n", d, layout_devices[d].layout);
        if (layout_devices[d].lie != NULL) {
            fprintf(file, "proc_lie %zu %s\n", d, layout_devices[d].lie);
        }
        for (unsigned int i = 0; i < layout_devices[d].count; i++) {
            fprintf(file, "proc %zu %u %llu\n", d, layout_pid(d, i),
                    (unsigned long long)layout_used(d, i));
        }
    }
    return fclose(file) == 0 ? 0 : -1;
}

static void
check_layouts(const cs_probe_result *result)
{
    CHECK(result->device_count == LAYOUT_DEVICES);
    if (result->device_count != LAYOUT_DEVICES) {
        return;
    }
    for (size_t d = 0; d < LAYOUT_DEVICES; d++) {
        const cs_probe_device *device = &result->devices[d];
        unsigned int count = layout_devices[d].count;
        if (layout_devices[d].reason != NULL) {
            CHECK(!device->has_processes);
            CHECK(device->process_count == 0);
            CHECK(device->process_entry_size == 0);
            CHECK(strcmp(device->processes_error, layout_devices[d].reason)
                  == 0);
            continue;
        }
        unsigned int expected = count < CS_PROBE_MAX_PROCESSES
                                    ? count
                                    : CS_PROBE_MAX_PROCESSES;
        CHECK(device->has_processes);
        CHECK(device->processes_error[0] == '\0');
        CHECK(device->process_count == expected);
        CHECK(device->processes_truncated == (count > expected));
        CHECK(device->process_entry_size
              == (count > 0 ? layout_devices[d].layout : 0));
        for (unsigned int i = 0; i < expected && i < device->process_count;
             i++) {
            CHECK(device->processes[i].pid == layout_pid(d, i));
            CHECK(device->processes[i].used_bytes == layout_used(d, i));
        }
    }
}

static void *
layouts_thread(void *raw)
{
    (void)raw;
    cs_probe_result *result = malloc(sizeof(*result));
    CHECK(result != NULL);
    if (result == NULL) {
        return NULL;
    }
    for (int i = 0; i < 20; i++) {
        cs_probe_run(result);
        check_layouts(result);
    }
    free(result);
    return NULL;
}

static void
scenario_layouts(void)
{
    pthread_t threads[4];
    int started = 0;
    for (; started < 4; started++) {
        if (pthread_create(&threads[started], NULL, layouts_thread, NULL)
            != 0) {
            break;
        }
    }
    CHECK(started == 4);
    for (int i = 0; i < started; i++) {
        CHECK(pthread_join(threads[i], NULL) == 0);
    }
}

static void
scenario_options(const char *nvml_path)
{
    cs_probe_options options;
    cs_probe_result *result = malloc(sizeof(*result));
    CHECK(result != NULL);
    if (result == NULL) {
        return;
    }
    /* The environment says "disabled" and names no library; the options
     * load NVML only, from the path they give. */
    cs_probe_options_from_environment(&options);
    CHECK(options.disable);
    memset(&options, 0, sizeof(options));
    snprintf(options.libnvml, sizeof(options.libnvml), "%s", nvml_path);
    options.libcuda_too_long = true;
    cs_probe_run_with(&options, result);
    CHECK(result->nvml.loaded);
    CHECK(strcmp(result->nvml.path, nvml_path) == 0);
    CHECK(!result->cuda.loaded);
    CHECK(strstr(result->cuda.error, "COMFY_STANDIN_LIBCUDA is longer than")
          != NULL);
    CHECK(result->device_count == 2);
    /* Loaded once: later options change nothing. */
    cs_probe_run_with(NULL, result);
    CHECK(result->nvml.loaded);
    free(result);
}

int
main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr,
                "usage: %s CUDA_STUB NVML_STUB SCRIPT_PATH SCENARIO\n",
                argv[0]);
        return 2;
    }
    const char *cuda_path = argv[1];
    const char *nvml_path = argv[2];
    const char *script_path = argv[3];
    const char *scenario = argv[4];

    /* Before the first probe: the probe reads its environment once. */
    if (write_file(script_path, full_script) != 0
        || setenv("CS_STUB_SCRIPT", script_path, 1) != 0
        || setenv("COMFY_STANDIN_LIBCUDA", cuda_path, 1) != 0
        || setenv("COMFY_STANDIN_LIBNVML", nvml_path, 1) != 0
        || unsetenv("COMFY_STANDIN_PROBE_DISABLE") != 0) {
        perror("setup");
        return 2;
    }
    if (strcmp(scenario, "full") == 0) {
        scenario_full(cuda_path, nvml_path);
    }
    else if (strcmp(scenario, "disabled") == 0) {
        if (setenv("COMFY_STANDIN_PROBE_DISABLE", "1", 1) != 0) {
            return 2;
        }
        scenario_disabled(cuda_path, nvml_path);
    }
    else if (strcmp(scenario, "layouts") == 0) {
        if (write_layouts_script(script_path) != 0) {
            return 2;
        }
        scenario_layouts();
    }
    else if (strcmp(scenario, "options") == 0) {
        if (setenv("COMFY_STANDIN_PROBE_DISABLE", "1", 1) != 0
            || unsetenv("COMFY_STANDIN_LIBNVML") != 0) {
            return 2;
        }
        scenario_options(nvml_path);
    }
    else if (strcmp(scenario, "missing") == 0) {
        if (setenv("COMFY_STANDIN_LIBCUDA", "/nonexistent/libcuda.so.1", 1)
                != 0
            || setenv("COMFY_STANDIN_LIBNVML",
                      "/nonexistent/libnvidia-ml.so.1", 1) != 0) {
            return 2;
        }
        scenario_missing();
    }
    else {
        fprintf(stderr, "unknown scenario %s\n", scenario);
        return 2;
    }
    if (atomic_load(&failures) != 0) {
        fprintf(stderr, "%d check(s) failed\n", atomic_load(&failures));
        return 1;
    }
    puts("ok");
    return 0;
}
