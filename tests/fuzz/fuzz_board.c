/*
 * fuzz_board.c -- libFuzzer harness for the board's host reader and the
 * host's adoption of a worker-made segment (src/board.c,
 * src/board_host.c, src/board_worker.c).
 *
 * Each input is a host table and a segment: the first bytes choose the
 * slot count, the heartbeat limit, the expected owner and, per slot,
 * whether the host assigned it, its size and which tag the reader passes;
 * the rest is written over the whole segment through the worker's
 * mapping, as a hostile worker could.  The reader must never read outside
 * the mapping, never return a valid reading above the caller's size or
 * stamped after now (plus the coarse clock's tick), and never take a
 * reading for a tag the host did not give; adopting the same bytes, at a
 * length and with seals the input picks, as a board a worker sent must
 * refuse or succeed cleanly (and every reading of an adopted board obeys
 * the same bounds).
 *
 * Build and run (see tests/fuzz/):
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude -Isrc \
 *       -D_GNU_SOURCE tests/fuzz/fuzz_board.c src/board.c \
 *       src/board_host.c src/board_worker.c -o /tmp/fb
 *   /tmp/fb tests/fuzz/corpus/fuzz_board -max_total_time=30
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "comfy_standin/board.h"

#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FUZZ_MAX_SLOTS 8

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* One board per slot count, made once (the worker's side) and adopted
 * twice (with and without a heartbeat limit): a board per input would
 * spend the run in memfd_create and mmap. */
static cs_board *workers[FUZZ_MAX_SLOTS + 1];
static cs_board *hosts[FUZZ_MAX_SLOTS + 1][2];

static uint64_t
take(const uint8_t **data, size_t *size, size_t n)
{
    uint64_t value = 0;
    for (size_t i = 0; i < n && *size > 0; i++) {
        value |= (uint64_t)**data << (8 * i);
        (*data)++;
        (*size)--;
    }
    return value;
}

static uint64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

