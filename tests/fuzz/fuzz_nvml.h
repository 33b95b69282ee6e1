/*
 * fuzz_nvml.h -- the script a fuzzed NVML (lib_fuzz_nvml.c) answers from;
 * fuzz_probe.c writes it from the fuzzer's bytes before each probe call.
 * Test-only: it mimics the NVML ABI (nvml.h's layouts and codes), nothing
 * of NVML's code.
 */
#ifndef COMFY_STANDIN_FUZZ_NVML_H
#define COMFY_STANDIN_FUZZ_NVML_H

#define FUZZ_NVML_DEVICES 3
#define FUZZ_NVML_MAX_PROCESSES 400

#define FUZZ_NVML_SUCCESS 0
#define FUZZ_NVML_ERROR_NOT_SUPPORTED 3
#define FUZZ_NVML_ERROR_INSUFFICIENT_SIZE 7
#define FUZZ_NVML_ERROR_UNKNOWN 999
#define FUZZ_NVML_VALUE_NOT_AVAILABLE (~0ULL)

typedef struct fuzz_nvml_script {
    /* nvmlDeviceGetMemoryInfo */
    int memory_result[FUZZ_NVML_DEVICES];
    unsigned long long total[FUZZ_NVML_DEVICES];
    unsigned long long free[FUZZ_NVML_DEVICES];
    /* nvmlDeviceGetComputeRunningProcesses*: */
    unsigned int count[FUZZ_NVML_DEVICES]; /* processes now running */
    int process_result[FUZZ_NVML_DEVICES]; /* != 0: answer this code */
    unsigned int stride;     /* bytes per entry the "driver" writes:
                                16, 24 or 32 (all seen in the field) */
    unsigned int growth;     /* processes started per INSUFFICIENT_SIZE */
    unsigned int understate; /* subtracted from the count it asks for */
    unsigned int pid_base;   /* process i has pid pid_base + i */
    unsigned char filler;    /* the bytes of the other fields */
    unsigned long long used[FUZZ_NVML_MAX_PROCESSES];
    /* What the last successful answer wrote, per device. */
    unsigned int written[FUZZ_NVML_DEVICES];
} fuzz_nvml_script;

#endif /* COMFY_STANDIN_FUZZ_NVML_H */
