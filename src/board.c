/*
 * board.c -- the live residency board (see include/comfy_standin/board.h
 * and docs/board.md).
 *
 * Every word of the segment is a lock-free 64-bit C11 atomic: the other
 * process writes it concurrently, and a lock-free atomic is address-free,
 * so the same word mapped at two addresses in two processes still behaves
 * as one atomic.  Slot fields are accessed relaxed; the seqlock word and
 * the fences give the ordering (Boehm, "Can seqlocks get along with
 * programming language memory models?", 2012):
 *
 *   writer   CAS seq even -> odd (acquire: after the previous writer's
 *            data), release fence, data stores, seq = odd + 1 (release).
 *   reader   s1 = seq (acquire); if odd retry; data loads; acquire fence;
 *            s2 = seq (relaxed); valid when s1 == s2.
 *
 * Only the worker writes the segment (the host writes the header once,
 * before any other process can see it).  The host's knowledge of the
 * board -- slot count, which model a slot carries, its tag and size -- is
 * in its own memory, never taken from the segment.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create, getrandom, pthread_condattr_setclock */
#endif

#include "comfy_standin/board.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <poll.h>
#include <sys/random.h>
#include <sys/syscall.h>
#endif

/* Linux boards are sealed memfds with no name; everywhere else (and in a
 * build that asks for it, to test that path on Linux) they are named POSIX
 * segments. */
#if defined(__linux__) && !defined(CS_BOARD_NAMED)
#define BOARD_MEMFD 1
#else
#define BOARD_MEMFD 0
#endif

/* ---- layout ---------------------------------------------------------- */

