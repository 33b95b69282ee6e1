/*
 * board_host.c -- the host's side of the live residency board: which model
 * each slot carries (the host's own table, with a tag per assignment),
 * what the host knows of the worker's liveness, and the wait-free read
 * (include/comfy_standin/board.h, docs/board.md).  The host never writes
 * the segment.
 */
#include "board_internal.h"

#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* FNV-1a, 64-bit: the high half of a tag names the model (informative;
 * the counter in the low half is what makes tags unique). */
static uint64_t
board_key(const char *id, size_t id_len)
{
    uint64_t hash = UINT64_C(0xcbf29ce484222325);
    for (size_t i = 0; i < id_len; i++) {
        hash ^= (unsigned char)id[i];
        hash *= UINT64_C(0x100000001b3);
    }
    return hash;
}

/* The host's clock for the heartbeat check: the coarse monotonic clock (a
 * few ns instead of a vDSO call; it lags by about a tick, which a limit of
 * seconds does not notice). */
static uint64_t
board_read_clock(void)
{
    return board_clock_ns(CLOCK_MONOTONIC_COARSE);
}

uint64_t
board_read_clock_tick(void)
{
    struct timespec res;
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0 && res.tv_sec == 0) {
        return (uint64_t)res.tv_nsec;
    }
    return 0;
}

/* ---- host: the worker's liveness ------------------------------------- */

void
cs_board_expect_owner(cs_board *board, int64_t pid)
{
    atomic_store_explicit(&board->expected_owner, pid < 0 ? 0 : pid,
                          memory_order_release);
    atomic_fetch_add_explicit(&board->changes, 1, memory_order_release);
    if (!board->host || !board_here(board)) {
        return;
    }
    int pidfd = -1;
#if defined(SYS_pidfd_open)
    /* A pidfd names this very process (no pid reuse), in the host's
     * namespace; polled off the read path (cs_board_poll_owner).  Linux
     * 5.3; without it, only what owner_gone says. */
    if (pid > 0 && pid <= INT_MAX) {
        long r = syscall(SYS_pidfd_open, (pid_t)pid, 0);
        pidfd = r >= 0 ? (int)r : -1;
        if (pidfd >= 0) {
            (void)fcntl(pidfd, F_SETFD, FD_CLOEXEC);
        }
    }
#endif
    pthread_mutex_lock(&board->lock);
    int old = board->owner_pidfd;
    board->owner_pidfd = pidfd;
    pthread_mutex_unlock(&board->lock);
    if (old >= 0) { /* no poll can be using it: they hold the lock */
        (void)close(old);
    }
}

bool
cs_board_poll_owner(cs_board *board)
{
    if (!board->host || !board_here(board)) {
        return cs_board_owner_is_gone(board);
    }
    /* The poll does not wait (timeout 0), so holding the lock across it
     * is bounded. */
    pthread_mutex_lock(&board->lock);
    bool exited = false;
    if (board->owner_pidfd >= 0) {
        struct pollfd p = {.fd = board->owner_pidfd, .events = POLLIN};
        exited = poll(&p, 1, 0) > 0; /* readable: the process exited */
    }
    pthread_mutex_unlock(&board->lock);
    if (exited) {
        cs_board_owner_gone(board);
    }
    return cs_board_owner_is_gone(board);
}

int64_t
cs_board_expected_owner(const cs_board *board)
{
    return atomic_load_explicit(&board->expected_owner,
                                memory_order_acquire);
}

void
cs_board_owner_gone(cs_board *board)
{
    atomic_store_explicit(&board->owner_gone, true, memory_order_release);
    atomic_fetch_add_explicit(&board->changes, 1, memory_order_release);
}

bool
cs_board_owner_is_gone(const cs_board *board)
{
    return atomic_load_explicit(&board->owner_gone, memory_order_acquire);
}

/* ---- host: slots (the host's own table; the segment is not touched) -- */

static bool
host_slot_is(const host_slot *entry, const char *id, size_t id_len)
{
    return entry->id != NULL && entry->id_len == id_len &&
           memcmp(entry->id, id, id_len) == 0;
}

