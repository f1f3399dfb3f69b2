"""Running a response's program, safely: the `code` reward's cases (ladle/rl/rewards.py) and any
tool that runs code. A hostile program (one that writes outside its folder, forks without end,
opens a socket, sleeps or loops past its limit, eats the memory, floods its output) fails its
case and leaves nothing behind; the run goes on.

Each run is a separate Python process (`python -I`, no user site or environment), in layers, so
that one layer's gap is another's wall:

- its own session and process group, killed whole at the end (SIGKILL), whatever it started;
- mount, network and process namespaces of its own where the kernel allows them (as root, else
  with a user namespace): every mount read-only, no devices, no set-user-id, but its folder
  (writable, no devices); no interface but a loopback that is down; no other process in sight
  (the trainer's cannot be signalled); run as root, it then enters a user namespace of its own,
  keeping no capability over the host (no device nodes, no remounts);
- as root, the run drops to the `nobody` user (no file of the host is its to write);
- resource limits: CPU seconds, address space, file size (stdout and stderr go to files in its
  folder, so the size limit caps the output), open files, processes;
- a private temporary folder as its working and home directory, removed at the end;
- an audit hook (PEP 578) installed before the program runs, which refuses forks, exec, new
  processes, sockets, ctypes and other native loaders, any write, removal or rename outside
  the folder, and the ways to it (frames, the garbage collector, tracing, a function's code);
  it reads nothing at call time the program could change, and the program runs in a fresh
  `__main__` module;
- a wall-clock limit, after which the whole group is killed.

`run(code, stdin, limits)` -> a `Result` (exit status, stdout, stderr, timed out or not).
`Pool` runs many at once on as many workers as the machine has cores.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# Runs first in the sandboxed interpreter: the audit hook, then the program (argv[1]) as a fresh
# __main__ module. The hook reads nothing at call time that the program could change (no global,
# no module function, no builtin by name: all bound when it is made), and the events that would
# reach it (frames, the garbage collector, tracing, a function's code) are refused too.
DRIVER = r"""
import os, sys, types

