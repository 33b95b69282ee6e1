/*
 * board_worker.c -- the worker's side of the live residency board: the
 * wait-free seqlock writer, publish and heartbeat, and the sampler thread
 * (include/comfy_standin/board.h, docs/board.md).  Only a worker writes
 * the segment.
 */
#include "board_internal.h"

/* ---- the seqlock (worker side) --------------------------------------- */

/* Takes the slot's seqlock for writing without waiting: false when another
 * writer is inside (the word is odd, or another CAS won). */
static bool
slot_write_begin(board_slot *slot, uint64_t *seq)
{
    uint64_t current = atomic_load_explicit(&slot->seq, memory_order_relaxed);
    if ((current & 1) != 0 ||
        !atomic_compare_exchange_strong_explicit(&slot->seq, &current,
                                                 current + 1,
                                                 memory_order_acquire,
                                                 memory_order_relaxed)) {
        return false;
    }
    /* Orders the data stores after the odd word: a reader that sees any of
     * them also sees the word changed. */
    atomic_thread_fence(memory_order_release);
    *seq = current + 1;
    return true;
}

static void
slot_write_end(board_slot *slot, uint64_t seq)
{
    atomic_store_explicit(&slot->seq, seq + 1, memory_order_release);
}

/* ---- worker: publishing ---------------------------------------------- */

