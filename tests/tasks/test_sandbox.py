"""The sandbox contains hostile programs, in every isolation mode this machine offers.

Modes run in-process are those available to the test's own uid (root here: "namespaces"); the non-root
mode ("userns") is exercised by re-running a battery as `nobody` through setpriv when the test runs as
root. There is no mode without namespaces: where none works, run_python refuses (fail closed).
"""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

from dinfer_jax.tasks import sandbox
from dinfer_jax.tasks.sandbox import Limits, run_python

REPO = pathlib.Path(__file__).resolve().parents[2]
MODES = sandbox.available_modes()
FAST = Limits(cpu_seconds=1, wall_seconds=2.0)

# A fork bomb that survives failed forks, so only the limits end it.
FORK_BOMB = """
import os
while True:
  try:
    os.fork()
  except OSError:
    pass
"""


def _sandbox_uid_processes(uids):
  """Live (non-zombie) processes, or any zombies, owned by one of `uids` (this test's own runs: the
  suite runs in parallel workers, and another worker's sandboxed program is not a leftover of ours)."""
  found = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        status = pathlib.Path(f"/proc/{entry}/status").read_text()
      except OSError:
        continue
      uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
      if uid in uids:
        found.append((int(entry), uid))
  return found


def _record(monkeypatch, name: str) -> list:
  """What sandbox.<name>() returns to this test's runs, in order. Other pytest workers run sandboxed
  programs at the same time, with their own uids and directories in the same parent: a test looks at its
  own runs' only."""
  seen = []
  make = getattr(sandbox, name)

  def record(*args):
    seen.append(make(*args))
    return seen[-1]

  monkeypatch.setattr(sandbox, name, record)
  return seen


@pytest.fixture
def run_uids(monkeypatch):
  """The sandbox uids the test's runs are given."""
  return _record(monkeypatch, "_new_uid")


def test_modes_found():
  assert MODES, sandbox._probe_errors
  if os.geteuid() == 0 and shutil.which("unshare"):
    assert MODES[0] == "namespaces", sandbox._probe_errors


def test_limits_validated():
  with pytest.raises(ValueError, match="memory_bytes"):
    Limits(memory_bytes=1)
  with pytest.raises(ValueError, match="cpu_seconds"):
    Limits(cpu_seconds=0)
  with pytest.raises(ValueError, match="wall_seconds"):
    Limits(wall_seconds=0)


@pytest.fixture
def run_workdirs(monkeypatch):
  """The host directories behind the test's runs' roots."""
  return _record(monkeypatch, "_new_workdir")


@pytest.mark.parametrize("mode", MODES)
def test_normal_program(mode, run_workdirs):
  r = run_python("import os, sys\nopen('f.txt', 'w').write(input())\nprint(open('f.txt').read()[::-1])\n"
                 "print(os.getcwd())\nprint('to stderr', file=sys.stderr)",
                 stdin="hello", mode=mode)
  assert r.ok, r
  assert r.mode == mode
  reversed_text, cwd = r.stdout.split()
  assert reversed_text == "olleh"
  assert r.stderr == "to stderr\n"
  assert cwd == "/tmp"  # the program's own tmpfs inside its root
  assert len(run_workdirs) == 1 and os.path.basename(run_workdirs[0]).startswith("dinfer-sandbox-")
  assert not os.path.exists(run_workdirs[0]), "the host directory behind the run's root must be removed afterwards"
  failed = run_python("raise SystemExit(3)", mode=mode)
  assert (failed.ok, failed.returncode, failed.killed_reason) == (False, 3, None)


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_hits_cpu_limit(mode):
  r = run_python("while True:\n  pass", limits=Limits(cpu_seconds=1, wall_seconds=8.0), mode=mode)
  assert not r.ok
  assert r.killed_reason == "cpu_limit" and r.returncode == -24, r


@pytest.mark.parametrize("mode", MODES)
def test_sleeper_hits_wall_timeout(mode):
  r = run_python("import time\ntime.sleep(60)", limits=Limits(wall_seconds=1.0), mode=mode)
  assert not r.ok and r.timed_out and r.killed_reason == "wall_timeout", r


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_contained(mode, run_uids):
  r = run_python(FORK_BOMB, limits=FAST, mode=mode)
  assert not r.ok
  assert r.killed_reason in ("wall_timeout", "cpu_limit"), r
  # The machine is unharmed: we can still start processes, and nothing of the run is left.
  assert subprocess.run(["true"]).returncode == 0
  assert len(run_uids) == 1
  assert _sandbox_uid_processes(run_uids) == []