cs_board_status
cs_board_assign(cs_board *board, const char *id, size_t id_len,
                uint64_t size, uint32_t *slot)
{
    cs_board_status status = CS_BOARD_OK;
    if (!board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    if (!board_here(board)) {
        return CS_BOARD_ERR_FORKED;
    }
    if (size > CS_BOARD_VALUE_MAX) {
        return CS_BOARD_ERR_RANGE;
    }
    char *copy = malloc(id_len + 1);
    if (copy == NULL) {
        return CS_BOARD_ERR_NOMEM;
    }
    memcpy(copy, id, id_len);
    copy[id_len] = '\0';
    pthread_mutex_lock(&board->lock);
    uint32_t free_slot = UINT32_MAX;
    for (uint32_t i = 0; i < board->slots; i++) {
        host_slot *entry = &board->table[i];
        if (host_slot_is(entry, id, id_len)) {
            if (atomic_load_explicit(&entry->size, memory_order_relaxed) !=
                size) {
                status = CS_BOARD_ERR_SIZE;
            }
            *slot = i;
            goto done;
        }
        if (entry->id == NULL && free_slot == UINT32_MAX) {
            free_slot = i;
        }
    }
    if (free_slot == UINT32_MAX) {
        status = CS_BOARD_ERR_FULL;
        goto done;
    }
    /* A fresh tag per assignment: 31 bits of the model's hash above
     * (informative), a counter that never repeats within the board below
     * (never 0).  Tags stay in [1, CS_BOARD_VALUE_MAX]: they travel as
     * plain non-negative ints. */
    if ((board->next_tag & UINT64_C(0xffffffff)) == 0) {
        board->next_tag++;
    }
    uint64_t counter = board->next_tag++;
    uint64_t tag = (board_key(id, id_len) & UINT64_C(0x7fffffff00000000)) |
                   (counter & UINT64_C(0xffffffff));
    host_slot *entry = &board->table[free_slot];
    atomic_store_explicit(&entry->size, size, memory_order_relaxed);
    entry->id = copy;
    entry->id_len = id_len;
    copy = NULL;
    /* Readers take the tag without the lock: store it last. */
    atomic_store_explicit(&entry->tag, tag, memory_order_release);
    atomic_fetch_add_explicit(&board->changes, 1, memory_order_release);
    *slot = free_slot;
done:
    pthread_mutex_unlock(&board->lock);
    free(copy);
    return status;
}

cs_board_status
cs_board_release(cs_board *board, uint32_t slot)
{
    if (!board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    if (!board_here(board)) {
        return CS_BOARD_ERR_FORKED;
    }
    if (slot >= board->slots) {
        return CS_BOARD_ERR_RANGE;
    }
    pthread_mutex_lock(&board->lock);
    host_slot *entry = &board->table[slot];
    atomic_store_explicit(&entry->tag, 0, memory_order_release);
    atomic_store_explicit(&entry->size, 0, memory_order_relaxed);
    free(entry->id);
    entry->id = NULL;
    entry->id_len = 0;
    atomic_fetch_add_explicit(&board->changes, 1, memory_order_release);
    pthread_mutex_unlock(&board->lock);
    return CS_BOARD_OK;
}

const _Atomic uint64_t *
cs_board_changes(const cs_board *board)
{
    return &board->changes;
}

uint64_t
cs_board_tag(const cs_board *board, uint32_t slot)
{
    if (!board->host || slot >= board->slots) {
        return 0;
    }
    return atomic_load_explicit(&board->table[slot].tag,
                                memory_order_acquire);
}

uint64_t
cs_board_assigned_size(const cs_board *board, uint32_t slot)
{
    if (!board->host || slot >= board->slots ||
        atomic_load_explicit(&board->table[slot].tag,
                             memory_order_acquire) == 0) {
        return 0;
    }
    return atomic_load_explicit(&board->table[slot].size,
                                memory_order_relaxed);
}

cs_board_status
cs_board_find(const cs_board *board, const char *id, size_t id_len,
              uint32_t *slot)
{
    if (!board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    if (!board_here(board)) {
        return CS_BOARD_ERR_FORKED;
    }
    pthread_mutex_t *lock = (pthread_mutex_t *)&board->lock;
    cs_board_status status = CS_BOARD_ERR_RANGE;
    pthread_mutex_lock(lock);
    for (uint32_t i = 0; i < board->slots; i++) {
        if (host_slot_is(&board->table[i], id, id_len)) {
            *slot = i;
            status = CS_BOARD_OK;
            break;
        }
    }
    pthread_mutex_unlock(lock);
    return status;
}

/* ---- host: reads ----------------------------------------------------- */

/* One consistent snapshot of a slot through its seqlock: a bounded
 * number of attempts, never a wait.  False: it never held still (torn). */
static bool
board_snapshot(board_slot *entry, uint64_t *tag, uint64_t *value,
               uint64_t *stamp)
{
    for (int attempt = 0; attempt < CS_BOARD_READ_RETRIES; attempt++) {
        uint64_t before = atomic_load_explicit(&entry->seq,
                                               memory_order_acquire);
        if (before & 1) {
            board_cpu_relax();
            continue;
        }
        *tag = atomic_load_explicit(&entry->tag, memory_order_relaxed);
        *value = atomic_load_explicit(&entry->loaded, memory_order_relaxed);
        *stamp = atomic_load_explicit(&entry->updated, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&entry->seq, memory_order_relaxed) ==
            before) {
            return true;
        }
        board_cpu_relax();
    }
    return false;
}

cs_board_reading
cs_board_read_slot_status(const cs_board *board, uint32_t slot,
                          uint64_t tag, uint64_t size, uint64_t *loaded,
                          uint64_t *updated_ns)
{
    /* Bounds and identity from the host's own records only. */
    if (board == NULL || !board->host || slot >= board->slots) {
        return CS_BOARD_UNASSIGNED;
    }
    if (!board_here(board)) {
        return CS_BOARD_OTHER_PROCESS;
    }
    uint64_t want = atomic_load_explicit(&board->table[slot].tag,
                                         memory_order_acquire);
    if (want == 0 || (tag != 0 && tag != want)) {
        /* Released, or reassigned to another model since the caller
         * attached: its tag is no longer the slot's. */
        return CS_BOARD_UNASSIGNED;
    }
    if (atomic_load_explicit(&board->owner_gone, memory_order_relaxed)) {
        return CS_BOARD_DEAD_OWNER;
    }
    const board_header *head = board_head(board);
    uint64_t owner = atomic_load_explicit(&head->owner_pid,
                                          memory_order_relaxed);
    if (owner == 0) {
        return CS_BOARD_NOT_ATTACHED;
    }
    int64_t expected = atomic_load_explicit(&board->expected_owner,
                                            memory_order_relaxed);
    if (expected != 0 && (uint64_t)expected != owner) {
        return CS_BOARD_WRONG_OWNER;
    }
    uint64_t now = board_read_clock();
    uint64_t beat = atomic_load_explicit(&head->heartbeat,
                                         memory_order_relaxed);
    /* A beat written after the reader took `now` is legitimately a little
     * ahead; one far in the future is garbage. */
    if (beat == 0 || beat > now + CLOCK_SLACK_NS) {
        return CS_BOARD_STALE;
    }
    if (board->heartbeat_limit != 0 && beat < now &&
        now - beat > board->heartbeat_limit) {
        return CS_BOARD_STALE;
    }
    uint64_t got_tag, value, stamp;
    if (!board_snapshot(board_slot_at(board, slot), &got_tag, &value,
                        &stamp)) {
        return CS_BOARD_TORN;
    }
    if (got_tag != want) {
        /* 0: the worker has not published under any tag yet. */
        return got_tag == 0 ? CS_BOARD_NO_READING : CS_BOARD_TAG_MISMATCH;
    }
    if (stamp == 0) {
        return CS_BOARD_NO_READING;
    }
    /* Untrusted values: the caller's size bounds the reading, and a stamp
     * from the future cannot claim to be newer than now.  The coarse
     * clock lags the precise one by about a tick, so a stamp within a
     * tick past it is taken as is (a fresh publish: at worst a tick
     * early), and one further (a forged one, or a tick that came late) is
     * checked against the precise clock. */
    if (stamp > now + board->clock_tick) {
        uint64_t precise = board_now_ns();
        if (stamp > precise) {
            stamp = precise;
        }
    }
    *loaded = value < size ? value : size;
    *updated_ns = stamp;
    return CS_BOARD_VALID;
}

bool
cs_board_read_slot(const cs_board *board, uint32_t slot, uint64_t tag,
                   uint64_t size, uint64_t *loaded, uint64_t *updated_ns)
{
    return cs_board_read_slot_status(board, slot, tag, size, loaded,
                                     updated_ns) == CS_BOARD_VALID;
}

