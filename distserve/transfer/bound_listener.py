"""A UCX listener on one address, where ucxx's Python API listens on every interface.

ucxx 0.52's `create_listener(callback, port)` binds 0.0.0.0: its Cython layer passes no host to the C++
ListenerBuilder, which has `host()`. csrc/bound_listener.pyx calls it and returns the same UCXListener
object ucxx's own listener is, wrapped here exactly as `ApplicationContext.create_listener` wraps it, so
that connections arrive as ordinary ucxx Endpoints.

The extension is compiled on first use (Cython, then g++ against the headers and libucxx the ucxx
wheels ship: ~10 s) into a folder named by a digest of its source, the ucxx version and the Python
environment; `python -m distserve.transfer.bound_listener` builds it ahead (scripts/setup.sh does).
Without a compiler, `create_listener` returns None and the caller falls back to ucxx's wildcard
listener (KvSender then logs that it listens on every interface).

This leans on three private names of ucxx._lib_async (the listener handler, its tracker and the
context getter), stable across the pinned ucxx-cu12==0.52.*; the tests bind and connect through it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import weakref
from pathlib import Path
from types import ModuleType
from typing import Callable

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "bound_listener.pyx"
_MODULE = "bound_listener"
_lock = threading.Lock()
_tried = False
_module: ModuleType | None = None


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(f"{name} is not installed")
    return Path(spec.origin).parent


def _compile_command(cpp: Path, out: Path) -> list[str]:
    ucxx, libucxx, libucx = (_package_dir(name) for name in ("ucxx", "libucxx", "libucx"))
    lib = libucxx / "lib64"
    return [os.environ.get("CXX", "g++"), "-O2", "-shared", "-fPIC", "-std=c++17", "-w",
            f"-I{sysconfig.get_paths()['include']}", f"-I{ucxx / 'include'}", f"-I{libucxx / 'include'}",
            f"-I{libucx / 'include'}", str(cpp), "-o", str(out), f"-L{lib}", "-lucxx", f"-Wl,-rpath,{lib}"]


def build_directory() -> Path:
    """Where this source's build for this environment lives (beside the CPU kernels' builds)."""
    from importlib.metadata import version

    from distserve.engine.cpu_kernels import build_directory as kernels_root

    digest = hashlib.sha1(_SOURCE.read_bytes())
    digest.update(f"{version('ucxx-cu12')}\0{sys.prefix}\0{sys.version}".encode())
    return kernels_root(f"distserve_bound_listener_{digest.hexdigest()[:12]}")


def _library(directory: Path) -> Path:
    return directory / f"{_MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"


def build(directory: Path) -> Path:
    """Compiles the extension into `directory` (one builder at a time; an existing build is kept)."""
    from distserve.engine.cpu_kernels import build_guard

    library = _library(directory)
    if library.is_file():  # built before (setup does): no lock to take
        return library
    with build_guard(directory):
        if library.is_file():
            return library
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            cpp = Path(scratch) / f"{_MODULE}.cpp"
            site = str(_package_dir("ucxx").parent)  # where `cimport ucxx._lib...` finds its .pxd files
            subprocess.run([sys.executable, "-m", "cython", "--cplus", "-3", "-I", site, str(_SOURCE),
                            "-o", str(cpp)], check=True, capture_output=True, text=True)
            built = Path(scratch) / library.name
            subprocess.run(_compile_command(cpp, built), check=True, capture_output=True, text=True)
            os.replace(built, library)  # atomic: a reader sees no half-written library
    return library


def extension() -> ModuleType | None:
    """The compiled extension, built on first call; None (logged once, with why) where it cannot be."""
    global _tried, _module
    with _lock:
        if not _tried:
            _tried = True
            try:
                library = build(build_directory())
                import ucxx  # noqa: F401  loads libucx and libucxx, which the library links

                spec = importlib.util.spec_from_file_location(_MODULE, library)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _module = module
            except (OSError, ImportError, subprocess.CalledProcessError, TimeoutError) as exc:
                detail = getattr(exc, "stderr", "") or ""
                log.warning("cannot build the address-bound UCX listener (%s%s)", exc,
                            f": {detail.strip()[-500:]}" if detail else "")
        return _module


def create_listener(host: str, port: int, on_endpoint: Callable) -> object | None:
    """A ucxx Listener (as ucxx.create_listener returns) accepting on host:port only (port 0: any free
    one); on_endpoint(endpoint) is called, or awaited, with each new connection's ucxx Endpoint. Call it
    inside the running event loop, after ucxx.init(). None where the extension cannot be built."""
    module = extension()
    if module is None:
        return None
    import asyncio

    from ucxx._lib_async.listener import Listener, _listener_handler, _ListenerHandlerTracker
    from ucxx.core import _get_ctx

    context = _get_ctx()
    context.continuous_ucx_progress()
    tracker = _ListenerHandlerTracker()
    # The arguments ucxx's _listener_handler takes, as ApplicationContext.create_listener passes them.
    handler_args = (asyncio.get_running_loop(), on_endpoint, weakref.ref(context), True, 5.0, tracker)
    raw = module.create_listener(context.worker, host, port, _listener_handler, handler_args,
                                 lambda exc: log.warning("UCX listener on %s: a connection failed: %r", host, exc))
    return Listener(raw, tracker, context)


if __name__ == "__main__":  # python -m distserve.transfer.bound_listener: build now (setup does), report
    logging.basicConfig(level=logging.INFO)
    built = extension() is not None
    print("UCX bound listener:", "built" if built else "unavailable (the KV listener binds every interface)")
    sys.exit(0 if built else 1)
