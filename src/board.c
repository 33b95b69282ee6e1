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
 * Writers exclude each other through the CAS, so several worker threads
 * (Python and the sampler) may publish to one slot.  The host is a writer
 * only when it assigns or releases a slot.
 *
 * Private (process-local) state is never taken from the segment after it
 * was validated: the host bounds every access by its own slot count and
 * checks each slot against its own copy of the key and size.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* getrandom, pthread_condattr_setclock */
#endif

#include "comfy_standin/board.h"

#include <assert.h>
#include <limits.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#ifndef _WIN32
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/random.h>
#endif
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
    _Atomic uint64_t host_pid;    /* informative only */
} board_header;

typedef struct board_slot {
    _Atomic uint64_t seq; /* seqlock word: odd while a writer is inside */
    _Atomic uint64_t key; /* FNV-1a of the model id; 0: unassigned */
    _Atomic uint64_t key_text[3];
    _Atomic uint64_t size;
    _Atomic uint64_t loaded;
    _Atomic uint64_t updated; /* CLOCK_MONOTONIC ns; 0: never published */
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
static_assert(offsetof(board_header, host_pid) == CS_BOARD_OFF_HOST_PID,
              "off");
static_assert(offsetof(board_slot, seq) == CS_BOARD_SLOT_OFF_SEQ, "off");
static_assert(offsetof(board_slot, key) == CS_BOARD_SLOT_OFF_KEY, "off");
static_assert(offsetof(board_slot, key_text) == CS_BOARD_SLOT_OFF_KEY_TEXT,
              "off");
static_assert(offsetof(board_slot, size) == CS_BOARD_SLOT_OFF_SIZE, "off");
static_assert(offsetof(board_slot, loaded) == CS_BOARD_SLOT_OFF_LOADED,
              "off");
static_assert(offsetof(board_slot, updated) == CS_BOARD_SLOT_OFF_UPDATED,
              "off");
static_assert(sizeof(((board_slot *)0)->key_text) == CS_BOARD_KEY_TEXT_SIZE,
              "key text");

/* Writers spin this long on a locked slot, then yield until this much
 * time has passed, then report CS_BOARD_ERR_BUSY (only a corrupted word
 * stays odd).  Time, not a count of yields: a writer preempted inside its
 * few stores can stay off the CPU for milliseconds on a loaded machine,
 * and a yield returns at once when nothing else is runnable here (the
 * sanitizer CI run hit 10,000 yields inside one preemption). */
#define WRITE_SPINS 1000
#define WRITE_BUSY_NS UINT64_C(250000000)

#define OPEN_NAME_MAX 256
/* How far ahead of the reader's clock a writer's stamp may legitimately
 * be (it took its clock after the reader did). */
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
    [CS_BOARD_ERR_RANGE] = "slot or value out of range",
    [CS_BOARD_ERR_ROLE] = "not allowed on this side of the board",
    [CS_BOARD_ERR_FULL] = "every slot of the board is assigned",
    [CS_BOARD_ERR_BUSY] = "the slot stayed locked by another writer",
    [CS_BOARD_ERR_UNSUPPORTED] = "no shared-memory board on this platform",
};

static const char *const reading_names[] = {
    [CS_BOARD_VALID] = "valid",
    [CS_BOARD_UNASSIGNED] = "unassigned",
    [CS_BOARD_NOT_ATTACHED] = "not attached",
    [CS_BOARD_BAD_HEADER] = "bad header",
    [CS_BOARD_WRONG_OWNER] = "wrong owner",
    [CS_BOARD_DEAD_OWNER] = "dead owner",
    [CS_BOARD_STALE] = "stale heartbeat",
    [CS_BOARD_TORN] = "torn",
    [CS_BOARD_KEY_MISMATCH] = "key mismatch",
    [CS_BOARD_NO_READING] = "no reading",
};
static_assert(sizeof(reading_names) / sizeof(reading_names[0]) ==
                  CS_BOARD_READING_COUNT,
              "a name per reading");

