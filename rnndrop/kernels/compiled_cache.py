"""Where the compiled kernel's library lives, how it gets there, and what is checked before it is
loaded (issues 42 and 44).

The folder is ``<torch's extension root>/<name>`` (``TORCH_EXTENSIONS_DIR`` or torch's default),
``name`` a hash of everything that changes the binary (:func:`build_key`): the C++ sources and
headers, the flags, torch's version and C++ ABI, the Python ABI, the compiler, and this
environment's include paths; two virtual environments on one machine get two folders. In it:

- ``<name>.so``: the library, only ever written whole (a copy, then ``os.replace``), never in place;
- ``<name>.json``: what the build wrote, size and sha256 of the library. A library that does not
  match it (a truncated copy, a partial sync: loading one kills the process with SIGBUS) is never
  loaded: it is rebuilt, or the layer falls back;
- ``build.lock``: held (``flock``) by the one process that builds, with its pid, host and start
  time. The operating system releases the lock when its owner dies, however it dies, so a killed
  build never makes anyone wait; where the lock still looks held but its owner is a dead process
  of this host (a forked child kept it), it is taken over; a live owner is waited on for a bounded
  time (:data:`WAIT_FOR_OTHER_BUILD_S`), after which the error names the file to delete;
- ``build-<host>-<pid>/``: a builder's private work folder (torch's ninja build runs there, in a
  child process); the next builder removes a killed one's.

A complete library in a folder this process may not write to (a read-only install, a shared
cache) is loaded as it is: loading writes nothing and takes no lock.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

from rnndrop.atomic import file_sha256

try:
    import fcntl
except ImportError:  # Windows: no flock; the pid and host in the lock decide
    fcntl = None  # type: ignore[assignment]

__all__ = ["Cache", "Unavailable", "build_key", "extensions_root"]

logger = logging.getLogger(__name__)

#: How long a build waits for another live process's build of the same folder before giving up.
WAIT_FOR_OTHER_BUILD_S = 900.0
#: How often a waiting or compiling build reports (``progress``).
REPORT_EVERY_S = 15.0
#: How long a held lock must name the same dead process before it is taken over: the process that
#: has just locked it writes its own record within microseconds, so a record that stays is stale.
TAKE_OVER_AFTER_S = 1.0


class Unavailable(RuntimeError):
    """Why the compiled kernel cannot be had, and ``how`` to get it when that is not the usual
    advice (install a compiler and ninja)."""

    def __init__(self, reason: str, how: str | None = None) -> None:
        super().__init__(reason)
        self.how = how


def build_key(sources: Sequence[Path], headers: Sequence[Path], flags: Sequence[str]) -> str:
    """A hex digest of everything that changes the compiled binary: the source folder, the sources
    and headers, the flags, torch (version, build, C++ ABI), Python (ABI tag, headers), the
    compiler named by ``CXX`` (where it resolves, when it was installed) and torch's headers in this
    environment."""
    parts: list[str] = [str(Path(sources[0]).parent.resolve()), " ".join(flags)]
    parts += [torch.__version__, str(torch.version.git_version), str(torch._C._GLIBCXX_USE_CXX11_ABI)]
    parts += [str(sysconfig.get_config_var("EXT_SUFFIX")), sys.implementation.cache_tag or "",
              sysconfig.get_paths()["include"], str(Path(torch.__file__).resolve().parent / "include")]
    compiler = os.environ.get("CXX", "c++")
    resolved = shutil.which(compiler)
    parts += [compiler, os.path.realpath(resolved) if resolved else ""]
    with contextlib.suppress(OSError):
        parts.append(str(os.stat(os.path.realpath(resolved or "")).st_mtime_ns))
    digest = hashlib.sha256("\0".join(parts).encode())
    for path in list(sources) + list(headers):
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def extensions_root() -> Path:
    """torch's extension root, as ``torch.utils.cpp_extension`` computes it (not created)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    import torch.utils.cpp_extension as cpp_extension

    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(cpp_extension.get_default_build_root()) / f"{python}_{accelerator}"


def _pid_namespace() -> str | None:
    """This process's pid namespace (Linux; None elsewhere): a pid says whether a process runs
    only within its namespace (containers sharing a host name and a cache have their own)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


#: The compilation, in a child process: torch's JIT build into a private folder (and an import of
#: the result there, so a library that cannot load never reaches the cache).
_COMPILE = """
import json, sys
import torch.utils.cpp_extension as cpp_extension
name, folder = sys.argv[1:3]
sources, cflags, ldflags = (json.loads(a) for a in sys.argv[3:6])
cpp_extension.load(name=name, sources=sources, extra_cflags=cflags, extra_ldflags=ldflags,
                   build_directory=folder, verbose=False)