typedef struct board_header {
    _Atomic uint64_t magic;
    _Atomic uint64_t version;
    _Atomic uint64_t slot_size;
    _Atomic uint64_t slot_count;
    _Atomic uint64_t generation;
    _Atomic uint64_t owner_pid;   /* the worker that opened it; 0: none */
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

/* Worker writers spin this long on a locked slot, then yield until this
 * much time has passed, then report CS_BOARD_ERR_BUSY.  Only a worker
 * waits here (the host never writes): a preempted writer thread of the
 * same worker can stay off the CPU for milliseconds. */
#define WRITE_SPINS 1000
#define WRITE_BUSY_NS UINT64_C(100000000)

#define OPEN_NAME_MAX 256
/* How far ahead of the reader's clock a heartbeat may legitimately be
 * (written after the reader took its clock); further is garbage. */
#define CLOCK_SLACK_NS UINT64_C(1000000000)
#define PERIOD_MIN_NS UINT64_C(1000000)
#define PERIOD_MAX_NS UINT64_C(3600000000000)

static const char *const status_messages[] = {
    [CS_BOARD_OK] = "ok",
    [CS_BOARD_ERR_SYSTEM] = "a system call failed",
    [CS_BOARD_ERR_NOMEM] = "out of memory",
    [CS_BOARD_ERR_NAME] =
        "not a board name: '/' then 1 to 254 of [A-Za-z0-9_.-]",
    [CS_BOARD_ERR_MAGIC] = "not a comfy-standin board (wrong magic)",
    [CS_BOARD_ERR_VERSION] = "a board of another layout version",
    [CS_BOARD_ERR_SIZE] =
        ("board size is inconsistent (slot size, slot count or segment "
         "size)"),
    [CS_BOARD_ERR_OWNED] = "the board is already open in another worker",
    [CS_BOARD_ERR_RANGE] = "slot, tag or value out of range",
    [CS_BOARD_ERR_ROLE] = "not allowed on this side of the board",
    [CS_BOARD_ERR_FULL] = "every slot of the board is assigned",
    [CS_BOARD_ERR_BUSY] = "the slot stayed locked by another writer",
    [CS_BOARD_ERR_UNBOUND] =
        "the slot has no tag: bind(slot, tag) with the host's tag first",
    [CS_BOARD_ERR_SEALS] =
        ("the segment is not sealed against resizing (a worker could "
         "shrink it under the host)"),
    [CS_BOARD_ERR_FORKED] =
        ("the board handle belongs to another process (inherited across "
         "fork)"),
    [CS_BOARD_ERR_UNSUPPORTED] = "not supported on this platform",
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

static void
board_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static uint64_t
board_clock_ns(clockid_t clock)
{
    struct timespec ts;
    if (clock_gettime(clock, &ts) != 0) {
        return 0;
    }
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

static uint64_t
board_now_ns(void)
{
    return board_clock_ns(CLOCK_MONOTONIC);
}

/* ---- fork: which process a handle belongs to ------------------------- */

/* Bumped in every fork() child (pthread_atfork; os.fork() runs the
 * handlers).  A handle made under another value was made by an ancestor:
 * comparing one atomic load is the read path's whole fork check, where
 * getpid() would be a system call per read. */
static _Atomic uint64_t fork_epoch;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static bool fork_handler_ok;

/* Names this process created and still holds (named boards only), for
 * removal at exit.  Entries carry the creating pid so a forked child never
 * removes its parent's names. */
static pthread_mutex_t linked_lock = PTHREAD_MUTEX_INITIALIZER;
#if !BOARD_MEMFD
typedef struct linked_name {
    struct linked_name *next;
    uint64_t pid;
    char name[CS_BOARD_NAME_MAX];
} linked_name;

static linked_name *linked_names;
#endif

static void
board_before_fork(void)
{
    pthread_mutex_lock(&linked_lock);
}

static void
board_after_fork_parent(void)
{
    pthread_mutex_unlock(&linked_lock);
}

static void
board_after_fork_child(void)
{
    atomic_fetch_add_explicit(&fork_epoch, 1, memory_order_relaxed);
    pthread_mutex_unlock(&linked_lock);
}

#if !BOARD_MEMFD
static void
board_unlink_all_at_exit(void)
{
    uint64_t pid = (uint64_t)getpid();
    if (pthread_mutex_lock(&linked_lock) != 0) {
        return;
    }
    for (linked_name *entry = linked_names; entry; entry = entry->next) {
        if (entry->pid == pid) {
            (void)shm_unlink(entry->name);
        }
    }
    pthread_mutex_unlock(&linked_lock);
}
#endif

static void
board_register_handlers(void)
{
    fork_handler_ok = pthread_atfork(board_before_fork,
                                     board_after_fork_parent,
                                     board_after_fork_child) == 0;
#if !BOARD_MEMFD
    fork_handler_ok = fork_handler_ok &&
                      atexit(board_unlink_all_at_exit) == 0;
#endif
}

static bool
board_handlers(void)
{
    return pthread_once(&fork_once, board_register_handlers) == 0 &&
           fork_handler_ok;
}

#if !BOARD_MEMFD
static cs_board_status
board_remember_name(const char *name)
{
    linked_name *entry = calloc(1, sizeof(*entry));
    if (entry == NULL) {
        return CS_BOARD_ERR_NOMEM;
    }
    entry->pid = (uint64_t)getpid();
    memcpy(entry->name, name, strlen(name) + 1);
    pthread_mutex_lock(&linked_lock);
    entry->next = linked_names;
    linked_names = entry;
    pthread_mutex_unlock(&linked_lock);
    return CS_BOARD_OK;
}

static void
board_forget_name(const char *name)
{
    pthread_mutex_lock(&linked_lock);
    for (linked_name **link = &linked_names; *link; link = &(*link)->next) {
        if (strcmp((*link)->name, name) == 0) {
            linked_name *entry = *link;
            *link = entry->next;
            free(entry);
            break;
        }
    }
    pthread_mutex_unlock(&linked_lock);
}
#endif

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
    /* Immutable after create/open. */
    bool host;
    unsigned char *base;
    size_t length;
    uint32_t slots;
    uint64_t generation;
    uint64_t heartbeat_limit;
    char name[CS_BOARD_NAME_MAX];
    uint64_t pid;   /* this process, when the handle was made */
    uint64_t epoch; /* fork_epoch when the handle was made */
    dev_t fd_dev;   /* the segment's identity, to recognise the fd */
    ino_t fd_ino;
    uint64_t clock_tick; /* the coarse clock's resolution (host reads) */

    /* Host only. */
    _Atomic int fd;       /* memfd board: the host's descriptor, or -1 */
    host_slot *table;     /* under lock; tag/size read unlocked */
    uint64_t next_tag;    /* under lock */
    _Atomic int64_t expected_owner;
    _Atomic int owner_pidfd; /* Linux: a pidfd of expected_owner, or -1 */
    _Atomic bool owner_gone;
    _Atomic bool linked;

    /* Worker only. */
    _Atomic uint64_t *bound; /* `slots` tags */
    pthread_mutex_t lock; /* the table, samplers, period, thread state */
    pthread_cond_t wake;
    pthread_t thread;
    bool thread_started;
    bool stopping;
    sampler *samplers; /* `slots` entries */
    _Atomic uint64_t period;
    _Atomic uint64_t passes;
};

static inline bool
board_here(const cs_board *board)
{
    return atomic_load_explicit(&fork_epoch, memory_order_relaxed) ==
           board->epoch;
}

static board_header *
board_head(const cs_board *board)
{
    return (board_header *)(void *)board->base;
}

static board_slot *
board_slot_at(const cs_board *board, uint32_t slot)
{
    return (board_slot *)(void *)(board->base + CS_BOARD_HEADER_SIZE +
                                  (size_t)slot * CS_BOARD_SLOT_SIZE);
}

/* The host's clock for the heartbeat check: the coarse monotonic clock
 * where there is one (a few ns instead of a vDSO call; it lags by about a
 * tick, which a limit of seconds does not notice). */
static uint64_t
board_read_clock(void)
{
#if defined(CLOCK_MONOTONIC_COARSE)
    return board_clock_ns(CLOCK_MONOTONIC_COARSE);
#else
    return board_now_ns();
#endif
}

static uint64_t
board_read_clock_tick(void)
{
#if defined(CLOCK_MONOTONIC_COARSE)
    struct timespec res;
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0 && res.tv_sec == 0) {
        return (uint64_t)res.tv_nsec;
    }
#endif
    return 0;
}

/* ---- the seqlock (worker side) --------------------------------------- */

/* Takes the slot's seqlock for writing; *seq gets the odd value held. */
static cs_board_status
slot_write_begin(board_slot *slot, uint64_t *seq)
{
    uint64_t give_up = 0;
    for (unsigned attempt = 0;; attempt++) {
        uint64_t current = atomic_load_explicit(&slot->seq,
                                                memory_order_relaxed);
        if ((current & 1) == 0 &&
            atomic_compare_exchange_weak_explicit(
                &slot->seq, &current, current + 1, memory_order_acquire,
                memory_order_relaxed)) {
            /* Orders the data stores after the odd word: a reader that
             * sees any of them also sees the word changed. */
            atomic_thread_fence(memory_order_release);
            *seq = current + 1;
            return CS_BOARD_OK;
        }
        if (attempt < WRITE_SPINS) {
            board_cpu_relax();
            continue;
        }
        uint64_t now = board_now_ns();
        if (give_up == 0) {
            give_up = now + WRITE_BUSY_NS;
        }
        else if (now >= give_up) {
            return CS_BOARD_ERR_BUSY;
        }
        (void)sched_yield();
    }
}

static void
slot_write_end(board_slot *slot, uint64_t seq)
{
    atomic_store_explicit(&slot->seq, seq + 1, memory_order_release);
}

/* ---- create / open / close ------------------------------------------- */

static cs_board *
board_alloc(uint32_t slots)
{
    cs_board *board = calloc(1, sizeof(*board));
    if (board == NULL) {
        return NULL;
    }
    if (pthread_mutex_init(&board->lock, NULL) != 0) {
        free(board);
        return NULL;
    }
    pthread_condattr_t attr;
    bool attr_ok = pthread_condattr_init(&attr) == 0;
#if defined(__linux__)
    /* Sampler waits use the monotonic clock, immune to clock steps. */
    if (attr_ok && pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0) {
        pthread_condattr_destroy(&attr);
        attr_ok = false;
    }
#endif
    if (!attr_ok || pthread_cond_init(&board->wake, &attr) != 0) {
        if (attr_ok) {
            pthread_condattr_destroy(&attr);
        }
        pthread_mutex_destroy(&board->lock);
        free(board);
        return NULL;
    }
    pthread_condattr_destroy(&attr);
    board->slots = slots;
    board->pid = (uint64_t)getpid();
    board->epoch = atomic_load_explicit(&fork_epoch, memory_order_relaxed);
    board->next_tag = 1;
    atomic_init(&board->fd, -1);
    atomic_init(&board->owner_pidfd, -1);
    atomic_init(&board->expected_owner, 0);
    atomic_init(&board->owner_gone, false);
    atomic_init(&board->linked, false);
    atomic_init(&board->period, CS_BOARD_DEFAULT_PERIOD_NS);
    atomic_init(&board->passes, 0);
    return board;
}

/* Frees what the handle owns.  `own`: in the process that made it (in a
 * fork() child the lock may be held by a thread that does not exist
 * there, so it is neither taken nor destroyed). */
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

static int
board_random(unsigned char *bytes, size_t n)
{
#if defined(__linux__)
    size_t got = 0;
    while (got < n) {
        ssize_t r = getrandom(bytes + got, n - got, 0);
        if (r < 0) {
            if (errno == EINTR) {
                continue;
            }
            break; /* ENOSYS on old kernels: fall back to the device */
        }
        got += (size_t)r;
    }
    if (got == n) {
        return 0;
    }
#endif
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    size_t done = 0;
    while (done < n) {
        ssize_t r = read(fd, bytes + done, n - done);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            int saved = errno;
            close(fd);
            errno = r == 0 ? EIO : saved;
            return -1;
        }
        done += (size_t)r;
    }
    close(fd);
    return 0;
}

