/*
 * stub_script.h -- the scripted GPU both stub libraries (stub_cuda.c,
 * stub_nvml.c) answer from.  Test-only; never installed.
 *
 * The script is a text file named by the environment variable
 * CS_STUB_SCRIPT (no variable or no file: no devices).  One directive a
 * line, '#' starts a comment:
 *
 *   devices N            NVML sees N devices (indices 0..N-1)
 *   name I TEXT...       device I's name (the rest of the line)
 *   total I BYTES        total memory
 *   free I BYTES         device-wide free memory (nvmlDeviceGetMemoryInfo)
 *   ctx_free I BYTES     what cuMemGetInfo says under a current context
 *   proc I PID USED      a compute process on device I (USED "na": NVML's
 *                        "not available" value)
 *   procs I N PID0 USED  N processes with pids PID0, PID0+1, ...
 *   proc_growth N        each INSUFFICIENT_SIZE answer adds N processes
 *                        (processes starting between the two calls)
 *   proc_layout I SIZE   device I's process entries are SIZE bytes,
 *                        whatever the entry point: 16 (pid, used), 24
 *                        (+ gpu/compute instance ids), 32 (+ protected
 *                        memory, R535.54-era), or layouts no driver has:
 *                        20 (the 24-byte fields packed), 40 (32 + 8)
 *   proc_ids I GI CI     the instance ids device I's processes listed
 *                        after this line carry (default 0xFFFFFFFF, "no
 *                        MIG")
 *   proc_lie I KIND N    device I's process list lies (see stub_nvml.c):
 *                        grow, overrun N, overcount, short N,
 *                        short_once N, zero
 *   nvml_uuid I TEXT     device I's UUID as NVML says it (up to 95
 *                        characters: NVML_DEVICE_UUID_V2_BUFFER_SIZE)
 *   struct_extra I N     device I's nvmlMemory_t and CUuuid answers write
 *                        N zero bytes past the struct (a wrong layout)
 *   cuda_devices I...    the CUDA ordinals in order, as NVML indices
 *                        (default: all, in NVML order)
 *   ctx_current I        cuCtxGetCurrent reports a context on CUDA
 *                        ordinal I (default: no current context)
 *   driver_version V     cuDriverGetVersion / nvmlSystemGetCudaDriverVersion
 *   fail NAME CODE       the stub function NAME returns error CODE
 *
 * Device I's UUID is GPU-00000000-0000-0000-0000-0000000000XX with XX =
 * I + 1 in hex, in both libraries.
 */
#ifndef CS_STUB_SCRIPT_H
#define CS_STUB_SCRIPT_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STUB_MAX_DEVICES 24
#define STUB_MAX_PROCESSES 400
#define STUB_MAX_FAILS 16
#define STUB_NOT_AVAILABLE (~0ULL)

typedef struct {
    char name[128];
    char nvml_uuid[96]; /* "" for the default */
    unsigned long long total;
    unsigned long long free;
    unsigned long long ctx_free;
    unsigned int process_count;
    unsigned int pids[STUB_MAX_PROCESSES];
    unsigned long long used[STUB_MAX_PROCESSES];
    unsigned int gpu_instances[STUB_MAX_PROCESSES];
    unsigned int compute_instances[STUB_MAX_PROCESSES];
    unsigned int layout; /* entry size; 0: the entry point's own */
    unsigned int gpu_instance, compute_instance;
    char lie[16];        /* "" tells the truth */
    unsigned int lie_amount;
    unsigned int lie_calls; /* answers given so far (short_once) */
    unsigned int struct_extra;
} stub_device;

typedef struct {
    char name[96];
    int code;
} stub_fail;

static struct {
    int devices;
    stub_device device[STUB_MAX_DEVICES];
    int cuda_count; /* -1: same as NVML */
    int cuda_map[STUB_MAX_DEVICES];
    int ctx_current; /* -1: none */
    int driver_version;
    unsigned int process_growth;
    unsigned int next_growth_pid;
    int fail_count;
    stub_fail fails[STUB_MAX_FAILS];
    pthread_mutex_t lock; /* guards process lists (proc_growth) */
} stub;

static pthread_once_t stub_once = PTHREAD_ONCE_INIT;

/* The next process of `device` carries its current instance ids. */
static void
stub_stamp_ids(stub_device *device)
{
    device->gpu_instances[device->process_count] = device->gpu_instance;
    device->compute_instances[device->process_count] =
        device->compute_instance;
}

