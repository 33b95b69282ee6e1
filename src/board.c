/*
 * board.c -- the live residency board's segment and handles: create (host),
 * make (worker) and adopt (host), open (worker), close and unlink, the fork
 * epoch, and the accessors (include/comfy_standin/board.h, docs/board.md;
 * src/board_internal.h says how the board's files divide the work).
 */
#include "board_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/random.h>
#endif

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

/* ---- fork: which process a handle belongs to ------------------------- */

/* Bumped in every fork() child (pthread_atfork; os.fork() runs the
 * handlers).  A handle made under another value was made by an ancestor:
 * comparing one atomic load is the read path's whole fork check, where
 * getpid() would be a system call per read. */
_Atomic uint64_t board_fork_epoch;
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
    atomic_fetch_add_explicit(&board_fork_epoch, 1, memory_order_relaxed);
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

bool
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
    if (pthread_mutex_init(&board->owner_lock, NULL) != 0) {
        pthread_mutex_destroy(&board->lock);
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
        pthread_mutex_destroy(&board->owner_lock);
        pthread_mutex_destroy(&board->lock);
        free(board);
        return NULL;
    }
    pthread_condattr_destroy(&attr);
    board->slots = slots;
    board->pid = (uint64_t)getpid();
    board->epoch = atomic_load_explicit(&board_fork_epoch,
                                        memory_order_relaxed);
    board->next_tag = 1;
    atomic_init(&board->fd, -1);
    board->owner_pidfd = -1;
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
        pthread_mutex_destroy(&board->owner_lock);
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

