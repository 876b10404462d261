/* framepipe's C core: the frame header codec, reads and writes, and waiting with a deadline,
 * over plain POSIX.
 *
 * No Python here. Functions return a status code (FP_OK and the others below) or -1 with errno
 * set. EINTR is never retried here: the caller runs the signal handlers first (PEP 475) and
 * calls again with the same absolute deadline.
 */
#ifndef FRAMEPIPE_FP_H
#define FRAMEPIPE_FP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

/* Status codes. */
#define FP_OK 0
#define FP_TIMEOUT 2      /* fp_wait: the deadline passed */
#define FP_LIVENESS 3     /* fp_wait: the liveness fd became readable */
#define FP_MORE 4         /* fp_header_decode: more bytes are needed (how many: h->size) */
#define FP_BAD_CHECK 5    /* fp_header_decode: the check bytes name no kind of frame */
#define FP_MISMATCH 6     /* fp_header_decode: the closing check bytes differ from the opening */
#define FP_TOO_LARGE 7    /* fp_header_decode: the length is over the cap (in h->value) */
#define FP_SKIPPED 8      /* fp_close_if_same: the number names another file; left alone */
#define FP_WOKEN 9        /* fp_wait: the wake fd became readable (another thread closed) */

/* The kinds of frame: a frame's two check bytes are its kind, twice. */
#define FP_KIND_DATA 0    /* a message (bytes, or a pickle) */
#define FP_KIND_TIMEOUT 1 /* sentinel, 2 bytes alone: a reference writer's read timed out */
#define FP_KIND_DEAD 2    /* sentinel, + u64 exit status word: the writer died */
#define FP_KIND_ERROR 3   /* a serialized exception */
#define FP_KIND_OBJECT 4  /* a pickle whose large buffers follow as BUFFER frames */
#define FP_KIND_BUFFER 5  /* one out-of-band buffer of the OBJECT frame before it */
#define FP_KIND_BULK 6    /* a DATA or BUFFER frame whose payload is on the bulk channel */
#define FP_KIND_PAD 7     /* filler after a small message, skipped (framepipe._wire.PAD_MIN) */
#define FP_KIND_MAX 7

/* A PAD frame's length is at most this; a message's first write is padded to it. */
#define FP_PAD_MIN 256

/* A frame header is CHECK(2) + u64 length in native order + CHECK(2). */
#define FP_HEADER_SIZE 12
/* A DEAD sentinel is 02 02 + u64 exit status word. */
#define FP_DEAD_SIZE 10
/* A TIMEOUT sentinel is 01 01 alone. */
#define FP_TIMEOUT_SIZE 2

/* What fp_header_decode found at a frame boundary. */
typedef struct fp_header {
    int kind;       /* FP_KIND_* */
    uint64_t value; /* the payload length; a DEAD sentinel's status word */
    size_t size;    /* bytes of the header or sentinel (FP_MORE: bytes needed to decode) */
} fp_header;

/* Directions for fp_wait. */
#define FP_READ 1  /* readable: data, end of file and errors all count */
#define FP_WRITE 2 /* writable */

/* How fp_read may avoid blocking when the fd has nothing to read. */
#define FP_MODE_BLOCK 0   /* a plain read(): the caller polled first */
#define FP_MODE_SOCKET 1  /* recv(MSG_DONTWAIT): per call, no shared O_NONBLOCK flag */
#define FP_MODE_PIPE 2    /* preadv2(RWF_NOWAIT): per call, for pipes (Linux) */
#define FP_MODE_NONBLOCK 3 /* read() on a private O_NONBLOCK description (fp_reopen_nonblocking) */
#define FP_MODE_RECORD 4  /* recv(MSG_DONTWAIT | MSG_TRUNC): a SOCK_SEQPACKET socket, one record */
#define FP_MODE_RECORD_WAIT 5 /* recv(MSG_TRUNC): the same, waiting in recv() for the record */

/* Seconds on the monotonic clock. */
double fp_now(void);

/* Write the 12-byte header of a frame of kind (FP_KIND_*) whose payload is length bytes. */
void fp_header_encode(unsigned char *out, int kind, uint64_t length);

/* Decode the header or sentinel at the start of p (avail bytes, at a frame boundary): FP_OK
 * with *h filled in; FP_MORE when avail is short (h->size: the bytes needed); FP_BAD_CHECK,
 * FP_MISMATCH, or FP_TOO_LARGE when the header's length is over cap, or a PAD frame's over
 * FP_PAD_MIN (h->value: that length). */
int fp_header_decode(const unsigned char *p, size_t avail, uint64_t cap, fp_header *h);

/* Wait until fd is ready in direction (FP_READ, FP_WRITE), or until liveness_fd (when >= 0)
 * is readable, or until wake_fd (when >= 0) is readable, or until the absolute monotonic
 * deadline (deadline < 0: no deadline). The wake fd wins, then fd, then liveness_fd. FP_WOKEN,
 * FP_OK, FP_LIVENESS, FP_TIMEOUT, or -1 with errno. */
