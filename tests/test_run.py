"""``python -m framepipe.run``: real multi-node jobs on loopback (two agents as two nodes, a
c10d rendezvous on 127.0.0.1), next to plain torchrun.

Every agent runs in its own session with a tag in its environment, which every process under
it inherits: at the end of each test no tagged process may be left (any is killed, and the test
fails).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import psutil
import pytest
from _helpers import run_python

import framepipe

# the directory that holds the framepipe under test (installed, or src/ in a checkout)
SRC = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))
TAG = "FRAMEPIPE_RUN_TEST_TAG"
AGENT_TIMEOUT = 90.0

ALLREDUCE = r"""
import json, os, sys
import torch, torch.distributed as dist
out = sys.argv[1]
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
world = dist.get_world_size()
assert world == int(os.environ["WORLD_SIZE"]) == 4, world
assert t.item() == 10.0, t.item()
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "sum": t.item(), "world": world}, f)
print(f"all_reduce ok on rank {dist.get_rank()}", flush=True)
print(f"stderr line of rank {dist.get_rank()}", file=sys.stderr, flush=True)
dist.destroy_process_group()
"""

SIGKILL = r"""
import os, signal, sys
import torch, torch.distributed as dist
out = sys.argv[1]
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size() == 4
marker = os.path.join(out, "killed")
victim = os.environ.get("VICTIM_NODE") in (None, os.environ.get("NODE_ROLE"))
if victim and os.environ["LOCAL_RANK"] == "1" and not os.path.exists(marker):
    with open(marker, "w") as f:
        f.write(os.environ["RANK"])
    print(f"rank {os.environ['RANK']} about to be killed", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
with open(os.path.join(out, f"done{dist.get_rank()}"), "w") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.destroy_process_group()
"""

HANG = r"""
import os, sys, time
def stuck_here():
    while True:
        time.sleep(0.2)
if os.environ["RANK"] == "1":
    print("rank 1 goes quiet", flush=True)
    stuck_here()
for i in range(600):
    print("tick", i, flush=True)
    time.sleep(0.05)
"""

SEGFAULT = r"""
import ctypes, os, time
def crash_in_c():
    ctypes.string_at(0)
if os.environ["RANK"] == "1":
    crash_in_c()
time.sleep(30)
"""

SLEEPER = r"""
import os, sys, time
open(os.path.join(sys.argv[1], "up" + os.environ["RANK"]), "w").close()
time.sleep(120)
"""

SELF_KILL = r"""
import os, signal, sys, time
if os.environ["RANK"] == "1":
    print("rank 1: the last words before SIGKILL", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(30)
"""


@pytest.fixture(scope="module")
def torch_dist():
    pytest.importorskip("torch")
    return pytest.importorskip("torch.distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TAG) == tag:
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


@dataclass
class Agent:
    code: int | None
    out: str
    err: str


def _run_agents(
    tmp_path,
    launcher: str,
    argvs: list[list[str]],
    envs: list[dict[str, str]] | None = None,
    meanwhile=None,
) -> list[Agent]:
    """Start one agent per argv (``python -m launcher ARGV``), call ``meanwhile(procs)`` if
    given, wait for all, return their exit codes and output; whatever is left of them is
    killed and fails the test."""
    tag = uuid.uuid4().hex
    procs, files = [], []
    try:
        for i, argv in enumerate(argvs):
            env = dict(os.environ)
            env.pop("PYTEST_CURRENT_TEST", None)  # names the test: differs between two jobs
            env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
            env[TAG] = tag
            env.update((envs or [{}] * len(argvs))[i])
            out = open(tmp_path / f"{launcher}-{i}.out", "w+")  # noqa: SIM115
            err = open(tmp_path / f"{launcher}-{i}.err", "w+")  # noqa: SIM115
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", launcher, *argv],
                    env=env,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        if meanwhile is not None:
            meanwhile(procs)
        deadline = time.monotonic() + AGENT_TIMEOUT
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        timed_out = [p.pid for p in procs if p.poll() is None]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        left = _tagged(tag)
        end = time.monotonic() + 10
        while left and time.monotonic() < end:
            time.sleep(0.1)
            left = _tagged(tag)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
    agents = []
    for p, (out, err) in zip(procs, files):
        out.seek(0)
        err.seek(0)
        agents.append(Agent(p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    assert not timed_out, f"agents {timed_out} still ran after {AGENT_TIMEOUT} s: " + "\n".join(
        a.err[-3000:] for a in agents
    )
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
    return agents


def _two_nodes(port: int, extra: list[str], script: str, *args: str) -> list[list[str]]:
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    common += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job", "--monitor-interval"]
    common += ["0.1", *extra]
    return [
        [*common, "--log-dir", os.path.join(os.path.dirname(script), f"logs{n}"), script, *args]
        for n in range(2)
    ]


def _script(tmp_path, text: str) -> str:
    path = tmp_path / "rank_script.py"
    path.write_text(text)
    return str(path)


def _detail(agents: list[Agent]) -> str:
    return "\n".join(
        f"--- agent {i} ({a.code}):\n{a.out[-2000:]}\n{a.err[-4000:]}" for i, a in enumerate(agents)
    )


def _ranks(out_dir) -> dict[int, dict]:
    return {
        int(os.path.basename(p)[4:-5]): json.load(open(p))
        for p in glob.glob(os.path.join(out_dir, "rank*.json"))
    }


def _allreduce_job(tmp_path, launcher: str, extra: list[str]) -> tuple[list[Agent], dict]:
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, ALLREDUCE)
    agents = _run_agents(tmp_path, launcher, _two_nodes(_free_port(), extra, script, str(out)))
    assert [a.code for a in agents] == [0, 0], _detail(agents)
    return agents, _ranks(out)


@pytest.fixture(scope="module")
def framepipe_job(torch_dist, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp2x2")
    agents, ranks = _allreduce_job(
        tmp, "framepipe.run", ["--tee", "1", "--local-ranks-filter", "0"]
    )
    return tmp, agents, ranks


def test_two_nodes_all_reduce(framepipe_job):
    tmp, agents, ranks = framepipe_job
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, seen in ranks.items():
        assert seen["sum"] == 10.0 and seen["world"] == 4
        env = seen["env"]
        assert env["RANK"] == str(rank)
        assert env["GROUP_RANK"] == str(rank // 2)
        assert env["LOCAL_RANK"] == str(rank % 2)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"


def test_console_prefix_and_local_ranks_filter(framepipe_job):
    tmp, agents, ranks = framepipe_job
    console = agents[0].out + agents[1].out
    # --tee 1 with --local-ranks-filter 0: local rank 0's stdout on the console, prefixed
    # with node and global rank; local rank 1's only in its file
    assert "[node0:rank0] all_reduce ok on rank 0" in console
    assert "[node1:rank2] all_reduce ok on rank 2" in console
    assert "all_reduce ok on rank 1" not in console
    assert "all_reduce ok on rank 3" not in console
    errs = agents[0].err + agents[1].err
    assert "[node0:rank0] stderr line of rank 0" in errs
    assert "stderr line of rank 1" not in errs


def test_log_dir_laid_out_as_torchrun(framepipe_job):
    tmp, agents, ranks = framepipe_job
    for rank, seen in ranks.items():
        node = int(seen["env"]["GROUP_RANK"])
        local = rank % 2
        # <log-dir>/<rdzv-id>_<random>/attempt_<restart>/<local rank>/stdout.log
        logs = None
        for n in range(2):
            found = glob.glob(str(tmp / f"logs{n}" / "job_*" / "attempt_0" / str(local)))
            for d in found:
                if os.path.dirname(os.path.dirname(seen["env"]["TORCHELASTIC_ERROR_FILE"])) == (
                    os.path.dirname(d)
                ):
                    logs = d
        assert logs is not None, (rank, node, seen["env"]["TORCHELASTIC_ERROR_FILE"])
        assert seen["env"]["TORCHELASTIC_ERROR_FILE"] == os.path.join(logs, "error.json")
        with open(os.path.join(logs, "stdout.log")) as f:
            assert f"all_reduce ok on rank {rank}" in f.read()


def test_same_job_under_torchrun_sees_the_same_environment(framepipe_job, tmp_path):
    _, _, ours = framepipe_job
    _, theirs = _allreduce_job(
        tmp_path, "torch.distributed.run", ["--tee", "1", "--local-ranks-filter", "0"]
    )
    assert sorted(theirs) == sorted(ours) == [0, 1, 2, 3]
    # values that name this run: its id, its ports, its files
    varying = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", TAG}
    for rank in ours:
        a, b = ours[rank]["env"], theirs[rank]["env"]
        assert sorted(a) == sorted(b), (rank, set(a) ^ set(b))
        same = {k for k in a if k not in varying}
        assert {k: a[k] for k in same} == {k: b[k] for k in same}


def test_sigkilled_rank_is_the_root_cause_and_the_job_restarts(torch_dist, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, SIGKILL)
    argvs = _two_nodes(_free_port(), ["--max-restarts", "1"], script, str(out))
    # a fresh store per rendezvous round (torch's shared one can hand a restarted rank the
    # address of a dead one: see docs/torchrun.md)
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = _run_agents(tmp_path, "framepipe.run", argvs, [env, env])
    assert [a.code for a in agents] == [0, 0], _detail(agents)
    victim = int((out / "killed").read_text())
    assert sorted(int(p.name[4:]) for p in out.glob("done*")) == [0, 1, 2, 3]
    # the victim's agent reports it as its own first failure (the other agent may name it
    # too, as the root cause of the job, when its own ranks failed after it)
    first_here = f"[framepipe.run]   rank {victim} (local rank 1, pid"
    reports = [a.err for a in agents if first_here in a.err]
    assert len(reports) == 1, _detail(agents)
    report = reports[0]
    node = victim // 2
    assert "was killed by SIGKILL" in report
    assert f"on node{node}" in report
    assert f"rank {victim} about to be killed" in report  # its last stderr line
    assert "restarting (1 of 1 left)" in report
    records = [
        json.load(open(p))
        for p in glob.glob(str(tmp_path / "logs*" / "job_*" / "attempt_0" / "1" / "error.json"))
    ]
    killed = [r for r in records if r.get("framepipe", {}).get("signal") == "SIGKILL"]
    assert len(killed) == 1, records
    assert killed[0]["framepipe"]["rank"] == victim
    assert killed[0]["framepipe"]["written_by"] == "supervisor"


def test_root_cause_across_nodes_in_torchs_summary(torch_dist, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, SIGKILL)
    port = _free_port()
    argvs = _two_nodes(port, ["--max-restarts", "0"], script, str(out))
    # the store's host survives the other node: its ranks fail later (their peer is gone),
    # and its summary names the first failure of the job, on the other node
    argvs[0][argvs[0].index("--monitor-interval") : 0] = ["--rdzv-conf", "is_host=1"]
    argvs[1][argvs[1].index("--monitor-interval") : 0] = ["--rdzv-conf", "is_host=0"]
    envs = [
        {"NODE_ROLE": "host", "VICTIM_NODE": "guest"},
        {"NODE_ROLE": "guest", "VICTIM_NODE": "guest"},
    ]
    agents = _run_agents(tmp_path, "framepipe.run", argvs, envs)
    assert agents[0].code != 0 and agents[1].code != 0, _detail(agents)
    victim = int((out / "killed").read_text())
    for agent in agents:
        assert "ChildFailedError" in agent.err, _detail(agents)
        root = agent.err.split("Root Cause (first observed failure):")[1]
        assert f"rank      : {victim} (local_rank: 1)" in root, _detail(agents)
        assert "(SIGKILL)" in root
        assert "error_file: <N/A>" not in root
        assert f"rank {victim} about to be killed" in root
    host = agents[0].err
    assert "root cause of the job: rank" in host and "was killed by SIGKILL" in host


def test_sigkill_record_replaces_na_in_torchs_summary(torch_dist, tmp_path):
    script = _script(tmp_path, SELF_KILL)
    agents = _run_agents(
        tmp_path, "framepipe.run", [["--standalone", "--nproc-per-node", "2", script]]
    )
    err = agents[0].err
    assert agents[0].code != 0
    root = err.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root
    assert "exitcode  : -9" in root and "(SIGKILL)" in root
    assert "error_file: <N/A>" not in root
    assert "was killed by SIGKILL" in root
    assert "peak RSS" in root and "OOM" in root
    assert "rank 1: the last words before SIGKILL" in root
    # rank 0 was stopped by the supervisor, not a failure of its own
    assert "<NO_OTHER_FAILURES>" in err


def test_hung_rank_reported_with_its_stack(torch_dist, tmp_path):
    script = _script(tmp_path, HANG)
    logs = tmp_path / "logs"
    argv = ["--standalone", "--nproc-per-node", "2", "--hang-timeout", "3", "--log-dir"]
    argv += [str(logs), "--redirects", "2", script]
    agents = _run_agents(tmp_path, "framepipe.run", [argv])
    err = agents[0].err
    assert agents[0].code != 0, _detail(agents)
    assert "wrote nothing for" in err
    root = err.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root
    assert "(SIGABRT)" in root and "hung: no output for" in root
    assert "in stuck_here" in root
    (record_path,) = glob.glob(str(logs / "*" / "attempt_0" / "1" / "error.json"))
    record = json.load(open(record_path))["framepipe"]
    assert record["exit_reason"] == "hang"
    assert "in stuck_here" in record["native_stack"]
    # the stack is in the rank's own log too
    log = open(os.path.join(os.path.dirname(record_path), "stderr.log")).read()
    assert "Fatal Python error: Aborted" in log and "in stuck_here" in log


def test_bad_hang_timeout_is_refused(torch_dist, tmp_path):
    proc = run_python(
        "-m", "framepipe.run", "--hang-timeout", "0", "x.py", env={**os.environ, "PYTHONPATH": SRC}
    )
    assert proc.returncode == 2
    assert "--hang-timeout must be a positive number of seconds" in proc.stderr


def test_without_torch_it_says_so(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from framepipe.run import main\n"
        "main(['--standalone', 'x.py'])\n"
    )
    proc = run_python("-c", code, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 1
    assert "python -m framepipe.run needs PyTorch" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_native_crash_record_has_the_stack(torch_dist, tmp_path):
    script = _script(tmp_path, SEGFAULT)
    agents = _run_agents(
        tmp_path, "framepipe.run", [["--standalone", "--nproc-per-node", "2", script]]
    )
    assert agents[0].code != 0
    root = agents[0].err.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in root and "(SIGSEGV)" in root
    assert "Fatal Python error: Segmentation fault" in root
    assert "in crash_in_c" in root


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_ranks_end_with_their_agent(torch_dist, tmp_path, sig):
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, SLEEPER)

    def kill_agent_once_ranks_run(procs):
        deadline = time.monotonic() + AGENT_TIMEOUT
        while len(list(out.glob("up*"))) < 2:
            assert time.monotonic() < deadline and procs[0].poll() is None, "ranks never ran"
            time.sleep(0.1)
        procs[0].send_signal(sig)

    agents = _run_agents(
        tmp_path,
        "framepipe.run",
        [["--standalone", "--nproc-per-node", "2", script, str(out)]],
        meanwhile=kill_agent_once_ranks_run,
    )
    # _run_agents fails the test if a rank (or its launcher) outlived the agent
    assert agents[0].code == (-signal.SIGKILL if sig == signal.SIGKILL else 1)
    if sig == signal.SIGTERM:
        assert "SignalException" in agents[0].err


@pytest.mark.parametrize(
    "flag", ["--duplicate-stdout-filters", "--duplicate-stderr-filters", "--numa-binding"]
)
def test_unsupported_torchrun_options_are_refused(torch_dist, flag):
    value = "node" if flag == "--numa-binding" else "loss"
    proc = subprocess.run(
        [sys.executable, "-m", "framepipe.run", flag, value, "x.py"],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{flag}: not supported by python -m framepipe.run" in proc.stderr
