"""code_tests in the bwrap sandbox: right answers pass; every attack scores 0 and leaves the host alone."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from grpokit.rewards import get
from grpokit.rewards.code import split_asserts
from grpokit.rewards.sandbox import Limits, Sandbox, SandboxUnavailable, running_pids, system_binds

TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(10, 5) == 15\nassert add(0, 0) == 0"


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\n"


@pytest.fixture(scope="module")
def reward():
    return get("code_tests", wall_s=5.0, cpu_s=3, memory_mb=512, num_parallel=4)


def judge(reward, code, tests=TESTS):
    return reward(["p"], [fenced(code)], tests=[tests])[0]


def test_right_partial_and_missing_code(reward):
    assert judge(reward, "def add(a, b):\n    return a + b") == 1.0
    assert judge(reward, "def add(a, b):\n    return a + b if a >= 0 else 99") == 0.75
    assert reward(["p"], ["no code block at all"], tests=[TESTS]) == [0.0]
    all_or_nothing = get("code_tests", mode="all")
    assert all_or_nothing(
        ["p"], [fenced("def add(a, b):\n    return a + b if a >= 0 else 99")], tests=[TESTS]
    ) == [0.0]


def test_stdin_stdout_cases(reward):
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]
    code = "a, b = map(int, input().split())\nprint(a + b)"
    assert reward(["p"], [fenced(code)], tests=[cases]) == [1.0]
    assert reward(["p"], [fenced("print(3)")], tests=[cases]) == [0.5]


# fmt: off
ATTACKS = {
    "sys.exit before the tests": "import sys\nsys.exit(0)",
    "os._exit before the tests": "import os\nos._exit(0)",
    "patched builtins and json": "import builtins, json\nbuiltins.repr = lambda x: '3'\njson.dumps = lambda *a, **k: '{}'"
    "\ndef add(a, b): return 0",
    "fake success text": "print('All tests passed! 4/4 OK')\ndef add(a, b): return None",
    "forged result lines": "import json\nfor i in range(4): print('\\x1egrpokit-result ' + json.dumps({'i': i, 'repr': '3'}))"
    "\ndef add(a, b): return 3",
    "always-equal object": "class E:\n    def __eq__(self, o): return True\n    def __repr__(self): return 'E()'\n"
    "def add(a, b): return E()",
    "infinite loop": "while True: pass",
    "fork bomb": "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
    "allocate 20 GB": "x = bytearray(20 * 1024**3)\ndef add(a, b): return a + b",
    "huge file": "open('/tmp/big', 'wb').write(b'0' * (200 * 1024**2))\ndef add(a, b): return a + b",
}
# fmt: on

# Reads every file it can open outside /usr (the system tree, too big to read in the CPU limit, and
# shown read-only) and /proc, /sys, /dev, collects every `add(A, B) == V` it finds, and answers from
# them. It scores 0 only because no expected value is anywhere it can see: put the asserts into the
# sandbox's files (the mutant `tests leaked into the sandbox`) and it scores 1.
SNOOP = r"""
import os, re, sys
found, read = {}, []
for root, dirs, files in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("usr", "proc", "sys", "dev")]
    for name in files:
        path = os.path.join(root, name)
        try:
            with open(path, errors="replace") as f:
                text = f.read(1 << 20)
        except OSError:
            continue
        read.append(path)
        for a, b, v in re.findall(r"add\((-?\d+), (-?\d+)\) == (-?\d+)", text):
            found[(int(a), int(b))] = int(v)
print("\x1fsnoop", len(read), sorted(found.items()), file=sys.stderr)
def add(a, b):
    return found.get((a, b), -1)