int fp_wait(int fd, int direction, int liveness_fd, int wake_fd, double deadline);

/* A wake fd for fp_wait, for a connection whose calls must end when another thread closes
 * it: an eventfd where there is one (*rfd == *wfd), else a pipe; close-on-exec and
 * non-blocking. FP_OK, or -1 with errno. */
int fp_wake_open(int *rfd, int *wfd);

/* Make the wake fd readable, for good: every wait on it returns FP_WOKEN from then on. FP_OK,
 * or -1 with errno. */
int fp_wake(int wfd);

/* Whether fp_wake_pipe_reader works on this system (Linux: through /proc/self/fd). */
#ifdef __linux__
#define FP_HAVE_PIPE_WAKE 1
#else
#define FP_HAVE_PIPE_WAKE 0
#endif

/* Wake a thread blocked in read() on the pipe read end fd, which no wake fd can reach: write a
 * TIMEOUT sentinel (2 bytes, one atomic write) into the pipe through a write description of
 * its own, opened for the purpose and closed at once. The woken reader, which knows its
 * connection was closed, drops what it read. Waiting in a plain read() costs a pipe reader one
 * system call per wait where poll() and read() cost two, which is why blocking reads of pipes
 * are worth this. FP_OK, or -1 with errno (no /proc, not a pipe, no fd left). */
int fp_wake_pipe_reader(int fd);

/* Wake a thread blocked in recv() on the socket fd, which no wake fd can reach: shut the
 * socket's reading down (shutdown(SHUT_RD)), so that this recv() and every later one return end
 * of file. Unlike fp_wake_pipe_reader this lasts, for every process that holds the socket, so a
 * connection does it only when it closes while one of its own threads waits in recv(). FP_OK, or
 * -1 with errno. */
int fp_wake_socket_reader(int fd);

/* One read of at most n bytes: > 0 bytes read, 0 at end of file, -1 with errno. With
 * FP_MODE_SOCKET, FP_MODE_RECORD or FP_MODE_PIPE it does not block: errno EAGAIN when there is
 * nothing, and EOPNOTSUPP or EINVAL when the kernel cannot read this fd without blocking.
 * FP_MODE_RECORD (FP_MODE_RECORD_WAIT: waiting for it) reads one record of a SOCK_SEQPACKET
 * socket, whole: errno EMSGSIZE when it was longer than n (the kernel dropped the rest, so the
 * stream is broken). */
ssize_t fp_read(int fd, void *buf, size_t n, int mode);

/* Look without sleeping until fd is readable (data, end of file or an error) or until the
 * monotonic time until: 1 when readable, 0 when not in time, -1 with errno. Each look is a
 * poll() with no timeout, which reads the pipe's or socket's state without the lock its writer
 * takes; between looks sched_yield() lets any thread waiting for this CPU run first. A reader
 * whose writer answers within microseconds from another CPU then gets the bytes with no
 * scheduler wake-up on either side (on a VM, several microseconds each). */
int fp_spin_readable(int fd, double until);

/* A second, private open file description of the pipe or FIFO read end fd, with O_NONBLOCK
 * and O_CLOEXEC set on it alone: read() on it never blocks, while fd (shared with children
 * that inherited it) stays blocking. Linux opens /proc/self/fd/N, which for a pipe makes a new
 * description of the same pipe; a plain read() there costs less than preadv2(RWF_NOWAIT),
 * whose iovec path is measurably slower per call. The new fd, or -1 with errno when this
 * system cannot (no /proc, no permission, not a pipe). */
int fp_reopen_nonblocking(int fd);

/* Write the bytes described by *iov (*iovcnt entries) to fd, looping over short writes. On
 * return *iov and *iovcnt describe what is left and *written (when not NULL) grew by the bytes
 * written. With cap > 0, the first write is at most cap bytes long, and with cap_after > 0, each
 * later one at most cap_after: on a SOCK_SEQPACKET socket each write is one record, and a
 * reader takes a frame's first record, and any record of several frames, into a buffer of
 * READ_BUFFER bytes (framepipe._wire). FP_OK once all is written, or -1 with errno: after
 * EINTR the caller runs its signal handlers and calls again to finish the same frame. With
 * nowait, no write blocks (pwritev2 with RWF_NOWAIT, a per-call flag, so the shared description
 * stays blocking): errno EAGAIN when fd is full, EOPNOTSUPP where this system cannot. */
int fp_writev(int fd, struct iovec **iov, int *iovcnt, int nowait, size_t cap, size_t cap_after,
              size_t *written);

/* The identity of fd's open file (device and inode), for fp_close_if_same. FP_OK, or -1 with
 * errno (EBADF: not an open fd). */
int fp_identity(int fd, uint64_t *dev, uint64_t *ino);

/* Close fd only if it is still the file whose identity was recorded when a connection took
 * it: FP_OK when closed, FP_SKIPPED when the number now names another file (or nothing) and
 * was left alone, -1 with errno when close() failed. */
int fp_close_if_same(int fd, uint64_t dev, uint64_t ino);

#endif