"""

#: Compilations running in this process's children, stopped at exit (:func:`stop_children`); after
#: that, none starts.
_children: dict[subprocess.Popen[bytes], Path] = {}  # each with its work folder
_children_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child's own lock and no compiler children of its own (they are the parent's)."""
    global _children_lock
    _children_lock = threading.Lock()
    _children.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
_stopping = False


def _stop(child: subprocess.Popen[bytes]) -> None:
    """Stop a compilation and its compiler processes (its own process group); remove its work."""
    with contextlib.suppress(OSError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=5)
    work = _children.pop(child, None)
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)


def stop_children() -> bool:
    """Stop the compilations still running (at exit: a background build must not outlive its
    process); whether there was one."""
    global _stopping
    with _children_lock:
        _stopping = True
        running = [child for child in list(_children) if child.poll() is None]
    for child in running:
        _stop(child)
    return bool(running)


class Cache:
    """The cached library of the extension ``name`` in ``folder``."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.folder = Path(folder)
        self.library = self.folder / f"{name}.so"
        self.manifest = self.folder / f"{name}.json"
        self.lock_file = self.folder / "build.lock"
        self._dead_record: tuple[bytes, float] | None = None  # (record, first seen): _stale_for_long

    # -------------------------------------------------------------- reading

    def check(self) -> str | None:
        """None when the library is there and is what its build wrote; else why not (``"missing"``
        when there is none)."""
        if not self.library.exists():
            return "missing"
        try:
            recorded = json.loads(self.manifest.read_text())
            size, sha256 = int(recorded["size"]), str(recorded["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            return f"{self.library} has no record of its build ({self.manifest.name} missing or unreadable)"
        actual = self.library.stat().st_size
        if actual != size:
            return f"{self.library} is {actual} bytes, its build wrote {size} (truncated or damaged)"
        if file_sha256(self.library) != sha256:
            return f"{self.library} is not the file its build wrote (sha256 differs)"
        return None

    def load(self) -> ModuleType:
        """Import the library (checked by :meth:`check` first)."""
        spec = importlib.util.spec_from_file_location(self.name, self.library)
        if spec is None or spec.loader is None:
            raise Unavailable(f"cannot import {self.library}")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except ImportError as error:
            raise Unavailable(f"the cached library {self.library} does not load ({error})",
                              how=f"delete {self.folder} and run `python -m rnndrop.kernels`") from error
        return module

    # -------------------------------------------------------------- the build lock

    def _owner(self) -> dict[str, object]:
        try:
            owner = json.loads(self.lock_file.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return owner if isinstance(owner, dict) else {}

    def describe_owner(self) -> str:
        owner = self._owner()
        if not owner:
            return "another process"
        since_s = owner.get("since")
        since = time.strftime("%H:%M:%S", time.localtime(since_s if isinstance(since_s, (int, float)) else 0))
        return f"process {owner.get('pid')} on {owner.get('host')} (since {since})"

    def _owner_is_dead(self) -> bool:
        """Whether the lock names a process of this host and pid namespace that no longer runs (of
        another namespace, a pid says nothing here: that owner is taken to be alive)."""
        owner = self._owner()
        pid = owner.get("pid")
        return (owner.get("host") == socket.gethostname() and owner.get("pidns") == _pid_namespace()
                and isinstance(pid, int) and not _alive(pid))

    def _stale_for_long(self) -> bool:
        """Whether the lock's record has named the same dead process for :data:`TAKE_OVER_AFTER_S`
        (since this process first saw it). A process that has just won the lock has not written its
        own record yet: the one left names the last owner, which may be dead."""
        try:
            record = self.lock_file.read_bytes()
        except OSError:
            record = b""
        now = time.monotonic()
        if self._dead_record is None or self._dead_record[0] != record:
            self._dead_record = (record, now)
        return now - self._dead_record[1] >= TAKE_OVER_AFTER_S

    def _try_lock(self) -> int | None:
        """The locked file's descriptor, or None while a live process holds it. OSError when the
        folder cannot be written."""
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if fcntl is None:
                raise OSError(errno.ENOLCK, "no flock here")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            # held by a process its dead owner forked: take it over, once the record stays
            if self._owner_is_dead() and self._stale_for_long():
                logger.warning("rnndrop: %s names %s, which is gone: taking the build over",
                               self.lock_file, self.describe_owner())
                with contextlib.suppress(OSError):
                    os.unlink(self.lock_file)
            return None
        except OSError as error:  # no flock on this file system: the pid and host decide
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
            if self._owner() and not self._owner_is_dead():
                os.close(fd)
                return None
        os.ftruncate(fd, 0)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "pidns": _pid_namespace(),
                 "since": time.time()}
        os.write(fd, json.dumps(owner).encode())
        return fd

    @contextlib.contextmanager
    def build_lock(self, wait_s: float, progress: Callable[[str], None] | None = None) -> Iterator[None]:
        """Hold ``build.lock`` (waiting at most ``wait_s`` for a live owner; Unavailable after that,
        or when the folder cannot be written)."""
        start = last = time.monotonic()
        while True:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                fd = self._try_lock()
            except OSError as error:
                raise Unavailable(
                    f"it is not built, and {self.folder} cannot be written to build it ({error.strerror})",
                    how="set TORCH_EXTENSIONS_DIR to a writable folder, or build it there with "
                        "`python -m rnndrop.kernels` as a user who may write to it",
                ) from error
            if fd is not None:
                break
            waited = time.monotonic() - start
            if waited > wait_s:
                raise Unavailable(
                    f"{self.describe_owner()} has been building it in {self.folder} for {waited:.0f} s",
                    how=f"wait for that build, or, if no build is running, delete {self.lock_file}",
                )
            if progress is not None and time.monotonic() - last >= REPORT_EVERY_S:
                last = time.monotonic()
                progress(f"waiting for {self.describe_owner()}, which is building it in {self.folder} "
                         f"({waited:.0f} s so far)")
            time.sleep(0.2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    # -------------------------------------------------------------- writing (under the lock)

    def remove_library(self) -> None:
        for path in (self.library, self.manifest):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def compile(self, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str],
                progress: Callable[[str], None] | None = None) -> Path:
        """Compile into a private work folder (a child process); the library built there.
        Unavailable with the compiler's first error line when the build fails."""
        for stale in self.folder.glob("build-*"):  # a killed builder's: only the lock holder builds
            shutil.rmtree(stale, ignore_errors=True)
        work = self.folder / f"build-{socket.gethostname()}-{os.getpid()}"
        work.mkdir()
        command = [sys.executable, "-c", _COMPILE, self.name, str(work),
                   *(json.dumps([str(a) for a in args]) for args in (sources, cflags, ldflags))]
        start = last = time.monotonic()
        with open(work / "output.txt", "w+b") as output:
            with _children_lock:
                if _stopping:
                    raise Unavailable("the process is exiting")
                child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                         start_new_session=True)
                _children[child] = work
            try:
                while child.poll() is None:
                    time.sleep(0.2)
                    if progress is not None and time.monotonic() - last >= REPORT_EVERY_S:
                        last = time.monotonic()
                        done = len(list(work.glob("*.o")))
                        progress(f"compiling: {done} of {len(sources)} sources done, "
                                 f"{last - start:.0f} s so far")
            finally:
                if child.poll() is None:  # interrupted (Ctrl-C, an exception): stop the compiler
                    _stop(child)
                _children.pop(child, None)
            output.seek(0)
            text = output.read().decode(errors="replace")
        built = work / f"{self.name}.so"
        if child.returncode != 0 or not built.exists():
            shutil.rmtree(work, ignore_errors=True)
            raise Unavailable(f"the build failed: {_complaint(text, child.returncode)}")
        return built

    def publish(self, built: Path) -> None:
        """Copy the library built in a work folder into place, whole, with the record of what it is."""
        partial = self.folder / f".{self.name}.so.{os.getpid()}.partial"
        shutil.copyfile(built, partial)
        with open(partial, "rb") as file:
            os.fsync(file.fileno())
        record = {"size": partial.stat().st_size, "sha256": file_sha256(partial), "torch": torch.__version__,
                  "built": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.remove_library()  # no moment where the old library meets the new record
        manifest = self.folder / f".{self.name}.json.{os.getpid()}.partial"
        manifest.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(partial, self.library)
        os.replace(manifest, self.manifest)
        shutil.rmtree(built.parent, ignore_errors=True)


def _complaint(output: str, returncode: int | None) -> str:
    """The line of a failed build's output that says why: the compiler's first error, else the
    exception a Python traceback ended with (a compiler that cannot even run), else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"\berror\b:", line, re.IGNORECASE):
            return line
    raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    if raised:
        return raised[-1]
    return lines[-1] if lines else f"exit status {returncode}"
