"""Hostile error payloads, built by hand (no class is imported or pickled to build them), and
a package on disk whose modules say when their code runs. Shared by test_reviving,
test_fault_matrix and test_fuzz_frames."""

from __future__ import annotations

import os
import pickle
import sys
import textwrap
from pathlib import Path
from typing import Any

FORMAT = "framepipe.remote/1"
BASES = [("builtins", "Exception"), ("builtins", "BaseException")]
GROUP = [("builtins", "ExceptionGroup"), ("builtins", "BaseExceptionGroup"), *BASES]


def class_global(module: str, qualname: str) -> bytes:
    """A pickle that calls ``module.qualname()``: what an exception's own pickle names."""
    return (
        b"\x80\x02c" + module.encode() + b"\n" + qualname.encode() + b"\n" + b")R."
    )  # GLOBAL, EMPTY_TUPLE, REDUCE, STOP


def node(
    module: str = "builtins",
    qualname: str = "ValueError",
    text: str = "boom",
    *,
    members: list[Any] | None = None,
    cause: Any = None,
    context: Any = None,
    pickled: bool = True,
    bases: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """One recorded exception, as dumps_exception records it (names and text; the object's
    own pickle names its class when ``pickled``)."""
    rec: dict[str, Any] = {
        "mro": [(module, qualname), *(bases if bases is not None else BASES)],
        "str": text,
        "args_repr": repr((text,)),
        "object": class_global(module, qualname) if pickled and members is None else None,
        "state": [],
        "traceback": [("hostile.py", "attack", 1, "hostile")],
        "cause": cause,
        "context": context,
        "suppress": False,
    }
    if members is None:
        rec["args"] = [(pickle.dumps(text), repr(text))]
    else:
        rec["message"] = text
        rec["members"] = members
        rec["mro"] = [(module, qualname), *(bases if bases is not None else GROUP)]
    return rec


def envelope(nodes: list[dict[str, Any]], root: int = 0, text: str = "hostile\n") -> bytes:
    return pickle.dumps(
        {"format": FORMAT, "root": root, "nodes": nodes, "text": text, "origin": {}}, protocol=5
    )


def error_frame(payload: bytes) -> bytes:
    """``payload`` as an error frame on the wire (check value 03 03)."""
    return b"\x03\x03" + len(payload).to_bytes(8, sys.byteorder) + b"\x03\x03" + payload


def one(module: str, qualname: str, **kw: Any) -> bytes:
    """A payload of one exception of class ``module.qualname``."""
    return envelope([node(module, qualname, **kw)])


def nested_groups(depth: int) -> bytes:
    """A group holding a group ... ``depth`` deep around one ValueError, without pickles."""
    nodes = [
        node("builtins", "ExceptionGroup", f"level {i}", members=[i + 1]) for i in range(depth)
    ]
    nodes.append(node(text="the bottom", pickled=False))
    return envelope(nodes)


def wide_group(width: int) -> bytes:
    nodes = [node("builtins", "ExceptionGroup", "wide", members=list(range(1, width + 1)))]
    nodes += [node(text=f"member {i}", pickled=False) for i in range(width)]
    return envelope(nodes)


def chain(length: int, link: str) -> bytes:
    """``length`` exceptions, each the ``link`` ("cause" or "context") of the one before."""
    nodes = [node(text=f"link {i}", pickled=False, **{link: i + 1}) for i in range(length - 1)]
    nodes.append(node(text="the first", pickled=False))
    return envelope(nodes)


def groups_of_chains(depth: int) -> bytes:
    """Groups nested ``depth`` deep whose members each have a cause that is a group too."""
    nodes: list[dict[str, Any]] = []
    for i in range(depth):
        base = len(nodes)
        nodes.append(node("builtins", "ExceptionGroup", f"g{i}", members=[base + 1]))
        nodes.append(node(text=f"m{i}", pickled=False, cause=base + 2))
    nodes.append(node(text="end", pickled=False))
    return envelope(nodes)


def member_cycle() -> bytes:
    """A group that holds itself, and a cause cycle."""
    return envelope(
        [
            node("builtins", "ExceptionGroup", "self", members=[0, 1], cause=1),
            node(text="m", pickled=False, cause=0, context=1),
        ]
    )


class Package:
    """A package ``name`` under ``root``, whose modules append a line to ``log`` when their code
    runs: ``name`` itself (empty), ``name.boom`` (defines ``Boom``), ``name.lazy`` (reached
    through the package's module ``__getattr__``) and ``name.loaded`` (a lazily loaded module
    once :meth:`lazy_load` registered it)."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.log = root / f"{name}.log"
        pkg = root / name
        pkg.mkdir()
        record = (
            f"open({str(self.log)!r}, 'a').write(__name__ + ' ' + str(__import__('os').getpid())"
            " + '\\n')\n"
        )
        (pkg / "__init__.py").write_text(
            textwrap.dedent(
                """
                def __getattr__(name):
                    import importlib
                    return getattr(importlib.import_module(__name__ + ".lazy"), name)
                """
            )
        )
        body = record + "class Boom(Exception):\n    pass\n"
        (pkg / "boom.py").write_text(body)
        (pkg / "lazy.py").write_text(record + "class LazyError(Exception):\n    pass\n")
        (pkg / "loaded.py").write_text(record + "class LoadedError(Exception):\n    pass\n")
        self.root = root

    def ran(self) -> list[str]:
        """The modules whose code ran in this process."""
        if not self.log.exists():
            return []
        me = str(os.getpid())
        lines = self.log.read_text().splitlines()
        return [line.split()[0] for line in lines if line.split()[1] == me]

    def lazy_load(self) -> None:
        """Register ``name.loaded`` as a lazily loaded module (importlib.util.LazyLoader):
        in sys.modules, its code not run until an attribute is read."""
        import importlib.util

        spec = importlib.util.find_spec(f"{self.name}.loaded")
        assert spec is not None and spec.loader is not None
        spec.loader = importlib.util.LazyLoader(spec.loader)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
