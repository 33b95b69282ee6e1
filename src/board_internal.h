/*
 * board_internal.h -- what the board's source files share and nothing
 * else includes: the segment's layout as C structs, the handle, and the
 * helpers of more than one file.  The board core is split by concern:
 *
 *   board.c          the segment's life: make, adopt, close; fork
 *                    epochs; labels; accessors
 *   board_host.c     the host's side: the slot table, owner tracking,
 *                    the wait-free read
 *   board_worker.c   the worker's side: the wait-free seqlock writer,
 *                    publish, heartbeat, the sampler thread
 *
 * Every word of the segment is a lock-free 64-bit C11 atomic: the other
 * process writes it concurrently, and a lock-free atomic is address-free,
 * so the same word mapped at two addresses in two processes still behaves
 * as one atomic.  Slot fields are accessed relaxed; the seqlock word and
 * the fences give the ordering (Boehm, "Can seqlocks get along with
 * programming language memory models?", 2012):
 *
 *   writer   CAS seq even -> odd (acquire: after the previous writer's
 *            data), or give up at once (another writer is inside);
 *            release fence, data stores, seq = odd + 1 (release).
 *   reader   s1 = seq (acquire); if odd retry; data loads; acquire fence;
 *            s2 = seq (relaxed); valid when s1 == s2.
 *
 * Only the worker writes the segment.  The host's knowledge of the board
 * -- slot count, which model a slot carries, its tag and size -- is in its
 * own memory, never taken from the segment.
 *
 * Functions declared here are internal (board_ prefix); the shared
 * library exports cs_board_* only (src/board.map).
 */
#ifndef COMFY_STANDIN_BOARD_INTERNAL_H
#define COMFY_STANDIN_BOARD_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, F_ADD_SEALS, getrandom */
#endif

#include "comfy_standin/board.h"

#include <assert.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/types.h>
#include <time.h>

/* ---- the layout ------------------------------------------------------ */

typedef struct board_header {
    _Atomic uint64_t magic;
    _Atomic uint64_t version;
    _Atomic uint64_t slot_size;
    _Atomic uint64_t slot_count;
    _Atomic uint64_t generation;
    _Atomic uint64_t owner_pid;   /* the worker; 0 once it closed it */
    _Atomic uint64_t heartbeat;   /* CLOCK_MONOTONIC ns of its last beat */
    _Atomic uint64_t reserved;
} board_header;

typedef struct board_slot {
    _Atomic uint64_t seq; /* seqlock word: odd while a writer is inside */
    _Atomic uint64_t tag; /* the host's tag the worker bound; 0: none */
    _Atomic uint64_t loaded;
    _Atomic uint64_t updated; /* CLOCK_MONOTONIC ns; 0: never published */
    _Atomic uint64_t reserved[4];
} board_slot;

/* The segment is shared between processes, so its atomics must be
 * lock-free (a lock-based atomic keeps its lock in process memory). */
#if UINT64_MAX == ULONG_MAX
static_assert(ATOMIC_LONG_LOCK_FREE == 2, "64-bit atomics must be lock-free");
#else
static_assert(ATOMIC_LLONG_LOCK_FREE == 2,
              "64-bit atomics must be lock-free");
#endif
static_assert(sizeof(_Atomic uint64_t) == 8, "atomic words are 8 bytes");
static_assert(sizeof(board_header) == CS_BOARD_HEADER_SIZE, "header size");
static_assert(sizeof(board_slot) == CS_BOARD_SLOT_SIZE, "slot size");
static_assert(offsetof(board_header, magic) == CS_BOARD_OFF_MAGIC, "off");
static_assert(offsetof(board_header, version) == CS_BOARD_OFF_VERSION,
              "off");
static_assert(offsetof(board_header, slot_size) == CS_BOARD_OFF_SLOT_SIZE,
              "off");
static_assert(offsetof(board_header, slot_count) == CS_BOARD_OFF_SLOT_COUNT,
              "off");
static_assert(offsetof(board_header, generation) == CS_BOARD_OFF_GENERATION,
              "off");
static_assert(offsetof(board_header, owner_pid) == CS_BOARD_OFF_OWNER_PID,
              "off");
static_assert(offsetof(board_header, heartbeat) == CS_BOARD_OFF_HEARTBEAT,
              "off");