/* Writes the header the worker checks at open.  Called before any other
 * process can reach the segment; the host never reads it back. */
static void
board_write_header(cs_board *board)
{
    board_header *head = board_head(board);
    atomic_store_explicit(&head->version, CS_BOARD_LAYOUT_VERSION,
                          memory_order_relaxed);
    atomic_store_explicit(&head->slot_size, CS_BOARD_SLOT_SIZE,
                          memory_order_relaxed);
    atomic_store_explicit(&head->slot_count, board->slots,
                          memory_order_relaxed);
    atomic_store_explicit(&head->generation, board->generation,
                          memory_order_relaxed);
    atomic_store_explicit(&head->magic, CS_BOARD_MAGIC, memory_order_release);
}

/* Fills buf with `prefix` + 24 hex digits (96 random bits). */
static int
board_random_name(char *buf, const char *prefix)
{
    unsigned char bytes[12];
    static const char hex[] = "0123456789abcdef";
    size_t n = strlen(prefix);
    if (board_random(bytes, sizeof(bytes)) != 0) {
        return -1;
    }
    memcpy(buf, prefix, n);
    for (size_t i = 0; i < sizeof(bytes); i++) {
        buf[n + 2 * i] = hex[bytes[i] >> 4];
        buf[n + 1 + 2 * i] = hex[bytes[i] & 15];
    }
    buf[n + 2 * sizeof(bytes)] = '\0';
    return 0;
}

