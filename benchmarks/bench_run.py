"""``python -m framepipe.run`` against plain torchrun, in one run, on this machine.

Two figures, each for a job of 2 nodes x 2 ranks on loopback (two agents, c10d rendezvous on
127.0.0.1), the launchers taking turns:

- start: from starting the two agents to the moment every rank has finished its first gloo
  all_reduce;
- restart: one rank SIGKILLs itself after that first collective; from the kill to the moment
  every rank of the restarted group has finished its first all_reduce again.

Usage: ``python benchmarks/bench_run.py [--repeat N]`` (needs torch; prints medians and the
ratio framepipe.run / torchrun). The restart runs set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
for both launchers (a fresh store per rendezvous round: see docs/torchrun.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

RANK_SCRIPT = r"""
import json, os, signal, sys, time
import torch, torch.distributed as dist
out, kill = sys.argv[1], sys.argv[2] == "1"
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size() == 4
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
marker = os.path.join(out, "killed")
again = os.path.exists(marker)
with open(os.path.join(out, f"collective-{dist.get_rank()}-{again:d}"), "w") as f:
    f.write(repr(time.time()))
if kill and dist.get_rank() == 3 and not again:
    with open(marker, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
"""

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(launcher: str, out: str, kill: bool) -> float:
    script = os.path.join(out, "rank.py")
    with open(script, "w") as f:
        f.write(RANK_SCRIPT)
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    argv = [sys.executable, "-m", launcher, "--nnodes", "2", "--nproc-per-node", "2"]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    argv += ["--rdzv-id", "bench", "--max-restarts", "1" if kill else "0"]
    argv += ["--monitor-interval", "0.1", script, out, "1" if kill else "0"]
    start = time.time()
    agents = [
        subprocess.Popen(
            argv + [],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        codes = [a.wait(timeout=300) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    if codes != [0, 0]:
        raise RuntimeError(f"{launcher}: the agents exited with {codes}")

    def stamps(again: int) -> list[float]:
        return [float(open(os.path.join(out, f"collective-{r}-{again}")).read()) for r in range(4)]

    if not kill:
        return max(stamps(0)) - start
    killed = float(open(os.path.join(out, "killed")).read())
    return max(stamps(1)) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    opts = parser.parse_args()
    launchers = {"torchrun": "torch.distributed.run", "framepipe.run": "framepipe.run"}
    figures: dict[str, dict[str, list[float]]] = {
        what: {name: [] for name in launchers} for what in ("start", "restart")
    }
    for i in range(opts.repeat):
        for what in ("start", "restart"):
            order = list(launchers.items())
            if i % 2:
                order.reverse()
            for name, module in order:
                with tempfile.TemporaryDirectory(prefix="bench-run-") as out:
                    seconds = _job(module, out, kill=what == "restart")
                figures[what][name].append(seconds)
                print(f"  {what:8} {name:14} {seconds:7.2f} s", file=sys.stderr, flush=True)
    print(f"2 nodes x 2 ranks on loopback, median of {opts.repeat} (seconds)")
    print(f"{'':34}{'torchrun':>10}{'framepipe.run':>15}{'ratio':>8}")
    rows = {
        "start to first all_reduce": "start",
        "SIGKILL to restarted all_reduce": "restart",
    }
    for label, what in rows.items():
        t = statistics.median(figures[what]["torchrun"])
        f = statistics.median(figures[what]["framepipe.run"])
        print(f"{label:34}{t:10.2f}{f:15.2f}{f / t:8.2f}")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
