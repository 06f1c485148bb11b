"""Building and loading the compiled kernel (issues 42 and 44): a killed build never makes anyone
wait, a damaged cached library is never loaded, the cache folder is keyed by everything that
changes the binary, a complete build in a folder that cannot be written is used, and
kernel="auto" never stalls for a compilation: it builds in the background and runs "manual"
meanwhile.

Each scenario runs in a subprocess (a library can be loaded once per process; a damaged one can
kill it) with a private ``TORCH_EXTENSIONS_DIR`` seeded from the session's build; the compilation
itself is replaced by a copy of that build (``compiled_cache._COMPILE``), so nothing here compiles.
"""

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from rnndrop.kernels import compiled, compiled_cache

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("needs_compiled_kernel")

#: Stands in for the compilation (same arguments): a second and a half, then the session's library.
FAKE_COMPILE = """
import os, shutil, sys, time
time.sleep(1.5)
shutil.copyfile(os.environ["GOOD_LIBRARY"], os.path.join(sys.argv[2], sys.argv[1] + ".so"))
"""

SCRIPT = textwrap.dedent(
    """
    import json, logging, os, runpy, sys, time, warnings
    import torch
    from rnndrop import VariationalLSTM
    from rnndrop.kernels import auto_loop_kernel, compiled, compiled_cache

    action, fake = sys.argv[1], sys.argv[2]
    if fake:
        compiled_cache._COMPILE, compiled_cache.REPORT_EVERY_S = fake, 0.3
    log = []

    class Keep(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    logging.getLogger("rnndrop").addHandler(Keep())
    if action == "build":
        sys.argv = ["rnndrop.kernels"]  # as `python -m rnndrop.kernels` runs: no arguments of its own
        runpy.run_module("rnndrop.kernels", run_name="__main__")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        layers = [VariationalLSTM(3, 4, dropout_hidden=0.5, kernel=k) for k in ("auto", "manual")]
        layers[1].load_state_dict(layers[0].state_dict())
        masks = layers[0].sample_masks(2, 5)
        x = torch.randn(5, 2, 3)
        start = time.monotonic()
        first = auto_loop_kernel(x)
        outs = [layer(x, masks=masks)[0] for layer in layers]
        first_s = time.monotonic() - start
        if getattr(compiled, "_background", None) is not None:
            compiled._background.join(120)
        later = auto_loop_kernel(x)
        again = layers[0](x, masks=masks)[0]
    print(json.dumps(dict(
        first=first, later=later, first_s=first_s, same=bool(torch.equal(outs[0], outs[1])),
        later_difference=float((again - outs[1]).abs().max()), log=log,
        warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    )))
    """
)


def _folder(extensions: Path) -> Path:
    return extensions / compiled.NAME


