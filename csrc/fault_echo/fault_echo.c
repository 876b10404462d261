/* framepipe._fault_echo: a native crash's faulthandler dump, copied to the crashing process's
 * own stderr.
 *
 * While a framepipe.guard is open, faulthandler dumps a native crash (SIGSEGV, SIGBUS, SIGFPE,
 * SIGABRT, SIGILL) into the process's fault file, which the parent reads for its WriterDied.
 * faulthandler writes to one descriptor only, so without help the process's stderr (its log, a
 * terminal) would see nothing of the crash. This module adds that second copy from inside the
 * crashing process, without a second faulthandler:
 *
 * 1. install() puts echo_handler on the five signals, and only then does the guard enable
 *    faulthandler, which saves echo_handler as the handler it chains to;
 * 2. at a crash, faulthandler writes its dump into the fault file, restores echo_handler and
 *    raises the signal again (its handler has SA_NODEFER, so echo_handler runs at once);
 * 3. echo_handler reads the dump back from the fault file (pread on the descriptor the guard
 *    keeps open: no fsync is needed, the bytes are in the page cache) and writes it to fd 2;
 * 4. it then restores the action the signal had before install() (SIG_DFL, unless the program
 *    had its own) and raises the signal once more, so the process dies by the same signal,
 *    with the same exit status and core dump behaviour as with faulthandler alone.
 *
 * The handler is async-signal-safe: no Python, no malloc, only pread, write, poll, fstat,
 * sigaction, clock_gettime and raise, on static storage. The copy to stderr is best effort and
 * never stands between the process and its death: it stops at the first error, when fd 2 is
 * the fault file itself, and when fd 2 takes no byte for ECHO_STALL_MS (a full pipe that
 * nobody reads); SIGPIPE is ignored while it writes (a closed pipe must not turn a SIGSEGV into
 * a SIGPIPE death).
 *
 * A separate extension, not part of the compiled engine: the guard uses it whichever engine
 * runs (framepipe._core or the pure-Python framepipe._pycore), so both behave the same.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The signals faulthandler.enable() handles, in its order. */
static const int echo_signals[] = {SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL};
#define ECHO_NSIGNALS ((int)(sizeof(echo_signals) / sizeof(echo_signals[0])))

/* How long fd 2 may take no byte before the copy gives up (a full pipe nobody reads). */
#define ECHO_STALL_MS 1000

/* What the handler needs, set by install() before the handler is in place. */
static volatile sig_atomic_t echo_installed = 0;
static int echo_fd = -1;    /* the fault file, open while a guard is */
static off_t echo_from = 0; /* where faulthandler's dump begins: after the header line */
static struct sigaction echo_previous[ECHO_NSIGNALS];
/* Static, not on the stack: the handler may run on faulthandler's small alternate stack. */
static char echo_buf[PIPE_BUF];

static long
elapsed_ms(const struct timespec *since)
{
    struct timespec now;
    if (clock_gettime(CLOCK_MONOTONIC, &now) != 0)
        return ECHO_STALL_MS; /* no clock: treat as stalled rather than wait blind */
    return (long)(now.tv_sec - since->tv_sec) * 1000 + (now.tv_nsec - since->tv_nsec) / 1000000;
}

/* Write all of buf[0:len] to fd 2, waiting at most ECHO_STALL_MS for it to take each byte.
 * Returns 0, or -1 when fd 2 failed or stalled. A write is at most PIPE_BUF bytes, and only
 * after poll() said fd 2 is writable, so a pipe takes it without blocking. */
static int
echo_write(const char *buf, size_t len)
{
    struct timespec stalled_since;
    if (clock_gettime(CLOCK_MONOTONIC, &stalled_since) != 0)
        return -1;
    while (len > 0) {
        struct pollfd p = {.fd = 2, .events = POLLOUT, .revents = 0};
        long left = ECHO_STALL_MS - elapsed_ms(&stalled_since);
        if (left <= 0)
            return -1;
        int ready = poll(&p, 1, (int)left);
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0 || (p.revents & (POLLERR | POLLNVAL)))
            return -1;
        ssize_t n = write(2, buf, len);
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
        clock_gettime(CLOCK_MONOTONIC, &stalled_since);
    }
    return 0;
}

/* Copy what faulthandler appended to the fault file (from echo_from to its current end) to
 * fd 2. */
