/*
 * comfy_standin/board.h -- the live residency board: one shared-memory
 * segment per worker in which the worker publishes how much of each of its
 * models is on the card, and the host reads it between messages
 * (docs/board.md has the layout table and the trust rules).
 *
 * Plain C11, no Python.
 *
 * Two roles, fixed when the handle is made:
 *
 *   host     cs_board_create(): makes the segment (owner-only, unguessable
 *            name, O_CREAT|O_EXCL), assigns slots, reads, and removes the
 *            name (cs_board_unlink, cs_board_close, or at process exit).
 *   worker   cs_board_open(): maps an existing segment by name (never
 *            creates one), publishes, beats the heartbeat, runs samplers.
 *
 * The segment is untrusted input to the host.  Every host read re-checks
 * the header, takes the slot through a seqlock with a bounded number of
 * retries (wait-free: it never blocks and never loops unboundedly), checks
 * the slot still carries the key the host assigned, and clamps the value to
 * the size the *caller* passes.  Anything doubtful reads as invalid and the
 * caller falls back to its receipt.
 *
 * Times are CLOCK_MONOTONIC nanoseconds, the clock of the ledger's receipts
 * (and of Python's time.monotonic_ns() on Linux), which every process of
 * one machine shares.
 *
 * Thread safety: every function may be called from any thread with or
 * without the GIL, except that cs_board_close() must not race any other
 * call on the same handle (the caller owns the handle's lifetime).
 */
#ifndef COMFY_STANDIN_BOARD_H
#define COMFY_STANDIN_BOARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the layout (version 1) ------------------------------------------ */

/* "CSBOARD\0" read as a little-endian 64-bit word. */
#define CS_BOARD_MAGIC UINT64_C(0x0044524F41425343)
#define CS_BOARD_LAYOUT_VERSION 1
#define CS_BOARD_HEADER_SIZE 64
#define CS_BOARD_SLOT_SIZE 64
#define CS_BOARD_MAX_SLOTS 4096

/* Header: eight 64-bit words at these byte offsets. */
#define CS_BOARD_OFF_MAGIC 0
#define CS_BOARD_OFF_VERSION 8
#define CS_BOARD_OFF_SLOT_SIZE 16
#define CS_BOARD_OFF_SLOT_COUNT 24
#define CS_BOARD_OFF_GENERATION 32
#define CS_BOARD_OFF_OWNER_PID 40
#define CS_BOARD_OFF_HEARTBEAT 48
#define CS_BOARD_OFF_HOST_PID 56

/* Slot i starts at CS_BOARD_HEADER_SIZE + i * CS_BOARD_SLOT_SIZE; eight
 * 64-bit words at these offsets within it. */
#define CS_BOARD_SLOT_OFF_SEQ 0
#define CS_BOARD_SLOT_OFF_KEY 8
#define CS_BOARD_SLOT_OFF_KEY_TEXT 16 /* 24 bytes: the id, truncated */
#define CS_BOARD_SLOT_OFF_SIZE 40
#define CS_BOARD_SLOT_OFF_LOADED 48
#define CS_BOARD_SLOT_OFF_UPDATED 56
#define CS_BOARD_KEY_TEXT_SIZE 24

/* Published values are limited to this (sums elsewhere stay meaningful). */
#define CS_BOARD_VALUE_MAX ((uint64_t)INT64_MAX)

/* A host read gives up after this many attempts at a slot whose seqlock
 * word is odd or changed under it, and reports the slot torn. */
#define CS_BOARD_READ_RETRIES 64

/* Defaults: how old a heartbeat may be before the board is ignored, and
 * how often the sampler thread runs. */
#define CS_BOARD_DEFAULT_HEARTBEAT_LIMIT_NS UINT64_C(5000000000)
#define CS_BOARD_DEFAULT_PERIOD_NS UINT64_C(10000000)

/* Longest name cs_board_create() makes, NUL included ("/csb" + 24 hex
 * digits; short enough for macOS's 31-character limit). */
#define CS_BOARD_NAME_MAX 32

/* ---- handles and results --------------------------------------------- */

typedef struct cs_board cs_board;

