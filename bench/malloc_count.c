/* malloc_count: an LD_PRELOAD shim that counts the live heap bytes of a process and their peak,
 * the way memtrain's CountingAllocator (src/memory/cpu.rs) counts them, so that a process that is
 * not memtrain (PyTorch under Python) can be measured on the same scale.
 *
 *   gcc -O2 -shared -fPIC -o libmalloc_count.so bench/malloc_count.c   (-ldl not needed)
 *   LD_PRELOAD=$PWD/libmalloc_count.so python3 ...
 *
 * What is counted: the bytes the caller asked for (malloc's size, calloc's n*size, realloc's new
 * size, the size argument of the aligned allocators), not what glibc hands out (chunk rounding,
 * alignment padding, pvalloc's page rounding), exactly as memtrain counts Layout::size(). A
 * realloc counts as "allocate the new size, then free the old one", so the peak sees both blocks,
 * as memtrain's realloc does. Memory that never goes through malloc (mmap by a library, thread
 * stacks, Python's small-object arenas) is not heap in this sense on either side.
 *
 * How: every call is forwarded to glibc's own entry points (__libc_malloc and friends, exported
 * by glibc for exactly this purpose), so there is no dlsym bootstrap and no recursion. The
 * requested size of each live block is kept in a side table keyed by the pointer (256 sharded
 * open-addressing hash tables in mmap'd memory, one spin lock per shard), not in a header in front
 * of the block: blocks keep glibc's layout, malloc_usable_size keeps working, and freeing a pointer
 * the shim never handed out (allocated before it was loaded, or by glibc-internal paths) is
 * forwarded and counted as nothing instead of reading a bogus header. The entry of a block is
 * removed before the block goes back to glibc, so another thread cannot get the same address and
 * register it first.
 *
 * Counters (all threads together, atomics) for ctypes, e.g. ctypes.CDLL(None).mc_peak():
 *   mc_current()     live requested bytes now
 *   mc_peak()        highest mc_current() since the start or the last mc_reset_peak()
 *   mc_reset_peak()  set the peak to the current value
 *   mc_peak_total()  highest mc_current() since the start (never reset)
 *   mc_allocs()      allocations counted so far
 *   mc_unknown_frees()  frees/reallocs of pointers the shim did not hand out (forwarded, uncounted)
 * With MC_REPORT=FILE in the environment, "total_peak_bytes current_bytes allocs unknown_frees" is
 * written to FILE when the process exits normally (whole-process peak, for a process such as
 * memtrain that cannot call the functions itself).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void *__libc_valloc(size_t);
extern void *__libc_pvalloc(size_t);

#define EXPORT __attribute__((visibility("default")))

/* ---- counters ------------------------------------------------------------------------------- */

static int64_t current_bytes, peak_bytes, total_peak_bytes;
static uint64_t n_allocs, n_unknown_frees;

