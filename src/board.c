/*
 * board.c -- the live residency board's segment and handles: make
 * (worker), adopt (host), close, the fork epoch, and the accessors
 * (include/comfy_standin/board.h, docs/board.md; src/board_internal.h
 * says how the board's files divide the work).
 */
#include "board_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

/* Linux 5.1: no new writable mapping and no write() for anyone, while the
 * mappings made before the seal keep working (the worker's own). */
#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif
/* What cs_board_make seals and cs_board_adopt requires. */
#define BOARD_SEALS                                                           \
    (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL)

static const char *const status_messages[] = {
    [CS_BOARD_OK] = "ok",
    [CS_BOARD_ERR_SYSTEM] = "a system call failed",
    [CS_BOARD_ERR_NOMEM] = "out of memory",
    [CS_BOARD_ERR_MAGIC] = "not a comfy-standin board (wrong magic)",
    [CS_BOARD_ERR_VERSION] = "a board of another layout version",
    [CS_BOARD_ERR_SIZE] =
        ("board size is inconsistent (slot size, slot count or segment "
         "size)"),
    [CS_BOARD_ERR_RANGE] = "slot, tag or value out of range",
    [CS_BOARD_ERR_ROLE] = "not allowed on this side of the board",
    [CS_BOARD_ERR_FULL] = "every slot of the board is assigned",
    [CS_BOARD_ERR_BUSY] = "the slot is locked by another writer",
    [CS_BOARD_ERR_UNBOUND] =
        "the slot has no tag: bind(slot, tag) with the host's tag first",
    [CS_BOARD_ERR_SEALS] =
        ("the segment is not sealed against resizing and writing (only "
         "the worker that made it may write it)"),
    [CS_BOARD_ERR_FORKED] =
        ("the board handle belongs to another process (inherited across "
         "fork)"),
};

static const char *const reading_names[] = {
    [CS_BOARD_VALID] = "valid",
    [CS_BOARD_UNASSIGNED] = "unassigned",
    [CS_BOARD_NOT_ATTACHED] = "not attached",
    [CS_BOARD_WRONG_OWNER] = "wrong owner",
    [CS_BOARD_DEAD_OWNER] = "dead owner",
    [CS_BOARD_STALE] = "stale heartbeat",
    [CS_BOARD_TORN] = "torn",
    [CS_BOARD_TAG_MISMATCH] = "tag mismatch",
    [CS_BOARD_NO_READING] = "no reading",
    [CS_BOARD_OTHER_PROCESS] = "other process",
};
static_assert(sizeof(reading_names) / sizeof(reading_names[0]) ==
                  CS_BOARD_READING_COUNT,
              "a name per reading");

const char *
cs_board_status_message(cs_board_status status)
{
    if ((unsigned)status >= sizeof(status_messages) / sizeof(char *) ||
        status_messages[status] == NULL) {
        return "unknown board status";
    }
    return status_messages[status];
}

const char *
cs_board_reading_name(cs_board_reading reading)
{
    if ((unsigned)reading >= CS_BOARD_READING_COUNT) {
        return "unknown";
    }
    return reading_names[reading];
}

int
cs_board_layout_version(void)
{
    return CS_BOARD_LAYOUT_VERSION;
}

/* ---- fork: which process a handle belongs to ------------------------- */

/* Bumped in every fork() child (pthread_atfork; os.fork() runs the
 * handlers).  A handle made under another value was made by an ancestor:
 * comparing one atomic load is the read path's whole fork check, where
 * getpid() would be a system call per read. */
_Atomic uint64_t board_fork_epoch;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static bool fork_handler_ok;

static void
board_after_fork_child(void)
{
    atomic_fetch_add_explicit(&board_fork_epoch, 1, memory_order_relaxed);
}

static void
board_register_handlers(void)
{
    fork_handler_ok = pthread_atfork(NULL, NULL, board_after_fork_child) == 0;
}

/* Registers the fork handler once; false if that failed. */
static bool
board_handlers(void)
{
    return pthread_once(&fork_once, board_register_handlers) == 0 &&
           fork_handler_ok;
}

/* ---- handles --------------------------------------------------------- */