#if BOARD_MEMFD
#define BOARD_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* An anonymous memfd of the board's length, sealed against resizing (and
 * against further seal changes) before anyone else can have it.  Returns
 * the descriptor or -1 (errno; *status SEALS when sealing is what
 * failed). */
static int
board_make_memfd(cs_board *board, cs_board_status *status)
{
    *status = CS_BOARD_ERR_SYSTEM;
    if (board_random_name(board->name, "memfd:csb-") != 0) {
        return -1;
    }
    /* The kernel's name is only a label in /proc/PID/fd (never a path). */
    int fd = memfd_create(board->name + 6, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) {
        if (errno == ENOSYS || errno == EINVAL) {
            *status = CS_BOARD_ERR_SEALS;
        }
        return -1;
    }
    if (ftruncate(fd, (off_t)board->length) != 0) {
        goto error;
    }
    if (fcntl(fd, F_ADD_SEALS, BOARD_SEALS) != 0) {
        *status = CS_BOARD_ERR_SEALS;
        goto error;
    }
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & BOARD_SEALS) != BOARD_SEALS) {
        *status = CS_BOARD_ERR_SEALS;
        goto error;
    }
    return fd;
error:;
    int saved = errno;
    close(fd);
    errno = saved;
    return -1;
}
#endif

