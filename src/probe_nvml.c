/*
 * probe_nvml.c -- the NVML half of the GPU probe (probe.c): NVML loaded
 * from its library, its devices matched to the CUDA table (or made into
 * it), and the per-call readings of memory and of the process list, whose
 * entry layout is measured from every answer, never assumed.
 */
#include "probe_internal.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

void
probe_nvml_describe(cs_nvml_return result, const char *call, char *buffer,
                    size_t size)
{
    const char *text = NULL;
    if (cs_probe_state.nvml.error_string != NULL) {
        text = cs_probe_state.nvml.error_string(result);
    }
    if (text == NULL) {
        text = "unknown error";
    }
    probe_message_format(buffer, size, "%s: %s (NVML error %d)", call, text,
                         result);
}

/* ---- NVML ----------------------------------------------------------- */

/* The required entry points; false (with the library's error set) when
 * one is missing.  `init_name` is set to the name nvml->init came from. */
static bool
nvml_resolve_required(library_handle handle, cs_probe_library *library,
                      nvml_functions *nvml, const char **init_name)
{
    const char *missing = NULL;

    *init_name = "nvmlInit_v2";
    /* The _v2 entry points count and index every device, including ones
     * the caller may not have permission to use; the unversioned ones are
     * the fallback for drivers that predate them. */
    if (!LIBRARY_SYMBOL(handle, "nvmlInit_v2", nvml->init)) {
        *init_name = "nvmlInit";
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
        probe_message_format(library->error, sizeof(library->error),
                             "symbol %s not found", missing);
        return false;
    }
    return true;
}

/* Optional symbols: a missing one costs only the figure it reads. */
static void
nvml_resolve_optional(library_handle handle, nvml_functions *nvml)
{
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
}

