/*
 * fuzz_common.h -- a byte reader for the libFuzzer harnesses in this
 * directory, and a check that aborts (so libFuzzer records a crash).
 *
 * Every take_* returns 0 once the input is used up, so any input, however
 * short, is a complete program.
 */
#ifndef COMFY_STANDIN_FUZZ_COMMON_H
#define COMFY_STANDIN_FUZZ_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fuzz_reader {
    const uint8_t *data;
    size_t size;
    size_t at;
} fuzz_reader;

static inline bool
fuzz_done(const fuzz_reader *r)
{
    return r->at >= r->size;
}

static inline uint8_t
fuzz_u8(fuzz_reader *r)
{
    return r->at < r->size ? r->data[r->at++] : 0;
}

static inline uint64_t
fuzz_bytes_u64(fuzz_reader *r, unsigned n)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++) {
        v = (v << 8) | fuzz_u8(r);
    }
    return v;
}

/* A 64-bit value biased toward the edges the core checks: small counts,
 * CS_VALUE_MAX and its neighbours, UINT64_MAX, and anything at all. */
static inline uint64_t
fuzz_value(fuzz_reader *r)
{
    uint8_t kind = fuzz_u8(r);
    switch (kind % 8) {
    case 0:
    case 1:
    case 2:
        return fuzz_u8(r);
    case 3:
        return fuzz_bytes_u64(r, 2) << 10;
    case 4:
        return ((uint64_t)INT64_MAX) - (fuzz_u8(r) % 3) + 1;
    case 5:
        return UINT64_MAX - (fuzz_u8(r) % 2);
    case 6:
        return fuzz_bytes_u64(r, 4);
    default:
        return fuzz_bytes_u64(r, 8);
    }
}

#define FUZZ_CHECK(cond)                                                  \
    do {                                                                  \
        if (!(cond)) {                                                    \
            fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__,    \
                    __LINE__, #cond);                                     \
            abort();                                                      \
        }                                                                 \
    } while (0)

#endif /* COMFY_STANDIN_FUZZ_COMMON_H */
