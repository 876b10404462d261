/* framepipe's C core. See fp.h for the contract of each function.
 *
 * Why each piece is the way it is:
 *
 * - Deadlines are absolute monotonic times, so a read interrupted by a signal and retried by
 *   the caller waits only for what is left of its timeout, never the whole timeout again.
 * - A frame is written with one writev() per call, header and payload together, so a frame is
 *   never split by a concatenation copy; short writes (a full pipe) continue where they stopped
 *   (fp_writev, the one write loop, blocking or not).
 * - Every wait is one poll() against an absolute deadline (poll_until, under fp_wait), with a
 *   wake fd in the set: close() from another thread makes it readable, so no thread stays
 *   blocked on a connection that is closed, and the fds are closed only once no thread is
 *   inside a call (no read or write can reach a number reused meanwhile). Reads and writes
 *   themselves never block: the waiting is in fp_wait, except for a read of a pipe without a
 *   deadline, which waits in read() (one system call instead of two) and is woken by
 *   fp_wake_pipe_reader.
 * - Reads that must not block use per-call flags (MSG_DONTWAIT, RWF_NOWAIT) instead of
 *   O_NONBLOCK, because O_NONBLOCK lives on the open file description, which is shared with
 *   every process that inherited the fd: setting it here would break a child's blocking reads.
 */
#define _GNU_SOURCE
#include "fp.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#ifdef __linux__
#include <sys/eventfd.h>
#include <sys/prctl.h>
#endif
#include <sched.h>
#include <time.h>
#include <unistd.h>

/* Waits shorter than this many seconds run with the least timer slack. */
#define FP_PRECISE_BELOW 0.1

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif

double fp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void fp_header_encode(unsigned char *out, int kind, uint64_t length)
{
    out[0] = out[1] = (unsigned char)kind;
    memcpy(out + 2, &length, sizeof length); /* native byte order, like struct "Q" */
    out[10] = out[11] = (unsigned char)kind;
}

/* The rules, in the order both engines apply them (framepipe._wire.decode_header is the same
 * in Python): the two check bytes name a kind or the stream is out of sync; a TIMEOUT
 * sentinel is those two bytes alone; a DEAD sentinel carries an 8-byte status word; any other
 * kind is a 12-byte header whose closing check bytes repeat the opening ones and whose length
 * must not exceed the cap. Nothing is consumed: the caller skips h->size bytes. */
int fp_header_decode(const unsigned char *p, size_t avail, uint64_t cap, fp_header *h)
{
    int kind;

    if (avail < 2) {
        h->size = 2;
        return FP_MORE;
    }
    kind = p[0];
    if (p[1] != p[0] || kind > FP_KIND_MAX)
        return FP_BAD_CHECK;
    h->kind = kind;
    h->value = 0;
    if (kind == FP_KIND_TIMEOUT) {
        h->size = FP_TIMEOUT_SIZE;
        return FP_OK;
    }
    h->size = kind == FP_KIND_DEAD ? FP_DEAD_SIZE : FP_HEADER_SIZE;
    if (avail < h->size)
        return FP_MORE;
    memcpy(&h->value, p + 2, sizeof h->value);
    if (kind == FP_KIND_DEAD)
        return FP_OK;
    if (p[10] != p[0] || p[11] != p[1])
        return FP_MISMATCH;
    if (h->value > (kind == FP_KIND_PAD ? FP_PAD_MIN : cap))
        return FP_TOO_LARGE;
    return FP_OK;
}

/* Wait with poll() semantics until the absolute deadline (< 0: none). Linux has ppoll(),
 * whose timeout is in nanoseconds: a 10 ms read timeout then returns within the scheduler's
 * wake-up latency instead of up to a millisecond late. Elsewhere poll() takes milliseconds,
 * rounded up so that a wait never ends before the deadline (a useless extra wake-up). */
static int poll_until(struct pollfd *fds, nfds_t n, double deadline)
{
    double left = 0;
    if (deadline >= 0) {
        left = deadline - fp_now();
        if (left < 0)
            left = 0;
    }
#ifdef __linux__
    {
        struct timespec ts, *tsp = NULL;
        if (deadline >= 0) {
            if (left > 1e9)
                left = 1e9; /* fp_wait() loops until the real deadline */
            ts.tv_sec = (time_t)left;
            ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
            tsp = &ts;
        }
        /* The default timer slack (50 us) would be added to every short deadline: wait with
         * the least slack, then give the thread its own back. Long waits keep it (there it
         * is a rounding error and the extra prctl() calls buy nothing). */
        if (deadline >= 0 && left < FP_PRECISE_BELOW) {
            int rc, err;
            int old = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
            if (old > 1)
                prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
            rc = ppoll(fds, n, tsp, NULL);
            err = errno;
            if (old > 1)
                prctl(PR_SET_TIMERSLACK, (unsigned long)old, 0, 0, 0);
            errno = err;
            return rc;
        }
        return ppoll(fds, n, tsp, NULL);
    }
#else
    if (deadline < 0)
        return poll(fds, n, -1);
    if (left > (double)INT_MAX / 1000.0)
        return poll(fds, n, INT_MAX);
    return poll(fds, n, (int)(left * 1000.0 + 0.999));
#endif
}