def make_hook(root, deny, writes, native, introspect, guarded_attrs):
    # Every name the hook and its helpers use is a default argument: nothing a program can reach
    # (a module's globals, builtins, a closure's cells) changes what they do; and replacing their
    # defaults or code is refused (`ours`, filled in once they exist).
    def normal(path, sep=os.sep, cwd=os.getcwd(), fsdecode=os.fsdecode, fspath=os.fspath):
        # the absolute path by string operations alone ('..' and '.' folded); no symlink can lead
        # out of the private folder (making one that points out is refused)
        p = fsdecode(fspath(path))
        if not p.startswith(sep):
            p = cwd + sep + p
        out = []
        for part in p.split(sep):
            if part == "..":
                if out:
                    out.pop()
            elif part and part != ".":
                out.append(part)
        return sep + sep.join(out)

    def inside(path, normal=normal, root=root, sep=os.sep, errors=(TypeError, ValueError)):
        try:
            p = normal(path)
        except errors:
            return False
        return p == root or p.startswith(root + sep)

    def hook(event, args, inside=inside, deny=deny, introspect=introspect, native=native, writes=writes,
             guarded_attrs=guarded_attrs, isinstance=isinstance, str=str, int=int, len=len, any=any,
             PermissionError=PermissionError, pathlike=(str, bytes, os.PathLike),
             flags_w=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, ours=()):
        if event in deny or event in introspect:
            raise PermissionError("sandbox: " + event + " is not allowed")
        if event == "object.__setattr__" and len(args) > 1 and args[1] in guarded_attrs:
            if any(args[0] is f for f in ours):
                raise PermissionError("sandbox: changing the sandbox's hook is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in native:
            raise PermissionError("sandbox: importing " + str(args[0]) + " is not allowed")
        if event == "open" and len(args) > 1:
            path, mode = args[0], args[1]
            flags = args[2] if len(args) > 2 else 0
            w = (mode and any(c in str(mode) for c in "wax+")) or (isinstance(flags, int) and flags & flags_w)
            if w and not isinstance(path, int) and not inside(path):
                raise PermissionError("sandbox: writing outside the sandbox is not allowed")
        if event == "os.chdir" and args and isinstance(args[0], int):  # paths are checked from the folder
            raise PermissionError("sandbox: os.fchdir is not allowed")
        if event in writes:
            for a in args[:2]:
                if isinstance(a, pathlike) and not inside(a):
                    raise PermissionError("sandbox: " + event + " outside the sandbox is not allowed")

    hook.__defaults__ = hook.__defaults__[:-1] + ((hook, inside, normal),)
    return hook

hook = make_hook(
    os.path.realpath(os.getcwd()),
    frozenset({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
               "os.killpg", "os.setsid", "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.bind",
               "socket.connect", "socket.getaddrinfo", "socket.sendto", "ctypes.dlopen", "ctypes.dlsym",
               "ctypes.cdata", "ctypes.call_function", "ctypes.addressof", "mmap.__new__", "sys.addaudithook",
               "os.chroot", "os.putenv", "os.unsetenv", "resource.setrlimit", "resource.prlimit"}),
    frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
               "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile",
               "shutil.copytree", "os.chdir"}),
    frozenset({"ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "_socket", "socket",
               "multiprocessing", "_multiprocessing", "signal", "_signal", "resource", "mmap", "_xxsubinterpreters"}),
    frozenset({"sys._current_frames", "sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers",
               "gc.get_referents", "code.__new__", "function.__new__", "object.__delattr__", "os.setns",
               "os.unshare"}),
    frozenset({"__code__", "__defaults__", "__kwdefaults__"}),
)
with open(sys.argv[1]) as f:
    code = compile(f.read(), "<program>", "exec")
main = types.ModuleType("__main__")  # the program's own module: this driver is not reachable by name
main.__builtins__ = __builtins__
sys.modules["__main__"], sys.argv = main, ["<program>"]
del make_hook, f
for loaded in ("_signal", "signal"):  # imported at start-up: the program must import them (refused)
    sys.modules.pop(loaded, None)
sys.addaudithook(hook)
del hook
exec(code, main.__dict__)
"""

# Runs first in the child (a fresh interpreter, no threads): the limits, a network namespace of
# its own, `nobody` where it can reach the interpreter; then the driver in its place (exec).
ISOLATE = r"""
import ctypes, os, resource, sys
cpu, memory, output, processes, drop = (int(x) for x in sys.argv[1:6])
libc = ctypes.CDLL(None, use_errno=True)
root = os.geteuid() == 0
NEWNS, NEWNET, NEWPID, NEWUSER = 0x00020000, 0x40000000, 0x20000000, 0x10000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
KEEP = {8: NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}  # statvfs flags a remount must keep -> mount's
# mount, network and process namespaces of its own (with a user namespace where not root); where
# the kernel refuses them, the audit hook still refuses sockets, processes and writes outside
if libc.unshare((0 if root else NEWUSER) | NEWNS | NEWNET | NEWPID) == 0:
    here = os.getcwd().encode()
    libc.mount(None, b"/", None, REC | PRIVATE, None)  # nothing of this propagates back
    if libc.mount(here, here, None, BIND, None) == 0:  # the folder stays writable, with no devices
        libc.mount(None, here, None, REMOUNT | BIND | NOSUID | NODEV, None)
        for line in open("/proc/self/mountinfo"):
            point = line.split()[4].encode().decode("unicode_escape").encode()
            if point == here:
                continue
            try:
                kept = sum(m for f, m in KEEP.items() if os.statvfs(point).f_flag & f)
            except OSError:
                kept = 0
            libc.mount(None, point, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | kept, None)
        os.chdir(here)  # through the new mount (the old working directory is the read-only one)
    pid = os.fork()  # the program: the first process of the new PID namespace (no other is in sight)
    if pid:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    if root and not drop:
        libc.unshare(NEWUSER)  # no capability over the host left: no device nodes, no remounts
