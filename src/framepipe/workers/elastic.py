"""torchrun with :class:`~framepipe.workers.WorkerGroup` supervising each node's ranks.

torch's elastic agent machinery does the distributed part as it does under ``torchrun``:
rendezvous (c10d, etcd, static), rank assignment, restarts, membership changes, the store and
the exit barrier. :class:`FramepipeAgent` is a ``SimpleElasticAgent`` (torch's public agent
API) whose ``_start_workers``, ``_monitor_workers``, ``_stop_workers`` and ``_shutdown`` run
the node's ranks in a framepipe ``WorkerGroup`` instead of torch's process context:

- each rank gets the environment torchrun gives it (the same variables, built the same way)
  and its files where torchrun puts them (``LogsSpecs.reify``);
- a failed rank that left no error file gets one written by the supervisor, in torchelastic's
  format: how it ended (signal name), its peak RSS, whether the OOM killer took it, the last
  lines of its stderr and the native stack faulthandler dumped, if any; torch's
  ``ChildFailedError`` summary shows it instead of ``<N/A>``;
- the root cause is the first failure by time, on this node and, through the rendezvous
  store, across the nodes of the job;
- ``hang_timeout``: a rank that writes nothing to stdout or stderr for that many seconds has
  its stack taken (SIGABRT, with faulthandler on in every Python rank: ``-X faulthandler``),
  written to its log and error record, and is stopped by it;
- console lines carry ``[node<N>:rank<R>]`` (node = group rank, rank = global rank).

This module needs torch; :mod:`framepipe.run` is the command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.api import WorkerGroup as _TorchWorkerGroup
from torch.distributed.elastic.metrics.api import MetricsConfig
from torch.distributed.elastic.multiprocessing import LogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.multiprocessing.errors import (
    ProcessFailure as TorchProcessFailure,
)
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.elastic.utils.api import macros
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from ..guard import _write_json
from ._process import peak_rss
from ._stderr import TAIL_LINES
from .group import GroupFailed, GroupResult, RankOutcome, Std, WorkerGroup

__all__ = ["FramepipeAgent", "launch", "main", "build_parser"]

#: how long a hung rank has to die of the SIGABRT that takes its stack before SIGKILL
_ABORT_GRACE = 5.0
#: how long the last node standing waits for the other nodes' failure records
_GATHER_SECONDS = 3.0
_STORE_KEY = "framepipe/failure/"
_PREFIX = "[framepipe.run]"


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write("".join(f"{_PREFIX} {line}\n" for line in text.rstrip().split("\n")))
        sys.stderr.flush()


def _mib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**20:.1f} MiB"


class _NodeRanks(WorkerGroup):
    """The ranks of one node, laid out as torchrun lays them out (``LogsDest``)."""

    _own_session = True  # as torchrun starts each rank (start_new_session)

    def __init__(
        self,
        entrypoint: Callable[..., Any] | str,
        nprocs: int,
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        dest: LogsDest,
        labels: dict[int, str],
        start_method: str,
        grace: float,
        name: str,
    ) -> None:
        self._dest = dest
        self._labels = labels
        errors = [p for p in dest.error_files.values() if p and p != os.devnull]
        log_dir = os.path.dirname(os.path.dirname(errors[0])) if errors else None
        super().__init__(
            [entrypoint] if isinstance(entrypoint, str) else entrypoint,
            nprocs,
            args=args,
            envs=envs,
            log_dir=log_dir,
            redirects=Std.NONE,
            start_method=start_method,
            name=name,
            grace=grace,
        )

    @staticmethod
    def _file(path: str | None) -> str | None:
        return path if path and path != os.devnull else None

    def _rank_paths(self, rank: int, base: str) -> tuple[str | None, str | None, str]:
        dest = self._dest
        error = self._file(dest.error_files.get(rank)) or os.path.join(
            base, str(rank), "error.json"
        )
        return self._file(dest.stdouts.get(rank)), self._file(dest.stderrs.get(rank)), error

    def _stream_plan(self, rank: int, which: Std, path: str | None) -> str:
        # Every stream goes through a pipe: the supervisor sees each rank's output (the hang
        # check) and prefixes what it shows. torchrun's rules decide what is shown: a stream
        # not redirected, or tee'd, reaches the console unless --local-ranks-filter leaves the
        # rank out (its LogsDest then says os.devnull, or drops the tee).
        dest = self._dest
        target = (dest.stdouts if which is Std.OUT else dest.stderrs).get(rank, "")
        tees = dest.tee_stdouts if which is Std.OUT else dest.tee_stderrs
        shown = target == "" or (bool(path) and rank in tees)
        return "prefix" if shown else "quiet"

    def _label(self, rank: int) -> str:
        return self._labels[rank]


class FramepipeAgent(SimpleElasticAgent):
    """torch's ``SimpleElasticAgent`` with a framepipe :class:`WorkerGroup` running the ranks.

    ``spec``, ``logs_specs``, ``start_method``, ``exit_barrier_timeout`` and
    ``shutdown_timeout`` mean what they mean to torch's ``LocalElasticAgent``.
    ``hang_timeout`` (seconds, None: off): a rank that writes nothing to stdout or stderr for
    that long is taken as hung: its stack is taken (SIGABRT; faulthandler dumps it to its
    stderr), written to its log and its error record, and it is stopped.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        shutdown_timeout: int = 30,
        hang_timeout: float | None = None,
    ) -> None:
        super().__init__(spec, exit_barrier_timeout, shutdown_timeout)
        self._logs_specs = logs_specs
        self._start_method = start_method
        self._hang_timeout = hang_timeout
        self._group: _NodeRanks | None = None
        self._peak: dict[int, int] = {}
        self._hung: dict[int, tuple[float, int, float]] = {}  # rank: (quiet s, at ns, abort at)
        self._attempt_dir: str | None = None
        self.failure_reports: list[str] = []

    # -- torch's SimpleElasticAgent hooks ------------------------------------------------------

    def _start_workers(self, worker_group: _TorchWorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        if worker_group.store is None:
            raise RuntimeError("the rendezvous gave the worker group no store")
        args: dict[int, tuple[Any, ...]] = {}
        envs: dict[int, dict[str, str]] = {}
        labels: dict[int, str] = {}
        for worker in worker_group.workers:
            local_rank = worker.local_rank
            env = self._rank_env(worker_group, worker)
            envs[local_rank] = env
            args[local_rank] = tuple(macros.substitute(list(spec.args), str(local_rank)))
            labels[local_rank] = f"node{worker_group.group_rank}:rank{worker.global_rank}"
        dest = self._logs_specs.reify(envs)  # torchrun's layout; sets TORCHELASTIC_ERROR_FILE
        self._install_signal_handlers()
        if spec.entrypoint is None:
            raise RuntimeError("the worker spec has no entry point")
        group = _NodeRanks(
            spec.entrypoint,
            spec.local_world_size,
            args,
            envs,
            dest,
            labels,
            self._start_method,
            float(self._shutdown_timeout),
            spec.role,
        )
        self._group = group
        self._peak = {}
        self._hung = {}
        self._attempt_dir = group.log_dir
        group.start()
        return group.pids

    def _rank_env(self, worker_group: _TorchWorkerGroup, worker: Any) -> dict[str, str]:
        """The variables LocalElasticAgent._start_workers gives each rank, in its order."""
        spec = worker_group.spec
        env = {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(worker_group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": str(worker_group.master_addr),
            "MASTER_PORT": str(worker_group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(spec.max_restarts - self._remaining_restarts),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", str(1)),
        }
        self._set_local_rank_env(env, worker.local_rank, spec)
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        watchdog = os.getenv("TORCHELASTIC_TIMER_FILE")
        if watchdog is not None:
            env["TORCHELASTIC_TIMER_FILE"] = watchdog
        return env

    @staticmethod
    def _set_local_rank_env(env: dict[str, str], local_rank: int, spec: WorkerSpec) -> None:
        # LocalElasticAgent._set_local_rank_env, for the same variables
        if getattr(spec, "virtual_local_rank", False):
            env["LOCAL_RANK"] = "0"
            visible = os.getenv("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                gpus = visible.split(",")
                if local_rank >= len(gpus):
                    raise ValueError(
                        f"local_rank {local_rank} exceeds available GPUs in "
                        f"CUDA_VISIBLE_DEVICES={visible}"
                    )
                env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank].strip()
            else:
                env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
            return
        env["LOCAL_RANK"] = str(local_rank)
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]

    def _install_signal_handlers(self) -> None:
        """What torch's process context does at its start: the signals torchrun handles raise
        ``SignalException`` in the agent, which stops the ranks with that signal."""
        if threading.current_thread() is not threading.main_thread():
            return
        names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
        for name in names.split(","):
            sig = getattr(signal, name.strip(), None)
            if isinstance(sig, signal.Signals):
                with contextlib.suppress(ValueError, OSError, RuntimeError):
                    signal.signal(sig, _raise_signal_exception)

    def _monitor_workers(self, worker_group: _TorchWorkerGroup) -> RunResult:
        group = self._group
        if group is None:
            return RunResult(state=WorkerState.UNKNOWN)
        outcome = group.poll()
        if outcome is None:
            self._sample_memory(group)
            self._check_hangs(group)
            return RunResult(state=WorkerState.HEALTHY)
        by_local = {w.local_rank: w.global_rank for w in worker_group.workers}
        if isinstance(outcome, GroupResult):
            return RunResult(
                state=WorkerState.SUCCEEDED,
                return_values={by_local[r]: v for r, v in outcome.return_values.items()},
            )
        return RunResult(state=WorkerState.FAILED, failures=self._failures(worker_group, outcome))

    def _stop_workers(self, worker_group: _TorchWorkerGroup) -> None:
        self._close_group(signal.SIGTERM, self._shutdown_timeout)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self._close_group(death_sig, timeout)

    def _close_group(self, death_sig: int, timeout: float) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close(death_sig, float(timeout))

    # -- what the supervisor adds --------------------------------------------------------------

    def _sample_memory(self, group: WorkerGroup) -> None:
        for rank, pid in group.pids.items():
            if pid is not None:
                peak = peak_rss(pid)
                if peak is not None and peak > self._peak.get(rank, 0):
                    self._peak[rank] = peak

    def _check_hangs(self, group: WorkerGroup) -> None:
        limit = self._hang_timeout
        if not limit:
            return
        now = time.monotonic()
        pids = group.pids
        for rank, quiet in group.quiet_for().items():
            pid = pids.get(rank)
            if pid is None:
                continue
            if rank in self._hung:
                if now >= self._hung[rank][2]:  # SIGABRT did not end it
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                continue
            if quiet < limit:
                continue
            self._hung[rank] = (quiet, time.time_ns(), now + _ABORT_GRACE)
            _say(
                f"{group._label(rank)} (pid {pid}) wrote nothing for {quiet:.1f} s "
                f"(--hang-timeout {limit:g}): taking its stack, then stopping it"
            )
            with contextlib.suppress(Exception):
                import resource

                resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))  # a stack, not a core
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGABRT)  # faulthandler dumps every thread, then it dies

    def _failures(
        self, worker_group: _TorchWorkerGroup, outcome: GroupFailed
    ) -> dict[int, TorchProcessFailure]:
        """torch's failures of this node, root cause first, each with an error record; the
        report printed; the root published to the other nodes."""
        by_local = {w.local_rank: w.global_rank for w in worker_group.workers}
        node = worker_group.group_rank
        host = socket.gethostname()
        records = self._records(outcome, node, by_local, host)
        order = sorted(records, key=lambda r: (records[r][0], r))
        failures: dict[int, TorchProcessFailure] = {}
        for rank in order:
            o = outcome.outcomes[rank]
            failures[by_local[rank]] = TorchProcessFailure(
                local_rank=rank,
                pid=o.pid or 0,
                exitcode=o.exitcode if o.exitcode is not None else 1,
                error_file=records[rank][1],
            )
        if not order:
            return failures
        root = order[0]
        at_ns, _, data = records[root]
        mine = {
            "node": node,
            "host": host,
            "rank": by_local[root],
            "local_rank": root,
            "pid": outcome.outcomes[root].pid,
            "exitcode": outcome.outcomes[root].exitcode,
            "at_ns": at_ns,
            "record": data,
        }
        return self._publish(worker_group, mine, failures)

    def _records(
        self, outcome: GroupFailed, node: int | None, by_local: dict[int, int], host: str
    ) -> dict[int, tuple[int, str, dict[str, Any]]]:
        """``{local rank: (failed at ns, error file, record)}`` of each failed rank: its own
        error file's record, else one the supervisor writes there."""
        group = self._group
        assert group is not None
        records: dict[int, tuple[int, str, dict[str, Any]]] = {}
        for rank, o in outcome.failures.items():
            hung = self._hung.get(rank)
            at_ns = hung[1] if hung else int((o.failed_at or time.time()) * 1e9)
            path = group.error_files.get(rank) or ""
            own = o.error is not None and o.error.error_file not in ("<N/A>", "")
            data = _read_record(path) if own and not hung else None
            if data is None:
                data = self._record(o, node, by_local[rank], host, at_ns, hung)
                with contextlib.suppress(OSError):
                    _write_json(path, data)
            records[rank] = (at_ns, path, data)
        return records

    def _publish(
        self,
        worker_group: _TorchWorkerGroup,
        mine: dict[str, Any],
        failures: dict[int, TorchProcessFailure],
    ) -> dict[int, TorchProcessFailure]:
        """Publish this node's root failure, read the other nodes', print the report."""
        node, at_ns = mine["node"], mine["at_ns"]
        store = worker_group.store
        with contextlib.suppress(Exception):
            assert store is not None
            store.set(f"{_STORE_KEY}{node}", json.dumps(mine))
        last = self._remaining_restarts == 0
        others = self._gather(worker_group, _GATHER_SECONDS if last else 0.0)
        first_remote = min(others, key=lambda e: (e["at_ns"], e["node"]), default=None)
        job_root = mine
        if first_remote is not None and first_remote["at_ns"] < at_ns:
            job_root = first_remote
            if last:  # torch's own summary names it too: first in the failures, with its record
                failures = {**self._remote_failure(first_remote), **failures}
        report = self._report(node, mine, job_root, others, last)
        self.failure_reports.append(report)
        _say(report)
        return failures

    def _record(
        self,
        o: RankOutcome,
        node: int | None,
        rank: int,
        host: str,
        at_ns: int,
        hung: tuple[float, int, float] | None,
    ) -> dict[str, Any]:
        """The supervisor's error record of a rank that left none (torchelastic's format)."""
        who = f"rank {rank} (local rank {o.rank}, pid {o.pid}) on node{node} ({host})"
        peak = self._peak.get(o.rank)
        if hung:
            headline = (
                f"{who} hung: no output for {hung[0]:.1f} s (--hang-timeout); its stack was "
                f"taken and it was stopped ({o.how()})"
            )
        else:
            headline = f"{who} {o.how()}"
        text = "\n".join([headline, *_record_lines(o, peak, hung is not None)])
        return {
            "message": {
                "message": headline,
                "extraInfo": {"py_callstack": text, "timestamp": str(at_ns // 1_000_000_000)},
            },
            "framepipe": {
                "pid": o.pid,
                "host": host,
                "node": node,
                "rank": rank,
                "local_rank": o.rank,
                "label": f"node{node}:rank{rank}",
                "exit_reason": "hang" if hung else ("signal" if o.signal_name else "exit"),
                "exitcode": o.exitcode,
                "signal": o.signal_name,
                "peak_rss": peak,
                "oom_killed": o.oom_killed,
                "stderr_tail": o.stderr_tail,
                "native_stack": o.native_stack,
                "timestamp_ns": at_ns,
                "written_by": "supervisor",
            },
        }

    def _gather(self, worker_group: _TorchWorkerGroup, wait: float) -> list[dict[str, Any]]:
        """The other nodes' root failures of this rendezvous round, from the store (waiting
        up to ``wait`` seconds for nodes that have not written one yet)."""
        store = worker_group.store
        if store is None:
            return []
        size = worker_group.group_world_size or 0
        keys = {g: f"{_STORE_KEY}{g}" for g in range(size) if g != worker_group.group_rank}
        found: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + wait
        while keys:
            for g, key in list(keys.items()):
                try:
                    if store.check([key]):
                        found[g] = json.loads(store.get(key))
                        del keys[g]
                except Exception:  # noqa: BLE001 - the store may be gone with its node
                    return list(found.values())
            if not keys or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return list(found.values())

    def _remote_failure(self, entry: dict[str, Any]) -> dict[int, TorchProcessFailure]:
        base = self._attempt_dir or self._logs_specs.root_log_dir
        path = os.path.join(base, "other_nodes", f"node{entry['node']}_rank{entry['rank']}.json")
        try:
            _write_json(path, entry["record"])
        except OSError:
            return {}
        return {
            int(entry["rank"]): TorchProcessFailure(
                local_rank=int(entry["local_rank"]),
                pid=int(entry["pid"] or 0),
                exitcode=int(entry["exitcode"] if entry["exitcode"] is not None else 1),
                error_file=path,
            )
        }

    def _report(
        self,
        node: int | None,
        mine: dict[str, Any],
        job_root: dict[str, Any],
        others: list[dict[str, Any]],
        last: bool,
    ) -> str:
        spec = self._worker_group.spec
        attempt = spec.max_restarts - self._remaining_restarts
        text = _record_text(mine["record"])
        lines = [f"node{node}: the ranks failed (attempt {attempt}); first failure here:"]
        lines += [f"  {line}" for line in text.split("\n")]
        if job_root is not mine:
            first = _record_text(job_root["record"]).split("\n")[0]
            late = (mine["at_ns"] - job_root["at_ns"]) / 1e9
            lines.append(
                f"root cause of the job: {first} ({late:.3f} s before the first failure here)"
            )
        elif others:
            lines.append("root cause of the job: the failure above (the first of all nodes)")
        if last:
            lines.append("no restarts left")
        else:
            lines.append(f"restarting ({self._remaining_restarts} of {spec.max_restarts} left)")
        return "\n".join(lines)


def _record_lines(o: RankOutcome, peak: int | None, hung: bool) -> list[str]:
    """The body of the supervisor's record of a failed rank: memory, stderr, stack."""
    lines = [f"peak RSS: {_mib(peak)} (last sampled)"]
    if o.signal_name == "SIGKILL" or o.oom_killed:
        if o.oom_killed:
            hint = "the OOM killer took it (its memory cgroup counted an OOM kill)"
        elif o.oom_killed is False:
            hint = "not the OOM killer (its cgroup counted no OOM kill): a kill -9 from outside"
        else:
            hint = "the OOM killer or a kill -9 from outside (the cgroup could not be read)"
        lines.append(f"OOM: {hint}")
    if o.stderr_tail and not (hung and o.native_stack):
        where = f" ({o.stderr_path})" if o.stderr_path else ""
        lines += [f"last stderr lines{where}:"] + [
            f"  | {line}" for line in o.stderr_tail.split("\n")[-TAIL_LINES:]
        ]
    if o.native_stack:
        lines += ["stack (faulthandler):", o.native_stack]
    elif hung:
        lines.append("stack: none was dumped (not a Python rank, or faulthandler was off)")
    return lines


def _read_record(path: str) -> dict[str, Any] | None:
    """A rank's own error file, None when it cannot be read as torchelastic's JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "message" in data else None


def _record_text(data: dict[str, Any]) -> str:
    """What torch's summary shows of a record: its traceback, else its message."""
    message = data.get("message")
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        return str(stack or message.get("message") or "<N/A>")
    return str(message)


def _raise_signal_exception(signum: int, frame: Any) -> None:
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


# --------------------------------------------------------------------------------------------
# The launcher: torch's launch_agent with FramepipeAgent
# --------------------------------------------------------------------------------------------


def _addr_and_port(params: RendezvousParameters) -> tuple[str | None, int | None]:
    if params.backend != "static":
        return None, None
    endpoint = params.endpoint.strip()
    if not endpoint:
        raise ValueError("the static rendezvous needs --rdzv-endpoint HOST:PORT")
    addr, port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    if port == -1:
        raise ValueError(f"the static rendezvous endpoint {endpoint!r} has no port")
    return addr, port


def _entrypoint_name(entrypoint: Callable[..., Any] | str, args: Sequence[Any]) -> str:
    """The name torch's failure summary gives the job: the script of a Python command."""
    if not isinstance(entrypoint, str):
        return str(getattr(entrypoint, "__qualname__", entrypoint))
    if entrypoint == sys.executable:
        words = iter(str(a) for a in args)
        for word in words:
            if word in ("-X", "-W"):
                next(words, None)
            elif word == "-m":
                return next(words, entrypoint)
            elif not word.startswith("-"):
                return word
    return entrypoint


def _worker_spec(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: Sequence[Any]
) -> WorkerSpec:
    """torch's ``WorkerSpec`` of this node under ``config``, with its rendezvous handler."""
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        virtual_local_rank=getattr(config, "virtual_local_rank", False),
    )


def launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any],
    hang_timeout: float | None = None,
) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` as this node's ranks under ``config`` (torch's
    ``LaunchConfig``), as ``torch.distributed.launcher.api.launch_agent`` does with
    :class:`FramepipeAgent`; the return values by global rank, or ``ChildFailedError``."""
    spec = _worker_spec(config, entrypoint, args)
    assert config.logs_specs is not None
    agent = FramepipeAgent(
        spec,
        config.logs_specs,
        start_method=config.start_method,
        shutdown_timeout=int(getattr(config, "shutdown_timeout", 30)),
        hang_timeout=hang_timeout,
    )
    name = _entrypoint_name(entrypoint, args)
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            if not result.failures:
                raise RuntimeError("the worker group was stopped before any rank failed")
            raise ChildFailedError(name=name, failures=result.failures)
        values: dict[int, Any] = result.return_values
        return values
    except ChildFailedError:
        raise
    except SignalException:
        shutdown_rdzv = False  # as torch: the rendezvous stays open for the next agents
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def build_parser() -> Any:
    """torchrun's own argument parser, plus ``--hang-timeout``."""
    parser = get_args_parser()
    parser.prog = "python -m framepipe.run"
    parser.description = (
        "torchrun with framepipe supervising each node's ranks: the same arguments, the same "
        "environment for the ranks; error records for ranks killed by a signal, the root "
        "cause across nodes, hang detection with stacks, [nodeN:rankR] console prefixes."
    )
    parser.add_argument(
        "--hang-timeout",
        "--hang_timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="take a rank that writes nothing to stdout or stderr for this many seconds as "
        "hung: dump its stack (faulthandler) into its log and error record, then stop it "
        "(default: off)",
    )
    return parser


def _config(args: Any) -> tuple[LaunchConfig, Callable[..., Any] | str, list[Any]]:
    """torchrun's run(): the defaults it fills in, then its config_from_args; and
    ``-X faulthandler`` for Python ranks, so a hung or crashing rank leaves its stack."""
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, cmd, cmd_args = config_from_args(args)
    cmd_args = list(cmd_args)
    if isinstance(cmd, str) and not args.no_python and cmd_args[:1] == ["-u"]:
        cmd_args[1:1] = ["-X", "faulthandler"]
    return config, cmd, cmd_args


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m framepipe.run [torchrun's arguments] [--hang-timeout S] script ...``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hang_timeout is not None and not args.hang_timeout > 0:
        parser.error(
            f"--hang-timeout must be a positive number of seconds, not {args.hang_timeout}"
        )
    unsupported = [
        flag
        for flag, value in (
            ("--duplicate-stdout-filters", args.duplicate_stdout_filters),
            ("--duplicate-stderr-filters", args.duplicate_stderr_filters),
            ("--numa-binding", getattr(args, "numa_binding", None)),
        )
        if value
    ]
    if unsupported:
        parser.error(
            f"{', '.join(unsupported)}: not supported by python -m framepipe.run; leave "
            "it out, or launch this job with torchrun"
        )
    if os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") == "1":
        _say(
            "TORCHELASTIC_ENABLE_FILE_TIMER=1 is ignored: framepipe.run runs no file timer "
            "server (--hang-timeout takes hung ranks' stacks and stops them)"
        )
    _run(args)


@record
def _run(args: Any) -> None:
    config, cmd, cmd_args = _config(args)
    launch(config, cmd, cmd_args, hang_timeout=args.hang_timeout)