static cs_board *
board_alloc(uint32_t slots, bool host)
{
    cs_board *board = calloc(1, sizeof(*board));
    if (board == NULL) {
        return NULL;
    }
    if (host) {
        board->table = calloc(slots, sizeof(host_slot));
    }
    else {
        board->samplers = calloc(slots, sizeof(sampler));
        board->bound = calloc(slots, sizeof(_Atomic uint64_t));
    }
    pthread_condattr_t attr;
    bool attr_ok = pthread_condattr_init(&attr) == 0;
    /* Sampler waits use the monotonic clock, immune to clock steps. */
    bool cond_ok = attr_ok &&
                   pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 &&
                   pthread_cond_init(&board->wake, &attr) == 0;
    if (attr_ok) {
        pthread_condattr_destroy(&attr);
    }
    bool lock_ok = cond_ok && pthread_mutex_init(&board->lock, NULL) == 0;
    if (!lock_ok || (host ? board->table == NULL
                          : board->samplers == NULL || board->bound == NULL)) {
        if (lock_ok) {
            pthread_mutex_destroy(&board->lock);
        }
        if (cond_ok) {
            pthread_cond_destroy(&board->wake);
        }
        free(board->table);
        free(board->samplers);
        free((void *)board->bound);
        free(board);
        return NULL;
    }
    for (uint32_t i = 0; !host && i < slots; i++) {
        atomic_init(&board->bound[i], 0);
    }
    board->host = host;
    board->slots = slots;
    board->length = CS_BOARD_HEADER_SIZE + (size_t)slots * CS_BOARD_SLOT_SIZE;
    board->pid = (uint64_t)getpid();
    board->epoch = atomic_load_explicit(&board_fork_epoch,
                                        memory_order_relaxed);
    board->next_tag = 1;
    board->owner_pidfd = -1;
    atomic_init(&board->expected_owner, 0);
    atomic_init(&board->owner_gone, false);
    atomic_init(&board->period, CS_BOARD_DEFAULT_PERIOD_NS);
    atomic_init(&board->passes, 0);
    return board;
}

/* Frees what the handle owns.  `own`: in the process that made it (in a
 * fork() child a lock may be held by a thread that does not exist there,
 * so none is destroyed). */
static void
board_free(cs_board *board, bool own)
{
    if (board->base != NULL) {
        (void)munmap(board->base, board->length);
    }
    if (own) {
        pthread_cond_destroy(&board->wake);
        pthread_mutex_destroy(&board->lock);
    }
    if (board->table != NULL) {
        for (uint32_t i = 0; i < board->slots; i++) {
            free(board->table[i].id);
        }
    }
    free(board->table);
    free(board->samplers);
    free((void *)board->bound);
    free(board);
}

/* Writes "memfd:csb-" and 24 hex digits into `name`: 96 bits from
 * getrandom, or, before the kernel's pool is ready (early boot), from the
 * clock and the pid.  Only a label: it never names anything to open. */
static void
board_new_label(char *name)
{
    static _Atomic uint64_t counter;
    static const char hex[] = "0123456789abcdef";
    unsigned char bytes[12];
    if (getrandom(bytes, sizeof(bytes), GRND_NONBLOCK) !=
        (ssize_t)sizeof(bytes)) {
        uint64_t x = board_now_ns() ^ ((uint64_t)getpid() << 32) ^
                     atomic_fetch_add(&counter, 1);
        for (size_t i = 0; i < sizeof(bytes); i++) {
            x = x * UINT64_C(6364136223846793005) +
                UINT64_C(1442695040888963407);
            bytes[i] = (unsigned char)(x >> 56);
        }
    }
    memcpy(name, "memfd:csb-", 10);
    for (size_t i = 0; i < sizeof(bytes); i++) {
        name[10 + 2 * i] = hex[bytes[i] >> 4];
        name[11 + 2 * i] = hex[bytes[i] & 15];
    }
    name[10 + 2 * sizeof(bytes)] = '\0';
}

/* ---- make (worker) ---------------------------------------------------- */

