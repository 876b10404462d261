/* A fork-safe lock around AddressSanitizer's allocator and thread registry, for tools/asan.sh.
 *
 * Why: gcc 12's libasan (compiler-rt before its pthread_atfork handlers) takes no lock of its
 * own around fork(). When one thread forks while another is inside the ASan allocator (malloc,
 * free, the quarantine) or its thread registry (a thread starting or ending), the child gets
 * that lock held forever, and its first malloc or pthread_create blocks for good. CPython
 * allocates without the GIL in such places (a thread's state is freed after the GIL is let go,
 * opendir() runs without it), so a suite that forks while other threads run hangs now and then:
 * tools/asan_fork_repro.py shows it with no framepipe code at all.
 *
 * How: this library is preloaded before libasan. Every allocation call and every thread's start
 * and end hold a shared (read) lock; fork() takes it exclusively in a pthread_atfork handler, so
 * a fork waits until no thread is inside ASan's allocator or registry. The lock prefers readers
 * (a thread may allocate again while it holds it). The child starts with a fresh lock: the held
 * one belongs to the parent's thread id. ASan still does all the checking: each call goes on to
 * libasan's own interceptor.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>

void *__interceptor_malloc(size_t);
void __interceptor_free(void *);
void *__interceptor_calloc(size_t, size_t);
void *__interceptor_realloc(void *, size_t);
int __interceptor_posix_memalign(void **, size_t, size_t);
void *__interceptor_memalign(size_t, size_t);
void *__interceptor_aligned_alloc(size_t, size_t);
void *__interceptor_valloc(size_t);
void *__interceptor_pvalloc(size_t);
int __interceptor_pthread_create(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

static pthread_rwlock_t lock = PTHREAD_RWLOCK_INITIALIZER; /* prefers readers */

#define SHARED(expr)                                                                           \
    do {                                                                                       \
        pthread_rwlock_rdlock(&lock);                                                          \
        expr;                                                                                  \
        pthread_rwlock_unlock(&lock);                                                          \
    } while (0)

void *malloc(size_t n) { void *p; SHARED(p = __interceptor_malloc(n)); return p; }
void free(void *p) { if (p) SHARED(__interceptor_free(p)); }
void *calloc(size_t a, size_t b) { void *p; SHARED(p = __interceptor_calloc(a, b)); return p; }
void *realloc(void *q, size_t n) { void *p; SHARED(p = __interceptor_realloc(q, n)); return p; }
void *memalign(size_t a, size_t n) { void *p; SHARED(p = __interceptor_memalign(a, n)); return p; }
void *valloc(size_t n) { void *p; SHARED(p = __interceptor_valloc(n)); return p; }
void *pvalloc(size_t n) { void *p; SHARED(p = __interceptor_pvalloc(n)); return p; }
void *aligned_alloc(size_t a, size_t n)
{
    void *p;
    SHARED(p = __interceptor_aligned_alloc(a, n));
    return p;
}
int posix_memalign(void **r, size_t a, size_t n)
{
    int rc;
    SHARED(rc = __interceptor_posix_memalign(r, a, n));
    return rc;
}

/* Threads. pthread_create holds the lock until the new thread runs its own code (ASan has
 * registered it by then). A thread's end is covered by a key whose destructor takes the lock in
 * the first round of destructors and lets it go in the last: ASan's own destructor defers
 * itself to that last round, and runs before this one there (its key is older). */
static pthread_key_t ending;
static pthread_once_t ending_once = PTHREAD_ONCE_INIT;

struct start {
    void *(*fn)(void *);
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int running;
};

static void end_of_thread(void *value)
{
    long round = (long)value;
    if (round == 1)
        pthread_rwlock_rdlock(&lock);
    if (round < PTHREAD_DESTRUCTOR_ITERATIONS) {
        pthread_setspecific(ending, (void *)(round + 1));
        return;
    }
    pthread_rwlock_unlock(&lock);
}

static void make_key(void) { pthread_key_create(&ending, end_of_thread); }

static void *trampoline(void *raw)
{
    struct start *s = raw;
    void *(*fn)(void *) = s->fn;
    void *arg = s->arg;
    pthread_setspecific(ending, (void *)1L);
    pthread_mutex_lock(&s->mu);
    s->running = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return fn(arg);
}

int pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*fn)(void *), void *arg)
{
    struct start s = {fn, arg, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    int rc;
    pthread_once(&ending_once, make_key);
    pthread_rwlock_rdlock(&lock);
    rc = __interceptor_pthread_create(t, attr, trampoline, &s);
    if (rc == 0) {
        pthread_mutex_lock(&s.mu);
        while (!s.running)
            pthread_cond_wait(&s.cv, &s.mu);
        pthread_mutex_unlock(&s.mu);
    }
    pthread_rwlock_unlock(&lock);
    return rc;
}

static void before_fork(void) { pthread_rwlock_wrlock(&lock); }
static void after_fork_parent(void) { pthread_rwlock_unlock(&lock); }
static void after_fork_child(void)
{
    pthread_rwlock_t fresh = PTHREAD_RWLOCK_INITIALIZER;
    lock = fresh;
}

__attribute__((constructor)) static void install(void)
{
    pthread_once(&ending_once, make_key);
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}
