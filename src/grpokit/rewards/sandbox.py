"""Run untrusted code from completions: bubblewrap, an unprivileged user, rlimits, a wall-clock timeout.

What it does: ``run(files, argv, stdin)`` writes ``files`` into a fresh host directory, then runs
``argv`` as

    prlimit (CPU s, address space, processes, file size, open files)
      -> setpriv (a throw-away unprivileged uid/gid, no groups)
        -> bwrap (new user/PID/net/IPC/UTS namespaces; read-only binds of only the system
                  paths the interpreter needs (``system_binds``); private /tmp, /proc and /dev; the
                  files read-only at /tmp/sandbox (the working directory); die-with-parent, new session)

and kills the whole process group at the wall-clock limit; the PID namespace then takes every
process the code started with it. Why each layer: root ignores RLIMIT_NPROC (a fork bomb as root
is bounded by nothing), so the code runs as an unprivileged uid -- one per concurrent sandbox so
their process counts do not mix; bwrap removes the network and shows the code only /usr (and the
interpreter's own prefix when it lives elsewhere), never the checkout, the data files, the run
directory or home directories, so a dataset's answers at a guessable path cannot be read; the
rlimits bound CPU, memory, processes and file sizes.

What it deliberately does not do: decide whether code passed (``rewards.code`` compares outputs
outside the sandbox), or run without isolation unless asked: ``Sandbox(mode="none")`` warns.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from grpokit.errors import ConfigError

FIX = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; `make test` does it) and allow "
    "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), or pass sandbox='none' "
    "to run unsandboxed (unsafe)"
)


# Where the files appear inside: under the private /tmp (the only writable place, and where
# programs expect scratch space).
SANDBOX_DIR = "/tmp/sandbox"


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create its namespaces here."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # wall-clock limit of one run
    cpu_s: int = 5  # RLIMIT_CPU
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    processes: int = 32  # RLIMIT_NPROC for the sandbox's own uid
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE
    open_files: int = 64  # RLIMIT_NOFILE


@dataclass
class RunResult:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


# Host paths shown read-only inside. /usr holds the interpreter, its standard library and the shared
# libraries; /bin, /lib, /lib64 and /sbin are symlinks into it on merged-/usr systems and are bound
# as directories where they are not. The dynamic loader's cache lives in /etc; nothing else there is.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d")


def system_binds(executable: str) -> list[str]:
    """bwrap arguments that show the system paths read-only, and the prefix of ``executable``
    (resolved through symlinks) when it lies outside them, e.g. /opt/python3.12. Home directories,
    the working directory and everything else stay absent."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    resolved = shutil.which(executable) or executable
    real = os.path.realpath(resolved)
    if os.path.isabs(real) and not _under(real, SYSTEM_DIRS):
        prefix = _interpreter_prefix(real)
        private = ("/root", "/home", *([os.getcwd()] if os.getcwd() != "/" else []))
        if prefix == "/" or _under(prefix, private) or _under(os.getcwd(), (prefix,)):
            raise SandboxUnavailable(
                f"the sandbox's interpreter {real} lives under {prefix}, which would expose a home "
                "directory or the working directory to the sandboxed code; pass python= an "
                "interpreter installed under /usr or /opt (e.g. /usr/bin/python3)"
            )
        args += ["--ro-bind", prefix, prefix]
    return args


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _interpreter_prefix(real: str) -> str:
    """/opt/py/bin/python3.12 -> /opt/py: the directory above ``bin`` (the whole installation)."""
    parent = os.path.dirname(real)
    return os.path.dirname(parent) if os.path.basename(parent) == "bin" else parent