static void
adopt_segment(const unsigned char *bytes, size_t length, uint32_t slots,
              uint64_t config)
{
    static const int seal_bits[] = {F_SEAL_SHRINK, F_SEAL_GROW,
                                    F_SEAL_FUTURE_WRITE, F_SEAL_SEAL};
    int fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        abort();
    }
    /* Mostly the right length, sometimes a slot more or less. */
    size_t actual = length;
    switch ((config >> 9) & 7) {
    case 1:
        actual = length > CS_BOARD_SLOT_SIZE ? length - CS_BOARD_SLOT_SIZE
                                             : 0;
        break;
    case 2:
        actual = length + CS_BOARD_SLOT_SIZE;
        break;
    default:
        break;
    }
    if (ftruncate(fd, (off_t)actual) != 0 ||
        pwrite(fd, bytes, length < actual ? length : actual, 0) < 0) {
        abort();
    }
    int seals = 0;
    for (int i = 0; i < 4; i++) {
        /* All four most of the time, so the reads below get exercised. */
        if (((config >> 12) & 3) != 0 || ((config >> (14 + i)) & 1)) {
            seals |= seal_bits[i];
        }
    }
    if (seals != 0 && fcntl(fd, F_ADD_SEALS, seals) != 0) {
        abort();
    }
    cs_board *host = NULL;
    int err = 0;
    cs_board_status st = cs_board_adopt(fd, slots, 1, 0, &host, &err);
    close(fd);
    int all = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE |
              F_SEAL_SEAL;
    if (st != CS_BOARD_OK) {
        return;
    }
    if (actual != length || (seals & all) != all ||
        cs_board_slot_count(host) != slots) {
        abort(); /* adopted what it must have refused */
    }
    for (uint32_t i = 0; i < slots; i++) {
        char id[2] = {'a', (char)('0' + i)};
        uint32_t got = 0;
        if (cs_board_assign(host, id, 2, 1000, &got) != CS_BOARD_OK) {
            abort();
        }
    }
    for (uint32_t i = 0; i < slots + 1; i++) {
        uint64_t loaded = 0, stamp = 0;
        if (cs_board_read_slot_status(host, i, 0, 1000, &loaded, &stamp) ==
                CS_BOARD_VALID &&
            (i >= slots || loaded > 1000 || stamp > now_ns() + 1000000000u)) {
            abort();
        }
    }
    cs_board_close(host);
}

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t tick = 0;
    struct timespec res;
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0) {
        tick = (uint64_t)res.tv_sec * UINT64_C(1000000000) +
               (uint64_t)res.tv_nsec;
    }
    uint64_t config = take(&data, &size, 2);
    uint32_t slots = 1 + (uint32_t)(config % FUZZ_MAX_SLOTS);
    int limited = (int)((config >> 3) & 1);
    if (workers[slots] == NULL) {
        int fd = -1, err = 0;
        if (cs_board_make(slots, 1, &workers[slots], &fd, &err) !=
                CS_BOARD_OK ||
            cs_board_adopt(fd, slots, 1, 0, &hosts[slots][0], &err) !=
                CS_BOARD_OK ||
            cs_board_adopt(fd, slots, 1, CS_BOARD_HEARTBEAT_LIMIT_MIN_NS,
                           &hosts[slots][1], &err) != CS_BOARD_OK) {
            abort();
        }
        close(fd);
    }
    cs_board *host = hosts[slots][limited];
    cs_board_expect_owner(host, (config >> 4) & 1 ? (int64_t)(config >> 5)
                                                   : 0);

    /* The host's table: which slots are assigned, with which sizes. */
    uint64_t sizes[FUZZ_MAX_SLOTS] = {0};
    uint64_t pass_tag[FUZZ_MAX_SLOTS] = {0};
    for (uint32_t i = 0; i < slots; i++) {
        (void)cs_board_release(host, i);
    }
    uint64_t specs[FUZZ_MAX_SLOTS];
    for (uint32_t i = 0; i < slots; i++) {
        char id[2] = {'m', (char)('0' + i)};
        uint32_t got = 0;
        specs[i] = take(&data, &size, 2);
        sizes[i] = (specs[i] >> 2) * UINT64_C(0x10001);
        if (cs_board_assign(host, id, 2, sizes[i], &got) != CS_BOARD_OK ||
            got != i) {
            abort(); /* all released above: slot i is the lowest free */
        }
    }
    for (uint32_t i = 0; i < slots; i++) {
        uint64_t spec = specs[i];
        if ((spec & 3) == 0) {
            (void)cs_board_release(host, i); /* unassigned */
            sizes[i] = 0;
            continue;
        }
        switch ((spec >> 1) & 1 ? 1 : spec & 3) {
        case 1:
            pass_tag[i] = 0; /* the slot's current tag */
            break;
        case 2:
            pass_tag[i] = cs_board_tag(host, i);
            break;
        default:
            pass_tag[i] = spec * UINT64_C(0x9e3779b97f4a7c15) | 1;
            break;
        }
    }

    /* The segment: whatever the worker wrote. */
    size_t length = 0;
    unsigned char *mem = cs_board_memory(workers[slots], &length);
    size_t n = size < length ? size : length;
    memset(mem, 0, length);
    memcpy(mem, data, n);

    for (uint32_t i = 0; i < slots + 1; i++) {
        uint64_t loaded = 0, stamp = 0;
        uint64_t want = i < slots ? cs_board_tag(host, i) : 0;
        uint64_t cap = i < slots ? sizes[i] : 0;
        uint64_t tag = i < slots ? pass_tag[i] : 0;
        cs_board_reading r = cs_board_read_slot_status(host, i, tag, cap,
                                                       &loaded, &stamp);
        if (r == CS_BOARD_VALID) {
            /* A stamp may be up to one coarse-clock tick ahead. */
            if (i >= slots || want == 0 || loaded > cap ||
                stamp > now_ns() + tick || (tag != 0 && tag != want)) {
                abort();
            }
        }
        if ((unsigned)r >= CS_BOARD_READING_COUNT) {
            abort();
        }
    }

    /* The same bytes as a board a worker made and sent: a length off by a
     * fuzzed amount and a fuzzed subset of the seals. */
    adopt_segment(mem, length, slots, config);
    return 0;
}