cs_board_status
cs_board_create(uint32_t slots, uint64_t generation,
                uint64_t heartbeat_limit_ns, cs_board **out, int *os_error)
{
    cs_board_status status = CS_BOARD_ERR_SYSTEM;
    cs_board *board = NULL;
    int fd = -1;
    *out = NULL;
    *os_error = 0;
    if (slots == 0 || slots > CS_BOARD_MAX_SLOTS ||
        (heartbeat_limit_ns != 0 &&
         (heartbeat_limit_ns < CS_BOARD_HEARTBEAT_LIMIT_MIN_NS ||
          heartbeat_limit_ns > CS_BOARD_HEARTBEAT_LIMIT_MAX_NS))) {
        return CS_BOARD_ERR_RANGE;
    }
    if (!board_handlers()) {
        return CS_BOARD_ERR_SYSTEM;
    }
    board = board_alloc(slots);
    if (board == NULL) {
        return CS_BOARD_ERR_NOMEM;
    }
    board->host = true;
    board->generation = generation;
    board->heartbeat_limit = heartbeat_limit_ns;
    board->clock_tick = board_read_clock_tick();
    board->length = CS_BOARD_HEADER_SIZE + (size_t)slots * CS_BOARD_SLOT_SIZE;
    board->table = calloc(slots, sizeof(host_slot));
    if (board->table == NULL) {
        status = CS_BOARD_ERR_NOMEM;
        goto error;
    }
#if BOARD_MEMFD
    fd = board_make_memfd(board, &status);
    if (fd < 0) {
        goto error;
    }
#else
    /* The name path: 96 random bits, and O_EXCL turns the rare collision
     * (or a squatter) into a retry rather than a shared segment.  A
     * worker holding a descriptor of a named segment can ftruncate it
     * (no seals here), and a host read of the lost pages would raise
     * SIGBUS: the price of the only shared memory these systems have. */
    for (int attempt = 0; attempt < 16 && fd < 0; attempt++) {
        if (board_random_name(board->name, "/csb") != 0) {
            goto error;
        }
        fd = shm_open(board->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC,
                      S_IRUSR | S_IWUSR);
        if (fd < 0 && errno != EEXIST) {
            goto error;
        }
    }
    if (fd < 0) {
        goto error;
    }
    status = board_remember_name(board->name);
    if (status != CS_BOARD_OK) {
        (void)shm_unlink(board->name);
        goto error;
    }
    status = CS_BOARD_ERR_SYSTEM;
    atomic_store_explicit(&board->linked, true, memory_order_relaxed);
    if (fchmod(fd, S_IRUSR | S_IWUSR) != 0 ||
        ftruncate(fd, (off_t)board->length) != 0) {
        goto error;
    }
#endif
    struct stat st;
    if (fstat(fd, &st) != 0) {
        goto error;
    }
    board->fd_dev = st.st_dev;
    board->fd_ino = st.st_ino;
    void *base = mmap(NULL, board->length, PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        goto error;
    }
    board->base = base;
    board_write_header(board);
#if BOARD_MEMFD
    atomic_store_explicit(&board->fd, fd, memory_order_relaxed);
    atomic_store_explicit(&board->linked, true, memory_order_relaxed);
#else
    close(fd);
#endif
    *out = board;
    return CS_BOARD_OK;

error:
    if (status == CS_BOARD_ERR_SYSTEM || status == CS_BOARD_ERR_SEALS) {
        *os_error = errno;
    }
    if (fd >= 0) {
        close(fd);
    }
#if !BOARD_MEMFD
    if (atomic_load_explicit(&board->linked, memory_order_relaxed)) {
        board_forget_name(board->name);
        (void)shm_unlink(board->name);
    }
#endif
    board_free(board, true);
    return status;
}

/* Checks a mapped segment of `length` bytes is a board of this layout;
 * *slots gets its slot count. */
