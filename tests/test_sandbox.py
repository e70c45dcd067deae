"""nanoagent/sandbox.py: run_python's contract, then one test per attack: the limit holds and the caller lives.

Tests that depend on the layers run once per configuration this machine gives: "bubblewrap" (every layer) and
"no bubblewrap" (sandbox.layers replaced by the same list without it). As root the program runs as nobody in
both; as a normal user without bubblewrap it runs as us and may do what we may, so the tests of what only a
uid of its own stops skip there. Tests that need bubblewrap fail in CI when it is missing, and skip elsewhere.
"""

import ast
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nanoagent import sandbox
from nanoagent.sandbox import NOBODY, Limits, run_python

REPO = Path(__file__).resolve().parent.parent


def program(source: str) -> str:
    """A test program written indented in place."""
    return textwrap.dedent(source).strip() + "\n"


def processes_with(marker: bytes) -> list[int]:
    """Live processes whose command line or environment holds marker (a zombie's both read empty)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline, open(f"/proc/{pid}/environ", "rb") as environ:
                if marker in cmdline.read() + environ.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def zombies_of_nobody() -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                count += stat.read().rsplit(")", 1)[1].split()[0] == "Z" and os.stat(f"/proc/{pid}").st_uid == NOBODY
        except OSError:
            continue
    return count


@pytest.fixture(autouse=True)
def nothing_left_running():
    """After every test, no process of the test's sandbox calls runs (they all carry their call's token). Calls
    that were running before the test (a training run on the same machine, say) are not the test's."""
    before = set(processes_with(b"NANOAGENT_SANDBOX="))
    yield
    left = sorted(set(processes_with(b"NANOAGENT_SANDBOX=")) - before)
    for pid in left:  # leave the machine clean even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes of a sandbox call outlived it: {left}"


def need_bubblewrap():
    if "bubblewrap" not in sandbox.layers():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI installs bubblewrap (.ci/run), but the sandbox's layers are {sandbox.layers()}")
        pytest.skip("bubblewrap is not installed here (apt-get install bubblewrap)")


@pytest.fixture(params=["bubblewrap", "no bubblewrap"])
def configuration(request, monkeypatch):
    """The layers a test runs under: every one this machine has, then all but bubblewrap."""
    if request.param == "bubblewrap":
        need_bubblewrap()
        return sandbox.layers()
    weaker = [layer for layer in sandbox.layers() if layer != "bubblewrap"]
    monkeypatch.setattr(sandbox, "layers", lambda: weaker)
    return weaker


@pytest.fixture
def uid_of_its_own(configuration):
    """The configuration, where the program does not run as us: nobody (as root), or in bubblewrap."""
    if configuration == ["process"]:
        pytest.skip("as a normal user without bubblewrap the program runs as us: nothing stops this")
    return configuration


@pytest.fixture
def shared_dir():
    """A directory outside the sandbox that nobody, too, may write: an escape would land here."""
    path = tempfile.mkdtemp()
    os.chmod(path, 0o777)
    yield Path(path)
    shutil.rmtree(path)


# ---------------------------------------------------------------------------------------------------------------
# The contract


def test_prints_come_back_stdout_then_stderr(configuration):
    code = program("""
        import sys
        sys.stderr.write('to stderr\\n')
        print('to stdout')
        print(sum(range(10)))
    """)
    assert run_python(code) == ("to stdout\n45\nto stderr\n", True)


def test_an_exception_comes_back_as_its_traceback(configuration):
    text, ok = run_python(program("""
        def f():
            raise ValueError('boom')
        f()
    """))
    assert not ok and "Traceback" in text and "line 2, in f" in text and "ValueError: boom" in text
    assert text.endswith("[sandbox: exit status 1]")
    text, ok = run_python("def f(:\n")
    assert not ok and "SyntaxError" in text


def test_exit_status_and_signals_are_reported(configuration):
    assert run_python("import sys; sys.exit(3)") == ("[sandbox: exit status 3]", False)
    text, ok = run_python("import os, signal; print('before', flush=True); os.kill(os.getpid(), signal.SIGSEGV)")
    assert (text, ok) == ("before\n[sandbox: the program was killed by signal SIGSEGV]", False)


def test_output_past_the_cap_is_cut_with_a_marker():
    text, ok = run_python("print('x' * 10_000)", Limits(output_bytes=100))
    assert text == "x" * 100 + "\n[sandbox: output cut at 100 bytes; the program was stopped]" and not ok