const char *
cs_board_status_message(cs_board_status status)
{
    if ((unsigned)status >= sizeof(status_messages) / sizeof(char *)) {
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

#ifndef _WIN32

/* FNV-1a, 64-bit; 0 is reserved for "unassigned". */
static uint64_t
board_key(const char *id, size_t id_len)
{
    uint64_t hash = UINT64_C(0xcbf29ce484222325);
    for (size_t i = 0; i < id_len; i++) {
        hash ^= (unsigned char)id[i];
        hash *= UINT64_C(0x100000001b3);
    }
    return hash == 0 ? 1 : hash;
}

/* The id's first bytes, zero-padded, as three words (for tools). */
static void
board_key_text(const char *id, size_t id_len, uint64_t words[3])
{
    unsigned char bytes[CS_BOARD_KEY_TEXT_SIZE] = {0};
    size_t n = id_len < sizeof(bytes) ? id_len : sizeof(bytes);
    memcpy(bytes, id, n);
    memcpy(words, bytes, sizeof(bytes));
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

/* ---- the handle ------------------------------------------------------ */

typedef struct host_slot {
    /* Written under board->lock; key and size also read lock-free by
     * host reads (key published last, with release). */
    _Atomic uint64_t key; /* 0: unassigned */
    _Atomic uint64_t size;
    char text[CS_BOARD_KEY_TEXT_SIZE]; /* for cs_board_find on a host */
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
    char name[OPEN_NAME_MAX];
    uint64_t pid; /* this process, when the handle was made */

    /* Host only. */
    host_slot *table;            /* under lock; read unlocked by readers */
    _Atomic int64_t expected_owner;
    _Atomic bool linked;

    /* The sampler thread (worker only). */
    pthread_mutex_t lock; /* the table, samplers, period, thread state */
    pthread_cond_t wake;
    pthread_t thread;
    bool thread_started;
    bool stopping;
    sampler *samplers; /* `slots` entries */
    _Atomic uint64_t period;
    _Atomic uint64_t passes;
};

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

static uint64_t
board_now_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        return 0;
    }
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

/* ---- names that outlive nothing: removal at process exit ------------- */

/* Host boards whose name still exists.  A C atexit handler removes them
 * even when no Python object is ever deallocated.  Entries carry the pid
 * that made them so a forked child never removes its parent's names. */
typedef struct linked_name {
    struct linked_name *next;
    uint64_t pid;
    char name[CS_BOARD_NAME_MAX];
} linked_name;

static pthread_mutex_t linked_lock = PTHREAD_MUTEX_INITIALIZER;
static linked_name *linked_names;
static pthread_once_t linked_once = PTHREAD_ONCE_INIT;
static bool linked_handler_ok;

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

static void
board_register_exit_handler(void)
{
    linked_handler_ok = atexit(board_unlink_all_at_exit) == 0;
}

static cs_board_status
board_remember_name(const char *name)
{
    if (pthread_once(&linked_once, board_register_exit_handler) != 0 ||
        !linked_handler_ok) {
        return CS_BOARD_ERR_SYSTEM;
    }
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

/* ---- the seqlock ----------------------------------------------------- */

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
    atomic_init(&board->expected_owner, 0);
    atomic_init(&board->linked, false);
    atomic_init(&board->period, CS_BOARD_DEFAULT_PERIOD_NS);
    atomic_init(&board->passes, 0);
    return board;
}

static void
board_free(cs_board *board)
{
    if (board->base != NULL) {
        (void)munmap(board->base, board->length);
    }
    pthread_cond_destroy(&board->wake);
    pthread_mutex_destroy(&board->lock);
    free(board->table);
    free(board->samplers);
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

cs_board_status
cs_board_create(uint32_t slots, uint64_t generation,
                uint64_t heartbeat_limit_ns, cs_board **out, int *os_error)
{
    cs_board_status status = CS_BOARD_ERR_SYSTEM;
    cs_board *board = NULL;
    int fd = -1;
    bool named = false;
    *out = NULL;
    *os_error = 0;
    if (slots == 0 || slots > CS_BOARD_MAX_SLOTS) {
        return CS_BOARD_ERR_RANGE;
    }
    board = board_alloc(slots);
    if (board == NULL) {
        return CS_BOARD_ERR_NOMEM;
    }
    board->host = true;
    board->generation = generation;
    board->heartbeat_limit = heartbeat_limit_ns;
    board->length = CS_BOARD_HEADER_SIZE + (size_t)slots * CS_BOARD_SLOT_SIZE;
    board->table = calloc(slots, sizeof(host_slot));
    if (board->table == NULL) {
        status = CS_BOARD_ERR_NOMEM;
        goto error;
    }
    /* 96 random bits: unguessable, and O_EXCL turns the rare collision
     * (or a squatter) into a retry rather than a shared segment. */
    for (int attempt = 0; attempt < 16 && fd < 0; attempt++) {
        unsigned char bytes[12];
        static const char hex[] = "0123456789abcdef";
        if (board_random(bytes, sizeof(bytes)) != 0) {
            goto error;
        }
        memcpy(board->name, "/csb", 4);
        for (size_t i = 0; i < sizeof(bytes); i++) {
            board->name[4 + 2 * i] = hex[bytes[i] >> 4];
            board->name[5 + 2 * i] = hex[bytes[i] & 15];
        }
        board->name[4 + 2 * sizeof(bytes)] = '\0';
        fd = shm_open(board->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC,
                      S_IRUSR | S_IWUSR);
        if (fd < 0 && errno != EEXIST) {
            goto error;
        }
    }
    if (fd < 0) {
        goto error;
    }
    named = true;
    /* The mode asked for is already 0600 (umask can only remove bits);
     * fchmod makes it so whatever the platform did with the mode. */
    if (fchmod(fd, S_IRUSR | S_IWUSR) != 0 ||
        ftruncate(fd, (off_t)board->length) != 0) {
        goto error;
    }
    void *base = mmap(NULL, board->length, PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        goto error;
    }
    board->base = base;
    if (close(fd) != 0) {
        fd = -1;
        goto error;
    }
    fd = -1;
    status = board_remember_name(board->name);
    if (status != CS_BOARD_OK) {
        goto error;
    }
    atomic_store_explicit(&board->linked, true, memory_order_relaxed);

    board_header *head = board_head(board);
    atomic_store_explicit(&head->version, CS_BOARD_LAYOUT_VERSION,
                          memory_order_relaxed);
    atomic_store_explicit(&head->slot_size, CS_BOARD_SLOT_SIZE,
                          memory_order_relaxed);
    atomic_store_explicit(&head->slot_count, slots, memory_order_relaxed);
    atomic_store_explicit(&head->generation, generation,
                          memory_order_relaxed);
    atomic_store_explicit(&head->host_pid, board->pid, memory_order_relaxed);
    /* ftruncate zero-filled the rest: no owner, no heartbeat, every slot
     * unassigned.  The magic goes last, so a header with the magic is
     * complete. */
    atomic_store_explicit(&head->magic, CS_BOARD_MAGIC, memory_order_release);
    *out = board;
    return CS_BOARD_OK;

error:
    if (status == CS_BOARD_ERR_SYSTEM) {
        *os_error = errno;
    }
    if (fd >= 0) {
        close(fd);
    }
    if (named) {
        (void)shm_unlink(board->name);
    }
    board_free(board);
    return status;
}

static bool
board_name_ok(const char *name)
{
    size_t len = strnlen(name, OPEN_NAME_MAX);
    if (len < 2 || len >= OPEN_NAME_MAX - 1 || name[0] != '/') {
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

cs_board_status
cs_board_open(const char *name, cs_board **out, int *os_error)
{
    cs_board_status status = CS_BOARD_ERR_SYSTEM;
    cs_board *board = NULL;
    void *base = MAP_FAILED;
    size_t length = 0;
    uint32_t slots = 0;
    int fd = -1;
    *out = NULL;
    *os_error = 0;
    if (name == NULL || !board_name_ok(name)) {
        return CS_BOARD_ERR_NAME;
    }
    /* No O_CREAT: the worker side never makes a segment. */
    fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) {
        goto error;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        goto error;
    }
    /* Refuse anything that cannot be a board before mapping it. */
    if (st.st_size < CS_BOARD_HEADER_SIZE + CS_BOARD_SLOT_SIZE ||
        st.st_size > CS_BOARD_HEADER_SIZE +
                         (off_t)CS_BOARD_MAX_SLOTS * CS_BOARD_SLOT_SIZE) {
        status = CS_BOARD_ERR_SIZE;
        goto error;
    }
    length = (size_t)st.st_size;
    base = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        goto error;
    }
    if (close(fd) != 0) {
        fd = -1;
        goto error;
    }
    fd = -1;
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
    if (board->samplers == NULL) {
        status = CS_BOARD_ERR_NOMEM;
        goto error;
    }
    board->host = false;
    board->base = base;
    base = MAP_FAILED; /* the handle owns the mapping now */
    board->length = length;
    memcpy(board->name, name, strlen(name) + 1);
    board_header *head = board_head(board);
    board->generation = atomic_load_explicit(&head->generation,
                                             memory_order_relaxed);
    /* Claim it: one worker per board, so a host's pid check means
     * something.  A worker that closed it (owner 0) may open it again. */
    uint64_t expected = 0;
    atomic_store_explicit(&head->heartbeat, board_now_ns(),
                          memory_order_relaxed);
    if (!atomic_compare_exchange_strong_explicit(
            &head->owner_pid, &expected, board->pid, memory_order_acq_rel,
            memory_order_acquire)) {
        status = CS_BOARD_ERR_OWNED;
        goto error;
    }
    *out = board;
    return CS_BOARD_OK;

error:
    if (status == CS_BOARD_ERR_SYSTEM) {
        *os_error = errno;
    }
    if (fd >= 0) {
        close(fd);
    }
    if (base != MAP_FAILED) {
        (void)munmap(base, length);
    }
    if (board != NULL) {
        board_free(board);
    }
    return status;
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

void
cs_board_close(cs_board *board)
{
    if (board == NULL) {
        return;
    }
    if (board->host) {
        int ignored;
        (void)cs_board_unlink(board, &ignored);
    }
    else {
        board_stop_sampler(board);
        /* Detach, but only if the board is still ours. */
        uint64_t expected = board->pid;
        atomic_compare_exchange_strong_explicit(
            &board_head(board)->owner_pid, &expected, 0,
            memory_order_acq_rel, memory_order_relaxed);
    }
    board_free(board);
}

cs_board_status
cs_board_unlink(cs_board *board, int *os_error)
{
    *os_error = 0;
    if (!board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    if (!atomic_exchange_explicit(&board->linked, false,
                                  memory_order_acq_rel)) {
        return CS_BOARD_OK;
    }
    board_forget_name(board->name);
    if (shm_unlink(board->name) != 0 && errno != ENOENT) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
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
}

int64_t
cs_board_expected_owner(const cs_board *board)
{
    return atomic_load_explicit(&board->expected_owner,
                                memory_order_acquire);
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

/* ---- host: slots ----------------------------------------------------- */

/* Writes a slot's identity under its seqlock, with no reading yet. */
static cs_board_status
slot_set_identity(board_slot *slot, uint64_t key, const uint64_t text[3],
                  uint64_t size)
{
    uint64_t seq;
    cs_board_status status = slot_write_begin(slot, &seq);
    if (status != CS_BOARD_OK) {
        return status;
    }
    atomic_store_explicit(&slot->key, key, memory_order_relaxed);
    for (int i = 0; i < 3; i++) {
        atomic_store_explicit(&slot->key_text[i], text[i],
                              memory_order_relaxed);
    }
    atomic_store_explicit(&slot->size, size, memory_order_relaxed);
    atomic_store_explicit(&slot->loaded, 0, memory_order_relaxed);
    atomic_store_explicit(&slot->updated, 0, memory_order_relaxed);
    slot_write_end(slot, seq);
    return CS_BOARD_OK;
}

static bool
host_slot_is(const host_slot *entry, uint64_t key, const char *id,
             size_t id_len)
{
    size_t n = id_len < CS_BOARD_KEY_TEXT_SIZE ? id_len
                                               : CS_BOARD_KEY_TEXT_SIZE;
    return atomic_load_explicit(&entry->key, memory_order_relaxed) == key &&
           entry->id_len == id_len &&
           memcmp(entry->text, id, n) == 0;
}

cs_board_status
cs_board_assign(cs_board *board, const char *id, size_t id_len,
                uint64_t size, uint32_t *slot)
{
    cs_board_status status = CS_BOARD_OK;
    if (!board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    if (size > CS_BOARD_VALUE_MAX) {
        return CS_BOARD_ERR_RANGE;
    }
    uint64_t key = board_key(id, id_len);
    uint64_t text[3];
    board_key_text(id, id_len, text);
    pthread_mutex_lock(&board->lock);
    uint32_t free_slot = UINT32_MAX;
    for (uint32_t i = 0; i < board->slots; i++) {
        host_slot *entry = &board->table[i];
        uint64_t have = atomic_load_explicit(&entry->key,
                                             memory_order_relaxed);
        if (have != 0 && host_slot_is(entry, key, id, id_len)) {
            if (atomic_load_explicit(&entry->size, memory_order_relaxed) !=
                size) {
                status = CS_BOARD_ERR_SIZE;
                goto done;
            }
            *slot = i;
            goto done;
        }
        if (have == 0 && free_slot == UINT32_MAX) {
            free_slot = i;
        }
    }
    if (free_slot == UINT32_MAX) {
        status = CS_BOARD_ERR_FULL;
        goto done;
    }
    status = slot_set_identity(board_slot_at(board, free_slot), key, text,
                               size);
    if (status != CS_BOARD_OK) {
        goto done;
    }
    host_slot *entry = &board->table[free_slot];
    atomic_store_explicit(&entry->size, size, memory_order_relaxed);
    entry->id_len = id_len;
    memcpy(entry->text, text, sizeof(entry->text));
    /* Readers take the key without the lock: publish it last. */
    atomic_store_explicit(&entry->key, key, memory_order_release);
    *slot = free_slot;
done:
    pthread_mutex_unlock(&board->lock);
    return status;
}

cs_board_status
cs_board_release(cs_board *board, uint32_t slot)
{
    static const uint64_t no_text[3] = {0, 0, 0};
    cs_board_status status = CS_BOARD_OK;
    if (!board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    if (slot >= board->slots) {
        return CS_BOARD_ERR_RANGE;
    }
    pthread_mutex_lock(&board->lock);
    atomic_store_explicit(&board->table[slot].key, 0, memory_order_release);
    atomic_store_explicit(&board->table[slot].size, 0, memory_order_relaxed);
    status = slot_set_identity(board_slot_at(board, slot), 0, no_text, 0);
    pthread_mutex_unlock(&board->lock);
    return status;
}

uint64_t
cs_board_assigned_size(const cs_board *board, uint32_t slot)
{
    if (!board->host || slot >= board->slots ||
        atomic_load_explicit(&board->table[slot].key,
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
    uint64_t key = board_key(id, id_len);
    uint64_t text[3];
    board_key_text(id, id_len, text);
    if (board->host) {
        /* The table's id text is written under the lock. */
        pthread_mutex_t *lock = (pthread_mutex_t *)&board->lock;
        cs_board_status status = CS_BOARD_ERR_RANGE;
        pthread_mutex_lock(lock);
        for (uint32_t i = 0; i < board->slots; i++) {
            if (host_slot_is(&board->table[i], key, id, id_len)) {
                *slot = i;
                status = CS_BOARD_OK;
                break;
            }
        }
        pthread_mutex_unlock(lock);
        return status;
    }
    for (uint32_t i = 0; i < board->slots; i++) {
        /* The worker trusts its host's assignments; the key text guards
         * against a hash collision between two ids. */
        board_slot *entry = board_slot_at(board, i);
        if (atomic_load_explicit(&entry->key, memory_order_acquire) != key) {
            continue;
        }
        bool same = true;
        for (int w = 0; w < 3; w++) {
            same = same && atomic_load_explicit(&entry->key_text[w],
                                                memory_order_relaxed) ==
                               text[w];
        }
        if (same) {
            *slot = i;
            return CS_BOARD_OK;
        }
    }
    return CS_BOARD_ERR_RANGE;
}

/* ---- host: reads ----------------------------------------------------- */

/* Whether the header still says what the host wrote and names a live
 * owner with a recent heartbeat. */
static cs_board_reading
board_check_owner(const cs_board *board, uint64_t now)
{
    const board_header *head = board_head(board);
    if (atomic_load_explicit(&head->magic, memory_order_relaxed) !=
            CS_BOARD_MAGIC ||
        atomic_load_explicit(&head->version, memory_order_relaxed) !=
            CS_BOARD_LAYOUT_VERSION ||
        atomic_load_explicit(&head->generation, memory_order_relaxed) !=
            board->generation) {
        return CS_BOARD_BAD_HEADER;
    }
    uint64_t owner = atomic_load_explicit(&head->owner_pid,
                                          memory_order_acquire);
    if (owner == 0) {
        return CS_BOARD_NOT_ATTACHED;
    }
    /* kill() with pid <= 0 addresses process groups: never pass one. */
    if (owner > (uint64_t)INT_MAX) {
        return CS_BOARD_BAD_HEADER;
    }
    int64_t expected = atomic_load_explicit(&board->expected_owner,
                                            memory_order_acquire);
    if (expected != 0 && (uint64_t)expected != owner) {
        return CS_BOARD_WRONG_OWNER;
    }
    /* EPERM means the pid exists (another user's): not proof of death.
     * An unreaped zombie still answers; the heartbeat limit covers it. */
    if (kill((pid_t)owner, 0) != 0 && errno == ESRCH) {
        return CS_BOARD_DEAD_OWNER;
    }
    uint64_t beat = atomic_load_explicit(&head->heartbeat,
                                         memory_order_relaxed);
    /* A beat written after the caller took `now` is legitimately a little
     * ahead; one far in the future is garbage. */
    if (beat == 0 || beat > now + CLOCK_SLACK_NS) {
        return CS_BOARD_STALE;
    }
    if (board->heartbeat_limit != 0 && beat < now &&
        now - beat > board->heartbeat_limit) {
        return CS_BOARD_STALE;
    }
    return CS_BOARD_VALID;
}

cs_board_reading
cs_board_read_slot_status(const cs_board *board, uint32_t slot,
                          uint64_t size, uint64_t *loaded,
                          uint64_t *updated_ns)
{
    if (board == NULL || !board->host || slot >= board->slots) {
        return CS_BOARD_UNASSIGNED;
    }
    uint64_t want_key = atomic_load_explicit(&board->table[slot].key,
                                             memory_order_acquire);
    if (want_key == 0) {
        return CS_BOARD_UNASSIGNED;
    }
    uint64_t now = board_now_ns();
    cs_board_reading reading = board_check_owner(board, now);
    if (reading != CS_BOARD_VALID) {
        return reading;
    }
    board_slot *entry = board_slot_at(board, slot);
    for (int attempt = 0; attempt < CS_BOARD_READ_RETRIES; attempt++) {
        uint64_t before = atomic_load_explicit(&entry->seq,
                                               memory_order_acquire);
        if (before & 1) {
            board_cpu_relax();
            continue;
        }
        uint64_t key = atomic_load_explicit(&entry->key,
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
        if (key != want_key) {
            return CS_BOARD_KEY_MISMATCH;
        }
        if (stamp == 0) {
            return CS_BOARD_NO_READING;
        }
        /* Untrusted values: the caller's size bounds the reading, and a
         * stamp from the future cannot claim to be newer than now. */
        *loaded = value < size ? value : size;
        *updated_ns = stamp < now ? stamp : now;
        return CS_BOARD_VALID;
    }
    return CS_BOARD_TORN;
}

bool
cs_board_read_slot(const cs_board *board, uint32_t slot, uint64_t size,
                   uint64_t *loaded, uint64_t *updated_ns)
{
    return cs_board_read_slot_status(board, slot, size, loaded,
                                     updated_ns) == CS_BOARD_VALID;
}

/* ---- worker: publishing ---------------------------------------------- */

cs_board_status
cs_board_heartbeat(cs_board *board)
{
    if (board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    atomic_store_explicit(&board_head(board)->heartbeat, board_now_ns(),
                          memory_order_relaxed);
    return CS_BOARD_OK;
}

cs_board_status
cs_board_publish_at(cs_board *board, uint32_t slot, uint64_t loaded,
                    uint64_t updated_ns)
{
    if (board->host) {
        return CS_BOARD_ERR_ROLE;
    }
    uint64_t now = board_now_ns();
    if (slot >= board->slots || loaded > CS_BOARD_VALUE_MAX ||
        updated_ns == 0 || updated_ns > now) {
        return CS_BOARD_ERR_RANGE;
    }
    board_slot *entry = board_slot_at(board, slot);
    uint64_t seq;
    cs_board_status status = slot_write_begin(entry, &seq);
    if (status != CS_BOARD_OK) {
        return status;
    }
    atomic_store_explicit(&entry->loaded, loaded, memory_order_relaxed);
    atomic_store_explicit(&entry->updated, updated_ns, memory_order_relaxed);
    slot_write_end(entry, seq);
    atomic_store_explicit(&board_head(board)->heartbeat, now,
                          memory_order_relaxed);
    return CS_BOARD_OK;
}

cs_board_status
cs_board_publish(cs_board *board, uint32_t slot, uint64_t loaded)
{
    if (board->host) {
        return CS_BOARD_ERR_ROLE;
    }
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
    if (board->host) {
        return CS_BOARD_ERR_ROLE;
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
    if (board->host) {
        return CS_BOARD_ERR_ROLE;
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

#else /* _WIN32 */

/* A Windows board (CreateFileMapping on a named section) may come later;
 * until then every entry point says so and reads are never valid. */

struct cs_board {
    int unused;
};

cs_board_status
cs_board_create(uint32_t slots, uint64_t generation,
                uint64_t heartbeat_limit_ns, cs_board **out, int *os_error)
{
    (void)slots;
    (void)generation;
    (void)heartbeat_limit_ns;
    *out = NULL;
    *os_error = 0;
    return CS_BOARD_ERR_UNSUPPORTED;
}

cs_board_status
cs_board_open(const char *name, cs_board **out, int *os_error)
{
    (void)name;
    *out = NULL;
    *os_error = 0;
    return CS_BOARD_ERR_UNSUPPORTED;
}

void
cs_board_close(cs_board *board)
{
    (void)board;
}

cs_board_reading
cs_board_read_slot_status(const cs_board *board, uint32_t slot,
                          uint64_t size, uint64_t *loaded,
                          uint64_t *updated_ns)
{
    (void)board;
    (void)slot;
    (void)size;
    (void)loaded;
    (void)updated_ns;
    return CS_BOARD_NOT_ATTACHED;
}

bool
cs_board_read_slot(const cs_board *board, uint32_t slot, uint64_t size,
                   uint64_t *loaded, uint64_t *updated_ns)
{
    return cs_board_read_slot_status(board, slot, size, loaded,
                                     updated_ns) == CS_BOARD_VALID;
}

/* No handle can exist here (create and open fail), so the accessors below
 * are never reached with one; they exist so the binding links. */

const char *
cs_board_name(const cs_board *board)
{
    (void)board;
    return "";
}

bool
cs_board_is_host(const cs_board *board)
{
    (void)board;
    return false;
}

uint32_t
cs_board_slot_count(const cs_board *board)
{
    (void)board;
    return 0;
}

uint64_t
cs_board_generation(const cs_board *board)
{
    (void)board;
    return 0;
}

int64_t
cs_board_owner_pid(const cs_board *board)
{
    (void)board;
    return 0;
}

cs_board_status
cs_board_find(const cs_board *board, const char *id, size_t id_len,
              uint32_t *slot)
{
    (void)board;
    (void)id;
    (void)id_len;
    (void)slot;
    return CS_BOARD_ERR_UNSUPPORTED;
}

void *
cs_board_memory(const cs_board *board, size_t *length)
{
    (void)board;
    if (length != NULL) {
        *length = 0;
    }
    return NULL;
}

cs_board_status
cs_board_assign(cs_board *board, const char *id, size_t id_len,
                uint64_t size, uint32_t *slot)
{
    (void)board;
    (void)id;
    (void)id_len;
    (void)size;
    (void)slot;
    return CS_BOARD_ERR_UNSUPPORTED;
}

cs_board_status
cs_board_release(cs_board *board, uint32_t slot)
{
    (void)board;
    (void)slot;
    return CS_BOARD_ERR_UNSUPPORTED;
}

uint64_t
cs_board_assigned_size(const cs_board *board, uint32_t slot)
{
    (void)board;
    (void)slot;
    return 0;
}

cs_board_status
cs_board_unlink(cs_board *board, int *os_error)
{
    (void)board;
    *os_error = 0;
    return CS_BOARD_ERR_UNSUPPORTED;
}

bool
cs_board_linked(const cs_board *board)
{
    (void)board;
    return false;
}

bool
cs_board_attached(const cs_board *board)
{
    (void)board;
    return false;
}

void
cs_board_expect_owner(cs_board *board, int64_t pid)
{
    (void)board;
    (void)pid;
}

int64_t
cs_board_expected_owner(const cs_board *board)
{
    (void)board;
    return 0;
}

uint64_t
cs_board_heartbeat_limit(const cs_board *board)
{
    (void)board;
    return 0;
}

cs_board_status
cs_board_publish(cs_board *board, uint32_t slot, uint64_t loaded)
{
    (void)board;
    (void)slot;
    (void)loaded;
    return CS_BOARD_ERR_UNSUPPORTED;
}

cs_board_status
cs_board_publish_at(cs_board *board, uint32_t slot, uint64_t loaded,
                    uint64_t updated_ns)
{
    (void)board;
    (void)slot;
    (void)loaded;
    (void)updated_ns;
    return CS_BOARD_ERR_UNSUPPORTED;
}

cs_board_status
cs_board_heartbeat(cs_board *board)
{
    (void)board;
    return CS_BOARD_ERR_UNSUPPORTED;
}

cs_board_status
cs_board_add_sampler(cs_board *board, uint32_t slot, cs_board_sampler_fn fn,
                     void *context, int *os_error)
{
    (void)board;
    (void)slot;
    (void)fn;
    (void)context;
    *os_error = 0;
    return CS_BOARD_ERR_UNSUPPORTED;
}

cs_board_status
cs_board_remove_sampler(cs_board *board, uint32_t slot)
{
    (void)board;
    (void)slot;
    return CS_BOARD_ERR_UNSUPPORTED;
}

cs_board_status
cs_board_set_period(cs_board *board, uint64_t period_ns)
{
    (void)board;
    (void)period_ns;
    return CS_BOARD_ERR_UNSUPPORTED;
}

uint64_t
cs_board_period(const cs_board *board)
{
    (void)board;
    return 0;
}

uint64_t
cs_board_sampler_passes(const cs_board *board)
{
    (void)board;
    return 0;
}

#endif /* _WIN32 */