static inline void atomic_max(int64_t *m, int64_t v) {
  int64_t p = __atomic_load_n(m, __ATOMIC_RELAXED);
  while (v > p && !__atomic_compare_exchange_n(m, &p, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

static inline void count_add(size_t n) {
  int64_t now = __atomic_add_fetch(&current_bytes, (int64_t)n, __ATOMIC_RELAXED);
  atomic_max(&peak_bytes, now);
  atomic_max(&total_peak_bytes, now);
  __atomic_add_fetch(&n_allocs, 1, __ATOMIC_RELAXED);
}

static inline void count_sub(size_t n) {
  __atomic_sub_fetch(&current_bytes, (int64_t)n, __ATOMIC_RELAXED);
}

EXPORT int64_t mc_current(void) { return __atomic_load_n(&current_bytes, __ATOMIC_RELAXED); }
EXPORT int64_t mc_peak(void) { return __atomic_load_n(&peak_bytes, __ATOMIC_RELAXED); }
EXPORT void mc_reset_peak(void) {
  __atomic_store_n(&peak_bytes, __atomic_load_n(&current_bytes, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
}
EXPORT int64_t mc_peak_total(void) { return __atomic_load_n(&total_peak_bytes, __ATOMIC_RELAXED); }
EXPORT uint64_t mc_allocs(void) { return __atomic_load_n(&n_allocs, __ATOMIC_RELAXED); }
EXPORT uint64_t mc_unknown_frees(void) { return __atomic_load_n(&n_unknown_frees, __ATOMIC_RELAXED); }

/* ---- pointer -> requested size table -------------------------------------------------------- */

#define NSHARDS 256u
#define INIT_CAP 1024u /* entries per shard at first use; doubles at half full */

typedef struct {
  uintptr_t key; /* 0: empty */
  size_t size;
} entry_t;

typedef struct {
  int lock;
  size_t cap, count; /* cap: power of two */
  entry_t *slots;
  char pad[64 - sizeof(int) - 2 * sizeof(size_t) - sizeof(entry_t *)];
} shard_t;

static shard_t shards[NSHARDS] __attribute__((aligned(64)));

static inline uint64_t hash_ptr(uintptr_t p) {
  uint64_t h = (uint64_t)p * 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 29);
}

static inline void lock_shard(shard_t *s) {
  unsigned spins = 0;
  while (__atomic_exchange_n(&s->lock, 1, __ATOMIC_ACQUIRE)) {
    while (__atomic_load_n(&s->lock, __ATOMIC_RELAXED)) {
      if (++spins > 64) {
        sched_yield();
        spins = 0;
      }
    }
  }
}

static inline void unlock_shard(shard_t *s) { __atomic_store_n(&s->lock, 0, __ATOMIC_RELEASE); }

static entry_t *map_slots(size_t cap) {
  void *m = mmap(NULL, cap * sizeof(entry_t), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return m == MAP_FAILED ? NULL : (entry_t *)m;
}

/* Slot index within a shard: hash bits above the 8 that picked the shard. */
static inline size_t slot_of(uint64_t h, size_t cap) { return (size_t)(h >> 8) & (cap - 1); }

static void raw_insert(entry_t *slots, size_t cap, uintptr_t key, size_t size) {
  size_t i = slot_of(hash_ptr(key), cap);
  while (slots[i].key != 0 && slots[i].key != key) i = (i + 1) & (cap - 1);
  slots[i].key = key;
  slots[i].size = size;
}

/* Returns 0 when the table could not grow (out of memory): the block is then left uncounted. */
static int grow(shard_t *s) {
  size_t ncap = s->cap ? s->cap * 2 : INIT_CAP;
  entry_t *n = map_slots(ncap);
  if (!n) return 0;
  for (size_t i = 0; i < s->cap; i++)
    if (s->slots[i].key) raw_insert(n, ncap, s->slots[i].key, s->slots[i].size);
  if (s->slots) munmap(s->slots, s->cap * sizeof(entry_t));
  s->slots = n;
  s->cap = ncap;
  return 1;
}

/* Register a block the shim handed out and count it. */
static void track(void *p, size_t size) {
  uintptr_t key = (uintptr_t)p;
  uint64_t h = hash_ptr(key);
  shard_t *s = &shards[h & (NSHARDS - 1)];
  lock_shard(s);
  if ((s->count + 1) * 2 > s->cap && !grow(s)) {
    unlock_shard(s);
    return;
  }
  size_t i = slot_of(h, s->cap);
  while (s->slots[i].key != 0 && s->slots[i].key != key) i = (i + 1) & (s->cap - 1);
  if (s->slots[i].key == key) {
    /* Cannot happen unless a block was freed behind the shim's back: replace the stale entry. */
    count_sub(s->slots[i].size);
  } else {
    s->count++;
  }
  s->slots[i].key = key;
  s->slots[i].size = size;
  unlock_shard(s);
  count_add(size);
}

/* Unregister a block that is about to go back to glibc and uncount it. Returns 0 for a pointer
 * the shim does not know. */
static int untrack(void *p, size_t *size_out) {
  uintptr_t key = (uintptr_t)p;
  uint64_t h = hash_ptr(key);
  shard_t *s = &shards[h & (NSHARDS - 1)];
  lock_shard(s);
  if (s->cap == 0) {
    unlock_shard(s);
    __atomic_add_fetch(&n_unknown_frees, 1, __ATOMIC_RELAXED);
    return 0;
  }
  size_t mask = s->cap - 1, i = slot_of(h, s->cap);
  while (s->slots[i].key != 0 && s->slots[i].key != key) i = (i + 1) & mask;
  if (s->slots[i].key == 0) {
    unlock_shard(s);
    __atomic_add_fetch(&n_unknown_frees, 1, __ATOMIC_RELAXED);
    return 0;
  }
  size_t size = s->slots[i].size;
  /* Backward-shift deletion keeps every probe chain intact without tombstones. */
  size_t j = i;
  for (;;) {
    j = (j + 1) & mask;
    if (s->slots[j].key == 0) break;
    size_t home = slot_of(hash_ptr(s->slots[j].key), s->cap);
    /* Move slot j into the hole i when its home is not cyclically within (i, j]. */
    if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
      s->slots[i] = s->slots[j];
      i = j;
    }
  }
  s->slots[i].key = 0;
  s->slots[i].size = 0;
  s->count--;
  unlock_shard(s);
  count_sub(size);
  if (size_out) *size_out = size;
  return 1;
}

/* A fork while another thread holds a shard lock would leave the child's lock held forever: hold
 * them all across fork (a thread never waits for a second lock while holding one, so taking them
 * in order cannot deadlock). */
static void lock_all(void) {
  for (unsigned i = 0; i < NSHARDS; i++) lock_shard(&shards[i]);
}
static void unlock_all(void) {
  for (unsigned i = NSHARDS; i-- > 0;) unlock_shard(&shards[i]);
}
__attribute__((constructor)) static void mc_init(void) { pthread_atfork(lock_all, unlock_all, unlock_all); }

/* ---- the allocator entry points ------------------------------------------------------------- */

EXPORT void *malloc(size_t size) {
  void *p = __libc_malloc(size);
  if (p) track(p, size);
  return p;
}

EXPORT void free(void *p) {
  if (!p) return;
  untrack(p, NULL);
  __libc_free(p);
}

EXPORT void *calloc(size_t n, size_t size) {
  void *p = __libc_calloc(n, size);
  if (p) track(p, n * size); /* glibc already refused an overflowing product */
  return p;
}

EXPORT void *realloc(void *old, size_t size) {
  if (!old) return malloc(size);
  size_t old_size = 0;
  int known = untrack(old, &old_size);
  /* untrack already subtracted old_size; add it back so the peak can see old + new together. */
  if (known) __atomic_add_fetch(&current_bytes, (int64_t)old_size, __ATOMIC_RELAXED);
  void *p = __libc_realloc(old, size);
  if (p) {
    track(p, size); /* alloc new (peak sees both blocks) ... */
    if (known) count_sub(old_size); /* ... then free old */
  } else if (size == 0) {
    /* glibc freed the block and returned NULL. */
    if (known) count_sub(old_size);
  } else if (known) {
    /* Failed: the old block is still live; register it again (its bytes are still counted). */
    count_sub(old_size);
    track(old, old_size);
    __atomic_sub_fetch(&n_allocs, 1, __ATOMIC_RELAXED);
  }
  return p;
}

EXPORT void *reallocarray(void *old, size_t n, size_t size) {
  size_t bytes;
  if (__builtin_mul_overflow(n, size, &bytes)) {
    errno = ENOMEM;
    return NULL;
  }
  return realloc(old, bytes);
}

EXPORT void *memalign(size_t align, size_t size) {
  void *p = __libc_memalign(align, size);
  if (p) track(p, size);
  return p;
}

EXPORT void *aligned_alloc(size_t align, size_t size) { return memalign(align, size); }

EXPORT int posix_memalign(void **out, size_t align, size_t size) {
  if (align % sizeof(void *) != 0 || (align & (align - 1)) != 0 || align == 0) return EINVAL;
  int saved = errno;
  void *p = __libc_memalign(align, size);
  if (!p) {
    errno = saved;
    return ENOMEM;
  }
  errno = saved;
  track(p, size);
  *out = p;
  return 0;
}

EXPORT void *valloc(size_t size) {
  void *p = __libc_valloc(size);
  if (p) track(p, size);
  return p;
}

EXPORT void *pvalloc(size_t size) {
  void *p = __libc_pvalloc(size);
  if (p) track(p, size);
  return p;
}

/* ---- whole-process report at exit ----------------------------------------------------------- */

static char *fmt_u64(char *end, uint64_t v) { /* writes backwards, returns the first digit */
  do {
    *--end = (char)('0' + v % 10);
    v /= 10;
  } while (v);
  return end;
}

__attribute__((destructor)) static void mc_report(void) {
  const char *path = getenv("MC_REPORT");
  if (!path || !*path) return;
  uint64_t vals[4] = {(uint64_t)mc_peak_total(), (uint64_t)(mc_current() < 0 ? 0 : mc_current()),
                      mc_allocs(), mc_unknown_frees()};
  char buf[128], *w = buf;
  for (int k = 0; k < 4; k++) {
    char tmp[24], *d = fmt_u64(tmp + sizeof tmp, vals[k]);
    size_t len = (size_t)(tmp + sizeof tmp - d);
    memcpy(w, d, len);
    w += len;
    *w++ = k == 3 ? '\n' : ' ';
  }
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  ssize_t r = write(fd, buf, (size_t)(w - buf));
  (void)r;
  close(fd);
}
