/* Whole-graph execution: a run of ops in one call (ea_run_ops), each op's rows split across
 * a small pool of worker threads owned by the library.
 *
 * Why in C: walking MobileNet's ~60 ops from Python costs ~15-25 us of interpreter and ctypes
 * work per op, which is a fifth of the whole backbone at a fine-tuning batch; and a Python
 * thread pool adds a future and a wake-up per op and part.
 *
 * Pool design, chosen for a shared 2-4 core device rather than an idle benchmark box:
 *  - an op is cut into a few chunks of rows (about two per thread) that the caller and the
 *    workers claim from an atomic counter: a thread that is descheduled (another process
 *    holds its core) simply claims fewer, so a run is never held up by more than the chunk
 *    that thread is in, and at worst runs at the single-thread speed -- a static split would
 *    wait for the slowest thread at every one of MobileNet's ~60 ops;
 *  - one mailbox per worker: the caller posts an op only to a worker that has finished its
 *    last one (a late worker is left out of this op), so it never rewrites a job in use;
 *  - a worker spins on its mailbox for a short while (ops follow each other within
 *    microseconds inside a run), yielding the core while it spins, then sleeps on a condition
 *    variable: when the threads share one core, spinning must not starve the thread that
 *    holds the work (XNNPACK's pool was measured at 30x slower in that situation);
 *  - one run at a time uses the pool; a concurrent caller runs its ops on its own thread.
 * Each chunk calls the same public entry points as single-op callers do, on a row range, so
 * threading cannot change a result: every output element is computed by exactly one chunk.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define EA_MAX_THREADS 16
#define SPIN_NS 200000 /* a worker spins this long for the next op before sleeping */

/* The chunks of one op in one run, claimed by whichever thread gets there first. */
typedef struct op_state {
    _Atomic int next;     /* next chunk to claim */
    _Atomic int finished; /* chunks done */
    _Atomic int rc;       /* first error */
    int chunks;
} op_state;

typedef struct part_job {
    const ea_variant *v;
    const ea_op *op;
    void *const *slots;
    op_state *st;
} part_job;

typedef struct mailbox {
    _Atomic unsigned seq;  /* bumped by the caller for each job posted */
    _Atomic unsigned done; /* set to seq by the worker when the job is finished */
    part_job job;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
} mailbox;