static cs_board_status
board_validate(const unsigned char *base, size_t length, uint32_t *slots)
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
    uint64_t slot_size = atomic_load_explicit(&head->slot_size,
                                              memory_order_relaxed);
    uint64_t count = atomic_load_explicit(&head->slot_count,
                                          memory_order_relaxed);
    if (slot_size != CS_BOARD_SLOT_SIZE || count == 0 ||
        count > CS_BOARD_MAX_SLOTS ||
        CS_BOARD_HEADER_SIZE + count * CS_BOARD_SLOT_SIZE != length) {
        return CS_BOARD_ERR_SIZE;
    }
    *slots = (uint32_t)count;
    return CS_BOARD_OK;
}

/* The worker side of an open segment `fd` (not consumed). */
static cs_board_status
board_open_segment(int fd, const char *name, cs_board **out)
{
    cs_board *board = NULL;
    void *base = MAP_FAILED;
    size_t length = 0;
    uint32_t slots = 0;
    struct stat st;
    cs_board_status status = CS_BOARD_ERR_SYSTEM;
    if (fstat(fd, &st) != 0) {
        return CS_BOARD_ERR_SYSTEM;
    }
    /* Refuse anything that cannot be a board before mapping it. */
    if (!S_ISREG(st.st_mode) ||
        st.st_size < CS_BOARD_HEADER_SIZE + CS_BOARD_SLOT_SIZE ||
        st.st_size > CS_BOARD_HEADER_SIZE +
                         (off_t)CS_BOARD_MAX_SLOTS * CS_BOARD_SLOT_SIZE) {
        return CS_BOARD_ERR_SIZE;
    }
#if BOARD_MEMFD
    /* Map only what nobody can shrink under this process either. */
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) !=
                         (F_SEAL_SHRINK | F_SEAL_GROW)) {
        return CS_BOARD_ERR_SEALS;
    }
#endif
    length = (size_t)st.st_size;
    base = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        return CS_BOARD_ERR_SYSTEM;
    }
    status = board_validate(base, length, &slots);
    if (status != CS_BOARD_OK) {
        goto error;
    }
    board = board_alloc(slots);
    if (board == NULL) {
        status = CS_BOARD_ERR_NOMEM;
        goto error;
    }
    board->samplers = calloc(slots, sizeof(sampler));
    board->bound = calloc(slots, sizeof(_Atomic uint64_t));
    if (board->samplers == NULL || board->bound == NULL) {
        status = CS_BOARD_ERR_NOMEM;
        goto error;
    }
    for (uint32_t i = 0; i < slots; i++) {
        atomic_init(&board->bound[i], 0);
    }
    board->host = false;
    board->base = base;
    base = MAP_FAILED; /* the handle owns the mapping now */
    board->length = length;
    board->fd_dev = st.st_dev;
    board->fd_ino = st.st_ino;
    size_t n = strlen(name);
    if (n >= sizeof(board->name)) {
        n = sizeof(board->name) - 1;
    }
    memcpy(board->name, name, n);
    board->name[n] = '\0';
    board_header *head = board_head(board);
    board->generation = atomic_load_explicit(&head->generation,
                                             memory_order_relaxed);
    /* Claim it first, beat after: a refused open must not touch the real
     * owner's heartbeat.  A worker that closed it (owner 0) may open it
     * again. */
    uint64_t expected = 0;
    if (!atomic_compare_exchange_strong_explicit(
            &head->owner_pid, &expected, board->pid, memory_order_acq_rel,
            memory_order_acquire)) {
        status = CS_BOARD_ERR_OWNED;
        goto error;
    }
    atomic_store_explicit(&head->heartbeat, board_now_ns(),
                          memory_order_release);
    *out = board;
    return CS_BOARD_OK;

error:;
    int saved = errno;
    if (base != MAP_FAILED) {
        (void)munmap(base, length);
    }
    if (board != NULL) {
        board_free(board, true);
    }
    errno = saved;
    return status;
}

cs_board_status
cs_board_open_fd(int fd, cs_board **out, int *os_error)
{
    *out = NULL;
    *os_error = 0;
    if (fd < 0) {
        return CS_BOARD_ERR_RANGE;
    }
    if (!board_handlers()) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    char name[CS_BOARD_NAME_MAX];
    /* "fd:" and an int always fit; a cut name would still be a label. */
    (void)snprintf(name, sizeof(name), "fd:%d", fd);
    cs_board_status status = board_open_segment(fd, name, out);
    if (status == CS_BOARD_ERR_SYSTEM) {
        *os_error = errno;
    }
    return status;
}

