/*
 * comfy_standin/board.h -- the live residency board: one shared-memory
 * segment per worker in which the worker publishes how much of each of its
 * models is on the card, and the host reads it between messages
 * (docs/board.md has the layout table, the trust rules and the lifecycle).
 *
 * Plain C11, no Python.  Linux only: the board is a sealed memfd.
 *
 * The worker makes the board (cs_board_make): an anonymous memfd it maps
 * read-write and then seals against resizing and against any further
 * writable mapping (F_SEAL_FUTURE_WRITE); it sends the descriptor to its
 * host over a Unix socket and closes it.  The host adopts it
 * (cs_board_adopt): checks the seals and the length, maps it read-only
 * and keeps no descriptor.  No process but that worker can ever write it,
 * whoever obtains a descriptor of it.
 *
 * The host keeps which model each slot carries in its own table, with a
 * tag it chose per assignment, and never writes the segment; the worker is
 * told (slot, tag) per model (cs_board_bind) and is the only writer:
 * readings, the heartbeat, its pid.
 *
 * The segment is untrusted input to the host.  A host read takes the slot
 * through a seqlock with a bounded number of retries (it never waits),
 * accepts it only when the slot carries the tag the *host* expects, when
 * the heartbeat is recent and the host has not learned the worker died,
 * and clamps the value to the size the caller passes.  Slot count and
 * every bound come from the host's own records.
 *
 * Every handle remembers the process that made it: in a forked child it
 * refuses everything, and closing it there only drops the child's copy of
 * the mapping (no detach, no thread join).
 *
 * Times are CLOCK_MONOTONIC nanoseconds, the clock of the ledger's
 * receipts (and of Python's time.monotonic_ns() on Linux).
 *
 * Thread safety: every function may be called from any thread with or
 * without the GIL, except that cs_board_close() must not race any other
 * call on the same handle (the caller owns the handle's lifetime).
 * cs_board_close(), cs_board_add_sampler() and cs_board_remove_sampler()
 * wait for a running sampler pass; the host's slot table calls take a lock
 * held only while another such call scans the table; nothing else waits.
 */
#ifndef COMFY_STANDIN_BOARD_H
#define COMFY_STANDIN_BOARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the layout (version 2) ------------------------------------------ */

/* "CSBOARD\0" read as a little-endian 64-bit word. */
#define CS_BOARD_MAGIC UINT64_C(0x0044524F41425343)
#define CS_BOARD_LAYOUT_VERSION 2
#define CS_BOARD_HEADER_SIZE 64
#define CS_BOARD_SLOT_SIZE 64
#define CS_BOARD_MAX_SLOTS 4096

/* Header: eight 64-bit words, all the worker's.  The first five are
 * written once, before the board is sealed and sent; the host checks them
 * at adoption and never reads them again. */
#define CS_BOARD_OFF_MAGIC 0
#define CS_BOARD_OFF_VERSION 8
#define CS_BOARD_OFF_SLOT_SIZE 16
#define CS_BOARD_OFF_SLOT_COUNT 24
#define CS_BOARD_OFF_GENERATION 32
#define CS_BOARD_OFF_OWNER_PID 40
#define CS_BOARD_OFF_HEARTBEAT 48

/* Slot i starts at CS_BOARD_HEADER_SIZE + i * CS_BOARD_SLOT_SIZE; all of
 * it is the worker's.  Words 4..7 are reserved (zero). */
#define CS_BOARD_SLOT_OFF_SEQ 0
#define CS_BOARD_SLOT_OFF_TAG 8
#define CS_BOARD_SLOT_OFF_LOADED 16
#define CS_BOARD_SLOT_OFF_UPDATED 24

/* Published values are limited to this (sums elsewhere stay meaningful). */
#define CS_BOARD_VALUE_MAX ((uint64_t)INT64_MAX)

/* A host read gives up after this many attempts at a slot whose seqlock
 * word is odd or changed under it, and reports the slot torn. */
