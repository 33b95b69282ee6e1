/*
 * stub_cuda.c -- a stand-in for libcuda.so.1 with scripted answers (see
 * stub_script.h).  Test-only: built by the test suite, never installed.
 *
 * It exports the driver symbols the probe may use, with both ABI variants
 * where they differ (cuDeviceTotalMem with a 32-bit size, _v2 with
 * size_t), so a probe that resolved the wrong variant reads a truncated
 * total.  It also exports the context-creating calls, counting them: the
 * probe must never call them.  Counters are read with stub_cuda_count().
 *
 * Variants (compile with -D):
 *   STUB_NO_GET_PROC_ADDRESS  no cuGetProcAddress (a pre-11.3 driver)
 *   STUB_NO_INIT              no cuInit at all
 *   STUB_NO_UUID              no cuDeviceGetUuid
 */
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "stub_script.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef struct {
    unsigned char bytes[16];
} CUuuid;

#define SUCCESS 0
#define ERROR_INVALID_VALUE 1
#define ERROR_NOT_INITIALIZED 3
#define ERROR_INVALID_DEVICE 101
#define ERROR_NOT_FOUND 500

#define EXPORT __attribute__((visibility("default")))

enum {
    COUNT_INIT,
    COUNT_GET_PROC_ADDRESS,
    COUNT_PROC_ADDRESS_VERSION, /* the last version asked for */
    COUNT_CTX_CREATE,
    COUNT_PRIMARY_CTX_RETAIN,
    COUNT_CTX_SET_CURRENT,
    COUNT_CTX_PUSH_CURRENT,
    COUNT_MEM_GET_INFO,
    COUNT_TOTAL_MEM_V1,
    COUNT_SIZE
};

static const char *const count_names[COUNT_SIZE] = {
    "cuInit", "cuGetProcAddress", "cuGetProcAddress.version",
    "cuCtxCreate", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent",
    "cuCtxPushCurrent", "cuMemGetInfo", "cuDeviceTotalMem.v1",
};

static _Atomic long counts[COUNT_SIZE];
static _Atomic int initialized;
static char fake_context; /* what a "current context" points at */

EXPORT long stub_cuda_count(const char *name);

EXPORT long
stub_cuda_count(const char *name)
{
    for (int i = 0; i < COUNT_SIZE; i++) {
        if (strcmp(count_names[i], name) == 0) {
            return atomic_load(&counts[i]);
        }
    }
    return -1;
}

static void
count(int which)
{
    atomic_fetch_add(&counts[which], 1);
}

/* Common entry: the scripted failure, else "not initialised" before
 * cuInit, as the real driver answers. */
static CUresult
enter(const char *name)
{
    int failure = stub_failure(name);
    if (failure != 0) {
        return failure;
    }
    if (!atomic_load(&initialized)) {
        return ERROR_NOT_INITIALIZED;
    }
    return SUCCESS;
}

static int
nvml_index_of(CUdevice device)
{
    if (device < 0 || device >= stub.cuda_count) {
        return -1;
    }
    return stub.cuda_map[device];
}

#ifndef STUB_NO_INIT
EXPORT CUresult cuInit(unsigned int flags);

EXPORT CUresult
cuInit(unsigned int flags)
{
    count(COUNT_INIT);
    int failure = stub_failure("cuInit");
    if (failure != 0) {
        return failure;
    }
    if (flags != 0) {
        return ERROR_INVALID_VALUE;
    }
    atomic_store(&initialized, 1);
    return SUCCESS;
}
#endif

EXPORT CUresult cuDriverGetVersion(int *version);

EXPORT CUresult
cuDriverGetVersion(int *version)
{
    int failure = stub_failure("cuDriverGetVersion");
    if (failure != 0) {
        return failure;
    }
    *version = stub.driver_version;
    return SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char **name);

EXPORT CUresult
cuGetErrorName(CUresult error, const char **name)
{
    switch (error) {
    case 100:
        *name = "CUDA_ERROR_NO_DEVICE";
        return SUCCESS;
    case 999:
        *name = "CUDA_ERROR_UNKNOWN";
        return SUCCESS;
    case ERROR_NOT_INITIALIZED:
        *name = "CUDA_ERROR_NOT_INITIALIZED";
        return SUCCESS;
    default:
        *name = NULL;
        return ERROR_INVALID_VALUE;
    }
}

EXPORT CUresult cuDeviceGetCount(int *count_out);

EXPORT CUresult
cuDeviceGetCount(int *count_out)
{
    CUresult result = enter("cuDeviceGetCount");
    if (result == SUCCESS) {
        *count_out = stub.cuda_count;
    }
    return result;
}

EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal);

EXPORT CUresult
cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult result = enter("cuDeviceGet");
    if (result != SUCCESS) {
        return result;
    }
    if (nvml_index_of(ordinal) < 0) {
        return ERROR_INVALID_DEVICE;
    }
    *device = ordinal;
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *name, int length, CUdevice device);

EXPORT CUresult
cuDeviceGetName(char *name, int length, CUdevice device)
{
    CUresult result = enter("cuDeviceGetName");
    int index = nvml_index_of(device);
    if (result != SUCCESS) {
        return result;
    }
    if (index < 0 || length <= 0) {
        return ERROR_INVALID_VALUE;
    }
    snprintf(name, (size_t)length, "%s", stub.device[index].name);
    return SUCCESS;
}

/* The pre-3.2 ABI: a 32-bit byte count. */
EXPORT CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice device);

EXPORT CUresult
cuDeviceTotalMem(unsigned int *bytes, CUdevice device)
{
    CUresult result = enter("cuDeviceTotalMem");
    int index = nvml_index_of(device);
    count(COUNT_TOTAL_MEM_V1);
    if (result != SUCCESS) {
        return result;
    }
    if (index < 0) {
        return ERROR_INVALID_DEVICE;
    }
    *bytes = (unsigned int)stub.device[index].total;
    return SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice device);

EXPORT CUresult
cuDeviceTotalMem_v2(size_t *bytes, CUdevice device)
{
    CUresult result = enter("cuDeviceTotalMem");
    int index = nvml_index_of(device);
    if (result != SUCCESS) {
        return result;
    }
    if (index < 0) {
        return ERROR_INVALID_DEVICE;
    }
    *bytes = (size_t)stub.device[index].total;
    return SUCCESS;
}

#ifndef STUB_NO_UUID
EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice device);

EXPORT CUresult
cuDeviceGetUuid(CUuuid *uuid, CUdevice device)
{
    CUresult result = enter("cuDeviceGetUuid");
    int index = nvml_index_of(device);
    if (result != SUCCESS) {
        return result;
    }
    if (index < 0) {
        return ERROR_INVALID_DEVICE;
    }
    stub_uuid_bytes(index, uuid->bytes);
    memset(uuid + 1, 0, stub.device[index].struct_extra);
    return SUCCESS;
}
#endif

EXPORT CUresult cuCtxGetCurrent(CUcontext *context);

EXPORT CUresult
cuCtxGetCurrent(CUcontext *context)
{
    CUresult result = enter("cuCtxGetCurrent");
    if (result != SUCCESS) {
        return result;
    }
    *context = stub.ctx_current >= 0 ? (CUcontext)&fake_context : NULL;
    return SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice *device);

EXPORT CUresult
cuCtxGetDevice(CUdevice *device)
{
    CUresult result = enter("cuCtxGetDevice");
    if (result != SUCCESS) {
        return result;
    }
    if (stub.ctx_current < 0) {
        return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    }
    *device = stub.ctx_current;
    return SUCCESS;
}

/* The pre-3.2 ABI: 32-bit counts. */
EXPORT CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total);

EXPORT CUresult
cuMemGetInfo(unsigned int *free_bytes, unsigned int *total)
{
    (void)free_bytes;
    (void)total;
    return ERROR_INVALID_VALUE; /* never the one to call */
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total);

EXPORT CUresult
cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
    CUresult result = enter("cuMemGetInfo");
    int index = nvml_index_of(stub.ctx_current);
    count(COUNT_MEM_GET_INFO);
    if (result != SUCCESS) {
        return result;
    }
    if (index < 0) {
        return 201; /* CUDA_ERROR_INVALID_CONTEXT: no current context */
    }
    *free_bytes = (size_t)stub.device[index].ctx_free;
    *total = (size_t)stub.device[index].total;
    return SUCCESS;
}

/* The context-creating calls: counted, and they do what they say (the
 * context becomes current), so a probe calling one is visible twice. */
EXPORT CUresult cuCtxCreate(CUcontext *context, unsigned int flags,
                            CUdevice device);
EXPORT CUresult cuCtxCreate_v2(CUcontext *context, unsigned int flags,
                               CUdevice device);
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *context,
                                         CUdevice device);
EXPORT CUresult cuCtxSetCurrent(CUcontext context);
EXPORT CUresult cuCtxPushCurrent(CUcontext context);
EXPORT CUresult cuCtxPushCurrent_v2(CUcontext context);

