"""A parent process for the worker fault tests: ``python _worker_parent.py MODE METHOD``.

``hold``: start a Pool of 2, a Worker and a WorkerGroup of 2, keep them busy, print their pids
as JSON, wait to be killed. ``map``: print the workers' pids, then run a long ``map`` until interrupted.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from _worker_tasks import getpid, sleep_for

from framepipe.workers import Pool, Worker, WorkerGroup


def main(mode: str, method: str) -> None:
    # A test runner in the background may have made this process inherit SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with Pool(2, start_method=method) as pool:
        pids = sorted({pool.submit(getpid).result(60) for _ in range(50)} | set(pool.pids))
        if mode == "hold":
            worker = Worker(start_method=method)
            pids.append(worker.call(getpid))
            worker.submit(sleep_for, 600)
            group = WorkerGroup(sleep_for, 2, args=(600,), start_method=method)
            group.start()
            pids += sorted(group.pids.values())
            for _ in range(4):
                pool.submit(sleep_for, 600)
            print(json.dumps(pids), flush=True)
            time.sleep(600)
        else:
            print(json.dumps(pids), flush=True)
            list(pool.map(sleep_for, [600] * 4))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