#if !BOARD_MEMFD
static bool
board_name_ok(const char *name)
{
    size_t len = strnlen(name, OPEN_NAME_MAX);
    if (len < 2 || len >= CS_BOARD_NAME_MAX || name[0] != '/') {
        return false;
    }
    for (size_t i = 1; i < len; i++) {
        char c = name[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                  (c >= '0' && c <= '9') || c == '_' || c == '.' ||
                  c == '-';
        if (!ok) {
            return false;
        }
    }
    return true;
}
#endif

cs_board_status
cs_board_open(const char *name, cs_board **out, int *os_error)
{
    *out = NULL;
    *os_error = 0;
#if BOARD_MEMFD
    (void)name;
    return CS_BOARD_ERR_UNSUPPORTED;
#else
    if (name == NULL || !board_name_ok(name)) {
        return CS_BOARD_ERR_NAME;
    }
    if (!board_handlers()) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    /* No O_CREAT: the worker side never makes a segment. */
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    cs_board_status status = board_open_segment(fd, name, out);
    if (status == CS_BOARD_ERR_SYSTEM) {
        *os_error = errno;
    }
    close(fd);
    return status;
#endif
}

static void
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

/* Closes `fd` only if it is still the board's segment (in a fork() child
 * the number may have been reused for something else). */
static void
board_close_fd_if_ours(const cs_board *board, int fd)
{
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && st.st_dev == board->fd_dev &&
        st.st_ino == board->fd_ino) {
        (void)close(fd);
    }
}