cs_board_status
cs_board_make(uint32_t slots, uint64_t generation, cs_board **out,
              int *fd_out, int *os_error)
{
    *out = NULL;
    *fd_out = -1;
    *os_error = 0;
    if (slots == 0 || slots > CS_BOARD_MAX_SLOTS) {
        return CS_BOARD_ERR_RANGE;
    }
    if (!board_handlers()) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    cs_board *board = board_alloc(slots, false);
    if (board == NULL) {
        return CS_BOARD_ERR_NOMEM;
    }
    board->generation = generation;
    board_new_label(board->name);
    cs_board_status status = CS_BOARD_ERR_SYSTEM;
    /* The kernel's name is the label without "memfd:", which it adds. */
    int fd = memfd_create(board->name + 6, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        if (errno == EINVAL) {
            status = CS_BOARD_ERR_SEALS; /* no sealable memfds */
        }
        goto error;
    }
    if (ftruncate(fd, (off_t)board->length) != 0) {
        goto error;
    }
    /* This process's writable mapping first: the write seal below leaves
     * mappings made before it working and refuses every later one. */
    void *base = mmap(NULL, board->length, PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        goto error;
    }
    board->base = base;
    int seals =
        fcntl(fd, F_ADD_SEALS, BOARD_SEALS) == 0 ? fcntl(fd, F_GET_SEALS) : -1;
    if (seals < 0 || (seals & BOARD_SEALS) != BOARD_SEALS) {
        status = CS_BOARD_ERR_SEALS; /* e.g. a kernel before Linux 5.1 */
        goto error;
    }
    board_header *head = board_head(board);
    atomic_store_explicit(&head->version, CS_BOARD_LAYOUT_VERSION,
                          memory_order_relaxed);
    atomic_store_explicit(&head->slot_size, CS_BOARD_SLOT_SIZE,
                          memory_order_relaxed);
    atomic_store_explicit(&head->slot_count, slots, memory_order_relaxed);
    atomic_store_explicit(&head->generation, generation, memory_order_relaxed);
    atomic_store_explicit(&head->owner_pid, board->pid, memory_order_relaxed);
    atomic_store_explicit(&head->heartbeat, board_now_ns(),
                          memory_order_relaxed);
    atomic_store_explicit(&head->magic, CS_BOARD_MAGIC, memory_order_release);
    *out = board;
    *fd_out = fd;
    return CS_BOARD_OK;

error:
    *os_error = errno;
    if (fd >= 0) {
        close(fd);
    }
    board_free(board, true);
    return status;
}

/* ---- adopt (host) ---------------------------------------------------- */

/* Whether the mapped segment `base` is a board of this layout with
 * `slots` slots. */
static cs_board_status
board_validate(const unsigned char *base, uint32_t slots)
{
    const board_header *head = (const board_header *)(const void *)base;
    if (atomic_load_explicit(&head->magic, memory_order_acquire) !=
        CS_BOARD_MAGIC) {
        return CS_BOARD_ERR_MAGIC;
    }
    if (atomic_load_explicit(&head->version, memory_order_relaxed) !=
        CS_BOARD_LAYOUT_VERSION) {
        return CS_BOARD_ERR_VERSION;
    }
    if (atomic_load_explicit(&head->slot_size, memory_order_relaxed) !=
            CS_BOARD_SLOT_SIZE ||
        atomic_load_explicit(&head->slot_count, memory_order_relaxed) !=
            slots) {
        return CS_BOARD_ERR_SIZE;
    }
    return CS_BOARD_OK;
}

/* The name the worker gave its memfd, when it is one of ours
 * ("csb-" and 24 hex digits): the label the kernel shows for the host's
 * mapping in /proc/<pid>/maps, so the board can be found there by name.
 * Anything else is the worker's word only, and the host labels the board
 * itself. */
static void
board_adopted_label(int fd, char *name)
{
    char path[64], link[CS_BOARD_NAME_MAX + 32];
    static const char prefix[] = "/memfd:csb-";
    (void)snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, link, sizeof(link) - 1);
    size_t digits = 24, start = sizeof(prefix) - 1;
    bool ours = n >= (ssize_t)(start + digits);
    for (size_t i = 0; ours && i < start; i++) {
        ours = link[i] == prefix[i];
    }
    for (size_t i = start; ours && i < start + digits; i++) {
        char c = link[i];
        ours = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
    }
    /* After the digits: the end, or the kernel's " (deleted)". */
    ours = ours && (n == (ssize_t)(start + digits) ||
                    link[start + digits] == ' ');
    if (ours) {
        memcpy(name, "memfd:csb-", 10);
        memcpy(name + 10, link + start, digits);
        name[10 + digits] = '\0';
    }
    else {
        board_new_label(name);
    }
}