typedef enum cs_board_status {
    CS_BOARD_OK = 0,
    CS_BOARD_ERR_SYSTEM,      /* a system call failed; errno in *os_error */
    CS_BOARD_ERR_NOMEM,       /* allocation failed; nothing changed */
    CS_BOARD_ERR_NAME,        /* not a board name ("/" + [A-Za-z0-9_.-]) */
    CS_BOARD_ERR_MAGIC,       /* the segment is not a board */
    CS_BOARD_ERR_VERSION,     /* a board of another layout version */
    CS_BOARD_ERR_SIZE,        /* slot size, slot count or segment size off */
    CS_BOARD_ERR_OWNED,       /* another process has the board open */
    CS_BOARD_ERR_RANGE,       /* slot index or value out of range */
    CS_BOARD_ERR_ROLE,        /* a host call on a worker handle or back */
    CS_BOARD_ERR_FULL,        /* every slot is assigned */
    CS_BOARD_ERR_BUSY,        /* a slot stayed locked by another writer */
    CS_BOARD_ERR_UNSUPPORTED  /* no shared memory on this platform (yet) */
} cs_board_status;

/* Why a host read is or is not valid (cs_board_read_slot_status). */
typedef enum cs_board_reading {
    CS_BOARD_VALID = 0,
    CS_BOARD_UNASSIGNED,     /* the host assigned no model to the slot */
    CS_BOARD_NOT_ATTACHED,   /* no worker has it open (or it closed it) */
    CS_BOARD_BAD_HEADER,     /* magic, version, generation or pid rewritten */
    CS_BOARD_WRONG_OWNER,    /* not the pid the host expects */
    CS_BOARD_DEAD_OWNER,     /* the owner's pid is gone */
    CS_BOARD_STALE,          /* heartbeat older than the limit (or absurd) */
    CS_BOARD_TORN,           /* the seqlock never held still */
    CS_BOARD_KEY_MISMATCH,   /* the slot now names another model */
    CS_BOARD_NO_READING,     /* assigned, never published */
    CS_BOARD_READING_COUNT
} cs_board_reading;

/* A sampler: fills *loaded with the model's resident bytes and returns 0,
 * or returns nonzero to publish nothing this period.  Called from the
 * board's own thread without the GIL, so it must not touch Python; it must
 * be quick (removal and close wait for a running pass). */
typedef int (*cs_board_sampler_fn)(void *context, uint64_t *loaded);

const char *cs_board_status_message(cs_board_status status);
/* A short lower-case name ("valid", "torn", "dead owner", ...). */
const char *cs_board_reading_name(cs_board_reading reading);

/* ---- both roles ------------------------------------------------------ */

/* Stops the sampler thread (joined), then: a worker marks the board
 * detached; a host removes the name if it still exists.  Unmaps and frees.
 * NULL is a no-op. */
void cs_board_close(cs_board *board);

const char *cs_board_name(const cs_board *board);
bool cs_board_is_host(const cs_board *board);
uint32_t cs_board_slot_count(const cs_board *board);
uint64_t cs_board_generation(const cs_board *board);
/* The header's owner pid as it is now (untrusted; 0: none). */
int64_t cs_board_owner_pid(const cs_board *board);
/* The slot that carries `id`: on a host from its own table, on a worker
 * from the segment.  CS_BOARD_ERR_RANGE when none does. */
cs_board_status cs_board_find(const cs_board *board, const char *id,
                              size_t id_len, uint32_t *slot);
/* The start of the mapping and its length (tests, tools). */
void *cs_board_memory(const cs_board *board, size_t *length);

/* ---- host ------------------------------------------------------------ */

/* Makes a board of `slots` slots (1..CS_BOARD_MAX_SLOTS) under the
 * worker's `generation`.  heartbeat_limit_ns 0 disables the heartbeat
 * check.  The name is registered for removal at process exit. */
cs_board_status cs_board_create(uint32_t slots, uint64_t generation,
                                uint64_t heartbeat_limit_ns,
                                cs_board **out, int *os_error);

/* Gives `id` a slot, or returns the slot it already has (then `size` must
 * match: CS_BOARD_ERR_SIZE otherwise).  The slot's loaded value is reset
 * and reads CS_BOARD_NO_READING until the worker publishes. */
