/* framepipe's C core. See fp.h for the contract of each function.
 *
 * Why each piece is the way it is:
 *
 * - Deadlines are absolute monotonic times, so a read interrupted by a signal and retried by
 *   the caller waits only for what is left of its timeout, never the whole timeout again.
 * - A frame is written with one writev() per call, header and payload together, so a frame is
 *   never split by a concatenation copy; short writes (a full pipe) continue where they stopped.
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
#include <sys/prctl.h>
#endif
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

void fp_header_encode(unsigned char *out, unsigned char check, uint64_t length)
{
    out[0] = out[1] = check;
    memcpy(out + 2, &length, sizeof length); /* native byte order, like struct "Q" */
    out[10] = out[11] = check;
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
                left = 1e9; /* wait_for() loops until the real deadline */
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

static int wait_for(int fd, short events, int liveness_fd, double deadline)
{
    struct pollfd fds[2];
    nfds_t n = 1;
    int rc;

    fds[0].fd = fd;
    fds[0].events = events;
    fds[0].revents = 0;
    if (liveness_fd >= 0) {
        fds[1].fd = liveness_fd;
        fds[1].events = POLLIN;
        fds[1].revents = 0;
        n = 2;
    }
    for (;;) {
        rc = poll_until(fds, n, deadline);
        if (rc < 0)
            return -1; /* EINTR included: the caller handles signals */
        /* The data fd wins over the liveness fd: frames written before the writer died are
         * delivered first. POLLHUP/POLLERR count as readable: the read reports them. */
        if (fds[0].revents)
            return FP_OK;
        if (n == 2 && fds[1].revents)
            return FP_LIVENESS;
        if (deadline >= 0 && fp_now() >= deadline)
            return FP_TIMEOUT;
        /* poll() returned early (rounding or a spurious wake-up): wait for the rest. */
    }
}

int fp_wait_readable(int fd, int liveness_fd, double deadline)
{
    return wait_for(fd, POLLIN | POLLPRI, liveness_fd, deadline);
}

int fp_wait_writable(int fd, double deadline)
{
    return wait_for(fd, POLLOUT, -1, deadline);
}

ssize_t fp_read(int fd, void *buf, size_t n, int mode)
{
    if (n > SSIZE_MAX)
        n = SSIZE_MAX;
    if (mode == FP_MODE_SOCKET)
        return recv(fd, buf, n, MSG_DONTWAIT);
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

ssize_t fp_writev_nowait(int fd, const struct iovec *iov, int iovcnt)
{
#ifdef __linux__
    return pwritev2(fd, iov, iovcnt > IOV_MAX ? IOV_MAX : iovcnt, -1, RWF_NOWAIT);
#else
    (void)fd;
    (void)iov;
    (void)iovcnt;
    errno = EOPNOTSUPP;
    return -1;
#endif
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

int fp_writev_all(int fd, struct iovec **iovp, int *iovcntp)
{
    struct iovec *iov = *iovp;
    int cnt = *iovcntp;
    ssize_t w;

    while (cnt > 0 && iov->iov_len == 0) {
        iov++;
        cnt--;
    }
    while (cnt > 0) {
        w = writev(fd, iov, cnt > IOV_MAX ? IOV_MAX : cnt);
        if (w < 0) {
            *iovp = iov;
            *iovcntp = cnt;
            return -1;
        }
        /* Skip what was written; a partly written entry is advanced in place. */
        while (cnt > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0 && w > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    *iovp = iov;
    *iovcntp = 0;
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
        return FP_EOF;
    return close(fd) < 0 ? -1 : FP_OK;
}
