/*
 * fuzz_probe.c -- libFuzzer harness of the GPU probe's NVML reading
 * (src/probe.c): the bytes a driver library hands back are untrusted.
 *
 * The probe is pointed at a fake NVML (lib_fuzz_nvml.c, built by run.sh
 * next to this binary) whose answers each input scripts: memory figures
 * and failures per device, how many processes run, how many start
 * between the probe's calls, a count the driver understates, error codes,
 * and the stride of the process entries (16, 24 or 32 bytes: every
 * layout drivers in the field write).  After each cs_probe_run the
 * harness aborts unless:
 *
 *   - the result's strings are terminated within their arrays;
 *   - at most CS_PROBE_MAX_PROCESSES processes are listed per device;
 *   - every listed process is one the driver wrote, with its own figure
 *     (pid and bytes from the same entry; "not available" as
 *     CS_PROBE_USED_UNKNOWN): a layout the probe cannot read yields no
 *     per-process readings, never garbage;
 *   - a device-wide free figure, when given, is the driver's.
 *
 * ASan catches any read or write outside the probe's buffers.
 */
#include "comfy_standin/probe.h"
#include "fuzz_common.h"
#include "fuzz_nvml.h"

#include <dlfcn.h>
#include <libgen.h>

static fuzz_nvml_script *script;
static cs_probe_result *result;

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int
LLVMFuzzerInitialize(int *argc, char ***argv)
{
    char self[4096];
    char path[4200];
    snprintf(self, sizeof(self), "%s", (*argv)[0]);
    snprintf(path, sizeof(path), "%s/lib_fuzz_nvml.so", dirname(self));
    /* Opened here first, so the probe's dlopen of the same path gets this
     * very copy (and its script). */
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        fprintf(stderr, "fuzz_probe: %s\n", dlerror());
        abort();
    }
    script = dlsym(handle, "fuzz_nvml_script_data");
    FUZZ_CHECK(script != NULL);
    setenv("COMFY_STANDIN_LIBNVML", path, 1);
    /* No CUDA driver: the device table comes from NVML alone. */
    setenv("COMFY_STANDIN_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
    unsetenv("COMFY_STANDIN_PROBE_DISABLE");
    result = malloc(sizeof(*result));
    FUZZ_CHECK(result != NULL);
    return 0;
}

static int
take_code(fuzz_reader *r)
{
    static const int codes[] = {
        FUZZ_NVML_SUCCESS, FUZZ_NVML_SUCCESS, FUZZ_NVML_SUCCESS,
        FUZZ_NVML_SUCCESS, FUZZ_NVML_SUCCESS, FUZZ_NVML_ERROR_NOT_SUPPORTED,
        FUZZ_NVML_ERROR_UNKNOWN, FUZZ_NVML_ERROR_INSUFFICIENT_SIZE,
    };
    return codes[fuzz_u8(r) % 8];
}

static void
check_text(const char *text, size_t size)
{
    FUZZ_CHECK(memchr(text, '\0', size) != NULL);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_reader r = {data, size, 0};
    static const unsigned int strides[] = {16, 24, 32};

    /* Up to a few probe calls per input: the driver's state carries
     * over between them (processes keep running, counts grow). */
    memset(script, 0, sizeof(*script));
    script->stride = strides[fuzz_u8(&r) % 3];
    script->pid_base = (unsigned int)fuzz_bytes_u64(&r, 4);
    script->filler = fuzz_u8(&r);
    for (unsigned int i = 0; i < FUZZ_NVML_MAX_PROCESSES; i++) {
        /* A few figures from the input, the rest derived from them. */
        script->used[i] = i < 8 ? fuzz_value(&r)
                                : script->used[i % 8] + i * 4096;
        if (i < 8 && (fuzz_u8(&r) & 7) == 0) {
            script->used[i] = FUZZ_NVML_VALUE_NOT_AVAILABLE;
        }
    }
    int calls = 1 + fuzz_u8(&r) % 3;
    for (int call = 0; call < calls; call++) {
        for (int d = 0; d < FUZZ_NVML_DEVICES; d++) {
            uint8_t shape = fuzz_u8(&r);
            script->memory_result[d] = take_code(&r);
            script->total[d] = fuzz_value(&r);
            script->free[d] = fuzz_value(&r);
            script->process_result[d] = (shape & 3) == 0 ? take_code(&r)
                                                         : 0;
            if (script->process_result[d] ==
                FUZZ_NVML_ERROR_INSUFFICIENT_SIZE && (shape & 4)) {
                script->process_result[d] = 0; /* the honest protocol */
            }
            unsigned int n;
            switch (shape >> 5) {
            case 0:
                n = 0;
                break;
            case 1:
                n = 1;
                break;
            case 2:
                n = 3;
                break;
            case 3:
                n = 49;
                break;
            case 4:
                n = 200;
                break;
            default:
                n = (unsigned int)fuzz_bytes_u64(&r, 2) %
                    (FUZZ_NVML_MAX_PROCESSES + 1);
                break;
            }
            script->count[d] = n;
            script->written[d] = 0;
        }
        script->growth = fuzz_u8(&r) % 4 == 0 ? fuzz_u8(&r) % 64 : 0;
        script->understate = fuzz_u8(&r) % 4 == 0 ? fuzz_u8(&r) % 8 : 0;

        memset(result, 0xA5, sizeof(*result)); /* no stale terminators */
        cs_probe_run(result);

        check_text(result->nvml.error, sizeof(result->nvml.error));
        check_text(result->nvml.path, sizeof(result->nvml.path));
        check_text(result->cuda.error, sizeof(result->cuda.error));
        check_text(result->cuda.path, sizeof(result->cuda.path));
        FUZZ_CHECK(result->nvml.loaded);
        FUZZ_CHECK(result->device_count <= CS_PROBE_MAX_DEVICES);
        FUZZ_CHECK(result->device_count == FUZZ_NVML_DEVICES);
        for (size_t i = 0; i < result->device_count; i++) {
            const cs_probe_device *dev = &result->devices[i];
            check_text(dev->name, sizeof(dev->name));
            check_text(dev->uuid, sizeof(dev->uuid));
            check_text(dev->error, sizeof(dev->error));
            FUZZ_CHECK(dev->nvml_index >= 0 &&
                       dev->nvml_index < FUZZ_NVML_DEVICES);
            int d = dev->nvml_index;
            if (dev->has_free && dev->source == CS_PROBE_SOURCE_NVML) {
                FUZZ_CHECK(dev->free_bytes == script->free[d]);
                FUZZ_CHECK(dev->total_bytes == script->total[d]);
            }
            if (!dev->has_processes) {
                continue;
            }
            FUZZ_CHECK(dev->process_count <= CS_PROBE_MAX_PROCESSES);
            FUZZ_CHECK(dev->process_count <= script->written[d]);
            for (size_t k = 0; k < dev->process_count; k++) {
                const cs_probe_process *p = &dev->processes[k];
                unsigned int index = p->pid - script->pid_base;
                FUZZ_CHECK(index < script->written[d]);
                uint64_t used = script->used[index];
                FUZZ_CHECK(p->used_bytes ==
                           (used == FUZZ_NVML_VALUE_NOT_AVAILABLE
                                ? CS_PROBE_USED_UNKNOWN
                                : used));
            }
        }
    }
    return 0;
}
