/*
 * lib_fuzz_nvml.c -- a fake NVML for fuzz_probe.c, built by run.sh as
 * lib_fuzz_nvml.so next to the harness.  It answers from the script the
 * harness fills (fuzz_nvml_script) and writes process entries with the
 * script's stride, as a driver of another NVML version would: the probe
 * must cope with every stride seen in the field without reading garbage
 * or writing out of bounds.
 */
#include "fuzz_nvml.h"

#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

EXPORT fuzz_nvml_script fuzz_nvml_script_data;

typedef void *nvml_device;

static int
device_index(nvml_device device)
{
    uintptr_t i = (uintptr_t)device;
    return i >= 1 && i <= FUZZ_NVML_DEVICES ? (int)(i - 1) : -1;
}

EXPORT int nvmlInit_v2(void);
EXPORT int nvmlDeviceGetCount_v2(unsigned int *count);
EXPORT int nvmlDeviceGetHandleByIndex_v2(unsigned int index,
                                         nvml_device *device);
EXPORT int nvmlDeviceGetName(nvml_device device, char *name,
                             unsigned int length);
EXPORT int nvmlDeviceGetUUID(nvml_device device, char *uuid,
                             unsigned int length);
EXPORT int nvmlDeviceGetMemoryInfo(nvml_device device, void *memory);
EXPORT int nvmlDeviceGetComputeRunningProcesses_v3(nvml_device device,
                                                   unsigned int *count,
                                                   void *infos);
EXPORT int nvmlDeviceGetComputeRunningProcesses_v2(nvml_device device,
                                                   unsigned int *count,
                                                   void *infos);
EXPORT int nvmlDeviceGetComputeRunningProcesses(nvml_device device,
                                                unsigned int *count,
                                                void *infos);

int
nvmlInit_v2(void)
{
    return FUZZ_NVML_SUCCESS;
}

int
nvmlDeviceGetCount_v2(unsigned int *count)
{
    *count = FUZZ_NVML_DEVICES;
    return FUZZ_NVML_SUCCESS;
}

int
nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvml_device *device)
{
    if (index >= FUZZ_NVML_DEVICES) {
        return FUZZ_NVML_ERROR_UNKNOWN;
    }
    *device = (nvml_device)(uintptr_t)(index + 1);
    return FUZZ_NVML_SUCCESS;
}

/* Fills the whole buffer, terminator last, as NVML does for a long name. */
static int
fill_text(char *text, unsigned int length, char letter)
{
    if (length == 0) {
        return FUZZ_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memset(text, letter, length - 1);
    text[length - 1] = '\0';
    return FUZZ_NVML_SUCCESS;
}

int
nvmlDeviceGetName(nvml_device device, char *name, unsigned int length)
{
    return fill_text(name, length, 'N');
}

int
nvmlDeviceGetUUID(nvml_device device, char *uuid, unsigned int length)
{
    int d = device_index(device);
    if (d < 0 || length < 41) {
        return FUZZ_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(uuid, "GPU-00000000-0000-0000-0000-00000000000", 39);
    uuid[39] = (char)('1' + d);
    uuid[40] = '\0';
    return FUZZ_NVML_SUCCESS;
}

int
nvmlDeviceGetMemoryInfo(nvml_device device, void *memory)
{
    const fuzz_nvml_script *s = &fuzz_nvml_script_data;
    int d = device_index(device);
    if (d < 0) {
        return FUZZ_NVML_ERROR_UNKNOWN;
    }
    if (s->memory_result[d] != FUZZ_NVML_SUCCESS) {
        return s->memory_result[d];
    }
    unsigned long long figures[3] = {s->total[d], s->free[d],
                                     s->total[d] - s->free[d]};
    memcpy(memory, figures, sizeof(figures));
    return FUZZ_NVML_SUCCESS;
}

static int
processes(nvml_device device, unsigned int *count, void *infos)
{
    fuzz_nvml_script *s = &fuzz_nvml_script_data;
    int d = device_index(device);
    if (d < 0 || count == NULL) {
        return FUZZ_NVML_ERROR_UNKNOWN;
    }
    if (s->process_result[d] != FUZZ_NVML_SUCCESS) {
        return s->process_result[d];
    }
    unsigned int n = s->count[d];
    if (*count < n || (infos == NULL && n > 0)) {
        /* The need, as the driver counts it (maybe understated), and
         * processes may start before the caller retries. */
        *count = n > s->understate ? n - s->understate : 0;
        unsigned int grown = n + s->growth;
        s->count[d] = grown < FUZZ_NVML_MAX_PROCESSES
                          ? grown : FUZZ_NVML_MAX_PROCESSES;
        return FUZZ_NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned char *out = infos;
    for (unsigned int i = 0; i < n; i++) {
        unsigned char *entry = out + (size_t)i * s->stride;
        unsigned int pid = s->pid_base + i;
        memset(entry, s->filler, s->stride);
        memcpy(entry, &pid, sizeof(pid));
        memcpy(entry + 8, &s->used[i], sizeof(s->used[i]));
    }
    *count = n;
    s->written[d] = n;
    return FUZZ_NVML_SUCCESS;
}

int
nvmlDeviceGetComputeRunningProcesses_v3(nvml_device device,
                                        unsigned int *count, void *infos)
{
    return processes(device, count, infos);
}

int
nvmlDeviceGetComputeRunningProcesses_v2(nvml_device device,
                                        unsigned int *count, void *infos)
{
    return processes(device, count, infos);
}

int
nvmlDeviceGetComputeRunningProcesses(nvml_device device,
                                     unsigned int *count, void *infos)
{
    return processes(device, count, infos);
}
