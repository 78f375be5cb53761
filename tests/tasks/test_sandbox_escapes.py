"""Escapes that the namespaces alone did not stop: host Unix sockets, host files, new namespaces.

Each hostile program prints "ESCAPED <how>" when it gets out and "contained" otherwise. They run in every
mode this machine offers to the test's uid (root: "namespaces") and, when the test runs as root, as
`nobody` in "userns" mode against a socket and a 0600 file that `nobody` itself owns (the case where
its uid alone would let it in), plus a caller with a supplementary group: that mode is then refused.
"""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import uuid

import pytest

from dinfer_jax.tasks import sandbox
from dinfer_jax.tasks.sandbox import Limits, run_python

REPO = pathlib.Path(__file__).resolve().parents[2]
MODES = sandbox.available_modes()
LIMITS = Limits(cpu_seconds=2, wall_seconds=5.0)
X86 = os.uname().machine == "x86_64"

_CTYPES = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def hostile_programs(sock_path: str, abstract_name: str, secret_path: str) -> dict:
  """name -> program text."""
  host_paths = [str(REPO), str(REPO / "README.md"), "/run", "/var", "/proc", "/sys", "/dev/shm",
                "/etc/passwd", secret_path, sock_path, os.path.dirname(sock_path) + "/."]
  p = {
      "unix_socket": (f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n  s.connect({sock_path!r})\n"
                      "  print('ESCAPED connected')\nexcept OSError as e:\n  print('contained', e)"),
      "abstract_socket": (f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n"
                          f"  s.connect('\\0' + {abstract_name!r})\n  print('ESCAPED connected')\n"
                          "except OSError as e:\n  print('contained', e)"),
      "read_secret": (f"try:\n  print('ESCAPED', open({secret_path!r}).read())\n"
                      "except OSError as e:\n  print('contained', e)"),
      "host_paths": (f"import os\nseen = [p for p in {host_paths!r} if os.path.lexists(p)]\n"
                     "print('ESCAPED ' + repr(seen) if seen else 'contained')"),
      # Every file the program can see lies in what the root binds (interpreter, stdlib, shared libraries),
      # is one of the four device nodes, or is its own main.py.
      "whole_tree": ("import os\nbinds = @BINDS@\nlinks = @LINKS@\n"
                     "allowed = {'/tmp/main.py', '/dev/null', '/dev/zero', '/dev/random', '/dev/urandom'}\n"
                     "under = lambda p: any(p == b or p.startswith(b + '/') for b in binds)\nextra = []\n"
                     "for d, dirs, files in os.walk('/'):\n"
                     "  dirs[:] = [x for x in dirs if not under(os.path.join(d, x))]\n"
                     "  extra += [os.path.join(d, f) for f in files if os.path.join(d, f) not in allowed\n"
                     "            and not under(os.path.join(d, f)) and os.path.join(d, f) not in links]\n"
                     "print('ESCAPED ' + repr(extra) if extra else 'contained')"),
      "write_root": ("try:\n  open('/pwned', 'w').write('x')\n  print('ESCAPED wrote /')\n"
                     "except OSError as e:\n  print('contained', e)"),
      "groups": "import os\ng = os.getgroups()\nprint('ESCAPED groups ' + repr(g) if g else 'contained')",
      "unshare_user": _CTYPES + ("r = libc.unshare(0x10000000)\n"
                                 "print('ESCAPED unshare(NEWUSER)' if r == 0 else 'contained', ctypes.get_errno())"),
      "unshare_mount": _CTYPES + ("r = libc.unshare(0x20000)\n"
                                  "print('ESCAPED unshare(NEWNS)' if r == 0 else 'contained', ctypes.get_errno())"),
      "mount_tmpfs": _CTYPES + ("r = libc.mount(b'x', b'/tmp', b'tmpfs', 0, None)\n"
                                "print('ESCAPED mount' if r == 0 else 'contained', ctypes.get_errno())"),
      "setns": _CTYPES + ("r = libc.setns(0, 0)\nprint('ESCAPED setns' if r == 0 else 'contained', "
                          "ctypes.get_errno())"),
  }
  if X86:
    # clone(CLONE_NEWUSER | SIGCHLD) by raw syscall (56), and keyctl(GET_KEYRING_ID, SESSION) (250):
    # no libc wrapper in the way.
    p["clone_newuser"] = _CTYPES + (
        "pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)\nif pid == 0:\n  os._exit(0)\n"
        "print('ESCAPED clone(NEWUSER)' if pid > 0 else 'contained', ctypes.get_errno())")
    p["keyctl"] = _CTYPES + ("r = libc.syscall(250, 0, -3, 1)\n"
                             "print('ESCAPED keyctl' if r >= 0 else 'contained', ctypes.get_errno())")
  return p


def with_root(code: str, root_contents) -> str:
  """Fills in what the caller's sandbox binds (it depends on the caller's interpreter)."""
  _, binds, links = root_contents
  return code.replace("@BINDS@", repr(binds)).replace("@LINKS@", repr([l for l, _ in links]))


def _check(runs: dict):
  for name, (ok, stdout, stderr) in runs.items():
    assert ok, (name, stdout, stderr)
    assert "ESCAPED" not in stdout and stdout.startswith("contained"), (name, stdout)


