"""Run Python code a policy wrote, in layers a reader can check (Linux):
`run_python(code) -> (text, ok)`.

The one place nanoagent runs untrusted input, thousands of times a training step.
The threat is a program that, by mistake or reward hacking, loops, eats memory,
floods its output, fills the disk, forks without end, reads the trainer's secrets
(HF_TOKEN), rewrites the project or its grader, reaches the network, or outlives the
call; not an attacker with a kernel exploit (no seccomp filter; the kernel is
shared). `layers()` names the layers here:

1. "process" (always). A new session per call in a fresh temporary directory, stdin
   closed, four environment variables and none of ours; isolated Python (`-I -S`: no
   PYTHON* variables, no site-packages), so the project cannot be imported; hard
   limits on CPU, memory, file size, open files and core dumps (util-linux's
   prlimit); at the time-out or the output cap we kill the process group and every
   process with the call's token in its environment (which one that left the group
   keeps). Not stopped: what our uid may do (write the repository, signal the
   trainer, read its /proc/PID/environ), the network, forks, and a process that
   leaves the group and hides the token: an execve with another environment, a
   write over its environment (/proc/self/mem: no execve) or, unless we are root,
   prctl(PR_SET_DUMPABLE, 0), which makes its /proc/PID/environ unreadable (EACCES).
   That one we skip, not kill: it cannot be told from any other process of our uid
   started meanwhile (sudo and ssh-agent are not dumpable either).
2. "unprivileged uid" (when we are root, as CI is). The program runs as nobody, with
   no groups (util-linux's setpriv): it cannot write what root owns, read /root or
   signal the trainer;
   RLIMIT_NPROC caps its processes. Not stopped: what any user may read (/etc) or
   write (/tmp), the network; calls running at once are all nobody: they may signal
   each other and share the process cap (killed processes count until reaped).
3. "bubblewrap" (`apt-get install bubblewrap`). Namespaces: the program sees a
   read-only /usr (and /bin, /lib), its work directory, a private /tmp, /proc, /dev,
   nothing else; no network but its own loopback; uid 65534 in a user namespace,
   where RLIMIT_NPROC counts this call's processes (Linux >= 5.14); a PID namespace,
   so all it started dies with it, whatever its session, environment or dumpable
   flag: wherever bubblewrap runs, the namespace, not the token, is the boundary. Not
   stopped: kernel bugs, and many files each under the size cap (memory in /tmp,
   disk in the work directory) until the time-out.
"""

import contextlib
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

MAX_CODE_BYTES = 1_000_000  # far beyond a program a policy writes: bigger is a sampling bug
NOBODY = 65534  # the unprivileged uid and gid (nobody, nogroup) every Linux has
_BWRAP = shutil.which("bwrap")
_probe_lock = threading.Lock()


@dataclass(frozen=True)
class Limits:
    """What one program may use. The defaults suit a tool call inside a rollout."""
    timeout_s: float = 5.0  # wall clock; then the whole sandbox is killed
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU)
    memory_mb: int = 512  # address space (RLIMIT_AS)
    output_bytes: int = 4096  # stdout + stderr the model reads back; past it the program stops
    file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE); not the number of files
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 64  # RLIMIT_NPROC, threads included, where the uid is its own (see above)


def run_python(code: str, limits: Limits = Limits()) -> tuple[str, bool]:
    """Run `code` as a Python program in the sandbox. Returns (what the model reads,
    ok): its stdout then stderr, cut at limits.output_bytes, then a "[sandbox: ...]"
    line unless it exited with status 0 (ok). Never raises, never outlives
    limits.timeout_s by more than about a second, and is safe to call from threads."""
    try:  # fails for a non-str, and for a lone surrogate (from "surrogateescape")
        source = code.encode("utf-8")
    except (AttributeError, UnicodeEncodeError) as error:
        return f"[sandbox: the code is not valid text ({error}); not run]", False
    if b"\0" in source:  # Python versions disagree on it (3.11 stops there, 3.12 refuses)
        return "[sandbox: the code contains a NUL byte; not run]", False
    if len(source) > MAX_CODE_BYTES:
        too_long = f"the code is {len(source)} bytes, over the limit of {MAX_CODE_BYTES}"
        return f"[sandbox: {too_long}; not run]", False
    try:
        active = layers()
        as_nobody = "unprivileged uid" in active
        return _run(source, limits, bwrap="bubblewrap" in active, as_nobody=as_nobody)
    except Exception as error:  # a failure to set up is what the model reads, not a crash
        return f"[sandbox: could not run the code: {type(error).__name__}: {error}]", False


def layers() -> list[str]:
    """The layers run_python uses here, weakest first. The first call tries
    bubblewrap; it warns once if that fails."""
    with _probe_lock:  # a thread pool's first calls arrive together: probe, and warn, once
        return list(_probe())


