/*
 * stub_nvml.c -- a stand-in for libnvidia-ml.so.1 with scripted answers
 * (see stub_script.h).  Test-only: built by the test suite, never
 * installed.
 *
 * Process lists follow NVML's protocol: *count holds the buffer's capacity
 * on entry; when it is too small the call returns INSUFFICIENT_SIZE with
 * *count set to what is needed.  The unversioned entry point fills the
 * two-field v1 layout, _v2 and _v3 the four-field one, so a probe that
 * reads the wrong layout reads wrong pids.  The script can give a device
 * another entry size (proc_layout: 16, 24 and 32 are drivers in the
 * field, 20 and 40 no driver), and make its list lie (proc_lie):
 *   grow       every call answers INSUFFICIENT_SIZE, asking for more
 *              than it was given
 *   overrun N  ignores the capacity: writes what fits plus N entries
 *              more, and reports only what fit
 *   overcount  ignores the capacity: writes what fits, and reports every
 *              process it has (more than the buffer holds)
 *   short N    writes N entries fewer than it reports
 *   short_once N  the same on its first answer only (a process that
 *              exits while the driver fills the list)
 *   zero       writes its entries and reports 0
 * Padding is never written (as a field-by-field copy leaves it).
 *
 * Variants (compile with -D):
 *   STUB_NO_INIT          neither nvmlInit_v2 nor nvmlInit
 *   STUB_NO_PROCESSES_V3  no nvmlDeviceGetComputeRunningProcesses_v3
 *   STUB_NO_PROCESSES_V2  no ..._v2 either (with STUB_NO_PROCESSES_V3)
 *   STUB_NO_PROCESSES     no process entry point at all
 *   STUB_NO_MEMORY_INFO   no nvmlDeviceGetMemoryInfo
 */
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "stub_script.h"

typedef int nvmlReturn_t;
typedef stub_device *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

#define SUCCESS 0
#define ERROR_UNINITIALIZED 1
#define ERROR_INVALID_ARGUMENT 2
#define ERROR_INSUFFICIENT_SIZE 7

#define EXPORT __attribute__((visibility("default")))

static _Atomic long init_calls;
static _Atomic long shutdown_calls;
static _Atomic long process_calls;
static _Atomic int initialized;

EXPORT long stub_nvml_count(const char *name);

EXPORT long
stub_nvml_count(const char *name)
{
    if (strcmp(name, "nvmlInit") == 0) {
        return atomic_load(&init_calls);
    }
    if (strcmp(name, "nvmlShutdown") == 0) {
        return atomic_load(&shutdown_calls);
    }
    if (strcmp(name, "nvmlDeviceGetComputeRunningProcesses") == 0) {
        return atomic_load(&process_calls);
    }
    return -1;
}

static nvmlReturn_t
enter(const char *name)
{
    int failure = stub_failure(name);
    if (failure != 0) {
        return failure;
    }
    return atomic_load(&initialized) ? SUCCESS : ERROR_UNINITIALIZED;
}

static int
index_of(nvmlDevice_t device)
{
    if (device < &stub.device[0] || device >= &stub.device[stub.devices]) {
        return -1;
    }
    return (int)(device - &stub.device[0]);
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result);

EXPORT const char *
nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case SUCCESS:
        return "Success";
    case ERROR_UNINITIALIZED:
        return "Uninitialized";
    case 3:
        return "Not Supported";
    case 4:
        return "Insufficient Permissions";
    case ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    case 9:
        return "Driver Not Loaded";
    default:
        return "Unknown Error";
    }
}

#ifndef STUB_NO_INIT
EXPORT nvmlReturn_t nvmlInit_v2(void);
EXPORT nvmlReturn_t nvmlInit(void);

EXPORT nvmlReturn_t
nvmlInit_v2(void)
{
    int failure = stub_failure("nvmlInit");
    atomic_fetch_add(&init_calls, 1);
    if (failure != 0) {
        return failure;
    }
    atomic_store(&initialized, 1);
    return SUCCESS;
}

EXPORT nvmlReturn_t
nvmlInit(void)
{
    return nvmlInit_v2();
}
#endif