class _HostBait:
  """A listening 0777 Unix socket in the host's temp dir, an abstract socket and a secret file."""

  def __init__(self, owner_uid=None):
    tag = uuid.uuid4().hex[:12]
    self.dir = pathlib.Path(f"/tmp/dinfer-bait-{tag}")
    self.dir.mkdir()
    self.dir.chmod(0o755)
    self.sock_path = str(self.dir / "s.sock")
    self.secret_path = str(self.dir / "secret")
    self.abstract = f"dinfer-bait-{tag}"
    self.sock = socket.socket(socket.AF_UNIX)
    self.sock.bind(self.sock_path)
    self.sock.listen()
    self.sock.settimeout(0.2)
    os.chmod(self.sock_path, 0o777)
    self.abstract_sock = socket.socket(socket.AF_UNIX)
    self.abstract_sock.bind("\0" + self.abstract)
    self.abstract_sock.listen()
    self.abstract_sock.settimeout(0.2)
    pathlib.Path(self.secret_path).write_text("s3cret")
    os.chmod(self.secret_path, 0o600 if owner_uid is not None else 0o644)
    if owner_uid is not None:
      os.chown(self.secret_path, owner_uid, owner_uid)
      os.chown(self.sock_path, owner_uid, owner_uid)

  def nobody_connected(self) -> bool:
    for s in (self.sock, self.abstract_sock):
      try:
        s.accept()[0].close()
        return True
      except socket.timeout:
        pass
    return False

  def close(self):
    self.sock.close()
    self.abstract_sock.close()
    shutil.rmtree(self.dir, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
def test_hostile_programs_contained(mode):
  bait = _HostBait()
  try:
    programs = hostile_programs(bait.sock_path, bait.abstract, bait.secret_path)
    runs = {}
    for name, code in programs.items():
      r = run_python(with_root(code, sandbox._root_contents()), limits=LIMITS, mode=mode)
      runs[name] = (r.ok, r.stdout, r.stderr[-400:])
    _check(runs)
    assert not bait.nobody_connected()
    assert not os.path.exists("/pwned")
  finally:
    bait.close()


_AS_NOBODY = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
programs = json.loads(sys.argv[2])
_, binds, links = sandbox._root_contents()
programs = {k: v.replace("@BINDS@", repr(binds)).replace("@LINKS@", repr([l for l, _ in links]))
            for k, v in programs.items()}
out = {"modes": list(sandbox.available_modes()), "errors": sandbox._probe_errors, "runs": {}}
for mode in out["modes"]:
  for name, code in programs.items():
    r = sandbox.run_python(code, limits=sandbox.Limits(cpu_seconds=2, wall_seconds=5.0), mode=mode)
    out["runs"][name] = [r.ok, r.stdout[-500:], r.stderr[-500:]]
print(json.dumps(out))
"""

_NOBODY_OK = os.geteuid() == 0 and shutil.which("setpriv") and os.access("/usr/bin/python3", os.X_OK)


def _as_nobody(programs: dict, groups: str | None):
  group_args = ["--groups", groups] if groups else ["--clear-groups"]
  proc = subprocess.run(
      ["setpriv", "--reuid", "65534", "--regid", "65534", *group_args, "/usr/bin/python3", "-I", "-c",
       _AS_NOBODY, sandbox.__file__, json.dumps(programs)],
      capture_output=True, text=True, cwd="/", timeout=180, env={"PATH": "/usr/bin:/bin"})
  if proc.returncode != 0 and "Permission denied" in proc.stderr:
    pytest.skip(f"sandbox.py is not readable by nobody: {proc.stderr[-300:]}")
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout)


@pytest.mark.skipif(not _NOBODY_OK, reason="needs root (to become nobody), setpriv and /usr/bin/python3")
def test_userns_contains_hostile_programs_against_the_callers_own_files():
  bait = _HostBait(owner_uid=65534)  # nobody's own 0600 file and socket: its uid alone would do
  try:
    out = _as_nobody(hostile_programs(bait.sock_path, bait.abstract, bait.secret_path), None)
    if not out["modes"]:
      pytest.skip(f"no sandbox mode works as nobody here: {out['errors']}")
    assert out["modes"] == ["userns"], out
    _check(out["runs"])
    assert not bait.nobody_connected()
  finally:
    bait.close()


@pytest.mark.skipif(not _NOBODY_OK, reason="needs root (to become nobody), setpriv and /usr/bin/python3")
def test_userns_refused_for_a_caller_with_supplementary_groups():
  # The docker.sock pattern: a root:users 0660 socket reachable through the caller's group. A user
  # namespace cannot drop the group, so the mode is refused rather than run weaker.
  out = _as_nobody({"noop": "print(1)"}, "100")
  assert out["modes"] == [], out
  assert "supplementary groups [100]" in out["errors"]["userns"], out
  assert "\n" not in out["errors"]["userns"]


def test_seccomp_filter_shape():
  # Every jump lands inside the program, forward only; the arch check comes first.
  import struct
  for arch in sandbox._SECCOMP_ARCH:
    prog = sandbox._seccomp_program(arch)
    ins = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    assert ins[0] == (0x20, 0, 0, 4) and ins[1][3] == sandbox._SECCOMP_ARCH[arch]
    for i, (op, jt, jf, _) in enumerate(ins):
      if op & 0x07 == 0x05:  # BPF_JMP
        assert i + 1 + max(jt, jf) < len(ins)
    assert ins[-1] == (0x06, 0, 0, 0x7FFF0000)