def test_time_out_kills_in_bounded_time_and_keeps_what_was_printed(configuration):
    start = time.monotonic()
    text, ok = run_python("import time; print('started'); time.sleep(60)", Limits(timeout_s=1))
    assert time.monotonic() - start < 2.5
    assert (text, ok) == ("started\n[sandbox: time-out: the program ran past 1 s and was killed]", False)


def test_nothing_left_running_and_the_work_directory_removed(configuration, monkeypatch):
    temp = tempfile.mkdtemp()
    os.chmod(temp, 0o755)  # nobody must reach its work directory inside
    monkeypatch.setattr(tempfile, "tempdir", temp)  # where run_python makes its work directory
    code = program("""
        import os, subprocess, sys
        os.mkdir('sub')
        open('sub/data.txt', 'w').write('x')
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)  # background-sleeper'])
        print(sorted(os.listdir('.')))
    """)
    assert run_python(code) == ("['main.py', 'sub']\n", True)
    assert processes_with(b"background-sleeper") == [] and os.listdir(temp) == []
    os.rmdir(temp)


def test_calls_from_a_thread_pool_each_get_their_own_answer(configuration):
    codes = [f"print({i} * {i})" for i in range(12)] + ["while True: pass"]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda code: run_python(code, Limits(timeout_s=1)), codes))
    assert results[:12] == [(f"{i * i}\n", True) for i in range(12)]
    assert "time-out" in results[12][0]


@pytest.fixture
def fresh_probe(monkeypatch):
    """layers() probes once per process: forget it before and after the test (monkeypatch is undone later)."""
    sandbox._probe.cache_clear()
    yield
    sandbox._probe.cache_clear()