for what, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, output),
                    (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (value, value))
if root and drop:
    os.chown(".", 65534, 65534)
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
os.execv(sys.executable, [sys.executable, "-I", "-S", "driver.py", "main.py"])
"""


@dataclass(frozen=True)
class Limits:
    """What one run may take."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 20
    processes: int = 4096  # as `nobody`: a ceiling over every sandbox of the machine at once


@dataclass
class Result:
    returncode: int | None  # None: killed at the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def reachable_by_others(path: str) -> bool:
    """Whether a user without rights of its own (`nobody`) can run the interpreter at `path`:
    every folder above it searchable and the file executable by others."""
    p = os.path.realpath(path)
    parts = [p] + [os.path.dirname(p)]
    while parts[-1] != os.path.dirname(parts[-1]):
        parts.append(os.path.dirname(parts[-1]))
    return all(os.stat(x).st_mode & 0o001 for x in parts)


DROP = reachable_by_others(sys.executable)  # as root: run the program as `nobody` (else as root, hooked)


def run(code: str, stdin: str = "", limits: Limits = Limits()) -> Result:
    """`code` (Python source) run in a sandbox with `stdin`; its folder is removed after. Any
    failure to run it is a failed `Result`, never an exception."""
    folder = tempfile.mkdtemp(prefix="ladle-sandbox-")
    t0 = time.perf_counter()
    try:
        for name, text in (("main.py", code), ("driver.py", DRIVER), ("stdin", stdin)):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(folder, name), 0o644)  # readable by `nobody`, whatever the umask
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
        args = [
            str(x)
            for x in (limits.cpu_s, limits.memory_bytes, limits.output_bytes, limits.processes, int(DROP))
        ]
        # stdout and stderr read back through these handles: the program may replace the paths
        with open(os.path.join(folder, "stdin")) as i, tempfile.TemporaryFile("w+", dir=folder) as o, \
                tempfile.TemporaryFile("w+", dir=folder) as e:  # fmt: skip
            p = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", ISOLATE, *args],
                stdin=i,
                stdout=o,
                stderr=e,
                cwd=folder,
                env=env,
                start_new_session=True,  # its own process group: killed whole at the end
                close_fds=True,
            )
            try:
                returncode, timed_out = p.wait(timeout=limits.wall_s), False
            except subprocess.TimeoutExpired:
                returncode, timed_out = None, True
            finally:
                _kill(p.pid)
                p.wait()
            o.seek(0), e.seek(0)
            out, err = o.read(limits.output_bytes), e.read(limits.output_bytes)
        return Result(returncode, out, err, timed_out, time.perf_counter() - t0)
    except Exception as e:  # the program left its folder in a state that fails the run: it fails
        return Result(-1, "", f"sandbox: {type(e).__name__}: {e}", False, time.perf_counter() - t0)
    finally:
        _remove(folder)


def _remove(folder: str) -> None:
    """The run's folder, whatever the program did to its permissions."""
    for root, dirs, _ in os.walk(folder):
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o700)
            except OSError:
                pass
    shutil.rmtree(folder, ignore_errors=True)


def _kill(pid: int) -> None:
    """The run's whole process group (its session: it made it), killed."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Pool:
    """Sandboxed runs side by side, as many as the machine has cores (or `workers`)."""

    def __init__(self, workers: int | None = None):
        self.workers = workers or max(1, len(os.sched_getaffinity(0)))
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ladle-sandbox")

    def map(self, jobs: list[tuple[str, str]], limits: Limits = Limits()) -> list[Result]:
        """Each (code, stdin) run; the results in order."""
        return list(self._pool.map(lambda job: run(job[0], job[1], limits), jobs))