EXPORT CUresult
cuCtxCreate(CUcontext *context, unsigned int flags, CUdevice device)
{
    (void)flags;
    count(COUNT_CTX_CREATE);
    stub.ctx_current = device;
    *context = &fake_context;
    return SUCCESS;
}

EXPORT CUresult
cuCtxCreate_v2(CUcontext *context, unsigned int flags, CUdevice device)
{
    return cuCtxCreate(context, flags, device);
}

EXPORT CUresult
cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device)
{
    count(COUNT_PRIMARY_CTX_RETAIN);
    *context = &fake_context;
    (void)device;
    return SUCCESS;
}

EXPORT CUresult
cuCtxSetCurrent(CUcontext context)
{
    count(COUNT_CTX_SET_CURRENT);
    (void)context;
    return SUCCESS;
}

EXPORT CUresult
cuCtxPushCurrent(CUcontext context)
{
    count(COUNT_CTX_PUSH_CURRENT);
    (void)context;
    return SUCCESS;
}

EXPORT CUresult
cuCtxPushCurrent_v2(CUcontext context)
{
    return cuCtxPushCurrent(context);
}

#ifndef STUB_NO_GET_PROC_ADDRESS
typedef struct {
    const char *name;
    int since;      /* the CUDA version this variant appeared in */
    void *address;
} symbol_entry;

#define FUNCTION_ADDRESS(function) ((void *)(uintptr_t)&(function))

EXPORT CUresult cuGetProcAddress(const char *symbol, void **function,
                                 int cuda_version, unsigned long long flags);

/* Like the driver: the newest variant of `symbol` not newer than
 * cuda_version. */
EXPORT CUresult
cuGetProcAddress(const char *symbol, void **function, int cuda_version,
                 unsigned long long flags)
{
    const symbol_entry table[] = {
#ifndef STUB_NO_INIT
        {"cuInit", 2000, FUNCTION_ADDRESS(cuInit)},
#endif
        {"cuDriverGetVersion", 2020, FUNCTION_ADDRESS(cuDriverGetVersion)},
        {"cuGetErrorName", 6000, FUNCTION_ADDRESS(cuGetErrorName)},
        {"cuDeviceGetCount", 2000, FUNCTION_ADDRESS(cuDeviceGetCount)},
        {"cuDeviceGet", 2000, FUNCTION_ADDRESS(cuDeviceGet)},
        {"cuDeviceGetName", 2000, FUNCTION_ADDRESS(cuDeviceGetName)},
        {"cuDeviceTotalMem", 2000, FUNCTION_ADDRESS(cuDeviceTotalMem)},
        {"cuDeviceTotalMem", 3020, FUNCTION_ADDRESS(cuDeviceTotalMem_v2)},
#ifndef STUB_NO_UUID
        {"cuDeviceGetUuid", 9020, FUNCTION_ADDRESS(cuDeviceGetUuid)},
#endif
        {"cuCtxGetCurrent", 4000, FUNCTION_ADDRESS(cuCtxGetCurrent)},
        {"cuCtxGetDevice", 2000, FUNCTION_ADDRESS(cuCtxGetDevice)},
        {"cuMemGetInfo", 2000, FUNCTION_ADDRESS(cuMemGetInfo)},
        {"cuMemGetInfo", 3020, FUNCTION_ADDRESS(cuMemGetInfo_v2)},
        {"cuCtxCreate", 3020, FUNCTION_ADDRESS(cuCtxCreate_v2)},
        {"cuDevicePrimaryCtxRetain", 7000,
         FUNCTION_ADDRESS(cuDevicePrimaryCtxRetain)},
        {"cuCtxSetCurrent", 4000, FUNCTION_ADDRESS(cuCtxSetCurrent)},
        {"cuCtxPushCurrent", 4000, FUNCTION_ADDRESS(cuCtxPushCurrent_v2)},
    };
    const symbol_entry *best = NULL;
    count(COUNT_GET_PROC_ADDRESS);
    atomic_store(&counts[COUNT_PROC_ADDRESS_VERSION], cuda_version);
    if (flags != 0 || function == NULL || symbol == NULL) {
        return ERROR_INVALID_VALUE;
    }
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        if (strcmp(table[i].name, symbol) == 0
            && table[i].since <= cuda_version
            && (best == NULL || table[i].since > best->since)) {
            best = &table[i];
        }
    }
    if (best == NULL) {
        *function = NULL;
        return ERROR_NOT_FOUND;
    }
    *function = best->address;
    return SUCCESS;
}
#endif