EXPORT nvmlReturn_t nvmlShutdown(void);

EXPORT nvmlReturn_t
nvmlShutdown(void)
{
    atomic_fetch_add(&shutdown_calls, 1);
    return SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version);

EXPORT nvmlReturn_t
nvmlSystemGetCudaDriverVersion(int *version)
{
    nvmlReturn_t result = enter("nvmlSystemGetCudaDriverVersion");
    if (result == SUCCESS) {
        *version = stub.driver_version;
    }
    return result;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count);

EXPORT nvmlReturn_t
nvmlDeviceGetCount_v2(unsigned int *count)
{
    nvmlReturn_t result = enter("nvmlDeviceGetCount");
    if (result == SUCCESS) {
        *count = (unsigned int)stub.devices;
    }
    return result;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index,
                                                  nvmlDevice_t *device);

EXPORT nvmlReturn_t
nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t result = enter("nvmlDeviceGetHandleByIndex");
    if (result != SUCCESS) {
        return result;
    }
    if (index >= (unsigned int)stub.devices) {
        return ERROR_INVALID_ARGUMENT;
    }
    *device = &stub.device[index];
    return SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name,
                                      unsigned int length);

EXPORT nvmlReturn_t
nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t result = enter("nvmlDeviceGetName");
    if (result != SUCCESS) {
        return result;
    }
    if (index_of(device) < 0 || length == 0) {
        return ERROR_INVALID_ARGUMENT;
    }
    snprintf(name, length, "%s", device->name);
    return SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid,
                                      unsigned int length);

/* Upper case, to check the probe compares UUIDs without regard to case.
 * A buffer shorter than the UUID and its NUL gets INSUFFICIENT_SIZE, as
 * from NVML (which documents 96 bytes, NVML_DEVICE_UUID_V2_BUFFER_SIZE,
 * as always enough). */
EXPORT nvmlReturn_t
nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t result = enter("nvmlDeviceGetUUID");
    int index = index_of(device);
    unsigned char bytes[16];
    char text[96];
    if (result != SUCCESS) {
        return result;
    }
    if (index < 0 || uuid == NULL) {
        return ERROR_INVALID_ARGUMENT;
    }
    stub_uuid_bytes(index, bytes);
    snprintf(text, sizeof(text),
             "GPU-%02X%02X%02X%02X-%02X%02X-%02X%02X-%02X%02X-"
             "%02X%02X%02X%02X%02X%02X",
             bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5],
             bytes[6], bytes[7], bytes[8], bytes[9], bytes[10], bytes[11],
             bytes[12], bytes[13], bytes[14], bytes[15]);
    if (device->nvml_uuid[0] != '\0') {
        snprintf(text, sizeof(text), "%s", device->nvml_uuid);
    }
    if (length < strlen(text) + 1) {
        return ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(uuid, text, strlen(text) + 1);
    return SUCCESS;
}

#ifndef STUB_NO_MEMORY_INFO
EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device,
                                            nvmlMemory_t *memory);

EXPORT nvmlReturn_t
nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t result = enter("nvmlDeviceGetMemoryInfo");
    if (result != SUCCESS) {
        return result;
    }
    if (index_of(device) < 0) {
        return ERROR_INVALID_ARGUMENT;
    }
    memory->total = device->total;
    memory->free = device->free;
    memory->used = device->total - device->free;
    memset(memory + 1, 0, device->struct_extra);
    return SUCCESS;
}
#endif

/* Every layout through one routine: `layout` is the entry point's own
 * entry size (16 or 24), unless the script gives the device another. */
#ifndef STUB_NO_PROCESSES
static void
put_u32(unsigned char *at, unsigned int value)
{
    memcpy(at, &value, sizeof(value));
}

static void
put_u64(unsigned char *at, unsigned long long value)
{
    memcpy(at, &value, sizeof(value));
}