#define CS_BOARD_READ_RETRIES 32

/* Defaults: how old a heartbeat may be before the board is ignored, and
 * how often the sampler thread runs. */
#define CS_BOARD_DEFAULT_HEARTBEAT_LIMIT_NS UINT64_C(5000000000)
#define CS_BOARD_DEFAULT_PERIOD_NS UINT64_C(10000000)
/* The heartbeat limit's range: shorter than a few clock ticks would make
 * every board stale between two beats of its sampler. */
#define CS_BOARD_HEARTBEAT_LIMIT_MIN_NS UINT64_C(10000000)
#define CS_BOARD_HEARTBEAT_LIMIT_MAX_NS UINT64_C(86400000000000)

/* Longest label a handle carries, NUL included. */
#define CS_BOARD_NAME_MAX 64

/* ---- handles and results --------------------------------------------- */

typedef struct cs_board cs_board;

typedef enum cs_board_status {
    CS_BOARD_OK = 0,
    CS_BOARD_ERR_SYSTEM,  /* a system call failed; errno in *os_error */
    CS_BOARD_ERR_NOMEM,   /* allocation failed; nothing changed */
    CS_BOARD_ERR_MAGIC,   /* the segment is not a board */
    CS_BOARD_ERR_VERSION, /* a board of another layout version */
    CS_BOARD_ERR_SIZE,    /* slot size, slot count or segment size off */
    CS_BOARD_ERR_RANGE,   /* slot index, tag or value out of range */
    CS_BOARD_ERR_ROLE,    /* a host call on a worker handle or back */
    CS_BOARD_ERR_FULL,    /* every slot is assigned */
    CS_BOARD_ERR_BUSY,    /* another writer is inside the slot's write */
    CS_BOARD_ERR_UNBOUND, /* worker: the slot has no tag (bind first) */
    CS_BOARD_ERR_SEALS,   /* the segment is not sealed as a board must be */
    CS_BOARD_ERR_FORKED   /* the handle belongs to another process */
} cs_board_status;

/* Why a host read is or is not valid (cs_board_read_slot_status). */
typedef enum cs_board_reading {
    CS_BOARD_VALID = 0,
    CS_BOARD_UNASSIGNED,    /* the host assigned no model to the slot */
    CS_BOARD_NOT_ATTACHED,  /* the worker closed the board */
    CS_BOARD_WRONG_OWNER,   /* not the pid the host expects */
    CS_BOARD_DEAD_OWNER,    /* the host was told the worker is gone */
    CS_BOARD_STALE,         /* heartbeat older than the limit (or absurd) */
    CS_BOARD_TORN,          /* the seqlock never held still */
    CS_BOARD_TAG_MISMATCH,  /* the slot's reading is for another model */
    CS_BOARD_NO_READING,    /* assigned, never published */
    CS_BOARD_OTHER_PROCESS, /* a handle inherited across fork() */
    CS_BOARD_READING_COUNT
} cs_board_reading;

/* A sampler: fills *loaded with the model's resident bytes and returns 0,
 * or returns nonzero to publish nothing this period.  Called from the
 * board's own thread without the GIL, so it must not touch Python; it must
 * be quick (removal and close wait for a running pass). */
typedef int (*cs_board_sampler_fn)(void *context, uint64_t *loaded);

const char *cs_board_status_message(cs_board_status status);
/* CS_BOARD_LAYOUT_VERSION of the library itself: a caller that loads the
 * board as a shared library (a worker's ctypes publisher) checks it
 * against the layout its host expects. */
int cs_board_layout_version(void);
/* A short lower-case name ("valid", "torn", "tag mismatch", ...). */
const char *cs_board_reading_name(cs_board_reading reading);

/* ---- both sides ------------------------------------------------------ */

/* In the process that made the handle: stops the sampler thread (joined)
 * and, on the worker's side, marks the board detached.  In another
 * process (a fork() child) only the child's copy of the mapping goes.
 * Unmaps and frees.  NULL is a no-op. */