cs_board_status cs_board_assign(cs_board *board, const char *id,
                                size_t id_len, uint64_t size,
                                uint32_t *slot);
/* Frees a slot for another model.  Reads of it are then UNASSIGNED. */
cs_board_status cs_board_release(cs_board *board, uint32_t slot);
/* The size the host assigned to `slot` (0 when unassigned). */
uint64_t cs_board_assigned_size(const cs_board *board, uint32_t slot);

/* Removes the segment's name: after this nobody can open it, and the
 * memory lives only as long as the host's and the worker's mappings.  Call
 * it once the worker has opened the board (cs_board_attached()).
 * Idempotent; a worker handle gets CS_BOARD_ERR_ROLE. */
cs_board_status cs_board_unlink(cs_board *board, int *os_error);
bool cs_board_linked(const cs_board *board);
/* True once a worker has opened the board (and not closed it). */
bool cs_board_attached(const cs_board *board);

/* The pid the host expects as owner (0: any).  With one set, a board
 * whose header names another pid reads CS_BOARD_WRONG_OWNER. */
void cs_board_expect_owner(cs_board *board, int64_t pid);
int64_t cs_board_expected_owner(const cs_board *board);
uint64_t cs_board_heartbeat_limit(const cs_board *board);

/* The host read, for a caller holding `size` (its own registered size;
 * the board's size field is not trusted).  Wait-free, never blocks, takes
 * no lock.  On CS_BOARD_VALID: *loaded in [0, size], *updated_ns in
 * (0, now].  Otherwise the outputs are left unchanged. */
cs_board_reading cs_board_read_slot_status(const cs_board *board,
                                           uint32_t slot, uint64_t size,
                                           uint64_t *loaded,
                                           uint64_t *updated_ns);
/* The same, as "a valid reading or false" (for the stand-in type). */
bool cs_board_read_slot(const cs_board *board, uint32_t slot, uint64_t size,
                        uint64_t *loaded, uint64_t *updated_ns);

/* ---- worker ---------------------------------------------------------- */

/* Maps the board `name` (made by a host; never created here) and claims
 * it for this process.  Refused with a clear status when it is not a
 * board of this layout, is sized wrongly, or another live process has it
 * open. */
cs_board_status cs_board_open(const char *name, cs_board **out,
                              int *os_error);

/* Publishes `loaded` (<= CS_BOARD_VALUE_MAX) for `slot`, stamped now, and
 * beats the heartbeat.  Lock-free; safe from any thread of the worker
 * (writers of one slot exclude each other through the seqlock word).
 * CS_BOARD_ERR_BUSY when the slot stayed locked (a corrupted word). */
cs_board_status cs_board_publish(cs_board *board, uint32_t slot,
                                 uint64_t loaded);
/* The same with the caller's own CLOCK_MONOTONIC stamp (e.g. when the
 * pager measured).  A stamp of 0 or in the future is refused. */
cs_board_status cs_board_publish_at(cs_board *board, uint32_t slot,
                                    uint64_t loaded, uint64_t updated_ns);
/* Tells the host the worker is alive (publish does it too). */
cs_board_status cs_board_heartbeat(cs_board *board);

/* Runs `fn(context, &loaded)` for `slot` every period on the board's
 * sampler thread (started on first use) and publishes the result.  One
 * sampler per slot; a second replaces the first.  The thread also beats
 * the heartbeat every period. */
cs_board_status cs_board_add_sampler(cs_board *board, uint32_t slot,
                                     cs_board_sampler_fn fn, void *context,
                                     int *os_error);
/* Removes the slot's sampler; when this returns the sampler is not
 * running and will not run again (its context may be freed). */
cs_board_status cs_board_remove_sampler(cs_board *board, uint32_t slot);
/* The sampler period (1 ms .. 1 h); takes effect at the next pass. */
cs_board_status cs_board_set_period(cs_board *board, uint64_t period_ns);
uint64_t cs_board_period(const cs_board *board);
/* How many passes the sampler thread has completed (tests, diagnostics). */
uint64_t cs_board_sampler_passes(const cs_board *board);

#ifdef __cplusplus
}
#endif

#endif /* COMFY_STANDIN_BOARD_H */