static void
echo_dump(void)
{
    int fd = echo_fd;
    struct stat file, err;
    if (fd < 0 || fd == 2 || fstat(fd, &file) != 0)
        return;
    if (fstat(2, &err) == 0 && err.st_dev == file.st_dev && err.st_ino == file.st_ino)
        return; /* stderr is the fault file: the dump is there already */
    struct sigaction ignore, pipe_action;
    memset(&ignore, 0, sizeof(ignore));
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    int pipe_saved = sigaction(SIGPIPE, &ignore, &pipe_action) == 0;
    off_t at = echo_from;
    while (at < file.st_size) {
        size_t want = sizeof(echo_buf);
        if ((off_t)want > file.st_size - at)
            want = (size_t)(file.st_size - at);
        ssize_t n = pread(fd, echo_buf, want, at);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0 || echo_write(echo_buf, (size_t)n) != 0)
            break;
        at += n;
    }
    if (pipe_saved)
        sigaction(SIGPIPE, &pipe_action, NULL); /* also drops a SIGPIPE raised meanwhile */
}

static void
echo_handler(int signum)
{
    int saved_errno = errno;
    int i = 0;
    while (i < ECHO_NSIGNALS - 1 && echo_signals[i] != signum)
        i++; /* installed on echo_signals only: the loop always finds signum */
    if (echo_installed)
        echo_dump();
    /* Die as faulthandler would have: by the action the signal had before install(). */
    sigaction(signum, &echo_previous[i], NULL);
    raise(signum);
    errno = saved_errno;
}

/* Put echo_handler on the signals, remembering their actions; 0, or -1 with errno set. */
static int
echo_install(int fd, off_t from)
{
    if (echo_installed) {
        echo_fd = fd;
        echo_from = from;
        return 0;
    }
    echo_fd = fd;
    echo_from = from;
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = echo_handler;
    sigemptyset(&action.sa_mask);
    /* As faulthandler's own: run at once when raised from its handler, on its altstack. */
    action.sa_flags = SA_NODEFER | SA_ONSTACK;
    for (int i = 0; i < ECHO_NSIGNALS; i++) {
        if (sigaction(echo_signals[i], &action, &echo_previous[i]) != 0) {
            int saved = errno;
            while (--i >= 0)
                sigaction(echo_signals[i], &echo_previous[i], NULL);
            errno = saved;
            return -1;
        }
    }
    echo_installed = 1;
    return 0;
}

/* Give each signal back its remembered action, where echo_handler is still the one in place
 * (a handler someone installed since is left alone). */
static void
echo_uninstall(void)
{
    if (!echo_installed)
        return;
    for (int i = 0; i < ECHO_NSIGNALS; i++) {
        struct sigaction current;
        if (sigaction(echo_signals[i], NULL, &current) == 0 &&
            !(current.sa_flags & SA_SIGINFO) && current.sa_handler == echo_handler)
            sigaction(echo_signals[i], &echo_previous[i], NULL);
    }
    echo_installed = 0;
    echo_fd = -1;
    echo_from = 0;
}

/* --- the Python module ------------------------------------------------------------------- */

static PyObject *
py_install(PyObject *self, PyObject *args)
{
    int fd;
    long long from;
    if (!PyArg_ParseTuple(args, "iL:install", &fd, &from))
        return NULL;
    if (fd < 0 || from < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "install(fd, offset) needs the fault file's open descriptor and the "
                        "offset its dump starts at, both >= 0");
        return NULL;
    }
    if (echo_install(fd, (off_t)from) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *
py_uninstall(PyObject *self, PyObject *unused)
{
    echo_uninstall();
    Py_RETURN_NONE;
}

static PyObject *
py_installed(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(echo_installed);
}

static PyMethodDef fault_echo_methods[] = {
    {"install", py_install, METH_VARARGS,
     "install(fd, offset)\n--\n\n"
     "Copy a native crash's faulthandler dump from the fault file open at ``fd`` (from\n"
     "``offset`` on) to fd 2. Call it before faulthandler.enable(file=fd), which must chain to\n"
     "it; called again while installed, it only changes ``fd`` and ``offset``."},
    {"uninstall", py_uninstall, METH_NOARGS,
     "uninstall()\n--\n\n"
     "Give the signals back the actions they had before install(). Call it after\n"
     "faulthandler.disable()."},
    {"installed", py_installed, METH_NOARGS,
     "installed()\n--\n\nWhether the handler is installed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fault_echo_module = {
    PyModuleDef_HEAD_INIT,
    "framepipe._fault_echo",
    "A native crash's faulthandler dump, copied from the fault file to the process's stderr\n"
    "(see csrc/fault_echo/fault_echo.c).",
    -1, /* its state is the process's signal handlers: one per process */
    fault_echo_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__fault_echo(void)
{
    return PyModule_Create(&fault_echo_module);
}