void
cs_board_close(cs_board *board)
{
    if (board == NULL) {
        return;
    }
    if (!board_here(board)) {
        /* Inherited across fork(): the parent's board.  Drop this
         * process's mapping and descriptor copy; unlink, detach and the
         * thread (which does not exist here) are the parent's. */
        if (board->host) {
            board_close_fd_if_ours(
                board, atomic_load_explicit(&board->fd,
                                            memory_order_relaxed));
        }
        board_free(board, false);
        return;
    }
    if (board->host) {
        int ignored;
        (void)cs_board_unlink(board, &ignored);
        int pidfd = atomic_exchange_explicit(&board->owner_pidfd, -1,
                                             memory_order_acq_rel);
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

cs_board_status
cs_board_unlink(cs_board *board, int *os_error)
{
    *os_error = 0;
    if (!board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    if (!board_here(board)) {
        return CS_BOARD_ERR_FORKED;
    }
    if (!atomic_exchange_explicit(&board->linked, false,
                                  memory_order_acq_rel)) {
        return CS_BOARD_OK;
    }
#if BOARD_MEMFD
    int fd = atomic_exchange_explicit(&board->fd, -1, memory_order_acq_rel);
    if (fd >= 0 && close(fd) != 0 && errno != EINTR) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
#else
    board_forget_name(board->name);
    if (shm_unlink(board->name) != 0 && errno != ENOENT) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
#endif
    return CS_BOARD_OK;
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

int
cs_board_fd(const cs_board *board)
{
    if (!board->host || !board_here(board)) {
        return -1;
    }
    return atomic_load_explicit(&board->fd, memory_order_acquire);
}

int64_t
cs_board_owner_pid(const cs_board *board)
{
    uint64_t pid = atomic_load_explicit(&board_head(board)->owner_pid,
                                        memory_order_acquire);
    return pid > (uint64_t)INT64_MAX ? -1 : (int64_t)pid;
}

void *
cs_board_memory(const cs_board *board, size_t *length)
{
    if (length != NULL) {
        *length = board->length;
    }
    return board->base;
}

bool
cs_board_linked(const cs_board *board)
{
    return atomic_load_explicit(&board->linked, memory_order_acquire);
}

bool
cs_board_attached(const cs_board *board)
{
    return atomic_load_explicit(&board_head(board)->owner_pid,
                                memory_order_acquire) != 0;
}

void
cs_board_expect_owner(cs_board *board, int64_t pid)
{
    atomic_store_explicit(&board->expected_owner, pid < 0 ? 0 : pid,
                          memory_order_release);
    if (!board->host || !board_here(board)) {
        return;
    }
    int pidfd = -1;
#if defined(__linux__) && defined(SYS_pidfd_open)
    /* A pidfd names this very process (no pid reuse), in the host's
     * namespace; polled off the read path (cs_board_poll_owner). */
    if (pid > 0 && pid <= INT_MAX) {
        long r = syscall(SYS_pidfd_open, (pid_t)pid, 0);
        pidfd = r >= 0 ? (int)r : -1;
        if (pidfd >= 0) {
            (void)fcntl(pidfd, F_SETFD, FD_CLOEXEC);
        }
    }
#endif
    int old = atomic_exchange_explicit(&board->owner_pidfd, pidfd,
                                       memory_order_acq_rel);
    if (old >= 0) {
        (void)close(old);
    }
}

bool
cs_board_poll_owner(cs_board *board)
{
    if (!board->host || !board_here(board)) {
        return cs_board_owner_is_gone(board);
    }
#if defined(__linux__)
    int pidfd = atomic_load_explicit(&board->owner_pidfd,
                                     memory_order_acquire);
    if (pidfd >= 0) {
        struct pollfd p = {.fd = pidfd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0) { /* readable: the process exited */
            cs_board_owner_gone(board);
        }
    }
#endif
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
}

bool
cs_board_owner_is_gone(const cs_board *board)
{
    return atomic_load_explicit(&board->owner_gone, memory_order_acquire);
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
    pthread_mutex_unlock(&board->lock);
    return CS_BOARD_OK;
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
    board_slot *entry = board_slot_at(board, slot);
    for (int attempt = 0; attempt < CS_BOARD_READ_RETRIES; attempt++) {
        uint64_t before = atomic_load_explicit(&entry->seq,
                                               memory_order_acquire);
        if (before & 1) {
            board_cpu_relax();
            continue;
        }
        uint64_t got_tag = atomic_load_explicit(&entry->tag,
                                                memory_order_relaxed);
        uint64_t value = atomic_load_explicit(&entry->loaded,
                                              memory_order_relaxed);
        uint64_t stamp = atomic_load_explicit(&entry->updated,
                                              memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&entry->seq, memory_order_relaxed) !=
            before) {
            board_cpu_relax();
            continue;
        }
        if (got_tag != want) {
            /* 0: the worker has not published under any tag yet. */
            return got_tag == 0 ? CS_BOARD_NO_READING
                                : CS_BOARD_TAG_MISMATCH;
        }
        if (stamp == 0) {
            return CS_BOARD_NO_READING;
        }
        /* Untrusted values: the caller's size bounds the reading, and a
         * stamp from the future cannot claim to be newer than now.  The
         * coarse clock lags the precise one by about a tick, so a stamp
         * within a tick past it is taken as is (a fresh publish: at worst
         * a tick early), and one further (a forged one, or a tick that
         * came late) is checked against the precise clock. */
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
    return CS_BOARD_TORN;
}

bool
cs_board_read_slot(const cs_board *board, uint32_t slot, uint64_t tag,
                   uint64_t size, uint64_t *loaded, uint64_t *updated_ns)
{
    return cs_board_read_slot_status(board, slot, tag, size, loaded,
                                     updated_ns) == CS_BOARD_VALID;
}

/* ---- worker: publishing ---------------------------------------------- */

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
    status = slot_write_begin(entry, &seq);
    if (status != CS_BOARD_OK) {
        return status;
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

/* ---- worker: the sampler thread -------------------------------------- */

static void
board_deadline(struct timespec *ts, uint64_t period)
{
#if defined(__linux__)
    clockid_t clock = CLOCK_MONOTONIC;
#else
    clockid_t clock = CLOCK_REALTIME; /* no pthread_condattr_setclock */
#endif
    if (clock_gettime(clock, ts) != 0) {
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
            if (s->fn != NULL && s->fn(s->context, &loaded) == 0) {
                if (loaded > CS_BOARD_VALUE_MAX) {
                    loaded = CS_BOARD_VALUE_MAX;
                }
                (void)cs_board_publish(board, i, loaded);
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

