/* framepipe's C core: framing, reads and writes with deadlines, over plain POSIX.
 *
 * No Python here. Functions return a status code (FP_OK, FP_EOF, FP_TIMEOUT, FP_LIVENESS) or
 * -1 with errno set. EINTR is never retried here: the caller runs the signal handlers first
 * (PEP 475) and calls again with the same absolute deadline.
 */
#ifndef FRAMEPIPE_FP_H
#define FRAMEPIPE_FP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#define FP_OK 0
#define FP_EOF 1
#define FP_TIMEOUT 2
#define FP_LIVENESS 3

/* A frame header is CHECK(2) + u64 length in native order + CHECK(2). */
#define FP_HEADER_SIZE 12
/* A DEAD sentinel is 02 02 + u64 exit status. */
#define FP_DEAD_SIZE 10

/* How fp_read may avoid blocking when the fd has nothing to read. */
#define FP_MODE_BLOCK 0   /* a plain read(): the caller polled first */
#define FP_MODE_SOCKET 1  /* recv(MSG_DONTWAIT): per call, no shared O_NONBLOCK flag */
#define FP_MODE_PIPE 2    /* preadv2(RWF_NOWAIT): per call, for pipes (Linux) */
#define FP_MODE_NONBLOCK 3 /* read() on a private O_NONBLOCK description (fp_reopen_nonblocking) */

/* Seconds on the monotonic clock. */
double fp_now(void);

/* Write the 12-byte header of a frame whose check bytes are (check, check). */
void fp_header_encode(unsigned char *out, unsigned char check, uint64_t length);

/* Wait until fd is readable (data, end of file or error count as readable) or, when
 * liveness_fd >= 0, until liveness_fd is readable, or until the absolute monotonic deadline
 * (deadline < 0: no deadline). FP_OK, FP_LIVENESS, FP_TIMEOUT, or -1 with errno. */
int fp_wait_readable(int fd, int liveness_fd, double deadline);

/* Same for writability of fd. FP_OK, FP_TIMEOUT or -1 with errno. */
int fp_wait_writable(int fd, double deadline);

/* One read of at most n bytes: > 0 bytes read, 0 at end of file, -1 with errno. With
 * FP_MODE_SOCKET or FP_MODE_PIPE it does not block: errno EAGAIN when there is nothing, and
 * EOPNOTSUPP or EINVAL when the kernel cannot read this fd without blocking. */
ssize_t fp_read(int fd, void *buf, size_t n, int mode);

/* A second, private open file description of the pipe or FIFO read end fd, with O_NONBLOCK
 * and O_CLOEXEC set on it alone: read() on it never blocks, while fd (shared with children
 * that inherited it) stays blocking. Linux opens /proc/self/fd/N, which for a pipe makes a new
 * description of the same pipe; a plain read() there costs less than preadv2(RWF_NOWAIT),
 * whose iovec path is measurably slower per call. The new fd, or -1 with errno when this
 * system cannot (no /proc, no permission, not a pipe). */
int fp_reopen_nonblocking(int fd);

/* One writev() of iov that never blocks (pwritev2 with RWF_NOWAIT, a per-call flag, so the
 * shared description stays blocking): bytes written, or -1 with errno (EAGAIN when the fd is
 * full, EOPNOTSUPP when this system cannot). */
ssize_t fp_writev_nowait(int fd, const struct iovec *iov, int iovcnt);

/* Write every byte described by *iov (*iovcnt entries), looping over short writes. On return
 * *iov and *iovcnt describe what is left, so after -1 with errno EINTR the caller runs its
 * signal handlers and calls again to finish the same frame. FP_OK or -1 with errno. */
int fp_writev_all(int fd, struct iovec **iov, int *iovcnt);

/* The identity of fd's open file (device and inode), for fp_close_if_same. FP_OK, or -1 with
 * errno (EBADF: not an open fd). */
int fp_identity(int fd, uint64_t *dev, uint64_t *ino);

/* Close fd only if it is still the file whose identity was recorded when a connection took
 * it: FP_OK when closed, FP_EOF when the number now names another file (or nothing) and was
 * left alone, -1 with errno when close() failed. */
int fp_close_if_same(int fd, uint64_t dev, uint64_t ino);

#endif