def _seed(extensions: Path, good: Path, library: str) -> Path:
    """The cache folder, holding the session's library ("good"), half of it ("truncated") or none."""
    folder = _folder(extensions)
    folder.mkdir(parents=True, exist_ok=True)
    if library != "none":
        shutil.copyfile(good, folder / good.name)
        shutil.copyfile(good.with_suffix(".json"), folder / f"{good.stem}.json")
    if library == "truncated":
        os.truncate(folder / good.name, good.stat().st_size // 2)
    return folder


def _kill_a_build_holding_the_lock(extensions: Path) -> None:
    """What a build killed mid-compile leaves behind (kill -9 of the process that holds the build
    lock), and the empty ``lock`` file of torch's own build protocol."""
    holder = textwrap.dedent(
        """
        import time
        from rnndrop.kernels import compiled
        with compiled._cache().build_lock(1):
            print("held", flush=True)
            time.sleep(600)
        """
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", holder], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "held"
    finally:
        process.kill()
        process.wait()
    (_folder(extensions) / "lock").touch()
    assert json.loads((_folder(extensions) / "build.lock").read_text())["pid"] == process.pid


def _run(extensions: Path, good: Path, action: str = "auto", fake: bool = True, timeout: float = 120,
         **env: str) -> subprocess.CompletedProcess[str]:
    environment = {name: value for name, value in os.environ.items() if name != "RNNDROP_COMPILE_WAIT"}
    environment.update(TORCH_EXTENSIONS_DIR=str(extensions), PYTHONPATH=str(ROOT), GOOD_LIBRARY=str(good))
    environment.update(env)
    command = [sys.executable, "-c", SCRIPT, action, FAKE_COMPILE if fake else ""]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)


def _result(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def good(needs_compiled_kernel) -> Path:
    """The session's library; its record of what the build wrote lies beside it."""
    return Path(needs_compiled_kernel.__file__)


# ------------------------------------------------------------------ a killed build


def test_a_killed_build_leaves_no_wait_when_the_library_is_there(tmp_path, good):
    """A complete library beside the lock a killed build left: the layer runs the compiled kernel
    at once, with no warning (before: every later forward waited forever on the empty ``lock``)."""
    _seed(tmp_path, good, "good")
    _kill_a_build_holding_the_lock(tmp_path)
    result = _result(_run(tmp_path, good, timeout=60))
    assert result["first"] == result["later"] == "compiled"
    assert result["warnings"] == [] and result["later_difference"] < 1e-5


def test_a_killed_build_is_taken_over_in_the_background(tmp_path, good):
    """No library and the lock of a killed build: the first forward runs "manual" at once (one
    warning that the build started in the background and how to build ahead), the build takes the
    lock over, and later calls run the compiled kernel, within 1e-5 of "manual"."""
    folder = _seed(tmp_path, good, "none")
    _kill_a_build_holding_the_lock(tmp_path)
    result = _result(_run(tmp_path, good, timeout=120))
    assert result["first"] == "manual" and result["first_s"] < 30 and result["same"]
    assert result["later"] == "compiled" and result["later_difference"] < 1e-5
    started = [line for line in result["log"] if "in the background" in line]
    assert len(started) == 1 and "python -m rnndrop.kernels" in started[0] and "min" in started[0]
    assert any("is built" in line for line in result["log"])
    assert result["warnings"] == []
    assert (folder / good.name).stat().st_size == good.stat().st_size
    assert not list(folder.glob("build-*"))  # the work folder is gone


def test_the_build_command_takes_a_killed_builds_lock_over_with_progress(tmp_path, good):
    """``python -m rnndrop.kernels`` after a killed build: it builds (here: the stand-in), with
    progress lines while it compiles, and says where the library is."""
    _seed(tmp_path, good, "none")
    _kill_a_build_holding_the_lock(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, "build", FAKE_COMPILE],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT),
             "GOOD_LIBRARY": str(good)},
        capture_output=True, text=True, timeout=120,
    )
    assert "built and cached" in done.stdout, done.stderr
    assert "compiling the C++ loop kernel into" in done.stderr
    assert "sources done" in done.stderr and "compiled in" in done.stderr


def test_a_live_build_is_waited_on_for_a_bounded_time_then_named(tmp_path, monkeypatch):
    """A lock a live process holds (here: this one, through another descriptor) is waited on for
    WAIT_FOR_OTHER_BUILD_S, then the error names the file to delete if no build is running."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_cache, "WAIT_FOR_OTHER_BUILD_S", 0.5)
    cache = compiled._cache()
    with cache.build_lock(1):
        start = time.monotonic()
        with pytest.raises(compiled_cache.Unavailable, match="has been building it") as raised, \
                cache.build_lock(0.5):
            pass
        assert time.monotonic() - start < 10
    assert f"delete {cache.lock_file}" in raised.value.how
    with cache.build_lock(0.5):  # released: free again
        pass


def test_auto_under_a_build_that_never_ends_runs_manual_then_warns_once_what_to_delete(tmp_path, monkeypatch):
    """kernel="auto" while a live process holds the lock and never finishes: "manual" runs from the
    first call; after the bounded wait, one warning naming the lock file to delete."""
    for name, value in (("_extension", None), ("_failure", None), ("_warned", False), ("_background", None)):
        monkeypatch.setattr(compiled, name, value)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("RNNDROP_COMPILE_WAIT", raising=False)
    monkeypatch.setattr(compiled_cache, "WAIT_FOR_OTHER_BUILD_S", 0.5)
    monkeypatch.setattr(compiled, "_missing_tool", lambda: None)
    cache = compiled._cache()
    with cache.build_lock(1):
        assert not compiled.is_available()
        compiled._background.join(30)
        with pytest.warns(RuntimeWarning) as caught:
            answers = [compiled.is_available(), compiled.is_available()]
    assert answers == [False, False]
    assert len(caught) == 1 and f"delete {cache.lock_file}" in str(caught[0].message)
    assert "'manual'" in str(caught[0].message)


def test_a_lock_kept_by_a_dead_builders_forked_child_is_taken_over(tmp_path, monkeypatch):
    """The builder died but a process it forked (a DataLoader worker) still holds the flock: the lock
    names a dead process of this host, so it is taken over at once, not waited on."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    holder = textwrap.dedent(
        """
        import os, time
        from rnndrop.kernels import compiled
        with compiled._cache().build_lock(1):
            child = os.fork()
            if child == 0:  # lets go of the parent's output, keeps the lock
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                os.dup2(1, 2)
                time.sleep(600)
                os._exit(0)
            print(child, flush=True)
            os._exit(0)
        """
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", holder], env=env, capture_output=True, text=True, timeout=60)
    child = int(done.stdout.strip())
    try:
        start = time.monotonic()
        with compiled._cache().build_lock(30):
            assert time.monotonic() - start < 10
    finally:
        os.kill(child, 9)