static void
stub_parse_line(char *line)
{
    char word[64];
    int index = -1, consumed = 0;
    unsigned long long value = 0;
    if (sscanf(line, "%63s%n", word, &consumed) != 1 || word[0] == '#') {
        return;
    }
    char *rest = line + consumed;
    if (strcmp(word, "devices") == 0) {
        stub.devices = atoi(rest);
        if (stub.devices > STUB_MAX_DEVICES) {
            stub.devices = STUB_MAX_DEVICES;
        }
    }
    else if (strcmp(word, "name") == 0
             && sscanf(rest, "%d %n", &index, &consumed) == 1
             && index >= 0 && index < STUB_MAX_DEVICES) {
        char *name = rest + consumed;
        name[strcspn(name, "\r\n")] = '\0';
        snprintf(stub.device[index].name, sizeof(stub.device[index].name),
                 "%s", name);
    }
    else if ((strcmp(word, "total") == 0 || strcmp(word, "free") == 0
              || strcmp(word, "ctx_free") == 0)
             && sscanf(rest, "%d %llu", &index, &value) == 2
             && index >= 0 && index < STUB_MAX_DEVICES) {
        stub_device *device = &stub.device[index];
        if (word[0] == 't') {
            device->total = value;
        }
        else if (word[0] == 'f') {
            device->free = value;
        }
        else {
            device->ctx_free = value;
        }
    }
    else if (strcmp(word, "proc") == 0) {
        unsigned int pid = 0;
        char used[32];
        if (sscanf(rest, "%d %u %31s", &index, &pid, used) == 3
            && index >= 0 && index < STUB_MAX_DEVICES
            && stub.device[index].process_count < STUB_MAX_PROCESSES) {
            stub_device *device = &stub.device[index];
            stub_stamp_ids(device);
            device->pids[device->process_count] = pid;
            device->used[device->process_count++] =
                strcmp(used, "na") == 0 ? STUB_NOT_AVAILABLE
                                        : strtoull(used, NULL, 10);
        }
    }
    else if (strcmp(word, "procs") == 0) {
        unsigned int count = 0, pid = 0;
        if (sscanf(rest, "%d %u %u %llu", &index, &count, &pid, &value) == 4
            && index >= 0 && index < STUB_MAX_DEVICES) {
            stub_device *device = &stub.device[index];
            for (unsigned int i = 0;
                 i < count && device->process_count < STUB_MAX_PROCESSES;
                 i++) {
                stub_stamp_ids(device);
                device->pids[device->process_count] = pid + i;
                device->used[device->process_count++] = value;
            }
        }
    }
    else if (strcmp(word, "proc_layout") == 0) {
        unsigned int size = 0;
        if (sscanf(rest, "%d %u", &index, &size) == 2 && index >= 0
            && index < STUB_MAX_DEVICES) {
            stub.device[index].layout = size;
        }
    }
    else if (strcmp(word, "nvml_uuid") == 0) {
        char text[96] = "";
        if (sscanf(rest, "%d %95s", &index, text) == 2 && index >= 0
            && index < STUB_MAX_DEVICES) {
            snprintf(stub.device[index].nvml_uuid,
                     sizeof(stub.device[index].nvml_uuid), "%s", text);
        }
    }
    else if (strcmp(word, "struct_extra") == 0) {
        unsigned int extra = 0;
        if (sscanf(rest, "%d %u", &index, &extra) == 2 && index >= 0
            && index < STUB_MAX_DEVICES) {
            stub.device[index].struct_extra = extra;
        }
    }
    else if (strcmp(word, "proc_ids") == 0) {
        unsigned int gi = 0, ci = 0;
        if (sscanf(rest, "%d %u %u", &index, &gi, &ci) == 3 && index >= 0
            && index < STUB_MAX_DEVICES) {
            stub.device[index].gpu_instance = gi;
            stub.device[index].compute_instance = ci;
        }
    }
    else if (strcmp(word, "proc_lie") == 0) {
        char kind[16];
        unsigned int amount = 0;
        int fields = sscanf(rest, "%d %15s %u", &index, kind, &amount);
        if (fields >= 2 && index >= 0 && index < STUB_MAX_DEVICES) {
            snprintf(stub.device[index].lie, sizeof(stub.device[index].lie),
                     "%s", kind);
            stub.device[index].lie_amount = fields == 3 ? amount : 0;
        }
    }
    else if (strcmp(word, "proc_growth") == 0) {
        stub.process_growth = (unsigned int)atoi(rest);
    }
    else if (strcmp(word, "cuda_devices") == 0) {
        int ordinal = 0;
        char *cursor = rest;
        while (ordinal < STUB_MAX_DEVICES
               && sscanf(cursor, "%d%n", &index, &consumed) == 1) {
            stub.cuda_map[ordinal++] = index;
            cursor += consumed;
        }
        stub.cuda_count = ordinal;
    }
    else if (strcmp(word, "ctx_current") == 0) {
        stub.ctx_current = atoi(rest);
    }
    else if (strcmp(word, "driver_version") == 0) {
        stub.driver_version = atoi(rest);
    }
    else if (strcmp(word, "fail") == 0 && stub.fail_count < STUB_MAX_FAILS) {
        stub_fail *fail = &stub.fails[stub.fail_count];
        if (sscanf(rest, "%95s %d", fail->name, &fail->code) == 2) {
            stub.fail_count++;
        }
    }
}

static void
stub_load(void)
{
    const char *path = getenv("CS_STUB_SCRIPT");
    char line[512];
    FILE *file;
    stub.cuda_count = -1;
    stub.ctx_current = -1;
    stub.driver_version = 12040;
    stub.next_growth_pid = 70000;
    pthread_mutex_init(&stub.lock, NULL);
    for (int i = 0; i < STUB_MAX_DEVICES; i++) {
        stub.cuda_map[i] = i;
        stub.device[i].gpu_instance = 0xFFFFFFFFu;
        stub.device[i].compute_instance = 0xFFFFFFFFu;
    }
    file = path != NULL ? fopen(path, "r") : NULL;
    if (file != NULL) {
        while (fgets(line, sizeof(line), file) != NULL) {
            stub_parse_line(line);
        }
        fclose(file);
    }
    if (stub.cuda_count < 0) {
        stub.cuda_count = stub.devices;
    }
}

static void
stub_ready(void)
{
    pthread_once(&stub_once, stub_load);
}

/* The scripted error for `name`, or 0. */
static int
stub_failure(const char *name)
{
    stub_ready();
    for (int i = 0; i < stub.fail_count; i++) {
        if (strcmp(stub.fails[i].name, name) == 0) {
            return stub.fails[i].code;
        }
    }
    return 0;
}

/* Unused in the STUB_NO_UUID variant of the CUDA stub. */
__attribute__((unused)) static void
stub_uuid_bytes(int index, unsigned char bytes[16])
{
    memset(bytes, 0, 16);
    bytes[15] = (unsigned char)(index + 1);
}

#endif /* CS_STUB_SCRIPT_H */