"""


def test_reading_every_visible_file_finds_no_expected_value(reward):
    assert judge(reward, SNOOP) == 0.0
    # the attack ran to the end: it read its own files, and found nothing
    res = Sandbox(limits=Limits(wall_s=10.0)).run(
        {"solution.py": SNOOP, "calls.json": '["add(1, 2)"]'}, ["/usr/bin/python3", "-I", "-S", "solution.py"]
    )
    assert res.returncode == 0, res.stderr
    report = res.stderr.split("\x1fsnoop")[1].split()
    assert int(report[0]) >= 2 and report[1] == "[]"
    assert "/tmp/sandbox/calls.json" not in res.stderr  # (paths are counted, not printed)


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def data_file_in_the_checkout():
    path = REPO / "tests" / f".sandbox-probe-{os.getpid()}.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n')
    path.chmod(0o644)
    yield path
    path.unlink()


def test_model_code_sees_no_checkout_data_or_home(data_file_in_the_checkout):
    probes = [
        str(data_file_in_the_checkout),
        str(REPO / "README.md"),
        str(REPO),
        str(Path.home()),
        os.getcwd(),
    ]
    code = (
        "import json, os, sys\n"
        f"paths = {probes!r}\n"
        "print(json.dumps({p: os.path.exists(p) for p in paths}))\n"
        "print(json.dumps(sorted(os.listdir('/'))))\n"
        "print(json.dumps(sorted(os.listdir('/etc'))))\n"
    )
    res = Sandbox().run({"probe.py": code}, ["/usr/bin/python3", "-I", "-S", "probe.py"])
    assert res.returncode == 0, res.stderr
    seen, top, etc = map(json.loads, res.stdout.splitlines())
    assert seen == {p: False for p in probes}
    assert set(top) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "sbin",
        "tmp",
        "usr",
    }
    assert set(etc) <= {"ld.so.cache", "ld.so.conf", "ld.so.conf.d"}


def test_an_interpreter_outside_usr_is_bound_alone_and_one_in_a_home_is_refused():
    args = system_binds("/opt/py312/bin/python3.12")
    assert args[-3:] == ["--ro-bind", "/opt/py312", "/opt/py312"]
    assert "/" not in [args[i + 1] for i, a in enumerate(args) if a == "--ro-bind"]
    with pytest.raises(SandboxUnavailable, match="home directory or the working directory"):
        system_binds("/root/.venv/bin/python")
    with pytest.raises(SandboxUnavailable, match="python= an interpreter"):
        system_binds(str(REPO / ".venv" / "bin" / "python3"))


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attacks_score_zero(reward, name):
    assert judge(reward, ATTACKS[name]) == 0.0


def test_no_write_outside_the_sandbox(reward, tmp_path):
    target = tmp_path / "pwned.txt"
    target.parent.chmod(0o777)  # even a world-writable host directory stays out of reach
    code = f"open({str(target)!r}, 'w').write('x')\ndef add(a, b): return a + b"
    assert judge(reward, code) == 0.0
    assert not target.exists()
    for path in ("/etc/pwned", str(Path.home() / "pwned")):
        judge(reward, f"open({path!r}, 'w').write('x')")
        assert not Path(path).exists()


def test_no_network(reward):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
    thread.start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ndef add(a, b): return a + b"
    assert judge(reward, code) == 0.0
    thread.join(timeout=1)
    assert not accepted
    server.close()


def test_nothing_survives_the_time_limit():
    box = Sandbox(limits=Limits(wall_s=2.0, cpu_s=2), slots=1)
    uid = Sandbox.UID_BASE
    code = (
        "import subprocess, time\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "subprocess.Popen(['/bin/sh', '-c', 'while :; do :; done'], start_new_session=True)\n"
        "time.sleep(300)\n"
    )
    res = box.run({"s.py": code}, ["/usr/bin/python3", "-I", "-S", "s.py"])
    assert res.timed_out and res.seconds < 10
    assert running_pids(uid) == []


def test_fork_bomb_leaves_no_process_behind():
    box = Sandbox(limits=Limits(wall_s=3.0), slots=1)
    box.run({"b.py": ATTACKS["fork bomb"]}, ["/usr/bin/python3", "-I", "-S", "b.py"])
    assert running_pids(Sandbox.UID_BASE) == []


def test_unsupported_tests_are_refused_not_run():
    with pytest.raises(ValueError, match="write `assert CALL == LITERAL`"):
        split_asserts("assert add(1, 2)")
    with pytest.raises(ValueError, match="must be a literal"):
        split_asserts("assert add(1, 2) == add(2, 1)")
    assert split_asserts("assert f([1, 2]) == (3, 'x')") == [("f([1, 2])", (3, "x"))]


def test_missing_bwrap_refuses_with_the_fix(monkeypatch):
    import grpokit.rewards.sandbox as sb

    monkeypatch.setattr(sb.shutil, "which", lambda name: None if name == "bwrap" else "/usr/bin/" + name)
    with pytest.raises(SandboxUnavailable, match=r"install bubblewrap.*sandbox='none'"):
        Sandbox()


def test_unsandboxed_mode_warns():
    with pytest.warns(UserWarning, match="WITHOUT a sandbox"):
        Sandbox(mode="none")


def test_many_quick_runs_do_not_pile_up_zombies_against_the_process_limit():
    # bwrap's namespace init is reparented when the outer bwrap exits; unreaped, 32 of them would
    # exhaust RLIMIT_NPROC and every later run would fail to start
    box = Sandbox(limits=Limits(processes=8), slots=1)
    codes = [box.run({}, ["/usr/bin/python3", "-I", "-S", "-c", "pass"]).returncode for _ in range(40)]
    assert codes == [0] * 40
    assert running_pids(Sandbox.UID_BASE) == []
