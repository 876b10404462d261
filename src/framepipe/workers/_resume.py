"""What ``DataLoader.state_dict()`` holds, and how its parts are taken and put back.

The state is a plain dict of ints, lists, dicts, bytes and what the user's own objects return
from their ``state_dict()`` (docs/loader-training.md lists it key by key)::

    {"version": 1, "kind": "map" | "iterable", "num_workers": n,
     "epochs": epochs started, "seed_counter": n, "generator": <its state> or None,
     "persistent_base_seed": int or None,
     "epoch": None or {                    # the epoch in progress
         "base_seed": int,                 # worker i is seeded from base_seed + i
         "shuffle_seed": int or None,      # the permutation of shuffle=True
         "sampler": None or {"state_dict": ...} or {"generator": bytes},
         "yielded": k,                     # batches the caller took
         "done_below": j, "taken": [...],  # map-style: requests taken (all below j, and these)
         "next_worker": w,                 # iterable, in order: whose batch comes next
         "workers": [{"state": ..., "yielded": n, "exhausted": bool}, ...],  # iterable
     }}

Seeds are kept as drawn, not as the state of the generator they were drawn from, so an epoch
resumes with its permutation and worker seeds whatever drew them; the generator's state (a
``random.Random``, a NumPy or a torch Generator) is kept so that the epochs after it draw what
they would have drawn.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

VERSION = 1


def generator_state(generator: Any) -> Any:
    """A picklable state of a loader's ``generator`` (None for the ``random`` module)."""
    if generator is None:
        return None
    if hasattr(generator, "getstate"):  # random.Random
        return {"random": generator.getstate()}
    bit = getattr(generator, "bit_generator", None)
    if bit is not None:  # numpy.random.Generator
        return {"numpy": bit.state}
    if hasattr(generator, "get_state"):  # torch.Generator
        return {"torch": bytes(generator.get_state().numpy().tobytes())}
    return None


def set_generator_state(generator: Any, state: Any) -> None:
    if generator is None or state is None:
        return
    if "random" in state:
        generator.setstate(_tuples(state["random"]))
    elif "numpy" in state:
        generator.bit_generator.state = state["numpy"]
    elif "torch" in state:
        import torch

        generator.set_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))


def _tuples(value: Any) -> Any:
    """random.Random's state with its tuples back (a state that went through JSON has lists)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def sampler_state(sampler: Any) -> dict[str, Any] | None:
    """What makes ``sampler`` iterate again as it is about to: its own ``state_dict()``, or
    the state of its torch ``generator`` (torch's RandomSampler); for a batch sampler with
    neither, the same of the sampler it batches (``.sampler``, as torch's BatchSampler has);
    None when there is none of these (it is then assumed to give the same order every
    time)."""
    state = _own_state(sampler)
    if state is None and sampler is not None and hasattr(sampler, "sampler"):
        inner = _own_state(sampler.sampler)
        if inner is not None:
            return {"inner": inner}
    return state


def _own_state(sampler: Any) -> dict[str, Any] | None:
    if sampler is None:
        return None
    if callable(getattr(sampler, "state_dict", None)) and callable(
        getattr(sampler, "load_state_dict", None)
    ):
        return {"state_dict": sampler.state_dict()}
    generator = getattr(sampler, "generator", None)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(generator, torch.Generator):
        return {"generator": generator_state(generator)}
    return None


def set_sampler_state(sampler: Any, state: dict[str, Any] | None) -> None:
    if state is None or sampler is None:
        return
    if "inner" in state:
        set_sampler_state(sampler.sampler, state["inner"])
    elif "state_dict" in state:
        sampler.load_state_dict(state["state_dict"])
    elif "generator" in state:
        set_generator_state(sampler.generator, state["generator"])


def check(state: Any, kind: str, num_workers: int) -> dict[str, Any]:
    """``state`` if it is one this loader can load; ValueError saying why not otherwise."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"load_state_dict() takes the dict DataLoader.state_dict() returned, "
            f"not {type(state).__name__}"
        )
    if state.get("version") != VERSION:
        raise ValueError(
            f"this DataLoader state has version {state.get('version')!r}, this framepipe "
            f"reads version {VERSION}: take the state with the same framepipe version"
        )
    if state.get("kind") != kind:
        words = {"map": "a map-style dataset", "iterable": "an iterable dataset"}
        raise ValueError(
            "this state was taken from a loader of "
            f"{words.get(str(state.get('kind')), 'nothing')}, "
            f"and this loader's dataset is {words[kind]}: load it into a loader over the same "
            f"dataset"
        )
    missing = sorted(
        {"epochs", "seed_counter", "generator", "persistent_base_seed", "epoch"} - set(state)
    )
    if missing:
        raise ValueError(
            f"this DataLoader state lacks {', '.join(missing)}: give load_state_dict() the "
            f"whole dict state_dict() returned"
        )
    epoch = state.get("epoch")
    if kind == "iterable" and epoch is not None:
        saved = len(epoch["workers"])
        if saved != max(num_workers, 1):
            raise ValueError(
                f"this state holds the positions of {saved} workers' parts of an iterable "
                f"dataset, and this loader has num_workers={num_workers}: each worker resumes "
                f"its own part, so load it into a loader with num_workers="
                f"{state.get('num_workers')}"
            )
    return dict(state)