@pytest.mark.parametrize("mode", MODES)
def test_escaped_background_process_killed(mode, run_uids):
  # A child that leaves the process group (setsid) and outlives the program.
  code = "import os, time\nif os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\nprint('parent done')"
  r = run_python(code, limits=FAST, mode=mode)
  assert r.ok and r.stdout == "parent done\n", r
  assert len(run_uids) == 1
  assert _sandbox_uid_processes(run_uids) == []


_CALLER = """
import sys
# The sandbox is stdlib-only and loads by its path, as its launcher runs: the package (jax, numpy) is not
# importable by this plain interpreter.
import importlib.util
_spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1] + "/dinfer_jax/tasks/sandbox.py")
sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sandbox)
sandbox.available_modes()  # the probe runs a sandboxed program too; get it out of the way
sandbox._new_uid = lambda: int(sys.argv[3])  # the test looks for exactly this run's processes
make_workdir = sandbox._new_workdir

def announced_workdir():
  d = make_workdir()
  print(d, flush=True)  # the test removes exactly this one: the killed caller cannot
  return d

sandbox._new_workdir = announced_workdir
print("probed", flush=True)
sandbox.run_python("import time\\ntime.sleep(100)", limits=sandbox.Limits(wall_seconds=3.0), mode=sys.argv[2])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="finds the program by its sandbox uid (root modes)")
@pytest.mark.parametrize("mode", MODES)
def test_program_dies_with_its_caller(mode):
  uids = [sandbox._new_uid()]
  workdir = None
  caller = subprocess.Popen([sys.executable, "-c", _CALLER, str(REPO), mode, str(uids[0])],
                            stdout=subprocess.PIPE, text=True)
  try:
    assert caller.stdout.readline() == "probed\n"
    workdir = caller.stdout.readline().strip()
    assert os.path.basename(workdir).startswith("dinfer-sandbox-"), workdir
    deadline = time.monotonic() + 10
    while not _sandbox_uid_processes(uids):
      assert time.monotonic() < deadline, "the sandboxed program never started"
      time.sleep(0.05)
    caller.kill()  # no cleanup runs in the caller
    caller.wait()
    # The launcher notices (parent-death signal, or its own wall-clock backstop) and ends the run.
    deadline = time.monotonic() + 10
    while _sandbox_uid_processes(uids):
      assert time.monotonic() < deadline, _sandbox_uid_processes(uids)
      time.sleep(0.1)
  finally:
    caller.kill()
    caller.wait()
    if workdir:  # the dead caller could not remove its working dir; others' live ones are left alone
      shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
def test_huge_allocation_fails(mode):
  r = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')", limits=FAST, mode=mode)
  assert not r.ok and "allocated" not in r.stdout
  assert "MemoryError" in r.stderr, r


# Forks `n` children that each hold `mb` MiB (touched, so resident) for a second: each is well under the
# per-process RLIMIT_AS, only their sum can be over the check's budget.
FORKED_MEMORY = """
import os, time
kids = []
for i in range({n}):
  pid = os.fork()
  if pid == 0:
    x = b"\\x01" * ({mb} * 2**20)
    time.sleep(1.0)
    os._exit(0)
  kids.append(pid)
for k in kids:
  os.waitpid(k, 0)