def _held_lock_naming(cache, record: dict) -> int:
    """``cache``'s build lock held by this process through a descriptor of its own (as another
    process would hold it), its record ``record``; the descriptor."""
    cache.folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps(record).encode())
    return fd


def _dead_pid() -> int:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    return finished.pid


def test_a_lock_just_won_by_a_live_builder_is_not_taken_over_for_its_old_record(tmp_path, monkeypatch):
    """A process that has just won the lock writes its record a moment later: until then the lock
    names its last owner, dead. Taking it over at that first look (two builders, each deleting the
    other's work folder) waits until the record has stayed for TAKE_OVER_AFTER_S."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_cache, "TAKE_OVER_AFTER_S", 1.0)
    cache = compiled._cache()
    here = {"host": socket.gethostname(), "pidns": compiled_cache._pid_namespace(), "since": time.time()}
    fd = _held_lock_naming(cache, {**here, "pid": _dead_pid()})
    threading.Timer(0.3, lambda: (os.ftruncate(fd, 0), os.pwrite(fd, json.dumps(
        {**here, "pid": os.getpid()}).encode(), 0))).start()  # the new owner writes its record
    try:
        with pytest.raises(compiled_cache.Unavailable, match="has been building it"), cache.build_lock(2.0):
            pass
        assert cache.lock_file.exists()
    finally:
        os.close(fd)


def test_a_lock_naming_a_process_of_another_pid_namespace_is_waited_on(tmp_path, monkeypatch):
    """Containers sharing a host name and a cache folder: a pid of another pid namespace says
    nothing about that process here, so its lock is not taken over (a live build would be)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(compiled_cache, "TAKE_OVER_AFTER_S", 0.2)
    cache = compiled._cache()
    fd = _held_lock_naming(cache, {"host": socket.gethostname(), "pidns": "pid:[1]", "pid": _dead_pid(),
                                   "since": time.time()})
    try:
        with pytest.raises(compiled_cache.Unavailable, match="has been building it"), cache.build_lock(1.0):
            pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------ a damaged library


def test_a_truncated_library_is_rebuilt_not_loaded(tmp_path, good):
    """A truncated cached library (a disk full during a copy, a partial sync) killed the process
    with SIGBUS on the first forward. It does not match the record of its build: the layer runs
    "manual" while it is rebuilt in the background, then the compiled kernel."""
    folder = _seed(tmp_path, good, "truncated")
    result = _result(_run(tmp_path, good))
    assert result["first"] == "manual" and result["same"]
    assert result["later"] == "compiled" and result["later_difference"] < 1e-5
    assert any("truncated" in line and "in the background" in line for line in result["log"])
    assert (folder / good.name).stat().st_size == good.stat().st_size