static_assert(offsetof(board_slot, seq) == CS_BOARD_SLOT_OFF_SEQ, "off");
static_assert(offsetof(board_slot, tag) == CS_BOARD_SLOT_OFF_TAG, "off");
static_assert(offsetof(board_slot, loaded) == CS_BOARD_SLOT_OFF_LOADED,
              "off");
static_assert(offsetof(board_slot, updated) == CS_BOARD_SLOT_OFF_UPDATED,
              "off");

/* ---- limits ---------------------------------------------------------- */

/* How far ahead of the reader's clock a heartbeat may legitimately be
 * (written after the reader took its clock); further is garbage. */
#define CLOCK_SLACK_NS UINT64_C(1000000000)
#define PERIOD_MIN_NS UINT64_C(1000000)
#define PERIOD_MAX_NS UINT64_C(3600000000000)

/* ---- the handle ------------------------------------------------------ */

typedef struct host_slot {
    /* Written under board->lock; tag and size also read lock-free by
     * host reads (tag stored last, with release; 0 first on release). */
    _Atomic uint64_t tag; /* 0: unassigned */
    _Atomic uint64_t size;
    char *id; /* owned copy, for cs_board_find; under lock */
    size_t id_len;
} host_slot;

typedef struct sampler {
    cs_board_sampler_fn fn; /* NULL: none */
    void *context;
} sampler;

struct cs_board {
    /* Immutable after make/adopt. */
    bool host;
    unsigned char *base;
    size_t length;
    uint32_t slots;
    uint64_t generation;
    uint64_t heartbeat_limit;
    char name[CS_BOARD_NAME_MAX];
    uint64_t pid;        /* this process, when the handle was made */
    uint64_t epoch;      /* fork_epoch when the handle was made */
    uint64_t clock_tick; /* the coarse clock's resolution (host reads) */

    /* Host: the table and the owner's pidfd.  Worker: the samplers and
     * the thread's state. */
    pthread_mutex_t lock;

    /* Host only. */
    host_slot *table;  /* under lock; tag/size read unlocked */
    uint64_t next_tag; /* under lock */
    _Atomic int64_t expected_owner;
    /* A pidfd of expected_owner, or -1.  Under lock, so a poll never runs
     * on a descriptor another thread just closed (or on whatever reused
     * its number). */
    int owner_pidfd;
    _Atomic bool owner_gone;
    /* Moves after every change of the host's view: a slot assigned or
     * released, the expected owner set, the owner marked gone. */
    _Atomic uint64_t changes;

    /* Worker only. */
    _Atomic uint64_t *bound; /* `slots` tags */
    pthread_cond_t wake;
    pthread_t thread;
    bool thread_started;
    bool stopping;
    sampler *samplers; /* `slots` entries */
    _Atomic uint64_t period;
    _Atomic uint64_t passes;
};

/* Bumped in every fork() child (board.c); a handle made under another
 * value was made by an ancestor. */
extern _Atomic uint64_t board_fork_epoch;

static inline bool
board_here(const cs_board *board)
{
    return atomic_load_explicit(&board_fork_epoch, memory_order_relaxed) ==
           board->epoch;
}

static inline board_header *
board_head(const cs_board *board)
{
    return (board_header *)(void *)board->base;
}

static inline board_slot *
board_slot_at(const cs_board *board, uint32_t slot)
{
    return (board_slot *)(void *)(board->base + CS_BOARD_HEADER_SIZE +
                                  (size_t)slot * CS_BOARD_SLOT_SIZE);
}

static inline void
board_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint64_t
board_clock_ns(clockid_t clock)
{
    struct timespec ts;
    if (clock_gettime(clock, &ts) != 0) {
        return 0;
    }
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

static inline uint64_t
board_now_ns(void)
{
    return board_clock_ns(CLOCK_MONOTONIC);
}

/* ---- shared between the files --------------------------------------- */

/* board_host.c: the coarse clock's resolution, for host handles. */
uint64_t board_read_clock_tick(void);
/* board_worker.c: stops and joins the sampler thread, if any. */
void board_stop_sampler(cs_board *board);

#endif /* COMFY_STANDIN_BOARD_INTERNAL_H */