print("all held")
"""
_CGROUP = sandbox._find_cgroup_parent()


@pytest.mark.parametrize("enforcer", ["cgroup", "poll"])
@pytest.mark.parametrize("mode", MODES)
def test_memory_is_limited_per_check_not_per_process(mode, enforcer, monkeypatch):
  # Before: RLIMIT_AS alone let 16 processes of 512 MiB take ~8.5 GiB in one check.
  if enforcer == "cgroup" and _CGROUP is None:
    pytest.skip("no memory cgroup can be made here (the polled budget is the 'poll' case)")
  monkeypatch.setattr(sandbox, "_cgroup_parent", [_CGROUP if enforcer == "cgroup" else None])
  made = _record(monkeypatch, "_memory_group") if enforcer == "cgroup" else None
  limits = Limits(cpu_seconds=3, wall_seconds=8.0, memory_bytes=256 * 2**20, check_memory_bytes=200 * 2**20)
  r = run_python(FORKED_MEMORY.format(n=6, mb=100), limits=limits, mode=mode)
  assert not r.ok and r.killed_reason == "memory_limit", r
  # Under the budget the same program runs: the limit is on the sum, not on forking.
  r = run_python(FORKED_MEMORY.format(n=2, mb=40), limits=limits, mode=mode)
  assert r.ok and r.stdout.strip() == "all held", r
  if made is not None:
    assert len(made) == 2 and all(g is not None and not os.path.exists(g.path) for g in made), made


def test_check_memory_limit_validated():
  with pytest.raises(ValueError, match="check_memory_bytes"):
    Limits(check_memory_bytes=1024)
  assert Limits(memory_bytes=64 * 2**20).memory_budget == 64 * 2**20
  assert Limits(check_memory_bytes=96 * 2**20).memory_budget == 96 * 2**20


@pytest.mark.parametrize("mode", MODES)
def test_output_flood_cut(mode):
  r = run_python("while True:\n  print('a' * 1000)", limits=Limits(max_output_bytes=10_000), mode=mode)
  assert not r.ok and r.killed_reason == "output_limit", r
  assert len(r.stdout) <= 10_000


@pytest.mark.parametrize("mode", MODES)
def test_big_file_hits_fsize_limit(mode):
  r = run_python("open('big', 'wb').write(b'x' * (8 << 20))", limits=Limits(max_file_bytes=1 << 20),
                 mode=mode)
  assert not r.ok and "File too large" in r.stderr, r


@pytest.mark.parametrize("mode", MODES)
def test_cannot_write_outside_workdir(mode, tmp_path):
  tag = uuid.uuid4().hex
  targets = [REPO / f"pwned-{tag}", REPO / "train_td" / f"pwned-{tag}"]
  # World-writable places, paths that do not exist yet: only a read-only mount stops the program.
  targets += [pathlib.Path(f"/tmp/pwn-{tag}/pwned"), pathlib.Path(f"/dev/shm/pwned-{tag}"),
              pathlib.Path(f"/var/tmp/pwned-{tag}"),
              pathlib.Path(sandbox.tempfile.gettempdir()) / f"escape-{tag}"]
  escape = [f"../escape-{tag}"]  # the working directory's parent, as a relative path
  code = (f"import os\nfor p in {[str(t) for t in targets] + escape!r}:\n"
          "  try:\n    os.makedirs(os.path.dirname(p), exist_ok=True)\n    open(p, 'w').write('x')\n"
          "    print('WROTE', p)\n  except OSError as e:\n    print('refused', p, e.strerror)\n"
          # The same through a directory fd (dir_fd) instead of a path.
          "for d in ('/tmp', '/dev/shm'):\n  try:\n    fd = os.open(d, os.O_RDONLY)\n"
          f"    os.close(os.open('dirfd-{tag}', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))\n"
          "    print('WROTE', d)\n  except OSError as e:\n    print('refused', d, e.strerror)\n"
          "open('inside.txt', 'w').write('fine')\nprint('inside ok')")
  dirfd_targets = [pathlib.Path(f"/tmp/dirfd-{tag}"), pathlib.Path(f"/dev/shm/dirfd-{tag}")]
  try:
    r = run_python(code, limits=FAST, mode=mode)
    assert r.ok, r
    # The program's /tmp is its own tmpfs (its working directory): writes there succeed and vanish.
    wrote = [line for line in r.stdout.splitlines() if line.startswith("WROTE")]
    assert all(line.split()[1].startswith("/tmp") for line in wrote), r.stdout
    assert "inside ok" in r.stdout, r.stdout
    for t in targets + dirfd_targets:
      assert not t.exists(), t
  finally:
    for t in targets + dirfd_targets:
      if t.exists():
        t.unlink()
    shutil.rmtree(f"/tmp/pwn-{tag}", ignore_errors=True)


# Every way we know to read another process's environment: by path, through a /proc directory fd
# (dir_fd: the escape of the removed "rlimits" mode), through os.scandir/os.listdir on an fd, and from
# the parent's pid.
ENVIRON_THIEF = """
import os
out = [repr(dict(os.environ))]
for p in (os.listdir('/proc') if os.path.isdir('/proc') else []):
  if p.isdigit():
    try:
      out.append(open('/proc/' + p + '/environ', 'rb').read().decode('latin-1'))
    except OSError:
      pass
try:
  proc = os.open('/proc', os.O_RDONLY | os.O_DIRECTORY)
  for p in [e.name for e in os.scandir(proc) if e.name.isdigit()] + [str(os.getppid())]:
    try:
      fd = os.open(p + '/environ', os.O_RDONLY, dir_fd=proc)
      out.append(os.read(fd, 1 << 20).decode('latin-1'))
      os.close(fd)
    except OSError:
      pass