void cs_board_close(cs_board *board);

/* "memfd:csb-<24 hex digits>": the label the kernel shows for the
 * mapping in /proc/<pid>/maps (never a path). */
const char *cs_board_name(const cs_board *board);
bool cs_board_is_host(const cs_board *board);
/* False in a process other than the one that made the handle. */
bool cs_board_is_own(const cs_board *board);
uint32_t cs_board_slot_count(const cs_board *board);
uint64_t cs_board_generation(const cs_board *board);
/* The header's owner pid as it is now (untrusted; 0: none). */
int64_t cs_board_owner_pid(const cs_board *board);
/* True while the worker has the board (the owner word is not 0). */
bool cs_board_attached(const cs_board *board);
/* The start of the mapping and its length (tests, tools). */
void *cs_board_memory(const cs_board *board, size_t *length);
/* A word that moves (release) after every change of the host's view of
 * the board: a slot assigned or released, the expected owner set, the
 * owner marked gone.  A reader may keep what it decided from the host's
 * view while the word holds still.  Host handles only. */
const _Atomic uint64_t *cs_board_changes(const cs_board *board);

/* ---- worker ---------------------------------------------------------- */

/* Makes a board of `slots` slots (1..CS_BOARD_MAX_SLOTS) under the
 * worker's `generation` in this (the worker's) process: an anonymous memfd
 * mapped here read-write, then sealed against resizing, against every
 * later writable mapping or write() (F_SEAL_FUTURE_WRITE: this mapping
 * keeps working, no other one can be made writable, whoever opens the
 * memfd) and against seal changes; the header written and the owner word
 * set to this process.  *fd_out is the descriptor to send to the host with
 * SCM_RIGHTS; close it once sent.  CS_BOARD_ERR_SEALS on a kernel without
 * F_SEAL_FUTURE_WRITE (before Linux 5.1). */
cs_board_status cs_board_make(uint32_t slots, uint64_t generation,
                              cs_board **out, int *fd_out, int *os_error);

/* Tells the worker which tag the host gave `slot` (0: unbind).  Later
 * publishes of the slot carry it. */
cs_board_status cs_board_bind(cs_board *board, uint32_t slot, uint64_t tag);
uint64_t cs_board_bound_tag(const cs_board *board, uint32_t slot);

/* Publishes `loaded` (<= CS_BOARD_VALUE_MAX) for `slot` under its bound
 * tag, stamped now, and beats the heartbeat.  The stamp says when the
 * value was true: the host prefers a reading to a receipt when the
 * reading's stamp is newer, so a value measured earlier must go through
 * cs_board_publish_at with the time its measurement began.  Wait-free:
 * CS_BOARD_ERR_BUSY at once when another thread of the worker is inside a
 * write of the slot (its sampler, say): try again. */
cs_board_status cs_board_publish(cs_board *board, uint32_t slot,
                                 uint64_t loaded);
/* The same with the caller's own CLOCK_MONOTONIC stamp: the time the
 * measurement of `loaded` began (never later).  A stamp of 0 or in the
 * future is refused. */
cs_board_status cs_board_publish_at(cs_board *board, uint32_t slot,
                                    uint64_t loaded, uint64_t updated_ns);
/* Tells the host the worker is alive (publish does it too). */
cs_board_status cs_board_heartbeat(cs_board *board);

/* Runs `fn(context, &loaded)` for `slot` every period on the board's
 * sampler thread (started on first use) and publishes the result.  One
 * sampler per slot; a second replaces the first.  The thread also beats
 * the heartbeat every period.  Waits for a running pass. */
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

/* ---- host ------------------------------------------------------------ */