static void
write_entry(unsigned char *entry, unsigned int size, unsigned int gi,
            unsigned int ci, unsigned int pid, unsigned long long used)
{
    put_u32(entry, pid);
    if (size == 20) { /* packed: no padding after the pid */
        put_u64(entry + 4, used);
        put_u32(entry + 12, gi);
        put_u32(entry + 16, ci);
        return;
    }
    put_u64(entry + 8, used);
    if (size >= 24) {
        put_u32(entry + 16, gi);
        put_u32(entry + 20, ci);
    }
    if (size >= 32) {
        put_u64(entry + 24, 0); /* usedGpuCcProtectedMemory */
    }
    if (size >= 40) {
        put_u64(entry + 32, 0);
    }
}

static nvmlReturn_t
get_processes(nvmlDevice_t device, unsigned int *count, void *infos,
              unsigned int layout)
{
    nvmlReturn_t result = enter("nvmlDeviceGetComputeRunningProcesses");
    atomic_fetch_add(&process_calls, 1);
    if (result != SUCCESS) {
        return result;
    }
    if (index_of(device) < 0 || count == NULL) {
        return ERROR_INVALID_ARGUMENT;
    }
    pthread_mutex_lock(&stub.lock);
    const char *lie = device->lie;
    unsigned int size = device->layout != 0 ? device->layout : layout;
    unsigned int capacity = *count;
    unsigned int written = device->process_count;
    unsigned int reported = device->process_count;
    bool ignores_capacity = strcmp(lie, "overrun") == 0
                            || strcmp(lie, "overcount") == 0;
    if (strcmp(lie, "grow") == 0) {
        *count = capacity + 10;
        pthread_mutex_unlock(&stub.lock);
        return ERROR_INSUFFICIENT_SIZE;
    }
    if (capacity < device->process_count && !ignores_capacity) {
        *count = device->process_count;
        /* Processes that start between this answer and the retry. */
        for (unsigned int i = 0; i < stub.process_growth
                                 && device->process_count
                                        < STUB_MAX_PROCESSES;
             i++) {
            stub_stamp_ids(device);
            device->pids[device->process_count] = stub.next_growth_pid++;
            device->used[device->process_count++] = 1u << 20;
        }
        pthread_mutex_unlock(&stub.lock);
        return ERROR_INSUFFICIENT_SIZE;
    }
    if (ignores_capacity && written > capacity) {
        written = capacity;
        reported = strcmp(lie, "overrun") == 0 ? capacity
                                               : device->process_count;
    }
    if (strcmp(lie, "short") == 0
        || (strcmp(lie, "short_once") == 0 && device->lie_calls++ == 0)) {
        written = device->lie_amount < written ? written - device->lie_amount
                                               : 0;
    }
    if (strcmp(lie, "zero") == 0) {
        reported = 0;
    }
    for (unsigned int i = 0; i < written; i++) {
        write_entry((unsigned char *)infos + (size_t)i * size, size,
                    device->gpu_instances[i], device->compute_instances[i],
                    device->pids[i], device->used[i]);
    }
    if (strcmp(lie, "overrun") == 0) {
        for (unsigned int i = 0; i < device->lie_amount; i++) {
            write_entry((unsigned char *)infos + (size_t)(written + i) * size,
                        size, device->gpu_instance, device->compute_instance,
                        60000 + i, 1u << 20);
        }
    }
    *count = reported;
    pthread_mutex_unlock(&stub.lock);
    return SUCCESS;
}

#ifndef STUB_NO_PROCESSES_V3
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(
    nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v2_t *infos);

EXPORT nvmlReturn_t
nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                        unsigned int *count,
                                        nvmlProcessInfo_v2_t *infos)
{
    return get_processes(device, count, infos, 24);
}
#endif

#ifndef STUB_NO_PROCESSES_V2
EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(
    nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v2_t *infos);

EXPORT nvmlReturn_t
nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device,
                                        unsigned int *count,
                                        nvmlProcessInfo_v2_t *infos)
{
    return get_processes(device, count, infos, 24);
}
#endif

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(
    nvmlDevice_t device, unsigned int *count, nvmlProcessInfo_v1_t *infos);

EXPORT nvmlReturn_t
nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device,
                                     unsigned int *count,
                                     nvmlProcessInfo_v1_t *infos)
{
    return get_processes(device, count, infos, 16);
}
#endif