except OSError:
  pass
print('\\n'.join(out))
"""


@pytest.mark.parametrize("mode", MODES)
def test_cannot_see_parent_environment(mode, monkeypatch):
  secret = "s3cret-" + uuid.uuid4().hex
  monkeypatch.setenv("DINFER_SANDBOX_SECRET", secret)
  # A process that carries the secret in its exec-time environment, i.e. in /proc/<pid>/environ.
  holder = subprocess.Popen(["sleep", "30"], env={"DINFER_SANDBOX_SECRET": secret})
  try:
    r = run_python(ENVIRON_THIEF, limits=FAST, mode=mode)
  finally:
    holder.kill()
    holder.wait()
  assert r.ok, r
  assert secret not in r.stdout and secret not in r.stderr
  assert "DINFER_SANDBOX_SECRET" not in r.stdout
  assert r.stdout.splitlines()[0] in ("{}", "{'LC_CTYPE': 'C.UTF-8'}"), r.stdout  # set by Python


def test_no_weak_mode_and_fail_closed(monkeypatch):
  with pytest.raises(ValueError, match="'rlimits' was removed"):
    run_python("print(1)", mode="rlimits")
  # A machine where no namespace mode works: nothing runs, and the error says what to enable.
  monkeypatch.setattr(sandbox, "_probe_results", {m: False for m in sandbox.MODES})
  monkeypatch.setattr(sandbox, "_probe_errors", {"namespaces": "needs root", "userns": "probe program failed"})
  monkeypatch.setattr(sandbox, "_run", lambda *a, **k: pytest.fail("must not run the program"))
  with pytest.raises(sandbox.SandboxError, match=r"cannot run model-written code safely here.*"
                     r"namespaces: needs root; userns: probe program failed.*unprivileged_userns_clone"):
    run_python("print(1)")
  with pytest.raises(sandbox.SandboxError):
    sandbox.eval_expression("x+1", [1])  # the program verifier fails closed too, it does not answer None


@pytest.mark.parametrize("mode", MODES)
def test_no_network(mode):
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print('connected')")
    r = run_python(code, limits=FAST, mode=mode)
    server.settimeout(0.3)
    with pytest.raises(socket.timeout):
      server.accept()
  assert not r.ok and "connected" not in r.stdout, r


@pytest.mark.parametrize("mode", MODES)
def test_eval_expression(mode):
  assert sandbox.eval_expression("x*3+2", [0, 1, -4], mode=mode) == [2, 5, -10]
  assert sandbox.eval_expression(" max(x,5) ", [1, 9], mode=mode) == [5, 9]
  assert sandbox.eval_expression("x//(x-1)", [0, 1], mode=mode) is None  # ZeroDivisionError
  assert sandbox.eval_expression("x/2", [4], mode=mode) is None  # float, not int
  assert sandbox.eval_expression("x>1", [4], mode=mode) is None  # bool, not int


@pytest.mark.parametrize("text", [
    "import os", "x; import os", "__import__('os').system('true')", "().__class__", "y+1",
    "lambda: 1", "open('f')", "", "x*", "x\nimport os", "(x:=1)", "[c for c in 'ab']", "x" * 300])
def test_eval_expression_rejects_non_expressions_early(text, monkeypatch):
  monkeypatch.setattr(sandbox, "run_python", lambda *a, **k: pytest.fail("must not reach the sandbox"))
  assert sandbox.eval_expression(text, [1]) is None


# --------------------------------------------------------------------------------------------------
# The non-root modes, run as `nobody` with the system interpreter.

_AS_NOBODY = r"""
import json, socket, sys
# The sandbox is stdlib-only and loads by its path, as its launcher runs: the package (jax, numpy) is not
# importable by this plain interpreter.
import importlib.util
_spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1] + "/dinfer_jax/tasks/sandbox.py")
sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sandbox)
programs = json.loads(sys.argv[2])
out = {"modes": list(sandbox.available_modes()), "errors": sandbox._probe_errors, "runs": {}}
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
server.settimeout(0.3)
programs["socket"] = ("import socket\nsocket.create_connection(('127.0.0.1', %d), timeout=1)\n"
                      "print('connected')" % server.getsockname()[1])