/* Adopts the board a worker made (cs_board_make) and sent over a Unix
 * socket: `fd` is checked before it is mapped -- a regular file (a memfd)
 * of exactly the length of `slots` slots, sealed against shrinking,
 * growing, any later writable mapping or write() (F_SEAL_FUTURE_WRITE)
 * and seal changes -- and its header must be this layout's with `slots`
 * slots.  Mapped read-only: the host never writes a board, and with the
 * write seal no process but the worker that made it can either.  `fd`
 * stays the caller's: close it as soon as this returns (the mapping keeps
 * the memory; a host holding no descriptor lends none through
 * /proc/<pid>/fd).  heartbeat_limit_ns 0 disables the heartbeat check;
 * otherwise it must be in [CS_BOARD_HEARTBEAT_LIMIT_MIN_NS,
 * CS_BOARD_HEARTBEAT_LIMIT_MAX_NS].  The host's table starts empty. */
cs_board_status cs_board_adopt(int fd, uint32_t slots, uint64_t generation,
                               uint64_t heartbeat_limit_ns, cs_board **out,
                               int *os_error);

/* Gives `id` a slot and a fresh tag, or returns the slot it already has
 * (then `size` must match: CS_BOARD_ERR_SIZE otherwise).  Only the host's
 * table changes: the worker learns (slot, tag) from its host and binds
 * it.  Until then the slot reads CS_BOARD_TAG_MISMATCH or NO_READING. */
cs_board_status cs_board_assign(cs_board *board, const char *id,
                                size_t id_len, uint64_t size,
                                uint32_t *slot);
/* The tag of the slot's current assignment (0: unassigned).  Never
 * repeats within one board. */
uint64_t cs_board_tag(const cs_board *board, uint32_t slot);
/* Frees a slot for another model (the host's table only).  Reads of it
 * are then UNASSIGNED. */
cs_board_status cs_board_release(cs_board *board, uint32_t slot);
/* The size the host assigned to `slot` (0 when unassigned). */
uint64_t cs_board_assigned_size(const cs_board *board, uint32_t slot);
/* The slot the host gave `id` (CS_BOARD_ERR_RANGE when none; ROLE on a
 * worker: the segment holds no ids). */
cs_board_status cs_board_find(const cs_board *board, const char *id,
                              size_t id_len, uint32_t *slot);

/* The pid the host expects as owner (0: any).  With one set, a board
 * whose header names another pid reads CS_BOARD_WRONG_OWNER. */
void cs_board_expect_owner(cs_board *board, int64_t pid);
int64_t cs_board_expected_owner(const cs_board *board);
/* The host learned (from its pool: reaping, is_alive, a pidfd) that the
 * worker is gone: every read is CS_BOARD_DEAD_OWNER from now on. */
void cs_board_owner_gone(cs_board *board);
bool cs_board_owner_is_gone(const cs_board *board);
/* Off the read path: cs_board_expect_owner() keeps a pidfd of the
 * expected owner; this polls it without waiting and, when the process has
 * exited, does cs_board_owner_gone().  True when the owner is known gone.
 * (Without a pidfd: only what owner_gone said.) */
bool cs_board_poll_owner(cs_board *board);
uint64_t cs_board_heartbeat_limit(const cs_board *board);

/* The host read, for a caller holding `size` (its own registered size)
 * and `tag` (the tag it was given at attach; 0: the slot's current tag).
 * Wait-free, no system call, no lock.  On CS_BOARD_VALID: *loaded in
 * [0, size], *updated_ns not later than now.  Otherwise the outputs are
 * left unchanged. */
cs_board_reading cs_board_read_slot_status(const cs_board *board,
                                           uint32_t slot, uint64_t tag,
                                           uint64_t size, uint64_t *loaded,
                                           uint64_t *updated_ns);
/* The same, as "a valid reading or false" (for the stand-in type). */
bool cs_board_read_slot(const cs_board *board, uint32_t slot, uint64_t tag,
                        uint64_t size, uint64_t *loaded,
                        uint64_t *updated_ns);

#ifdef __cplusplus
}
#endif

#endif /* COMFY_STANDIN_BOARD_H */