def default_python() -> str:
    """An interpreter the unprivileged uid can execute (a venv under /root usually is not)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("python3") or "python3"


class Sandbox:
    """Runs programs in isolation. ``mode="bwrap"`` (default) or ``"none"`` (unsafe, warns)."""

    UID_BASE = 61000  # uids UID_BASE .. UID_BASE + slots - 1, one per concurrent run

    def __init__(self, mode: str = "bwrap", limits: Limits | None = None, slots: int = 16) -> None:
        if mode not in ("bwrap", "none"):
            raise ConfigError(f"sandbox mode must be 'bwrap' or 'none', got {mode!r}")
        self.mode, self.limits = mode, limits or Limits()
        self._free = list(range(self.UID_BASE, self.UID_BASE + slots))
        self._lock = threading.Lock()
        if mode == "bwrap":
            _become_subreaper()
        if mode == "none":
            warnings.warn(
                "code rewards run WITHOUT a sandbox (sandbox='none'): completions can read, write "
                "and delete your files and use the network",
                stacklevel=2,
            )
        else:
            self.check()

    def check(self) -> None:
        """Raise SandboxUnavailable with the fix unless bwrap can start a sandbox here."""
        for tool in ("bwrap", "prlimit", "setpriv"):
            if shutil.which(tool) is None:
                raise SandboxUnavailable(f"{tool} is not installed; {FIX}")
        res = self.run({}, ["/bin/true"])
        if res.returncode != 0:
            raise SandboxUnavailable(
                f"bwrap cannot create a sandbox here ({res.stderr.strip()[:300]}); {FIX}"
            )

    def run(self, files: dict[str, str], argv: list[str], stdin: str = "") -> RunResult:
        """Run ``argv`` with ``files`` (name -> text) in the working directory (/tmp/sandbox, read-only)."""
        with self._lock:
            uid = self._free.pop() if self._free else None
        if uid is None:
            raise RuntimeError("more concurrent sandbox runs than slots; raise Sandbox(slots=...)")
        host_dir = Path(tempfile.mkdtemp(prefix="grpokit-sandbox-"))
        try:
            os.chmod(host_dir, 0o755)
            for name, text in files.items():
                (host_dir / name).write_text(text)
                os.chmod(host_dir / name, 0o644)
            return self._execute(self._command(host_dir, argv, uid), stdin, host_dir)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)
            self._reap(uid)
            with self._lock:
                self._free.append(uid)

    def _command(self, host_dir: Path, argv: list[str], uid: int) -> list[str]:
        lim = self.limits
        if self.mode == "none":
            return argv
        return [
            "prlimit", f"--cpu={lim.cpu_s}", f"--as={lim.memory_bytes}", f"--nproc={lim.processes}",
            f"--fsize={lim.file_bytes}", f"--nofile={lim.open_files}", "--",
            "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--",
            "bwrap", "--unshare-all", "--die-with-parent", "--new-session", *system_binds(argv[0]),
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--ro-bind", str(host_dir), SANDBOX_DIR,
            "--chdir", SANDBOX_DIR, "--setenv", "HOME", "/tmp", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--", *argv,
        ]  # fmt: skip

    def _execute(self, cmd: list[str], stdin: str, host_dir: Path) -> RunResult:
        t0 = time.monotonic()
        cwd = host_dir if self.mode == "none" else None
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin, timeout=self.limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with_suppressed(os.killpg, proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        # output beyond 1 MiB is noise; keep the parent's memory bounded whatever the code printed
        return RunResult(proc.returncode, out[: 1 << 20], err[: 1 << 16], timed_out, time.monotonic() - t0)

    def _reap(self, uid: int) -> None:
        """Kill anything still running under the slot's uid (nothing should be: the PID namespace
        dies with bwrap) and reap the zombies reparented to us, so the next run of this slot
        starts with a clean process count."""
        if self.mode == "none":
            return
        for _ in range(100):  # SIGKILL is asynchronous: wait until the uid runs nothing
            pids = _pids_of(uid)
            for pid in pids:  # reap our orphaned sandbox inits (we are their subreaper)
                if _state(pid) == "Z":
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
            alive = [pid for pid in pids if _state(pid) not in ("Z", None)]
            if not alive:
                return
            for pid in alive:
                with_suppressed(os.kill, pid, signal.SIGKILL)
            time.sleep(0.02)


def _become_subreaper() -> None:
    """bwrap's namespace init outlives the outer bwrap by a moment and is reparented; as a child
    subreaper this process receives it (instead of a container's pid 1, which may never reap) and
    ``_reap`` collects it, so zombies never pile up against the sandbox uid's RLIMIT_NPROC."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def running_pids(uid: int) -> list[int]:
    """Live (non-zombie) processes of ``uid``."""
    return [pid for pid in _pids_of(uid) if _state(pid) not in ("Z", None)]


def _pids_of(uid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    out.append(int(entry))
            except FileNotFoundError:
                pass
    return out


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return None


def with_suppressed(fn, *args) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        fn(*args)