for mode in out["modes"]:
  for name, code in programs.items():
    limits = sandbox.Limits(cpu_seconds=1, wall_seconds=2.0)
    r = sandbox.run_python(code.replace("@MODE@", mode), limits=limits, mode=mode)
    out["runs"][mode + "/" + name] = [r.ok, r.stdout[-500:], r.killed_reason]
try:
  server.accept()
  out["connection_arrived"] = True
except socket.timeout:
  out["connection_arrived"] = False
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.access(
    "/usr/bin/python3", os.X_OK), reason="needs root (to become nobody), setpriv and /usr/bin/python3")
def test_non_root_modes_contain_hostile_programs():
  tag = uuid.uuid4().hex
  # The repository: not even visible inside. The sandbox gives programs a /tmp of their own, so a clone under
  # /tmp would be shadowed by it (the write lands in the sandbox's /tmp, never on the host): aim at /var/tmp.
  base = "/var/tmp" if REPO.resolve().is_relative_to("/tmp") else str(REPO)
  outside = f"{base}/pwn-{tag}/@MODE@"
  secret = "s3cret-" + uuid.uuid4().hex
  programs = {
      "environ": ENVIRON_THIEF,
      "dirfd_write": (f"import os\nfd = os.open('/', os.O_RDONLY)\n"
                      f"os.close(os.open('dirfd-{tag}-@MODE@', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))\n"
                      "print('WROTE')"),
      "loop": "while True:\n  pass",
      "fork_bomb": FORK_BOMB,
      "write": (f"import os\np = {outside!r}\ntry:\n  os.makedirs(os.path.dirname(p))\n"
                "  open(p, 'w').write('x')\n  print('WROTE')\nexcept OSError as e:\n  print('refused')"),
      "memory": "x = bytearray(10 * 1024**3)\nprint('allocated')",
      # 6 x 100 MiB: each under RLIMIT_AS, together over the check's budget (nobody cannot make a cgroup:
      # the caller's polled budget stops it).
      "forked_memory": FORKED_MEMORY.format(n=6, mb=100).replace("print(\"all held\")", "print('allocated')"),
  }
  # The caller (nobody) carries the secret in its environment: same uid as the userns program outside.
  proc = subprocess.run(
      ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3", "-I",
       "-c", _AS_NOBODY, str(REPO), json.dumps(programs)],
      capture_output=True, text=True, cwd="/", timeout=120,
      env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DINFER_SANDBOX_SECRET": secret})
  try:
    if proc.returncode != 0 and "Permission denied" in proc.stderr:
      pytest.skip(f"the repository is not readable by nobody: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "rlimits" not in out["modes"]
    if not out["modes"]:
      pytest.skip(f"no sandbox mode works as nobody here: {out['errors']}")
    assert out["modes"] == ["userns"], out
    for key, (ok, stdout, killed_reason) in out["runs"].items():
      name = key.split("/")[1]
      if name == "write":
        assert ok and stdout.strip() == "refused", (key, stdout)
      elif name == "environ":
        assert ok and secret not in stdout and "DINFER_SANDBOX_SECRET" not in stdout, (key, stdout)
      else:
        assert not ok, (key, stdout, killed_reason)
      assert "connected" not in stdout and "allocated" not in stdout and "WROTE" not in stdout, (key, stdout)
      if name == "forked_memory":
        assert killed_reason == "memory_limit", (key, stdout, killed_reason)
      if name in ("loop", "fork_bomb"):
        assert killed_reason in ("cpu_limit", "wall_timeout"), (key, killed_reason)
    assert not out["connection_arrived"]
    assert subprocess.run(["true"]).returncode == 0
    assert not os.path.exists(outside.replace("@MODE@", "userns"))
    assert not os.path.exists(f"/tmp/dirfd-{tag}-userns") and not os.path.exists(f"/dirfd-{tag}-userns")
  finally:
    shutil.rmtree(f"{base}/pwn-{tag}", ignore_errors=True)
    for leftover in (f"/tmp/dirfd-{tag}-userns", f"/dirfd-{tag}-userns"):
      if os.path.exists(leftover):
        os.unlink(leftover)


@pytest.mark.parametrize("mode", MODES)
def test_private_tmpdir_does_not_break_the_sandbox(mode, tmp_path, monkeypatch):
  private = tmp_path / "private"
  private.mkdir(mode=0o700)
  monkeypatch.setattr(sandbox.tempfile, "tempdir", str(private))
  r = run_python("print(6 * 7)", mode=mode)
  assert r.ok and r.stdout == "42\n", r
  assert list(private.iterdir()) == []