/* A worker handle of `slots` slots: no mapping yet, nothing bound. */
static cs_board *
board_alloc_worker(uint32_t slots)
{
    cs_board *board = board_alloc(slots);
    if (board == NULL) {
        return NULL;
    }
    board->samplers = calloc(slots, sizeof(sampler));
    board->bound = calloc(slots, sizeof(_Atomic uint64_t));
    if (board->samplers == NULL || board->bound == NULL) {
        board_free(board, true);
        return NULL;
    }
    for (uint32_t i = 0; i < slots; i++) {
        atomic_init(&board->bound[i], 0);
    }
    board->host = false;
    return board;
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
/* Linux 5.1: no new writable mapping and no write() for anyone, while the
 * mappings made before the seal keep working (the worker's own). */
#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif
/* What a host-created board carries (cs_board_create). */
#define BOARD_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
/* What a worker-made board carries, and what cs_board_adopt requires. */
#define BOARD_MADE_SEALS (BOARD_SEALS | F_SEAL_FUTURE_WRITE)

/* An anonymous memfd of the board's length, not yet sealed.  Returns the
 * descriptor or -1 (errno; *status SEALS when the kernel has no sealable
 * memfds). */
static int
board_new_memfd(cs_board *board, cs_board_status *status)
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
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

/* Adds `seals` to `fd` and checks they hold; false (errno) if not. */
static bool
board_seal(int fd, int seals)
{
    if (fcntl(fd, F_ADD_SEALS, seals) != 0) {
        return false;
    }
    int have = fcntl(fd, F_GET_SEALS);
    return have >= 0 && (have & seals) == seals;
}
#endif

/* The host's new segment for `board` (its length set): a memfd sealed
 * against resizing before anyone else can have it, or elsewhere a named
 * segment.  Returns the descriptor, or -1 with *status (and errno). */
static int
board_host_segment(cs_board *board, cs_board_status *status)
{
    *status = CS_BOARD_ERR_SYSTEM;
#if BOARD_MEMFD
    int fd = board_new_memfd(board, status);
    if (fd >= 0 && !board_seal(fd, BOARD_SEALS)) {
        int saved = errno;
        close(fd);
        errno = saved;
        *status = CS_BOARD_ERR_SEALS;
        return -1;
    }
    return fd;
#else
    /* The name path: 96 random bits, and O_EXCL turns the rare collision
     * (or a squatter) into a retry rather than a shared segment.  A
     * worker holding a descriptor of a named segment can ftruncate it
     * (no seals here), and a host read of the lost pages would raise
     * SIGBUS: the price of the only shared memory these systems have. */
    int fd = -1;
    for (int attempt = 0; attempt < 16 && fd < 0; attempt++) {
        if (board_random_name(board->name, "/csb") != 0) {
            return -1;
        }
        fd = shm_open(board->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC,
                      S_IRUSR | S_IWUSR);
        if (fd < 0 && errno != EEXIST) {
            return -1;
        }
    }
    if (fd < 0) {
        return -1;
    }
    *status = board_remember_name(board->name);
    if (*status != CS_BOARD_OK) {
        (void)shm_unlink(board->name);
        close(fd);
        return -1;
    }
    *status = CS_BOARD_ERR_SYSTEM;
    atomic_store_explicit(&board->linked, true, memory_order_relaxed);
    if (fchmod(fd, S_IRUSR | S_IWUSR) != 0 ||
        ftruncate(fd, (off_t)board->length) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
#endif
}

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
    fd = board_host_segment(board, &status);
    if (fd < 0) {
        goto error;
    }
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

#if BOARD_MEMFD
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
    else if (board_random_name(name, "memfd:csb-") != 0) {
        memcpy(name, "memfd:csb", sizeof("memfd:csb"));
    }
}
#endif

cs_board_status
cs_board_make(uint32_t slots, uint64_t generation, cs_board **out,
              int *fd_out, int *os_error)
{
    *out = NULL;
    *fd_out = -1;
    *os_error = 0;
#if BOARD_MEMFD
    if (slots == 0 || slots > CS_BOARD_MAX_SLOTS) {
        return CS_BOARD_ERR_RANGE;
    }
    if (!board_handlers()) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    cs_board *board = board_alloc_worker(slots);
    if (board == NULL) {
        return CS_BOARD_ERR_NOMEM;
    }
    board->generation = generation;
    board->length = CS_BOARD_HEADER_SIZE + (size_t)slots * CS_BOARD_SLOT_SIZE;
    cs_board_status status = CS_BOARD_ERR_SYSTEM;
    int fd = board_new_memfd(board, &status);
    if (fd < 0) {
        goto error;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        goto error;
    }
    board->fd_dev = st.st_dev;
    board->fd_ino = st.st_ino;
    /* This process's writable mapping first: the write seal below leaves
     * mappings made before it working and refuses every later one. */
    void *base = mmap(NULL, board->length, PROT_READ | PROT_WRITE,
                      MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        goto error;
    }
    board->base = base;
    if (!board_seal(fd, BOARD_MADE_SEALS)) {
        status = CS_BOARD_ERR_SEALS; /* e.g. a kernel before Linux 5.1 */
        goto error;
    }
    board_write_header(board);
    board_header *head = board_head(board);
    atomic_store_explicit(&head->owner_pid, board->pid, memory_order_release);
    atomic_store_explicit(&head->heartbeat, board_now_ns(),
                          memory_order_release);
    *out = board;
    *fd_out = fd;
    return CS_BOARD_OK;

error:
    if (status == CS_BOARD_ERR_SYSTEM || status == CS_BOARD_ERR_SEALS) {
        *os_error = errno;
    }
    if (fd >= 0) {
        close(fd);
    }
    board_free(board, true);
    return status;
#else
    (void)slots;
    (void)generation;
    return CS_BOARD_ERR_UNSUPPORTED;
#endif
}

cs_board_status
cs_board_adopt(int fd, uint32_t slots, uint64_t generation,
               uint64_t heartbeat_limit_ns, cs_board **out, int *os_error)
{
    *out = NULL;
    *os_error = 0;
#if BOARD_MEMFD
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
    if (seals < 0 || (seals & BOARD_MADE_SEALS) != BOARD_MADE_SEALS) {
        return CS_BOARD_ERR_SEALS;
    }
    /* Read-only: the host never writes a board, and now cannot. */
    void *base = mmap(NULL, length, PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        *os_error = errno;
        return CS_BOARD_ERR_SYSTEM;
    }
    uint32_t found = 0;
    cs_board_status status = board_validate(base, length, &found);
    if (status == CS_BOARD_OK && found != slots) {
        status = CS_BOARD_ERR_SIZE;
    }
    cs_board *board = NULL;
    if (status == CS_BOARD_OK) {
        board = board_alloc(slots);
        status = board == NULL ? CS_BOARD_ERR_NOMEM : CS_BOARD_OK;
    }
    if (status == CS_BOARD_OK) {
        board->table = calloc(slots, sizeof(host_slot));
        if (board->table == NULL) {
            board_free(board, true);
            status = CS_BOARD_ERR_NOMEM;
        }
    }
    if (status != CS_BOARD_OK) {
        (void)munmap(base, length);
        return status;
    }
    board->host = true;
    board->generation = generation;
    board->heartbeat_limit = heartbeat_limit_ns;
    board->clock_tick = board_read_clock_tick();
    board->length = length;
    board->base = base;
    board->fd_dev = st.st_dev;
    board->fd_ino = st.st_ino;
    board_adopted_label(fd, board->name);
    *out = board;
    return CS_BOARD_OK;
#else
    (void)fd;
    (void)slots;
    (void)generation;
    (void)heartbeat_limit_ns;
    return CS_BOARD_ERR_UNSUPPORTED;
#endif
}

int
cs_board_layout_version(void)
{
    return CS_BOARD_LAYOUT_VERSION;
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
    board = board_alloc_worker(slots);
    if (board == NULL) {
        status = CS_BOARD_ERR_NOMEM;
        goto error;
    }
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
        pthread_mutex_lock(&board->owner_lock);
        int pidfd = board->owner_pidfd;
        board->owner_pidfd = -1;
        pthread_mutex_unlock(&board->owner_lock);
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

