"""A data loader on framepipe workers: torch's ``DataLoader`` arguments, framepipe's transport.

:class:`DataLoader` takes the arguments torch users know, with torch's defaults
(``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler``, ``num_workers``, ``collate_fn``,
``prefetch_factor``, ``in_order``, ``timeout``, ``worker_init_fn``, ``persistent_workers``,
``drop_last``) and needs
no torch. How it works:

- Every worker has its own duplex channel (:class:`~framepipe.workers._process.WorkerProcess`).
  No queue is shared by the workers, so a crash costs what that worker held and nothing else.
- The parent samples (the sampler runs in the parent, as under torch, so a
  ``DistributedSampler`` plugs in unchanged) and gives each worker its batches ahead of time,
  :data:`CHUNK` to a message. What a worker may load is decided by credits: it holds
  ``prefetch_factor`` of them, spends one per batch it loads, and gets it back when the caller
  takes that batch. So at most ``prefetch_factor * num_workers`` batches are loaded (or being
  loaded) and not yet taken, however far ahead the indices went: that bounds the parent's
  memory. Credits come back one at a time while a worker's batches are slow to load (it must
  never wait), and in groups while they are fast (a credit costs a write and a wake-up, which
  is most of what a fast batch costs); the worker reports which. A worker whose batches are
  small arrays that load fast (each under 64 KiB, sent inline) may hold up to
  ``max(prefetch_factor, DEEP_AHEAD)`` credits, their groups half that.
- In order (the default), batches go to the workers round robin, torch's order (batch k to
  worker ``k % num_workers``; a worker whose part of an iterable dataset ended is skipped), so
  a seed reproduces an epoch; the parent reads each batch from the worker that holds it, and
  what the other workers loaded waits in their channels (there is no reorder buffer to fill).
  ``in_order=False`` gives each worker a new chunk when it runs low and yields whatever any
  worker has ready.
- Collate (:mod:`.collate`): torch's ``default_collate`` and ``default_convert`` with torch
  installed (batches are tensors), NumPy's arrays without it.
- Results: a batch that is one NumPy array or CPU tensor under ``wire.INLINE_MAX`` (64 KiB)
  is written as a pickle built directly (``wire._inline_array``), and a worker with credit for
  several such batches writes them in one frame. Anything else travels with
  ``Connection.send`` (pickle protocol 5): arrays from 64 KiB out of band on the connection's
  bulk socketpair (one kernel copy each way), from ``_shm.SHM_MIN`` (1 MiB) in a per-worker
  pool of memfds that the parent
  maps and hands back when the array is freed (no copy in the parent). Torch tensors travel
  as their NumPy view and are rebuilt with ``torch.from_numpy`` (no copy).
- Failures: a dead worker is seen at once (the channel is watched: :class:`framepipe.WriterDied`
  after every batch it finished) and raises :class:`WorkerCrashed` naming the worker, its pid,
  exit code or signal, the batch it was loading and the others it held (``err.batches``) and
  those queued for it (``err.queued``), the OOM hint and its stderr tail. An
  exception in the dataset or ``collate_fn`` is raised in the parent as its own type, with the
  worker's traceback and a note naming the index. ``timeout`` raises :class:`LoaderTimeout` with
  the stuck worker's stack. Workers stop when the epoch ends (unless persistent), when the
  iteration is abandoned, and when the loader is deleted or closed.
- Training (docs/loader-training.md): ``worker_crash_retries`` gives the batches of a worker
  that died to a fresh one (``recovery.retry``); ``state_dict()`` / ``load_state_dict()``
  resume an epoch (NOTE [ Resuming an epoch ], in :mod:`.epoch`, and
  :mod:`framepipe.workers._resume`); ``pin_memory`` pins batches in the parent
  (:mod:`framepipe.workers._pin`).

The package, in torch's manner: :mod:`.worker` (the worker's loop and fetching), :mod:`.collate`,
:mod:`.credits` (the credit counters), :mod:`.wire` (the messages and the directly built
pickles), :mod:`.manager` (the parent's side of the workers), :mod:`.epoch` (one pass),
:mod:`.samplers` and :mod:`.dataloader` (the class users build).
"""

from __future__ import annotations

from .collate import default_collate, default_convert
from .dataloader import DataLoader
from .errors import LoaderTimeout, WorkerCrashWarning, WorkerInitError
from .worker import WorkerInfo, get_worker_info

__all__ = [
    "DataLoader",
    "LoaderTimeout",
    "WorkerCrashWarning",
    "WorkerInfo",
    "WorkerInitError",
    "default_collate",
    "default_convert",
    "get_worker_info",
]