def test_layers_warn_once_when_bubblewrap_is_missing(fresh_probe, monkeypatch):
    monkeypatch.setattr(sandbox, "_BWRAP", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = sandbox.layers()
        assert run_python("print(1)") == ("1\n", True)  # the weaker layers, and no second warning
    assert found == (["process", "unprivileged uid"] if os.geteuid() == 0 else ["process"])
    assert len(caught) == 1 and "apt-get install bubblewrap" in str(caught[0].message)


def test_layers_warn_once_when_bubblewrap_cannot_start(fresh_probe, monkeypatch):
    monkeypatch.setattr(sandbox, "_BWRAP", shutil.which("false", path="/usr/bin:/bin"))  # fails, as bwrap may
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert "bubblewrap" not in sandbox.layers() and "bubblewrap" not in sandbox.layers()
    assert len(caught) == 1 and "cannot start a sandbox" in str(caught[0].message)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can become a normal user (as one, the other tests are this)")
def test_runs_for_a_normal_user_with_and_without_bubblewrap():
    # Our interpreter may sit where a normal user cannot read it, so the normal user runs the system's, with a copy
    # of the module (the repository, too, may be out of its reach).
    copy = tempfile.mkdtemp()
    os.chmod(copy, 0o755)
    shutil.copy(REPO / "nanoagent" / "sandbox.py", copy)
    script = program("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import sandbox
        print(sandbox.layers())
        print(sandbox.run_python('import os; print(6 * 7, os.getuid())'))
        sandbox.layers = lambda: ['process']
        print(sandbox.run_python('import os; print(6 * 7, os.getuid())'))
    """)
    result = subprocess.run(["/usr/bin/python3", "-c", script, copy], user=NOBODY, group=NOBODY, extra_groups=[],
                            env={"PATH": os.environ["PATH"]}, cwd=copy, capture_output=True, text=True, timeout=60)
    shutil.rmtree(copy)
    expected_layers = [layer for layer in sandbox.layers() if layer != "unprivileged uid"]
    assert result.stdout == f"{expected_layers}\n" + "('42 65534\\n', True)\n" * 2, result.stderr


# ---------------------------------------------------------------------------------------------------------------
# Attacks: each limit holds, and the caller lives


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(configuration):
    start = time.monotonic()
    text, ok = run_python("while True: pass", Limits(cpu_s=1, timeout_s=20))
    assert (text, ok) == ("[sandbox: CPU time limit: the program used 1 s of CPU and was killed]", False)
    assert time.monotonic() - start < 10  # one second of CPU, however busy the machine


def test_the_program_runs_under_exactly_the_limits_it_was_given(configuration):
    limits = Limits(cpu_s=3, memory_mb=300, file_mb=5, open_files=32, processes=20)
    names = ["RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_NPROC"]
    text, ok = run_python(f"import resource; print([resource.getrlimit(getattr(resource, n)) for n in {names}])",
                          limits)
    assert ok, text
    expected = [(3, 4), (300 << 20, 300 << 20), (5 << 20, 5 << 20), (32, 32), (0, 0)]  # SIGXCPU, then a second
    got = [tuple(pair) for pair in ast.literal_eval(text)]
    if configuration == ["process"]:  # the program runs as us: a cap on our uid's processes would count ours
        assert got[:5] == expected
    else:
        assert got == expected + [(20, 20)]


def test_the_program_cannot_raise_its_limits(configuration):
    text, ok = run_python("import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))")
    assert not ok and "ValueError: not allowed to raise maximum limit" in text


def test_the_program_runs_neither_as_root_nor_as_us(uid_of_its_own):
    assert run_python("import os; print(os.getuid(), os.getgid(), os.getgroups())") == ("65534 65534 []\n", True)


def test_a_fork_bomb_is_capped(uid_of_its_own):
    # The first process forks until the cap says no and prints how far it got; then every process forks forever.
    code = program("""
        import os, time
        count = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(0.5)  # while the first process counts
                    while True:
                        try:
                            os.fork()
                        except OSError:
                            pass
                count += 1
        except OSError as error:
            print(count, error)
        time.sleep(60)
    """)
    start = time.monotonic()
    text, ok = run_python(code, Limits(timeout_s=2))
    assert time.monotonic() - start < 4 and not ok and "time-out" in text
    assert 0 < int(text.split()[0]) < Limits().processes and "Resource temporarily unavailable" in text, text
    # Without a PID namespace the killed processes are init's to reap, and until then they count against nobody's
    # cap: the next call could not fork. Wait for init, as that call would have to.
    deadline = time.monotonic() + 10
    while zombies_of_nobody() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert zombies_of_nobody() == 0, "init does not reap orphans here: without bubblewrap, use an init that does"


def test_memory_far_beyond_the_limit_fails_in_the_program(configuration):
    text, ok = run_python("chunks = []\nwhile True: chunks.append(bytearray(50 << 20))")
    assert not ok and "MemoryError" in text and "out of memory (the limit is 512 MB)" in text
    text, ok = run_python("x = bytearray(64 << 30)")
    assert not ok and "MemoryError" in text


def test_printing_gigabytes_is_cut(configuration):
    start = time.monotonic()
    text, ok = run_python("import sys\nwhile True: sys.stdout.write('x' * (1 << 20))")
    assert time.monotonic() - start < 2 and not ok
    assert text == "x" * 4096 + "\n[sandbox: output cut at 4096 bytes; the program was stopped]"


def test_a_huge_file_stops_at_the_size_limit(configuration):
    code = program("""
        import os
        try:
            open('big', 'wb').write(b'x' * (8 << 20))
        except OSError as error:
            print(error)
        print(os.path.getsize('big'))
    """)
    assert run_python(code, Limits(file_mb=1)) == ("[Errno 27] File too large\n1048576\n", True)


def test_no_writing_into_the_repository_or_the_home_directory(uid_of_its_own):
    targets = [REPO / f"sandbox-escape-{os.getpid()}.txt", Path.home() / f"sandbox-escape-{os.getpid()}.txt"]
    code = program(f"""
        for path in {[str(target) for target in targets]!r}:
            try:
                open(path, 'w').write('x')
                print('wrote', path)
            except OSError as error:
                print(type(error).__name__)
    """)
    text, _ = run_python(code)
    escaped = [target for target in targets if target.exists()]
    for target in escaped:
        target.unlink()
    assert escaped == [], text


def test_no_writing_into_the_real_tmp_with_bubblewrap(shared_dir):
    need_bubblewrap()
    text, ok = run_python(f"open({str(shared_dir / 'escape.txt')!r}, 'w').write('x')")
    assert not ok and "FileNotFoundError" in text and not (shared_dir / "escape.txt").exists()


def test_the_environment_holds_none_of_our_secrets(configuration, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fake_secret_for_the_test")
    text, ok = run_python("import os; print(dict(os.environ))")
    assert ok and "hf_fake_secret" not in text and "HF_TOKEN" not in text


def test_the_parents_environment_cannot_be_read(uid_of_its_own, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_fake_secret_for_the_test")
    text, ok = run_python(f"print(open('/proc/{os.getpid()}/environ', 'rb').read())")
    assert not ok and "hf_fake_secret" not in text


def test_no_network_with_bubblewrap():
    need_bubblewrap()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        text, ok = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)")
        server.settimeout(0.1)
        with pytest.raises(TimeoutError):
            server.accept()  # nobody knocked
    assert not ok and "ConnectionRefusedError" in text


def detach_code(shared_dir: Path, environment: str) -> str:
    """A program whose grandchild leaves the session, then sleeps and writes a file; `environment` is what it
    execs with (the default keeps the call's, {} drops it)."""
    late = shared_dir / "late.txt"
    grandchild = f"import time; time.sleep(1); open({str(late)!r}, 'w').write('x')  # detached-grandchild"
    return program(f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execve(sys.executable, [sys.executable, '-c', {grandchild!r}], {environment})
            os._exit(0)
        os.wait()
        print('parent done')
    """)


def test_a_detached_grandchild_dies_with_the_call(configuration, shared_dir):
    assert run_python(detach_code(shared_dir, "os.environ")) == ("parent done\n", True)
    assert processes_with(b"detached-grandchild") == []
    time.sleep(1.5)
    assert not (shared_dir / "late.txt").exists()


def test_a_detached_grandchild_with_a_new_environment_dies_with_bubblewrap(shared_dir):
    need_bubblewrap()  # without it, nothing finds a process that left the session and dropped the token
    assert run_python(detach_code(shared_dir, "{}")) == ("parent done\n", True)
    assert processes_with(b"detached-grandchild") == []


def test_the_environment_of_a_process_in_an_execve_is_not_taken_for_none():
    """While an execve replaces a process's memory, /proc reads its environment empty: the
    look for a call's token must wait for the new one (None), not pass the process by."""
    loop = 'if [ "$1" -gt 0 ]; then exec /bin/sh -c "$0" "$0" $(($1 - 1)); fi'
    execs = subprocess.Popen(["/bin/sh", "-c", loop, loop, "1000000"], env={"MARK": "1"})
    plain, ours = [], []
    try:
        for _ in range(20_000):
            with open(f"/proc/{execs.pid}/environ", "rb") as file:
                plain.append(file.read())
            ours.append(sandbox._environ(str(execs.pid)))
    finally:
        execs.kill()
        execs.wait()
    assert b"" in plain, "no read fell in an execve: the test shows nothing here"
    assert all(environ is None or b"MARK=1" in environ.split(b"\0") for environ in ours)
    assert ours.count(None) < len(ours) / 2
    with subprocess.Popen(["sleep", "10"], env={}) as bare:  # and no environment reads as none
        time.sleep(0.2)  # through its execve
        assert sandbox._environ(str(bare.pid)) == b""
        bare.kill()


def test_signalling_the_parent_does_not_kill_the_caller(uid_of_its_own):
    code = program(f"""
        import os, signal
        for kill in [lambda: os.kill(os.getppid(), signal.SIGKILL), lambda: os.kill({os.getpid()}, signal.SIGKILL),
                     lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)]:
            try:
                kill()
            except OSError:
                pass
        print('still here')
    """)
    assert run_python(code) == ("still here\n", True)  # and so are we


def test_closing_stdout_or_flooding_it_does_not_confuse_the_reader(configuration):
    start = time.monotonic()
    text, _ = run_python("import os, time; os.close(1); os.close(2); time.sleep(0.5)", Limits(timeout_s=10))
    assert "time-out" not in text and time.monotonic() - start < 3  # it ended when the program did
    text, ok = run_python("import os\nos.close(1); os.close(2)\nwhile True: pass", Limits(timeout_s=1, cpu_s=60))
    assert (text, ok) == ("[sandbox: time-out: the program ran past 1 s and was killed]", False)
    text, ok = run_python("import sys; sys.stdout.write('a' * 5000); sys.stderr.write('b' * 5000)")
    assert text.startswith("a" * 4096 + "\n[sandbox: output cut") and not ok


def test_the_projects_modules_cannot_be_imported(configuration):
    code = program("""
        for name in ['train', 'nanoagent', 'torch']:
            try:
                __import__(name)
                print('imported', name)
            except ImportError as error:
                print(type(error).__name__)
    """)
    assert run_python(code) == ("ModuleNotFoundError\n" * 3, True)


def test_bad_input_is_a_message_not_an_exception():
    assert run_python("") == ("", True)
    assert run_python("print(1)\0print(2)") == ("[sandbox: the code contains a NUL byte; not run]", False)
    text, ok = run_python(b"\xff\xfe".decode("utf-8", errors="surrogateescape"))  # invalid UTF-8, as Python keeps it
    assert not ok and text.startswith("[sandbox: the code is not valid text (") and "surrogates not allowed" in text
    text, ok = run_python(b"print(1)")
    assert not ok and text.startswith("[sandbox: the code is not valid text (") and "'bytes'" in text
    start = time.monotonic()
    text, ok = run_python("x = 1\n" * 1_000_000)
    assert (text, ok) == ("[sandbox: the code is 6000000 bytes, over the limit of 1000000; not run]", False)
    assert time.monotonic() - start < 0.5
