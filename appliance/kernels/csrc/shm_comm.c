/* Collectives between the ranks of one host over a shared-memory segment
 * (``kernels/shm_comm.py``): all-reduce (sum) and all-gather.
 *
 * Segment: one 64-byte flag line per rank (the sequence number of the last
 * operation whose input that rank has published), then two sets of slots
 * (one per parity of the sequence number), one slot of ``cap`` bytes per
 * rank in each. An operation s copies this rank's input into its slot of
 * parity s & 1, publishes s (release), waits until every rank has
 * published s (acquire), then reads every rank's slot. Two parities need no
 * second barrier: a rank writes parity p again at s + 2 only after every
 * rank published s + 1, which each does after it finished reading s.
 *
 * Every rank sums the slots in rank order, so all ranks get the same bits.
 * Inputs longer than a slot go through in slot-sized chunks (an operation
 * each). A wait spins briefly, then yields the core (ranks may share
 * cores), and gives up after ``timeout_ns`` (returns -1: a rank is gone).
 * Portable C11 atomics; no ISA flags needed.
 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define LINE 64
#define SPINS 4096

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline uint64_t *flag_of(char *base, int r) { return (uint64_t *)(base + (int64_t)r * LINE); }

static inline char *slot_of(char *base, int world, int64_t cap, uint64_t s, int r) {
    return base + (int64_t)world * LINE + ((int64_t)(s & 1) * world + r) * cap;
}

/* Publish s for ``rank``, then wait for every rank's s; 0, or -1 past the deadline. */
static int publish_and_wait(char *base, int rank, int world, uint64_t s, int64_t timeout_ns) {
    __atomic_store_n(flag_of(base, rank), s, __ATOMIC_RELEASE);
    int64_t deadline = 0;
    for (int r = 0; r < world; r++) {
        uint64_t *f = flag_of(base, r);
        for (int64_t i = 0; __atomic_load_n(f, __ATOMIC_ACQUIRE) < s; i++) {
            if (i < SPINS) {
                cpu_relax();
                continue;
            }
            sched_yield();
            if ((i & 255) == 0) {
                int64_t t = now_ns();
                if (!deadline) deadline = t + timeout_ns;
                else if (t > deadline) return -1;
            }
        }
    }
    return 0;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* Sum ``data`` [n elements of dtype] over the ranks, in place. ``seq``: this
 * rank's operation counter (every rank calls the collectives in one order). */
int appl_shm_all_reduce(void *segment, int rank, int world, int64_t cap, uint64_t *seq, void *data, int64_t n,
                        int dtype, int64_t timeout_ns) {
    char *base = (char *)segment;
    int64_t elem = dtype == DT_F32 ? 4 : 2;
    int64_t per = cap / elem;
    for (int64_t off = 0; off < n; off += per) {
        int64_t m = n - off < per ? n - off : per;
        uint64_t s = ++*seq;
        memcpy(slot_of(base, world, cap, s, rank), (char *)data + off * elem, (size_t)(m * elem));
        if (publish_and_wait(base, rank, world, s, timeout_ns)) return -1;
        if (dtype == DT_F32) {
            float *out = (float *)data + off;
            const float *first = (const float *)slot_of(base, world, cap, s, 0);
            for (int64_t i = 0; i < m; i++) out[i] = first[i];
            for (int r = 1; r < world; r++) {
                const float *x = (const float *)slot_of(base, world, cap, s, r);
                for (int64_t i = 0; i < m; i++) out[i] += x[i];
            }
        } else {
            uint16_t *out = (uint16_t *)data + off;
            for (int64_t i = 0; i < m; i++) {
                float acc = 0.0f;
                for (int r = 0; r < world; r++) acc += bf16_to_f32(((const uint16_t *)slot_of(base, world, cap, s, r))[i]);
                out[i] = f32_to_bf16(acc);
            }
        }
    }
    return 0;
}

/* Every rank's ``nbytes`` of ``data`` into ``out`` [world, nbytes], in rank order. */
int appl_shm_all_gather(void *segment, int rank, int world, int64_t cap, uint64_t *seq, const void *data,
                        int64_t nbytes, void *out, int64_t timeout_ns) {
    char *base = (char *)segment;
    for (int64_t off = 0; off < nbytes; off += cap) {
        int64_t m = nbytes - off < cap ? nbytes - off : cap;
        uint64_t s = ++*seq;
        memcpy(slot_of(base, world, cap, s, rank), (const char *)data + off, (size_t)m);
        if (publish_and_wait(base, rank, world, s, timeout_ns)) return -1;
        for (int r = 0; r < world; r++)
            memcpy((char *)out + (int64_t)r * nbytes + off, slot_of(base, world, cap, s, r), (size_t)m);
    }
    return 0;
}

/* ``src``'s ``nbytes`` of ``data`` into every other rank's ``data``. */
int appl_shm_broadcast(void *segment, int rank, int world, int64_t cap, uint64_t *seq, void *data, int64_t nbytes,
                       int src, int64_t timeout_ns) {
    char *base = (char *)segment;
    for (int64_t off = 0; off < nbytes; off += cap) {
        int64_t m = nbytes - off < cap ? nbytes - off : cap;
        uint64_t s = ++*seq;
        if (rank == src) memcpy(slot_of(base, world, cap, s, rank), (const char *)data + off, (size_t)m);
        if (publish_and_wait(base, rank, world, s, timeout_ns)) return -1;
        if (rank != src) memcpy((char *)data + off, slot_of(base, world, cap, s, src), (size_t)m);
    }
    return 0;
}

/* One rank's collectives as a context, for a caller in C (the native forward of a tensor-parallel rank): the
 * same segment and operation counter as the rank's Python collectives, so both kinds run in one order. */
typedef struct {
    void *segment;
    int32_t rank, world;
    int64_t cap, timeout_ns;
    uint64_t *seq;
} ShmReduceCtx;

/* An fp32 all-reduce through a ShmReduceCtx (cpu_ops.c's ReduceFn). */
int appl_shm_reduce_f32(void *ctx, float *data, int64_t n) {
    const ShmReduceCtx *c = (const ShmReduceCtx *)ctx;
    return appl_shm_all_reduce(c->segment, c->rank, c->world, c->cap, c->seq, data, n, DT_F32, c->timeout_ns);
}