@functools.cache
def _probe() -> tuple[str, ...]:
    found = ("process", "unprivileged uid") if os.geteuid() == 0 else ("process",)
    if _BWRAP is None:
        problem = "is not installed (apt-get install bubblewrap)"
    else:
        text, ok = _run(b"", Limits(), bwrap=True, as_nobody="unprivileged uid" in found)
        if ok:
            return found + ("bubblewrap",)
        problem = (
            f"({_BWRAP}) cannot start a sandbox here ({text.strip()}); allow user"
            " namespaces (sysctl kernel.unprivileged_userns_clone=1, or"
            " kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu)"
        )
    warnings.warn(
        f"bubblewrap {problem}. Without it the model's code may reach the network and"
        " every file its uid may, and a process that leaves its session and hides"
        " its environment outlives the call", RuntimeWarning, stacklevel=3
    )
    return found


def _run(source: bytes, limits: Limits, bwrap: bool, as_nobody: bool) -> tuple[str, bool]:
    token = os.urandom(8).hex()  # marks every process of this call (see kill_all)
    with tempfile.TemporaryDirectory(
        prefix="nanoagent-sandbox-", ignore_cleanup_errors=True
    ) as workdir:
        with open(os.path.join(workdir, "main.py"), "wb") as file:
            file.write(source)
        if as_nobody:  # the work directory is the one place nobody may write
            os.chown(workdir, NOBODY, NOBODY)
            os.chown(file.name, NOBODY, NOBODY)
        env = {
            "PATH": "/usr/bin:/bin", "HOME": "/sandbox" if bwrap else workdir,
            "LANG": "C.UTF-8", "NANOAGENT_SANDBOX": token
        }
        with subprocess.Popen(
            _command(limits, workdir, bwrap, as_nobody), cwd=workdir, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        ) as proc:  # reaped on exit
            try:
                stdout, stderr, stopped = collect(
                    proc, limits.timeout_s, limits.output_bytes,
                    kill=lambda: kill_all(proc, token, bwrap)
                )
            finally:  # bwrap, should it still run; the group, in any case
                with contextlib.suppress(ProcessLookupError):
                    # its leader is not reaped yet: the group id is still ours
                    os.killpg(proc.pid, signal.SIGKILL)
    returncode = proc.returncode
    # bwrap says "killed by signal N" as a shell does, with exit status 128 + N (so
    # sys.exit(137) reads as SIGKILL there)
    if bwrap and returncode - 128 in signal.valid_signals():
        returncode = 128 - returncode
    return _what_the_model_reads(stdout, stderr, stopped, returncode, limits)


def _command(limits: Limits, workdir: str, bwrap: bool, as_nobody: bool) -> list[str]:
    """The argv that runs main.py: prlimit sets the limits, then execs Python (not
    Popen's preexec_fn, which can deadlock in threads, nor a Python prelude: a second
    interpreter start), inside bubblewrap if bwrap, all as nobody if as_nobody."""
    # Any Python 3 will do: ours, unless nobody or bubblewrap may not reach it
    # (outside /usr): the system's. A virtual environment's links to its base.
    python = os.path.realpath(sys.executable)
    if (bwrap or as_nobody) and not python.startswith("/usr/"):
        python = "/usr/bin/python3"
    rlimits = [
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",  # SIGXCPU first, SIGKILL a second later
        f"--as={limits.memory_mb << 20}", f"--fsize={limits.file_mb << 20}",
        f"--nofile={limits.open_files}", "--core=0"
    ]
    if bwrap or as_nobody:  # RLIMIT_NPROC counts all of the uid's processes: not ours
        rlimits.append(f"--nproc={limits.processes}")
    # -u: what it printed before a time-out still comes back. prlimit is found on
    # PATH, in the sandbox too.
    argv = ["prlimit", *rlimits, "--", python, "-I", "-S", "-u", "-X", "utf8", "main.py"]
    if bwrap:  # it passes on the environment Popen gives it, and sets PWD
        argv = [
            _BWRAP, "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),  # not root
            "--unshare-pid", "--die-with-parent",  # a PID namespace, which dies if we do
            "--unshare-net", "--unshare-ipc", "--unshare-uts", "--new-session",  # no network
            "--ro-bind", "/usr", "/usr", "--ro-bind-try", "/bin", "/bin",
            "--ro-bind-try", "/lib", "/lib", "--ro-bind-try", "/lib64", "/lib64",
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--bind", workdir, "/sandbox", "--chdir", "/sandbox", "--", *argv
        ]
    # bwrap, too, is nobody. setpriv drops root in the child, not Popen's user=, with
    # which Python forks the whole trainer (its page tables) instead of vforking: a
    # call's cost would grow with the trainer's memory (docs/performance.md).
    setpriv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    return setpriv + argv if as_nobody else argv