void
probe_nvml_load(const cs_probe_options *options)
{
    cs_probe_library *library = &cs_probe_state.nvml_library;
    nvml_functions *nvml = &cs_probe_state.nvml;
    const char *path = probe_option_path(
        options->libnvml, options->libnvml_too_long, "COMFY_STANDIN_LIBNVML",
        library->error, sizeof(library->error));
    library_handle handle =
        path == NULL ? NULL
                     : probe_library_open(path, CS_LIBNVML_DEFAULT,
                                          &library->preloaded, library->error,
                                          sizeof(library->error));
    const char *init_name = NULL;
    cs_nvml_return result;

    if (handle == NULL) {
        goto error;
    }
    (void)LIBRARY_SYMBOL(handle, "nvmlErrorString", nvml->error_string);
    if (!nvml_resolve_required(handle, library, nvml, &init_name)) {
        goto error;
    }
    nvml_resolve_optional(handle, nvml);
    /* Never paired with nvmlShutdown: NVML counts init calls, so this
     * reference cannot pull NVML from under another user in the process,
     * and keeping it makes every later probe cheap. */
    result = nvml->init();
    if (result != CS_NVML_SUCCESS) {
        probe_nvml_describe(result, init_name, library->error,
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
    probe_library_path(handle, symbol, library->path, sizeof(library->path));
    library->loaded = true;
    return;

error:
    memset(nvml, 0, sizeof(*nvml));
    library->loaded = false;
    library->preloaded = false;
}

/* ---- the device table ----------------------------------------------- */

/* What NVML says of its device `index`: the handle (NULL when it gave
 * none), UUID and name ("" when unread), and the first failure in
 * `message`. */
typedef struct {
    cs_nvml_device handle;
    char name[CS_PROBE_NAME_SIZE];
    char uuid[CS_PROBE_UUID_SIZE];
    char message[CS_PROBE_MESSAGE_SIZE];
} nvml_identity;

static void
nvml_identify(const nvml_functions *nvml, unsigned int index,
              nvml_identity *identity)
{
    cs_nvml_return result =
        nvml->device_get_handle_by_index(index, &identity->handle);

    if (result != CS_NVML_SUCCESS) {
        identity->handle = NULL;
        probe_nvml_describe(result, "nvmlDeviceGetHandleByIndex",
                            identity->message, sizeof(identity->message));
        return;
    }
    if (nvml->device_get_uuid != NULL) {
        result = nvml->device_get_uuid(identity->handle, identity->uuid,
                                       (unsigned int)sizeof(identity->uuid));
        if (result != CS_NVML_SUCCESS) {
            identity->uuid[0] = '\0';
            probe_nvml_describe(result, "nvmlDeviceGetUUID",
                                identity->message,
                                sizeof(identity->message));
            return;
        }
        identity->uuid[sizeof(identity->uuid) - 1] = '\0';
    }
    if (nvml->device_get_name != NULL) {
        result = nvml->device_get_name(identity->handle, identity->name,
                                       (unsigned int)sizeof(identity->name));
        if (result != CS_NVML_SUCCESS) {
            identity->name[0] = '\0';
        }
        identity->name[sizeof(identity->name) - 1] = '\0';
    }
}

/* The table entry an NVML device belongs to: the CUDA device with its
 * UUID (NULL when none: hidden from this process by CUDA_VISIBLE_DEVICES
 * or unreadable, so torch cannot use it either), or a new entry when the
 * table is NVML's own. */
static device_static *
nvml_place(bool from_cuda, unsigned int index, const nvml_identity *identity)
{
    device_static *device;

    if (from_cuda) {
        for (size_t i = 0; i < cs_probe_state.device_count; i++) {
            if (uuid_equal(cs_probe_state.devices[i].uuid, identity->uuid)) {
                return &cs_probe_state.devices[i];
            }
        }
        return NULL;
    }
    device = &cs_probe_state.devices[cs_probe_state.device_count++];
    device->index = index;
    device->nvml_index = -1;
    probe_text_copy(device->uuid, sizeof(device->uuid), identity->uuid);
    probe_message_set_first(device->error, sizeof(device->error),
                            identity->message);
    return device;
}

/* Matches NVML devices to the CUDA table by UUID, or, when the driver
 * gave no table, makes the table from NVML's own enumeration. */
void
probe_nvml_enumerate(void)
{
    nvml_functions *nvml = &cs_probe_state.nvml;
    bool from_cuda = cs_probe_state.devices_from_cuda;
    unsigned int count = 0;
    cs_nvml_return result = nvml->device_get_count(&count);

    if (result != CS_NVML_SUCCESS) {
        probe_nvml_describe(result, "nvmlDeviceGetCount",
                            cs_probe_state.nvml_library.error,
                            sizeof(cs_probe_state.nvml_library.error));
        return;
    }
    if (!from_cuda && count > CS_PROBE_MAX_DEVICES) {
        cs_probe_state.devices_truncated = true;
        count = CS_PROBE_MAX_DEVICES;
    }
    for (unsigned int index = 0; index < count; index++) {
        nvml_identity identity = {0};
        device_static *device;

        nvml_identify(nvml, index, &identity);
        device = nvml_place(from_cuda, index, &identity);
        if (device == NULL || identity.handle == NULL) {
            continue;
        }
        device->nvml_index = (int)index;
        device->nvml_device = identity.handle;
        if (device->name[0] == '\0') {
            probe_text_copy(device->name, sizeof(device->name),
                            identity.name);
        }
    }
    if (from_cuda) {
        for (size_t i = 0; i < cs_probe_state.device_count; i++) {
            device_static *device = &cs_probe_state.devices[i];
            if (device->nvml_index < 0) {
                probe_message_set_first(device->error, sizeof(device->error),
                                        device->uuid[0] == '\0'
                                            ? "no UUID from the CUDA driver "
                                              "to match an NVML device by"
                                            : "no NVML device with this "
                                              "UUID");
            }
        }
    }
}

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

/* What is wrong with one entry under the `stride`-byte layout (NULL when
 * nothing), with its identity in `key`. */
static const char *
process_entry_check(const unsigned char *entry, size_t stride,
                    unsigned char sentinel, uint64_t bound, process_key *key)
{
    uint32_t pid = load_u32(entry + CS_NVML_PROCESS_PID);
    uint64_t used = load_u64(entry + CS_NVML_PROCESS_USED);

    key->pid = pid;
    key->gpu_instance = CS_NVML_NO_INSTANCE;
    key->compute_instance = CS_NVML_NO_INSTANCE;
    if (entry[stride - 1] == sentinel) {
        return "is not written to its end";
    }
    if (pid == 0 || pid > (uint32_t)INT32_MAX) {
        return "has an impossible pid";
    }
    if (!plausible_bytes(used, bound)) {
        return "uses more memory than the device has";
    }
    if (stride >= 24) {
        key->gpu_instance = load_u32(entry + CS_NVML_PROCESS_GPU_INSTANCE);
        key->compute_instance =
            load_u32(entry + CS_NVML_PROCESS_COMPUTE_INSTANCE);
        if ((key->gpu_instance != CS_NVML_NO_INSTANCE
             && key->gpu_instance >= PROCESS_INSTANCE_LIMIT)
            || (key->compute_instance != CS_NVML_NO_INSTANCE
                && key->compute_instance >= PROCESS_INSTANCE_LIMIT)) {
            return "has an impossible MIG instance id";
        }
    }
    if (stride >= 32
        && !plausible_bytes(load_u64(entry + CS_NVML_PROCESS_CC_PROTECTED),
                            bound)) {
        return "has more protected memory than the device has";
    }
    return NULL;
}

/* The layout whose entries end exactly where the driver stopped writing,
 * or 0 with the reason.  Every field of every layout ends the entry, and
 * its last byte is the top byte of a count or an id (0x00 or 0xFF in any
 * real answer): the driver's extent is exactly count * size.  One entry
 * measures as well as many. */
static size_t
process_layout(size_t extent, unsigned int count, char *reason,
               size_t reason_size)
{
    size_t stride = 0;

    for (size_t i = 0; i < sizeof(process_entry_sizes)
                               / sizeof(process_entry_sizes[0]); i++) {
        if (extent == (size_t)count * process_entry_sizes[i]) {
            stride = process_entry_sizes[i];
        }
    }
    if (stride == 0) {
        probe_message_format(reason, reason_size,
                             "unknown process entry layout: the driver wrote "
                             "%zu bytes for %u processes (entries of 16, 24 "
                             "or 32 bytes expected)",
                             extent, count);
    }
    return stride;
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
    size_t extent = probe_written_extent(buffer, size, sentinel);
    size_t stride;
    process_key *keys = NULL;

    if (count == 0) {
        if (extent != 0) {
            probe_message_format(reason, reason_size,
                                 "the driver wrote %zu bytes for 0 "
                                 "processes",
                                 extent);
        }
        return 0;
    }
    stride = process_layout(extent, count, reason, reason_size);
    if (stride == 0) {
        return 0;
    }
    keys = malloc((size_t)count * sizeof(*keys));
    if (keys == NULL) {
        probe_message_format(reason, reason_size,
                             "out of memory checking the process list");
        return 0;
    }
    for (unsigned int i = 0; i < count; i++) {
        const char *wrong = process_entry_check(
            buffer + (size_t)i * stride, stride, sentinel, bound, &keys[i]);
        if (wrong != NULL) {
            probe_message_format(reason, reason_size,
                                 "process entry %u of %u %s under the "
                                 "%zu-byte layout the driver's answer "
                                 "measures",
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
            probe_message_format(reason, reason_size,
                                 "pid %u listed twice under the %zu-byte "
                                 "layout the driver's answer measures",
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

/* NVML answered INSUFFICIENT_SIZE with its need in `count`: the next
 * capacity, or false with the reason when the answer is broken. */
static bool
process_capacity_grow(const nvml_functions *nvml, unsigned int count,
                      unsigned int *capacity, char *reason,
                      size_t reason_size)
{
    if (count <= *capacity) {
        probe_message_format(reason, reason_size,
                             "%s: asked for %u entries when given %u",
                             nvml->processes_symbol, count, *capacity);
        return false;
    }
    if (count > PROCESS_MAX_CAPACITY) {
        probe_message_format(reason, reason_size,
                             "%s: reports %u processes, more than %d",
                             nvml->processes_symbol, count,
                             PROCESS_MAX_CAPACITY);
        return false;
    }
    /* Headroom for processes starting before the next call. */
    *capacity = count + count / 2 + 8;
    if (*capacity > PROCESS_MAX_CAPACITY) {
        *capacity = PROCESS_MAX_CAPACITY;
    }
    return true;
}

/* Room for `capacity` entries of the largest layout and the guard zone. */
static bool
process_buffer_reserve(unsigned char **buffer, size_t *allocated,
                       unsigned int capacity, char *reason,
                       size_t reason_size)
{
    size_t needed = (size_t)capacity * CS_NVML_PROCESS_MAX_SIZE
                    + PROCESS_GUARD_BYTES;
    unsigned char *grown;

    if (needed <= *allocated) {
        return true;
    }
    grown = realloc(*buffer, needed);
    if (grown == NULL) {
        probe_message_format(reason, reason_size,
                             "out of memory reading the process list");
        return false;
    }
    *buffer = grown;
    *allocated = needed;
    return true;
}

/* Reads the process list with NVML's protocol (call with a capacity; on
 * INSUFFICIENT_SIZE, count holds the need: grow and call again), into a
 * heap buffer that leaves room for the largest known entry and a guard
 * zone, filled with a sentinel before every call.  The entry size is
 * measured from each answer (process_entry_size); an answer that fits no
 * layout is measured once more under the other sentinel, then refused.
 * A refused or unreadable list leaves has_processes false and says why
 * in processes_error (and device->error, if it is the first failure). */
void
probe_read_processes(const device_static *source, cs_probe_device *device)
{
    const nvml_functions *nvml = &cs_probe_state.nvml;
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
        probe_message_format(reason, reason_size,
                             "symbol nvmlDeviceGetComputeRunningProcesses "
                             "not found");
        goto done;
    }
    for (int attempt = 0; attempt < PROCESS_ATTEMPTS; attempt++) {
        unsigned char sentinel = probe_sentinel_bytes[failed_measures & 1];
        unsigned int count = capacity;
        cs_nvml_return result;
        size_t stride;

        if (!process_buffer_reserve(&buffer, &allocated, capacity, reason,
                                    reason_size)) {
            goto done;
        }
        memset(buffer, sentinel, allocated);
        result = nvml->device_get_processes(source->nvml_device, &count,
                                            buffer);
        if (result == CS_NVML_ERROR_INSUFFICIENT_SIZE) {
            if (!process_capacity_grow(nvml, count, &capacity, reason,
                                       reason_size)) {
                goto done;
            }
            continue;
        }
        if (result != CS_NVML_SUCCESS) {
            probe_nvml_describe(result, nvml->processes_symbol, reason,
                                reason_size);
            goto done;
        }
        if (count > capacity) {
            probe_message_format(reason, reason_size,
                                 "%s: reports %u processes written into "
                                 "room for %u",
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
    probe_message_format(reason, reason_size,
                         "%s: the list changed on each of %d calls",
                         nvml->processes_symbol, PROCESS_ATTEMPTS);

done:
    free(buffer);
    if (!device->has_processes) {
        if (reason[0] == '\0') {
            probe_text_copy(reason, reason_size,
                            "the process list was not read");
        }
        probe_message_set_first(device->error, sizeof(device->error),
                                reason);
    }
}

/* nvmlDeviceGetMemoryInfo into a sentinel-filled buffer larger than
 * nvmlMemory_t: the driver must have written exactly its 24 bytes, and
 * the figures must agree with each other. */
void
probe_read_memory(const device_static *source, cs_probe_device *device)
{
    const nvml_functions *nvml = &cs_probe_state.nvml;
    union {
        cs_nvml_memory memory;
        unsigned char bytes[64];
    } answer;
    char message[CS_PROBE_MESSAGE_SIZE];
    cs_nvml_return result;
    size_t extent;

    if (nvml->device_get_memory_info == NULL) {
        probe_message_set_first(device->error, sizeof(device->error),
                                "symbol nvmlDeviceGetMemoryInfo not found");
        return;
    }
    memset(answer.bytes, probe_sentinel_bytes[0], sizeof(answer.bytes));
    result = nvml->device_get_memory_info(source->nvml_device,
                                          &answer.memory);
    if (result != CS_NVML_SUCCESS) {
        probe_nvml_describe(result, "nvmlDeviceGetMemoryInfo", message,
                            sizeof(message));
        probe_message_set_first(device->error, sizeof(device->error), message);
        return;
    }
    extent = probe_written_extent(answer.bytes, sizeof(answer.bytes),
                                  probe_sentinel_bytes[0]);
    if (extent != sizeof(cs_nvml_memory)) {
        probe_message_format(message, sizeof(message),
                             "nvmlDeviceGetMemoryInfo: the driver wrote %zu "
                             "bytes, not the %zu of nvmlMemory_t",
                             extent, sizeof(cs_nvml_memory));
        probe_message_set_first(device->error, sizeof(device->error), message);
        return;
    }
    if (answer.memory.total == 0 || answer.memory.free > answer.memory.total
        || answer.memory.used > answer.memory.total) {
        probe_message_format(message, sizeof(message),
                             "nvmlDeviceGetMemoryInfo: inconsistent figures "
                             "(total %llu, free %llu, used %llu)",
                             answer.memory.total, answer.memory.free,
                             answer.memory.used);
        probe_message_set_first(device->error, sizeof(device->error), message);
        return;
    }
    device->has_total = true;
    device->total_bytes = answer.memory.total;
    device->has_free = true;
    device->free_bytes = answer.memory.free;
    device->source = CS_PROBE_SOURCE_NVML;
}