def test_a_truncated_library_without_a_compiler_falls_back_with_one_warning(tmp_path, good):
    """The same with no compiler to rebuild it: "manual", one warning naming the damage and what
    to delete; ``python -m rnndrop.kernels`` exits 1 with that line, no SIGBUS."""
    no_compiler = {"CXX": "/nonexistent/c++"}
    name = subprocess.run(
        [sys.executable, "-c", "from rnndrop.kernels import compiled; print(compiled.NAME)"],
        env={**os.environ, **no_compiler, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        check=True,
    ).stdout.strip()
    folder = tmp_path / name  # the compiler is part of the folder's name
    folder.mkdir()
    shutil.copyfile(good, folder / f"{name}.so")
    shutil.copyfile(good.with_suffix(".json"), folder / f"{name}.json")
    os.truncate(folder / f"{name}.so", good.stat().st_size // 2)
    result = _result(_run(tmp_path, good, fake=False, **no_compiler))
    assert result["first"] == result["later"] == "manual" and result["same"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "truncated" in result["warnings"][0] and f"delete {folder}" in result["warnings"][0]
    env = {**os.environ, **no_compiler, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "rnndrop.kernels"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and "truncated" in done.stderr and "delete" in done.stderr, done.stderr


@pytest.mark.parametrize("damage", ["no record", "other bytes"])
def test_a_library_that_is_not_what_its_build_wrote_is_refused(tmp_path, good, damage):
    """Same size, other bytes (sha256), or no record of the build at all: not loaded."""
    cache = compiled_cache.Cache(compiled.NAME, _seed(tmp_path, good, "good"))
    assert cache.check() is None
    if damage == "no record":
        cache.manifest.unlink()
    else:
        data = bytearray(cache.library.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cache.library.write_bytes(bytes(data))
    assert cache.check() is not None and ("sha256" in cache.check() or "no record" in cache.check())


# ------------------------------------------------------------------ the cache key, a read-only folder


def test_the_folder_is_keyed_by_everything_that_changes_the_binary(monkeypatch, tmp_path):
    """Sources, flags, torch, Python's ABI, the compiler and this environment's include paths:
    two virtual environments (two torch installs) on one machine get two folders."""
    args = (compiled.SOURCES, compiled.HEADERS, compiled.CFLAGS + compiled.LDFLAGS)
    base = compiled_cache.build_key(*args)
    assert compiled.NAME.endswith(base[:16])
    changes = {
        "torch version": lambda: monkeypatch.setattr(torch, "__version__", "0.0.0"),
        "torch install": lambda: monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv2" / "init.py")),
        "python headers": lambda: monkeypatch.setattr(
            compiled_cache.sysconfig, "get_paths", lambda: {"include": str(tmp_path / "venv2" / "include")}),
        "python abi": lambda: monkeypatch.setattr(
            compiled_cache.sysconfig, "get_config_var", lambda name: ".cpython-399-x86_64-linux-gnu.so"),
        "compiler": lambda: monkeypatch.setenv("CXX", "clang++"),
    }
    for what, change in changes.items():
        with monkeypatch.context():
            change()
            assert compiled_cache.build_key(*args) != base, what
    assert compiled_cache.build_key(compiled.SOURCES, compiled.HEADERS, ["-O2"]) != base


def test_a_complete_build_in_a_folder_that_cannot_be_written_is_loaded(tmp_path, good, monkeypatch):
    """Loading takes no lock and writes nothing (before: a read-only folder was "the build
    failed", with the advice to install a compiler). Where it must be built and cannot be
    written, the reason says so and how to get it points to TORCH_EXTENSIONS_DIR."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _seed(tmp_path, good, "good")

    def no_writes(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    loaded = object()
    monkeypatch.setattr(compiled_cache.Cache, "load", lambda self: loaded)
    monkeypatch.setattr(compiled_cache.Cache, "build_lock", no_writes)
    monkeypatch.setattr(compiled_cache.Cache, "compile", no_writes)
    assert compiled._obtain(compile=True, report=None) is loaded
    monkeypatch.undo()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(compiled, "_missing_tool", lambda: None)
    monkeypatch.setattr(compiled_cache.os, "open", no_writes)
    with pytest.raises(compiled_cache.Unavailable, match="cannot be written to build it") as raised:
        compiled._obtain(compile=True, report=None)
    assert "TORCH_EXTENSIONS_DIR" in raised.value.how and "compiler" not in raised.value.how


def test_compile_wait_builds_in_the_first_call(tmp_path, good):
    """``RNNDROP_COMPILE_WAIT=1``: kernel="auto" builds in its first call (no background thread,
    the compiled kernel from the first forward)."""
    _seed(tmp_path, good, "none")
    result = _result(_run(tmp_path, good, RNNDROP_COMPILE_WAIT="1"))
    assert result["first"] == result["later"] == "compiled"
    assert not any("in the background" in line for line in result["log"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_child_forked_during_a_build_has_a_free_lock_and_no_build_of_its_own(monkeypatch):
    """The build thread holds the lock; a forked child inherits it held, without the thread that
    would release it (kernel="compiled" there waited forever). The child starts with a free lock."""
    import threading

    monkeypatch.setattr(compiled, "_lock", threading.Lock())
    monkeypatch.setattr(compiled, "_background", threading.Thread(target=lambda: None))
    compiled._lock.acquire()  # as the build thread holds it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running anything of the parent's
        free = compiled._lock.acquire(blocking=False)
        os.write(write, json.dumps([free, compiled._background is None]).encode())
        os._exit(0)
    os.close(write)
    answer = json.loads(os.read(read, 100).decode())
    os.waitpid(pid, 0)
    compiled._lock.release()
    assert answer == [True, True]