int fp_wait(int fd, int direction, int liveness_fd, int wake_fd, double deadline)
{
    struct pollfd fds[3];
    nfds_t n = 1;
    int rc, live = -1, wake = -1;

    fds[0].fd = fd;
    fds[0].events = direction == FP_WRITE ? POLLOUT : POLLIN | POLLPRI;
    fds[0].revents = 0;
    if (liveness_fd >= 0) {
        live = (int)n++;
        fds[live].fd = liveness_fd;
        fds[live].events = POLLIN;
        fds[live].revents = 0;
    }
    if (wake_fd >= 0) {
        wake = (int)n++;
        fds[wake].fd = wake_fd;
        fds[wake].events = POLLIN;
        fds[wake].revents = 0;
    }
    for (;;) {
        rc = poll_until(fds, n, deadline);
        if (rc < 0)
            return -1; /* EINTR included: the caller handles signals */
        /* A close by another thread ends the wait whatever else is ready. Then the data fd
         * wins over the liveness fd: frames written before the writer died are delivered
         * first. POLLHUP/POLLERR count as ready: the read or write reports them. */
        if (wake >= 0 && fds[wake].revents)
            return FP_WOKEN;
        if (fds[0].revents)
            return FP_OK;
        if (live >= 0 && fds[live].revents)
            return FP_LIVENESS;
        if (deadline >= 0 && fp_now() >= deadline)
            return FP_TIMEOUT;
        /* poll() returned early (rounding or a spurious wake-up): wait for the rest. */
    }
}

int fp_wake_open(int *rfd, int *wfd)
{
#ifdef __linux__
    int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd >= 0) {
        *rfd = *wfd = fd;
        return FP_OK;
    }
    if (errno != ENOSYS && errno != EINVAL)
        return -1;
#endif
    {
        int p[2];
        if (pipe(p) < 0)
            return -1;
        fcntl(p[0], F_SETFD, FD_CLOEXEC);
        fcntl(p[1], F_SETFD, FD_CLOEXEC);
        fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
        fcntl(p[1], F_SETFL, fcntl(p[1], F_GETFL) | O_NONBLOCK);
        *rfd = p[0];
        *wfd = p[1];
        return FP_OK;
    }
}

int fp_wake(int wfd)
{
    uint64_t one = 1; /* an eventfd takes exactly 8 bytes; a pipe takes any */
    ssize_t w = write(wfd, &one, sizeof one);
    if (w < 0 && errno != EAGAIN) /* EAGAIN: a full pipe or counter is readable already */
        return -1;
    return FP_OK;
}

int fp_wake_pipe_reader(int fd)
{
#ifdef __linux__
    char path[40];
    static const unsigned char sentinel[2] = {FP_KIND_TIMEOUT, FP_KIND_TIMEOUT};
    int wfd, err;
    ssize_t w;

    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    wfd = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (wfd < 0)
        return -1;
    w = write(wfd, sentinel, sizeof sentinel);
    err = errno;
    close(wfd);
    if (w < 0 && err != EAGAIN) { /* EAGAIN: the pipe is not empty, so nobody is blocked */
        errno = err;
        return -1;
    }
    return FP_OK;
#else
    (void)fd;
    errno = ENOSYS;
    return -1;
#endif
}

int fp_wake_socket_reader(int fd)
{
    return shutdown(fd, SHUT_RD) < 0 ? -1 : FP_OK;
}

ssize_t fp_read(int fd, void *buf, size_t n, int mode)
{
    if (n > SSIZE_MAX)
        n = SSIZE_MAX;
    if (mode == FP_MODE_SOCKET)
        return recv(fd, buf, n, MSG_DONTWAIT);
    if (mode == FP_MODE_RECORD || mode == FP_MODE_RECORD_WAIT) {
        /* MSG_TRUNC: the record's whole length, even when it did not fit */
        ssize_t r = recv(fd, buf, n, MSG_TRUNC | (mode == FP_MODE_RECORD ? MSG_DONTWAIT : 0));
        if (r > (ssize_t)n) {
            errno = EMSGSIZE;
            return -1;
        }
        return r;
    }
    if (mode == FP_MODE_NONBLOCK)
        return read(fd, buf, n);
    if (mode == FP_MODE_PIPE) {
#ifdef __linux__
        struct iovec iov;
        iov.iov_base = buf;
        iov.iov_len = n;
        return preadv2(fd, &iov, 1, -1, RWF_NOWAIT);
#else
        errno = EOPNOTSUPP;
        return -1;
#endif
    }
    return read(fd, buf, n);
}