/* CS_BOARD_OK when `board` may make a worker call here. */
static cs_board_status
board_worker_call(const cs_board *board)
{
    if (board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    if (!board_here(board)) {
        return CS_BOARD_ERR_FORKED;
    }
    return CS_BOARD_OK;
}

cs_board_status
cs_board_bind(cs_board *board, uint32_t slot, uint64_t tag)
{
    cs_board_status status = board_worker_call(board);
    if (status != CS_BOARD_OK) {
        return status;
    }
    if (slot >= board->slots) {
        return CS_BOARD_ERR_RANGE;
    }
    atomic_store_explicit(&board->bound[slot], tag, memory_order_release);
    return CS_BOARD_OK;
}

uint64_t
cs_board_bound_tag(const cs_board *board, uint32_t slot)
{
    if (board->host || slot >= board->slots) {
        return 0;
    }
    return atomic_load_explicit(&board->bound[slot], memory_order_acquire);
}

cs_board_status
cs_board_heartbeat(cs_board *board)
{
    cs_board_status status = board_worker_call(board);
    if (status != CS_BOARD_OK) {
        return status;
    }
    atomic_store_explicit(&board_head(board)->heartbeat, board_now_ns(),
                          memory_order_release);
    return CS_BOARD_OK;
}

cs_board_status
cs_board_publish_at(cs_board *board, uint32_t slot, uint64_t loaded,
                    uint64_t updated_ns)
{
    cs_board_status status = board_worker_call(board);
    if (status != CS_BOARD_OK) {
        return status;
    }
    uint64_t now = board_now_ns();
    if (slot >= board->slots || loaded > CS_BOARD_VALUE_MAX ||
        updated_ns == 0 || updated_ns > now) {
        return CS_BOARD_ERR_RANGE;
    }
    uint64_t tag = atomic_load_explicit(&board->bound[slot],
                                        memory_order_acquire);
    if (tag == 0) {
        return CS_BOARD_ERR_UNBOUND;
    }
    board_slot *entry = board_slot_at(board, slot);
    uint64_t seq;
    if (!slot_write_begin(entry, &seq)) {
        return CS_BOARD_ERR_BUSY;
    }
    atomic_store_explicit(&entry->tag, tag, memory_order_relaxed);
    atomic_store_explicit(&entry->loaded, loaded, memory_order_relaxed);
    atomic_store_explicit(&entry->updated, updated_ns, memory_order_relaxed);
    slot_write_end(entry, seq);
    atomic_store_explicit(&board_head(board)->heartbeat, now,
                          memory_order_release);
    return CS_BOARD_OK;
}

cs_board_status
cs_board_publish(cs_board *board, uint32_t slot, uint64_t loaded)
{
    return cs_board_publish_at(board, slot, loaded, board_now_ns());
}

void
board_stop_sampler(cs_board *board)
{
    pthread_mutex_lock(&board->lock);
    bool started = board->thread_started;
    board->stopping = true;
    pthread_cond_broadcast(&board->wake);
    pthread_mutex_unlock(&board->lock);
    if (started) {
        (void)pthread_join(board->thread, NULL);
    }
}

/* ---- worker: the sampler thread -------------------------------------- */

static void
board_deadline(struct timespec *ts, uint64_t period)
{
    if (clock_gettime(CLOCK_MONOTONIC, ts) != 0) {
        ts->tv_sec = 0;
        ts->tv_nsec = 0;
    }
    uint64_t nsec = (uint64_t)ts->tv_nsec + period % UINT64_C(1000000000);
    ts->tv_sec += (time_t)(period / UINT64_C(1000000000) +
                           nsec / UINT64_C(1000000000));
    ts->tv_nsec = (long)(nsec % UINT64_C(1000000000));
}

static void *
board_sampler_main(void *arg)
{
    cs_board *board = arg;
    pthread_mutex_lock(&board->lock);
    while (!board->stopping) {
        /* Samplers run under the lock, so removal (which takes it) waits
         * for a running pass and then the sampler never runs again. */
        for (uint32_t i = 0; i < board->slots; i++) {
            sampler *s = &board->samplers[i];
            uint64_t loaded = 0;
            /* Stamped when the measurement began, never after it: the
             * host takes a reading as newer than a receipt by its stamp,
             * so a stamp taken after sampling could pass a value measured
             * before a move for one measured after. */
            uint64_t measured = board_now_ns();
            if (s->fn != NULL && s->fn(s->context, &loaded) == 0) {
                if (loaded > CS_BOARD_VALUE_MAX) {
                    loaded = CS_BOARD_VALUE_MAX;
                }
                /* Busy: a Python publish is inside; the next pass
                 * publishes again. */
                (void)cs_board_publish_at(board, i, loaded, measured);
            }
        }
        (void)cs_board_heartbeat(board);
        atomic_fetch_add_explicit(&board->passes, 1, memory_order_release);
        struct timespec deadline;
        board_deadline(&deadline, cs_board_period(board));
        /* Wakes at the period or at once when close() signals; a spurious
         * wake only runs a pass early. */
        (void)pthread_cond_timedwait(&board->wake, &board->lock, &deadline);
    }
    pthread_mutex_unlock(&board->lock);
    return NULL;
}

cs_board_status
cs_board_add_sampler(cs_board *board, uint32_t slot, cs_board_sampler_fn fn,
                     void *context, int *os_error)
{
    cs_board_status status = CS_BOARD_OK;
    *os_error = 0;
    status = board_worker_call(board);
    if (status != CS_BOARD_OK) {
        return status;
    }
    if (slot >= board->slots || fn == NULL) {
        return CS_BOARD_ERR_RANGE;
    }
    pthread_mutex_lock(&board->lock);
    if (board->stopping) {
        status = CS_BOARD_ERR_ROLE;
        goto done;
    }
    if (!board->thread_started) {
        int rc = pthread_create(&board->thread, NULL, board_sampler_main,
                                board);
        if (rc != 0) {
            *os_error = rc;
            status = CS_BOARD_ERR_SYSTEM;
            goto done;
        }
        board->thread_started = true;
    }
    board->samplers[slot].fn = fn;
    board->samplers[slot].context = context;
    /* Sample the new slot now rather than a period from now. */
    pthread_cond_broadcast(&board->wake);
done:
    pthread_mutex_unlock(&board->lock);
    return status;
}

cs_board_status
cs_board_remove_sampler(cs_board *board, uint32_t slot)
{
    cs_board_status status = board_worker_call(board);
    if (status != CS_BOARD_OK) {
        return status;
    }
    if (slot >= board->slots) {
        return CS_BOARD_ERR_RANGE;
    }
    pthread_mutex_lock(&board->lock);
    board->samplers[slot].fn = NULL;
    board->samplers[slot].context = NULL;
    pthread_mutex_unlock(&board->lock);
    return CS_BOARD_OK;
}

cs_board_status
cs_board_set_period(cs_board *board, uint64_t period_ns)
{
    if (period_ns < PERIOD_MIN_NS || period_ns > PERIOD_MAX_NS) {
        return CS_BOARD_ERR_RANGE;
    }
    atomic_store_explicit(&board->period, period_ns, memory_order_relaxed);
    return CS_BOARD_OK;
}

