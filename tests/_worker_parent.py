"""A parent process for the worker fault tests: ``python _worker_parent.py MODE METHOD``.

``hold``: start a Pool of 2, a Worker and a WorkerGroup of 2, keep them busy, print their pids
as JSON, wait to be killed. ``map``: print the workers' pids, then run a long ``map`` until interrupted.
``exit PATH`` and ``exit-nowait PATH``: give a pool of 2 six tasks that each record themselves
in PATH after 0.3 s, and leave without waiting for them (``exit-nowait``: after
``shutdown(wait=False)``).
"""

from __future__ import annotations

import json
import signal
import sys
import time

from _worker_tasks import getpid, sleep_for, sleep_then_record

from framepipe.workers import Pool, Worker, WorkerGroup


def main(mode: str, method: str, path: str = "") -> None:
    # A test runner in the background may have made this process inherit SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if mode.startswith("exit"):
        pool = Pool(2, start_method=method)
        for i in range(6):
            pool.submit(sleep_then_record, 0.3, path, i)
        if mode == "exit-nowait":
            pool.shutdown(wait=False)
        return
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
    main(*sys.argv[1:])