int fp_spin_readable(int fd, double until)
{
    struct pollfd p;
    int rc;

    p.fd = fd;
    p.events = POLLIN | POLLPRI;
    for (;;) {
        p.revents = 0;
        rc = poll(&p, 1, 0);
        if (rc != 0)
            return rc < 0 ? -1 : 1;
        if (fp_now() >= until)
            return 0;
        sched_yield();
    }
}

int fp_reopen_nonblocking(int fd)
{
#ifdef __linux__
    char path[40];
    struct stat a, b;
    int nfd, err;

    if (fstat(fd, &a) < 0)
        return -1;
    if (!S_ISFIFO(a.st_mode)) {
        errno = EINVAL;
        return -1;
    }
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    nfd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (nfd < 0)
        return -1;
    /* Make sure it is the same pipe (a /proc that is not this process's would not be). */
    if (fstat(nfd, &b) < 0) {
        err = errno;
        close(nfd);
        errno = err;
        return -1;
    }
    if (a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
        close(nfd);
        errno = ENODEV;
        return -1;
    }
    return nfd;
#else
    (void)fd;
    errno = ENOSYS;
    return -1;
#endif
}

/* Skip n written bytes of *iov: whole entries first, then a partly written one in place. */
static void iov_advance(struct iovec **iovp, int *cntp, size_t n)
{
    struct iovec *iov = *iovp;
    int cnt = *cntp;

    while (cnt > 0 && n >= iov->iov_len) {
        n -= iov->iov_len;
        iov++;
        cnt--;
    }
    if (cnt > 0 && n > 0) {
        iov->iov_base = (char *)iov->iov_base + n;
        iov->iov_len -= n;
    }
    *iovp = iov;
    *cntp = cnt;
}

static ssize_t writev_once(int fd, const struct iovec *iov, int cnt, int nowait)
{
    if (cnt > IOV_MAX)
        cnt = IOV_MAX;
    if (!nowait)
        return writev(fd, iov, cnt);
#ifdef __linux__
    return pwritev2(fd, iov, cnt, -1, RWF_NOWAIT);
#else
    errno = EOPNOTSUPP;
    return -1;
#endif
}

int fp_writev(int fd, struct iovec **iov, int *iovcnt, int nowait, size_t cap, size_t cap_after,
              size_t *written)
{
    ssize_t w;
    struct iovec *last;
    size_t kept, sum;
    int cnt;

    iov_advance(iov, iovcnt, 0); /* empty entries first: a frame may have an empty payload */
    while (*iovcnt > 0) {
        cnt = *iovcnt;
        last = NULL;
        kept = 0;
        if (cap > 0) { /* end this write at cap bytes: trim the entry that crosses it */
            sum = 0;
            for (cnt = 0; cnt < *iovcnt && sum < cap; cnt++) {
                if ((*iov)[cnt].iov_len > cap - sum) {
                    last = &(*iov)[cnt];
                    kept = last->iov_len;
                    last->iov_len = cap - sum;
                }
                sum += (*iov)[cnt].iov_len;
            }
        }
        w = writev_once(fd, *iov, cnt, nowait);
        if (last != NULL)
            last->iov_len = kept;
        cap = cap_after;
        if (w < 0)
            return -1;
        if (written != NULL)
            *written += (size_t)w;
        iov_advance(iov, iovcnt, (size_t)w);
    }
    return FP_OK;
}

/* A connection may outlive its fds: a caller that closes "its copy" of a handle with os.close()
 * frees the number, and the next open (a pidfd of the watcher, a file) may get it. Closing by
 * number then would close someone else's descriptor. The identity recorded when the connection
 * took the fd tells the two apart: an open pipe or socket keeps its inode, and no other open
 * file shares it. */
int fp_identity(int fd, uint64_t *dev, uint64_t *ino)
{
    struct stat st;
    if (fstat(fd, &st) < 0)
        return -1;
    *dev = (uint64_t)st.st_dev;
    *ino = (uint64_t)st.st_ino;
    return FP_OK;
}

int fp_close_if_same(int fd, uint64_t dev, uint64_t ino)
{
    uint64_t d, i;
    if (fp_identity(fd, &d, &i) < 0 || d != dev || i != ino)
        return FP_SKIPPED;
    return close(fd) < 0 ? -1 : FP_OK;
}