def _what_the_model_reads(stdout, stderr, stopped, returncode, limits) -> tuple[str, bool]:
    """The output, then how the program ended, unless it ended well."""
    text = (stdout + stderr)[:limits.output_bytes].decode("utf-8", errors="replace")
    if stopped == "output":
        note = f"output cut at {limits.output_bytes} bytes; the program was stopped"
    elif stopped == "time-out":
        note = f"time-out: the program ran past {limits.timeout_s:g} s and was killed"
    elif returncode == -signal.SIGXCPU:
        note = f"CPU time limit: the program used {limits.cpu_s} s of CPU and was killed"
    elif returncode < 0:
        note = f"the program was killed by signal {signal.Signals(-returncode).name}"
    elif returncode:  # a MemoryError is the memory limit, almost always
        out_of_memory = f": out of memory (the limit is {limits.memory_mb} MB)"
        note = f"exit status {returncode}{out_of_memory if b'MemoryError' in stderr else ''}"
    else:
        return text, True
    separator = "\n" if text and not text.endswith("\n") else ""
    return f"{text}{separator}[sandbox: {note}]", False


def collect(proc, timeout_s, output_bytes, kill, tail=False) -> tuple[bytes, bytes, str]:
    """Read stdout and stderr until the program ends: kill() at the time-out, past
    output_bytes, or once it exits (its children may hold the pipes), then read a
    second at most. With tail, keep each stream's last output_bytes instead (a program
    may print without bound). Returns (stdout, stderr, "" or why stopped)."""
    output = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    deadline, stopped, killed = time.monotonic() + timeout_s, "", False
    exit_fd = os.pidfd_open(proc.pid)  # readable once it (or bwrap) exits; it is not reaped
    try:
        with selectors.DefaultSelector() as selector:
            for fd in [*output, exit_fd]:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map() and not (killed and time.monotonic() > deadline):
                timeout = deadline - time.monotonic()
                for key, _ in selector.select(timeout) if timeout > 0 else []:
                    chunk = os.read(key.fd, 1 << 16) if key.fd != exit_fd else b""
                    if chunk:
                        output[key.fd] += chunk
                        if tail:
                            del output[key.fd][:-output_bytes]
                    else:  # end of file, or the exit
                        selector.unregister(key.fd)
                if not (stopped or tail) and sum(map(len, output.values())) > output_bytes:
                    stopped = "output"
                    for fd in output.keys() & selector.get_map().keys():
                        selector.unregister(fd)  # read no more, but still wait for the exit
                if not killed and (stopped or timeout <= 0 or exit_fd not in selector.get_map()):
                    stopped = stopped or ("time-out" if timeout <= 0 else "")
                    kill()
                    killed, deadline = True, time.monotonic() + 1.0
    finally:
        if not killed:
            kill()
        os.close(exit_fd)
    return bytes(output[proc.stdout.fileno()]), bytes(output[proc.stderr.fileno()]), stopped


def kill_all(proc: subprocess.Popen, token: str, bwrap=False) -> None:
    """SIGKILL the call's process group and every process carrying its token
    (NANOAGENT_SANDBOX=token in its environment), wherever it moved. Under
    bubblewrap, spare bwrap: the namespace's first process (bwrap's fork) has the
    token, and its death ends the namespace, then bwrap."""
    if not bwrap:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    marker = f"NANOAGENT_SANDBOX={token}".encode()
    for _ in range(50):  # a process may fork or exec while we look: until a pass finds nothing
        found = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):  # gone, or not dumpable (the docstring's layer 1)
                environ = _environ(pid)
                if environ is None:  # one in an execve: look again once it is through
                    found = True
                elif marker in environ.split(b"\0") and not (bwrap and int(pid) == proc.pid):
                    os.kill(int(pid), signal.SIGKILL)
                    found = True
        if not found:
            return
        time.sleep(0.001)


def _environ(pid: str) -> bytes | None:
    """/proc/PID/environ, or None while an execve replaces it. Mid-execve it reads empty:
    the read opened the memory the execve dropped (read again), or the kernel has not
    set the new one up (env_end 0 in /proc/PID/stat) or is still writing it (env_start
    == env_end, which is also how a process with no environment looks)."""
    for _ in range(3):
        with open(f"/proc/{pid}/environ", "rb") as file:
            environ = file.read()
        if environ:
            return environ
        with open(f"/proc/{pid}/stat") as file:  # fields 3, 9, 50, 51 (man 5 proc)
            fields = file.read().rsplit(")", 1)[1].split()
        state, flags, env_start, env_end = fields[0], int(fields[6]), fields[47], fields[48]
        if state in "ZX" or flags & 0x00200000:  # no memory: a zombie, or PF_KTHREAD
            return b""
        if env_end == "0":
            return None
    return b"" if env_start == env_end else None