cs_board_status
cs_board_adopt(int fd, uint32_t slots, uint64_t generation,
               uint64_t heartbeat_limit_ns, cs_board **out, int *os_error)
{
    *out = NULL;
    *os_error = 0;
    if (fd < 0 || slots == 0 || slots > CS_BOARD_MAX_SLOTS ||
        (heartbeat_limit_ns != 0 &&
         (heartbeat_limit_ns < CS_BOARD_HEARTBEAT_LIMIT_MIN_NS ||
          heartbeat_limit_ns > CS_BOARD_HEARTBEAT_LIMIT_MAX_NS))) {
        return CS_BOARD_ERR_RANGE;
    }
    if (!board_handlers()) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    size_t length = CS_BOARD_HEADER_SIZE + (size_t)slots * CS_BOARD_SLOT_SIZE;
    /* Everything about the descriptor is checked before it is mapped: a
     * regular file (a memfd) of exactly the length the host expects, that
     * nobody can resize, write through a new mapping, or unseal. */
    struct stat st;
    if (fstat(fd, &st) != 0) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    if (!S_ISREG(st.st_mode) || st.st_size < 0 ||
        (uint64_t)st.st_size != (uint64_t)length) {
        return CS_BOARD_ERR_SIZE;
    }
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & BOARD_SEALS) != BOARD_SEALS) {
        return CS_BOARD_ERR_SEALS;
    }
    /* Read-only: the host never writes a board, and now cannot. */
    void *base = mmap(NULL, length, PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    cs_board_status status = board_validate(base, slots);
    cs_board *board = NULL;
    if (status == CS_BOARD_OK) {
        board = board_alloc(slots, true);
        status = board == NULL ? CS_BOARD_ERR_NOMEM : CS_BOARD_OK;
    }
    if (status != CS_BOARD_OK) {
        (void)munmap(base, length);
        return status;
    }
    board->base = base;
    board->generation = generation;
    board->heartbeat_limit = heartbeat_limit_ns;
    board->clock_tick = board_read_clock_tick();
    board_adopted_label(fd, board->name);
    *out = board;
    return CS_BOARD_OK;
}

/* ---- close ----------------------------------------------------------- */

void
cs_board_close(cs_board *board)
{
    if (board == NULL) {
        return;
    }
    if (!board_here(board)) {
        /* Inherited across fork(): the parent's board.  Drop this
         * process's mapping; the detach, the pidfd and the thread (which
         * does not exist here) are the parent's. */
        board_free(board, false);
        return;
    }
    if (board->host) {
        pthread_mutex_lock(&board->lock);
        int pidfd = board->owner_pidfd;
        board->owner_pidfd = -1;
        pthread_mutex_unlock(&board->lock);
        if (pidfd >= 0) {
            (void)close(pidfd);
        }
    }
    else {
        board_stop_sampler(board);
        /* Detach, but only if the board is still ours. */
        uint64_t expected = board->pid;
        atomic_compare_exchange_strong_explicit(
            &board_head(board)->owner_pid, &expected, 0,
            memory_order_acq_rel, memory_order_relaxed);
    }
    board_free(board, true);
}

/* ---- accessors ------------------------------------------------------- */

const char *
cs_board_name(const cs_board *board)
{
    return board->name;
}

bool
cs_board_is_host(const cs_board *board)
{
    return board->host;
}

bool
cs_board_is_own(const cs_board *board)
{
    return board_here(board);
}

uint32_t
cs_board_slot_count(const cs_board *board)
{
    return board->slots;
}

uint64_t
cs_board_generation(const cs_board *board)
{
    return board->generation;
}

int64_t
cs_board_owner_pid(const cs_board *board)
{
    uint64_t pid = atomic_load_explicit(&board_head(board)->owner_pid,
                                        memory_order_acquire);
    return pid > (uint64_t)INT64_MAX ? -1 : (int64_t)pid;
}

bool
cs_board_attached(const cs_board *board)
{
    return atomic_load_explicit(&board_head(board)->owner_pid,
                                memory_order_acquire) != 0;
}

void *
cs_board_memory(const cs_board *board, size_t *length)
{
    if (length != NULL) {
        *length = board->length;
    }
    return board->base;
}

uint64_t
cs_board_heartbeat_limit(const cs_board *board)
{
    return board->heartbeat_limit;
}

uint64_t
cs_board_period(const cs_board *board)
{
    return atomic_load_explicit(&board->period, memory_order_relaxed);
}

uint64_t
cs_board_sampler_passes(const cs_board *board)
{
    return atomic_load_explicit(&board->passes, memory_order_acquire);
}