static struct {
    pthread_mutex_t mu; /* guards starting workers */
    pthread_mutex_t run_mu; /* one ea_run_ops uses the pool at a time */
    int started;
    pid_t pid; /* a forked child has no workers: it starts its own */
    mailbox box[EA_MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, 0, 0, {{0}}};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ------------------------------------------------------------------ one part of one op */

static int64_t op_rows(const ea_op *op) {
    switch (op->kind) {
    case EA_OP_CONV:
    case EA_OP_DEPTHWISE:
        return (int64_t)op->conv.batch * op->conv.out_h * op->conv.out_w;
    case EA_OP_GEMM:
        return op->gemm.m;
    case EA_OP_ADD:
        return op->n[0];
    case EA_OP_MEAN:
    case EA_OP_QUANTIZE:
        return op->n[0];
    default:
        return 1;
    }
}

/* How many chunks an op is worth cutting into: about two per thread, each worth at least
 * ~64 K multiply-adds (a few microseconds; less costs more to hand over than it saves) and
 * 16 rows (a GEMM tile). By work, not rows: MobileNet's last blocks have few rows (3x3
 * pixels) but hundreds of channels. */
static int op_chunks(const ea_op *op, int threads) {
    if (threads < 2) return 1;
    const int64_t rows = op_rows(op);
    int64_t per_row, min_rows = 16;
    switch (op->kind) {
    case EA_OP_CONV:
        per_row = (int64_t)op->conv.k_h * op->conv.k_w * op->conv.in_c * op->conv.out_c;
        break;
    case EA_OP_DEPTHWISE:
        per_row = (int64_t)op->conv.k_h * op->conv.k_w * op->conv.out_c;
        break;
    case EA_OP_GEMM:
        per_row = op->gemm.k * op->gemm.n;
        break;
    case EA_OP_ADD:
        per_row = 4, min_rows = 1024;
        break;
    case EA_OP_MEAN:
        per_row = op->n[1] * op->n[2], min_rows = 1;
        break;
    case EA_OP_QUANTIZE:
        per_row = op->n[1] * op->n[2] * 4, min_rows = 1;
        break;
    default:
        return 1;
    }
    int64_t chunks = rows * per_row / 65536;
    if (chunks > rows / min_rows) chunks = rows / min_rows;
    if (chunks > 2 * threads) chunks = 2 * threads;
    return chunks < 1 ? 1 : (int)chunks;
}

/* Row range of chunk i of n over `rows`, aligned to 16 rows (GEMM tiles) but the last. */
static void part_range(int64_t rows, int i, int n, int64_t *lo, int64_t *hi) {
    int64_t a = rows * i / n, b = rows * (i + 1) / n;
    if (n > 1 && rows >= 16 * n) {
        a = i == 0 ? 0 : (a + 15) / 16 * 16;
        b = i == n - 1 ? rows : (b + 15) / 16 * 16;
    }
    *lo = a;
    *hi = b;
}

static int run_rows(const ea_variant *v, const ea_op *op, void *const *s, int part, int parts) {
    const void *in0 = s[op->in0];
    void *out = s[op->out];
    int64_t lo, hi;
    part_range(op_rows(op), part, parts, &lo, &hi);
    if (hi <= lo) return EA_OK;
    switch (op->kind) {
    case EA_OP_CONV:
        return ea_conv2d(v, &op->conv, (const int8_t *)in0, op->w, op->colsum, op->bias,
                         op->mult, op->shift, (int8_t *)out, lo, hi);
    case EA_OP_DEPTHWISE:
        return ea_depthwise_conv2d(v, &op->conv, (const int8_t *)in0, (const int16_t *)op->w,
                                   op->bias, op->mult, op->shift, (int8_t *)out, lo, hi);
    case EA_OP_GEMM: {
        ea_gemm_params g = op->gemm;
        g.m = hi - lo;
        const size_t elem = g.out_int32 ? 4 : 1;
        return ea_gemm(v, &g, (const int8_t *)in0 + lo * g.a_stride_m, op->w, op->colsum,
                       op->bias, op->mult, op->shift,
                       (char *)out + (size_t)(lo * g.c_stride_m) * elem);
    }
    case EA_OP_ADD:
        return ea_add(v, hi - lo, (const int8_t *)in0 + lo, (const int8_t *)s[op->in1] + lo,
                      &op->add, (int8_t *)out + lo);
    case EA_OP_MEAN: {
        const int64_t hw = op->n[1], c = op->n[2];
        return ea_mean_hw(hi - lo, hw, c, (const int8_t *)in0 + lo * hw * c, op->q[0], op->q[1],
                          op->q[2], op->q[3], (int8_t *)out + lo * c);
    }
    case EA_OP_QUANTIZE: {
        const int64_t c = op->n[1], hw = op->n[2];
        return ea_quantize_nchw(hi - lo, c, hw, (const float *)in0 + lo * c * hw, op->scale,
                                op->q[0], (int8_t *)out + lo * c * hw);
    }
    case EA_OP_COPY:
        if (op->n[0] < 0) return EA_EINVAL;
        if (out != in0) memmove(out, in0, (size_t)op->n[0]);
        return EA_OK;
    default:
        return EA_EINVAL;
    }
}

/* Claims and runs chunks of j's op until none is left. */
static void run_chunks(const part_job *j) {
    op_state *st = j->st;
    for (;;) {
        const int c = atomic_fetch_add_explicit(&st->next, 1, memory_order_relaxed);
        if (c >= st->chunks) return;
        const int rc = run_rows(j->v, j->op, j->slots, c, st->chunks);
        if (rc != EA_OK) {
            int ok = EA_OK;
            atomic_compare_exchange_strong(&st->rc, &ok, rc);
        }
        atomic_fetch_add_explicit(&st->finished, 1, memory_order_release);
    }
}

/* ------------------------------------------------------------------ the pool */

static void *worker_main(void *arg) {
    mailbox *b = (mailbox *)arg;
    unsigned last = 0; /* seq when the thread was created: a job may be posted before it runs */
    for (;;) {
        unsigned seq;
        int64_t t0 = now_ns();
        int spins = 0;
        while ((seq = atomic_load_explicit(&b->seq, memory_order_acquire)) == last) {
            cpu_relax();
            if (++spins % 64 == 0) {
                if (now_ns() - t0 > SPIN_NS) break;
                sched_yield(); /* let a thread sharing this core run */
            }
        }
        if (seq == last) {
            pthread_mutex_lock(&b->mu);
            while ((seq = atomic_load_explicit(&b->seq, memory_order_acquire)) == last)
                pthread_cond_wait(&b->cv, &b->mu);
            pthread_mutex_unlock(&b->mu);
        }
        last = seq;
        run_chunks(&b->job);
        atomic_store_explicit(&b->done, seq, memory_order_release);
    }
    return NULL;
}

/* Workers 1..n-1 running (worker 0 is the caller); returns how many threads are usable. */
static int ensure_workers(int n) {
    if (n > EA_MAX_THREADS) n = EA_MAX_THREADS;
    pthread_mutex_lock(&pool.mu);
    const pid_t pid = getpid();
    if (pool.pid != pid) { /* first use, or a forked child: the parent's threads are gone */
        memset(pool.box, 0, sizeof(pool.box));
        pool.started = 1;
        pool.pid = pid;
    }
    while (pool.started < n) {
        mailbox *b = &pool.box[pool.started];
        pthread_mutex_init(&b->mu, NULL);
        pthread_cond_init(&b->cv, NULL);
        atomic_store(&b->seq, 0);
        atomic_store(&b->done, 0);
        if (pthread_create(&b->thread, NULL, worker_main, b) != 0) break;
        pthread_detach(b->thread);
        pool.started++;
    }
    const int usable = pool.started < n ? pool.started : n;
    pthread_mutex_unlock(&pool.mu);
    return usable;
}

int ea_op_size(void) { return (int)sizeof(ea_op); }

int ea_pool_size(void) { return pool.started > 0 ? pool.started - 1 : 0; }

static void post(mailbox *b, const part_job *j) {
    b->job = *j;
    pthread_mutex_lock(&b->mu); /* under the lock, so a worker about to sleep cannot miss it */
    atomic_fetch_add_explicit(&b->seq, 1, memory_order_release);
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

static int idle(mailbox *b) {
    return atomic_load_explicit(&b->done, memory_order_acquire) ==
           atomic_load_explicit(&b->seq, memory_order_relaxed);
}

/* Spin, then yield, until cond(arg) holds. */
static void wait_until(int (*cond)(void *), void *arg) {
    int spins = 0;
    while (!cond(arg)) {
        cpu_relax();
        if (++spins > 256) sched_yield();
    }
}

static int chunks_finished(void *arg) {
    op_state *st = (op_state *)arg;
    return atomic_load_explicit(&st->finished, memory_order_acquire) == st->chunks;
}

static int box_idle(void *arg) { return idle((mailbox *)arg); }

int ea_run_ops(const ea_variant *v, const ea_op *ops, int32_t n_ops, void *const *slots,
               int32_t threads) {
    if (!v || !ops || !slots || n_ops < 0 || threads < 1) return EA_EINVAL;
    int usable = 1;
    const int pooled = threads > 1 && pthread_mutex_trylock(&pool.run_mu) == 0;
    if (pooled) usable = ensure_workers(threads);
    /* one state per op, alive until every worker posted in this run has finished */
    op_state *states = usable > 1 ? (op_state *)calloc((size_t)(n_ops ? n_ops : 1), sizeof(op_state)) : NULL;
    if (usable > 1 && !states) usable = 1;
    int rc = EA_OK;
    for (int32_t i = 0; i < n_ops && rc == EA_OK; i++) {
        const int chunks = op_chunks(&ops[i], usable);
        if (chunks == 1) {
            rc = run_rows(v, &ops[i], slots, 0, 1);
            continue;
        }
        op_state *st = &states[i];
        st->chunks = chunks;
        const part_job j = {v, &ops[i], slots, st};
        for (int p = 1; p < usable && p < chunks; p++)
            if (idle(&pool.box[p])) post(&pool.box[p], &j); /* a late worker sits this op out */
        run_chunks(&j);
        wait_until(chunks_finished, st); /* only chunks already claimed are outstanding */
        rc = atomic_load_explicit(&st->rc, memory_order_relaxed);
    }
    for (int p = 1; p < usable; p++) wait_until(box_idle, &pool.box[p]); /* before states go */
    free(states);
    if (pooled) pthread_mutex_unlock(&pool.run_mu);
    return rc;
}
