"""Why tools/asan.sh preloads tools/asan_forksafe.c: fork() under a sanitizer runtime that
takes no lock around it (gcc 12's libasan) can leave the child blocked forever. No framepipe
here, only threads, os.fork and the allocator.

    A=$(gcc -print-file-name=libasan.so)
    LD_PRELOAD=$A ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc \\
        "$(python -c 'import sys; print(sys.executable)')" tools/asan_fork_repro.py 1000

prints a few "child N hung" lines per thousand forks (seen here: 2 in 300); with the shim
preloaded first (tools/asan.sh builds it; add verify_asan_link_order=0), none in 3,000.
Without the runtime preloaded, none. A hung child sits in ASan's allocator, waiting for a lock
that a parent thread held at the fork.
"""

import os
import sys
import threading
import time

stop = False


def churn() -> None:
    # Threads that start and end (a thread's state is freed after it lets the GIL go) and list a
    # directory (opendir allocates with the GIL released): the allocator is in use at the fork.
    while not stop:
        t = threading.Thread(target=lambda: os.listdir("/proc/self/fd"))
        t.start()
        t.join()


def main(forks: int) -> int:
    global stop
    for _ in range(2):
        threading.Thread(target=churn, daemon=True).start()
    hung = 0
    for i in range(forks):
        pid = os.fork()
        if pid == 0:
            # The child starts a thread and allocates, as a worker process does at start.
            t = threading.Thread(target=lambda: [set(range(50)) for _ in range(200)])
            t.start()
            t.join()
            os._exit(0)
        deadline = time.monotonic() + 10
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                hung += 1
                print(f"fork {i}: child {pid} hung", flush=True)
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    stop = True
    print(f"{forks} forks, {hung} children hung")
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300))
