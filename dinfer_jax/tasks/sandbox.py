"""Run untrusted, model-written Python in a contained child process.

Everything a model writes is executed here and nowhere else: the verifiers in `dinfer_jax.tasks` never
`eval` model output in-process. The module is stdlib-only on purpose: it doubles as the launcher script
that runs inside the sandbox's namespaces (`python -I -S -B sandbox.py --launch CONFIG`), and it must be
loadable by its path under a plain system interpreter (the non-root tests run it so as `nobody`; the package
above it needs jax).

Process tree of one run:

  caller ─ setpriv --pdeathsig KILL unshare --net --mount --pid --ipc --uts --fork --kill-child ...
             └─ launcher (this file, `--launch`; trusted; pid 1 of the new pid namespace; builds the
                  program's root and pivots into it)
                  └─ sandboxed interpreter running main.py (own process group, rlimits set,
                     privileges dropped)

Isolation modes (`available_modes()` lists what works on this machine; `run_python(mode=None)` picks
the strongest). Both give the same guarantees; they differ in who may start them:

* ``"namespaces"`` (caller is root and `unshare` works): the namespaces below are made directly, and the
  program runs as a random unprivileged uid/gid that nothing else uses, with no supplementary groups.
  The random uid matters: root is exempt from RLIMIT_NPROC, and RLIMIT_NPROC counts *all* processes of
  a uid, so with a uid of its own the limit counts exactly this run's processes.
* ``"userns"`` (caller is not root, unprivileged user namespaces allowed): the same namespaces, made
  inside a user namespace; the program is root there with every capability dropped and
  SECBIT_NOROOT locked. An unprivileged caller cannot drop its supplementary groups inside a user
  namespace (setgroups must be denied before the gid map is written), so a caller that has any is
  refused this mode with a one-line error rather than run weaker.

What the program gets, in every mode (the threat model and the tested escapes: train_td/README.md):
- its own root (pivot_root into a fresh tmpfs): the interpreter and its stdlib and the shared libraries
  it links, all read-only; /dev/null, zero, random, urandom; /tmp, an empty size-limited writable tmpfs
  that is its working directory. No host path exists for it: not the repository, the caller's home or
  files, the host's /tmp, /run, /dev/shm, /proc or /sys, so no filesystem Unix socket or other
  path-named IPC can be reached whatever its uid could open;
- new network (only a downed loopback: no connection leaves it, and abstract Unix sockets are per
  network namespace), pid (it sees only its own processes, and all die with the launcher), IPC and UTS
  namespaces;
- no_new_privs (setuid binaries cannot regain privileges) and a seccomp filter that refuses new
  namespaces (unshare, setns, clone with CLONE_NEW* flags; clone3 says ENOSYS so libc falls back to
  clone), mount calls, pivot_root/chroot, kernel keyrings, bpf, perf, userfaultfd, io_uring, ptrace and
  cross-process memory access (x86_64 and aarch64; elsewhere no mode is offered).
There is no weaker fallback. An earlier "rlimits" mode (no namespaces, an in-process audit hook as the
guard) did not hold: the hook checked paths but not `dir_fd`, so `os.open("/proc")` then
`os.open(f"{pid}/environ", dir_fd=fd)` read the caller's environment, and writes to /tmp and /dev/shm
persisted. Where neither mode works, `run_python` raises SandboxError saying what to enable: model-written
code is then not run at all (fail closed).

In every mode: RLIMIT_CPU (SIGXCPU, then SIGKILL one second later), RLIMIT_AS, RLIMIT_FSIZE,
RLIMIT_NOFILE, RLIMIT_NPROC, RLIMIT_CORE=0 (no core dumps), RLIMIT_MSGQUEUE=0; a wall-clock timeout
after which the program's process group is SIGKILLed (and, through the pid namespace, processes that
left it); an output cap (the run is killed once stdout+stderr exceed it); an
empty environment (``env={}``; the interpreter runs with ``-I -S -B``); a fresh temporary working
directory, deleted afterwards. If the caller dies mid-run, the run still ends: the launcher (or unshare)
gets a parent-death signal, and the launcher has its own wall-clock alarm as a backstop (wall + 3 s).
Memory is limited per check as well as per process: a check's processes together hold at most
`Limits.check_memory_bytes` (by default `memory_bytes`), so 16 processes cannot take 16 x RLIMIT_AS. Where
the caller may make a memory cgroup (cgroup v2 with the memory controller delegated to it, or a writable
v1 memory hierarchy, e.g. as root in a container), every run gets a cgroup of its own with that limit and
no swap, and the kernel enforces it (its OOM kill reports as "memory_limit"). Otherwise the caller sums the
resident anonymous memory of the run's processes every 20 ms and kills the run past the budget; between two
polls a run can overshoot by what it allocates in 20 ms, each process still bounded by RLIMIT_AS.
Not enforced: CPU share/niceness and page-cache memory. If the caller is SIGKILLed,
the (empty) host directory behind the run's root is left behind in the temp dir.
"""
from __future__ import annotations

import os
import sys

# ----------------------------------------------------------------------------------------------------
# Launcher side. It comes first and imports almost nothing because it starts once per sandboxed run:
# every import here is paid per verified answer. Config arrives marshalled (marshal is built in, json
# would pull in `re`), status goes back as text lines on an inherited pipe.

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 32, 1024, 2048, 4096
_MS_REC, _MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 16384, 1 << 18, 1 << 21, 1 << 24
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 24, 28, 38, 47
_PR_CAP_AMBIENT_CLEAR_ALL, _PR_SET_PDEATHSIG = 4, 1
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _MNT_DETACH = 22, 2, 2
_SECBIT_NOROOT, _SECBIT_NOROOT_LOCKED = 1, 2
# Used when the random sandbox uid cannot be set (e.g. root in a container with a 16-bit uid map).
_FALLBACK_UID = 65534

def _launcher(cfg: dict) -> int:
  """Sets up the working directory and mounts, then forks and execs the sandboxed interpreter.

  Reports "exit N", "signal N" or "error MESSAGE" on the status pipe.
  """
  status_fd = cfg["status_fd"]
  os.set_inheritable(status_fd, False)  # closed by the exec of the sandboxed interpreter

  def report(kind, value):
    os.write(status_fd, f"{kind} {value}".replace("\n", " ").encode()[:4000] + b"\n")

  try:
    import resource, struct  # noqa: F401 - before the root changes: the host's stdlib is gone after
    with os.fdopen(cfg["code_fd"], "rb") as f:
      code = f.read()
    with open("/proc/sys/kernel/cap_last_cap") as f:
      cfg["last_cap"] = int(f.read())
    cfg["seccomp"] = _seccomp_program(cfg["arch"])
    _setup_root(cfg)
    fd = os.open("/tmp/main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
      f.write(code)
  except Exception as e:  # noqa: BLE001 - reported to the caller as a SandboxError
    report("error", f"{type(e).__name__}: {e}")
    return 1
  # Stop requests: SIGUSR1 from the caller (wall time, output cap; killing the launcher instead would
  # skip the cleanup below), SIGUSR1 as parent-death signal (the caller died), SIGALRM as a wall-clock
  # backstop that holds even then. Each kills the program's process group; the group id is our own
  # unreaped child's pid, so it cannot have been reused.
  import signal
  child, stop = [], []

  def on_stop(*_):
    stop.append(True)
    if child:
      _killpg(child[0])

  signal.signal(signal.SIGUSR1, on_stop)
  signal.signal(signal.SIGALRM, on_stop)
  # The caller's own deadline started earlier and normally wins; 3 s later this one takes over.
  signal.alarm(int(cfg["limits"]["wall_seconds"]) + 3)
  _prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1)
  pid = os.fork()
  if pid == 0:
    try:
      os.setpgid(0, 0)  # a group of its own, so one killpg reaches everything it forks
      interpreter, argv = _drop_privileges(cfg)
      os.execve(interpreter, argv, {})  # also resets the handlers above to their defaults
    except BaseException as e:  # noqa: BLE001 - anything here is a setup failure
      try:
        report("error", f"{type(e).__name__}: {e}")
      finally:
        os._exit(126)
  child.append(pid)
  if stop:  # asked to stop before the program existed
    _killpg(pid)
  # Reap orphans as they come (as pid 1 of the namespace) so that zombies do not hold
  # RLIMIT_NPROC slots, until the program itself exits; leave the program unreaped (WNOWAIT) for now.
  while True:
    try:
      done = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT).si_pid
    except ChildProcessError:
      report("error", "lost the sandboxed process")
      return 1
    if done == pid:
      break
    os.waitpid(done, 0)
  _, wstatus = os.waitpid(pid, 0)
  if os.WIFSIGNALED(wstatus):
    report("signal", os.WTERMSIG(wstatus))
  else:
    report("exit", os.WEXITSTATUS(wstatus))
  # The launcher's exit ends the pid namespace: the kernel kills and reaps
  # whatever is left.
  return 0


def _is_under(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip("/") + "/")


def _killpg(pgid: int) -> None:
  import signal
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _children_of(ppid: int) -> list:
  """Pids whose parent is `ppid` (from /proc)."""
  children = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          stat = f.read()
      except OSError:
        continue
      # Field 4 (ppid) follows the parenthesised command name, which may itself contain ") ".
      if int(stat[stat.rindex(")") + 2:].split()[1]) == ppid:
        children.append(int(entry))
  return children


def _libc():
  import ctypes  # only the namespace setup and prctl need it
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                         ctypes.c_char_p]
  libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
  return libc, ctypes


def _mount(source, target, fstype, flags, data=None):
  libc, ctypes = _libc()
  enc = lambda s: None if s is None else s.encode()
  if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _prctl(option, arg2=0, arg3=0):
  libc, ctypes = _libc()
  if libc.prctl(option, arg2, arg3, 0, 0) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def _unescape_mount_path(s: str) -> str:
  """Undoes mountinfo's octal escapes (\\040 for space, ...) without importing `re`."""
  out, i = [], 0
  while i < len(s):
    if s[i] == "\\" and len(s[i + 1:i + 4]) == 3 and s[i + 1:i + 4].isdigit():
      out.append(chr(int(s[i + 1:i + 4], 8)))
      i += 4
    else:
      out.append(s[i])
      i += 1
  return "".join(out)


def _read_mountinfo() -> list:
  """(mount point, per-mount options) of every mount in this mount namespace."""
  out = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      fields = line.split()
      out.append((_unescape_mount_path(fields[4]), set(fields[5].split(","))))
  return out


def _source_flags(path: str, mounts: list) -> int:
  """Remount flags that keep what the mount holding `path` locks (nodev, noexec, atime: inside a user
  namespace a bind-remount must pass them back unchanged, or the kernel refuses), plus read-only."""
  point, opts = max((m for m in mounts if _is_under(path, m[0])), key=lambda m: len(m[0]))
  flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
  flags |= _MS_NOEXEC if "noexec" in opts else 0
  flags |= _MS_NODIRATIME if "nodiratime" in opts else 0
  flags |= _MS_NOATIME if "noatime" in opts else _MS_RELATIME if "relatime" in opts else _MS_STRICTATIME
  return flags


def _setup_root(cfg: dict) -> None:
  """Builds the program's whole filesystem and moves into it (pivot_root), in this mount namespace only.

  The new root is an empty tmpfs holding: read-only binds of the interpreter, its standard library and
  the shared libraries it links (`cfg["binds"]`, each at its own path), the symlinks between them
  (/lib -> usr/lib, ...), /dev/null, zero, random and urandom, and /tmp, an empty size-limited writable
  tmpfs (the working directory). The host's old root is then detached: no host path (repository, home,
  /tmp, /run and their sockets, /proc) exists for the program, whatever its uid could open.
  """
  lim = cfg["limits"]
  root = cfg["workdir"]
  mounts = _read_mountinfo()
  os.umask(0o022)
  _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done below propagates back to the host
  _mount("sandbox-root", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")

  def place(path, is_dir):
    target = root + path
    os.makedirs(target if is_dir else os.path.dirname(target), mode=0o755, exist_ok=True)
    if not is_dir:
      os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    return target

  for path in cfg["binds"]:
    target = place(path, os.path.isdir(path))
    try:
      _mount(path, target, None, _MS_BIND)
    except OSError:  # a user namespace may refuse a non-recursive bind over locked submounts
      _mount(path, target, None, _MS_BIND | _MS_REC)
    _mount(None, target, None, _source_flags(path, mounts))
  for link, dest in cfg["links"]:
    os.makedirs(os.path.dirname(root + link), mode=0o755, exist_ok=True)
    os.symlink(dest, root + link)
  for dev in ("null", "zero", "random", "urandom"):
    _mount(f"/dev/{dev}", place(f"/dev/{dev}", False), None, _MS_BIND)
  owner = f",uid={cfg['uid']},gid={cfg['uid']}" if cfg["uid"] is not None else ""
  _mount("sandbox-tmp", place("/tmp", True), "tmpfs", _MS_NOSUID | _MS_NODEV,
         f"size={lim['disk_bytes']},nr_inodes=4096,mode=0700{owner}")
  libc, _ = _libc()
  os.chdir(root)
  if libc.syscall(_SYS_PIVOT_ROOT[cfg["arch"]], b".", b".") != 0:
    raise OSError(ctypes_errno(), "pivot_root")
  if libc.umount2(b".", _MNT_DETACH) != 0:  # the old root, stacked under the new one
    raise OSError(ctypes_errno(), "umount old root")
  os.chdir("/")
  _mount(None, "/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def ctypes_errno() -> int:
  _, ctypes = _libc()
  return ctypes.get_errno()


# Seccomp: syscalls the program never gets, on the two architectures the filter knows (elsewhere no
# mode is offered). New namespaces (unshare, setns, and clone with a CLONE_NEW* flag; clone3, whose
# flags a filter cannot read, says ENOSYS so libc falls back to clone), mounts, kernel keyrings, bpf,
# perf, userfaultfd, io_uring (its requests bypass seccomp), ptrace and cross-process memory access,
# and the administrative calls an unprivileged uid is refused anyway.
_SECCOMP_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
_SYS_CLONE3 = 435
_SYS_BLOCKED = {
    # unshare setns mount umount2 pivot_root chroot open_tree..fspick mount_setattr keyctl add_key
    # request_key bpf perf_event_open userfaultfd io_uring_* ptrace process_vm_readv/writev kexec_load
    # init/finit/delete_module acct swapon swapoff reboot sethostname setdomainname quotactl
    # open_by_handle_at syslog vhangup personality
    "x86_64": (272, 308, 165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442, 250, 248, 249, 321, 298, 323,
               425, 426, 427, 101, 310, 311, 246, 175, 313, 176, 163, 167, 168, 169, 170, 171, 179, 304, 103,
               153, 135),
    "aarch64": (97, 268, 40, 39, 41, 51, 428, 429, 430, 431, 432, 433, 442, 219, 217, 218, 280, 241, 282,
                425, 426, 427, 117, 270, 271, 104, 105, 273, 106, 89, 224, 225, 142, 161, 162, 60, 265, 116,
                58, 92),
}
_CLONE_NEW_FLAGS = 0x7E020080  # NEWNS NEWCGROUP NEWUTS NEWIPC NEWUSER NEWPID NEWNET NEWTIME
_EPERM, _ENOSYS = 1, 38


def _seccomp_program(arch: str) -> bytes:
  """The classic-BPF seccomp filter described above, as the kernel's sock_filter array."""
  import struct
  ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
  allow, kill = 0x7FFF0000, 0x80000000
  errno = lambda e: 0x00050000 | e
  prog = [(ld, 0, 0, 4), (jeq, "arch_ok", "kill", _SECCOMP_ARCH[arch]), ("arch_ok",), (ld, 0, 0, 0)]
  if arch == "x86_64":
    prog.append((jge, "kill", 0, 0x40000000))  # the x32 ABI's numbers alias the blocked ones
  prog += [(jeq, "eperm", 0, nr) for nr in _SYS_BLOCKED[arch]]
  prog += [(jeq, "clone", 0, _SYS_CLONE[arch]), (jeq, "enosys", 0, _SYS_CLONE3), (ret, 0, 0, allow),
           ("eperm",), (ret, 0, 0, errno(_EPERM)), ("enosys",), (ret, 0, 0, errno(_ENOSYS)),
           ("kill",), (ret, 0, 0, kill),
           ("clone",), (ld, 0, 0, 16), (jset, 0, "clone_ok", _CLONE_NEW_FLAGS), (ret, 0, 0, errno(_EPERM)),
           ("clone_ok",), (ret, 0, 0, allow)]  # BPF jumps only forward
  labels, code = {}, []
  for ins in prog:
    if len(ins) == 1:
      labels[ins[0]] = len(code)
    else:
      code.append(ins)
  out = b""
  for i, (op, jt, jf, k) in enumerate(code):
    rel = lambda t: labels[t] - i - 1 if isinstance(t, str) else t
    out += struct.pack("=HBBI", op, rel(jt), rel(jf), k)
  return out


def _install_seccomp(program: bytes) -> None:
  libc, ctypes = _libc()
  buf = ctypes.create_string_buffer(program, len(program))

  class FProg(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

  fprog = FProg(len(program) // 8, ctypes.addressof(buf))
  _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog))


def _drop_privileges(cfg: dict) -> tuple:
  """In the forked child, inside the new root: rlimits, uid/capabilities, seccomp, cwd. Returns the
  interpreter and its argv."""
  import resource  # already imported by the launcher before the root changed
  lim = cfg["limits"]
  os.chdir("/tmp")
  nproc = lim["max_processes"]
  for res, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_MSGQUEUE, 0),
                     (resource.RLIMIT_AS, lim["memory_bytes"]),
                     (resource.RLIMIT_FSIZE, lim["max_file_bytes"]),
                     (resource.RLIMIT_NOFILE, lim["max_open_files"]), (resource.RLIMIT_NPROC, nproc)):
    resource.setrlimit(res, (value, value))
  # The soft CPU limit sends SIGXCPU (reported as "cpu_limit"); a program that catches it gets
  # SIGKILL at the hard limit one second later.
  resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_seconds"], lim["cpu_seconds"] + 1))
  if cfg["uid"] is not None:
    os.setgroups([])  # the supplementary groups of the caller (root) go
    for uid in (cfg["uid"], _FALLBACK_UID):
      try:
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        break
      except OSError:
        if uid == _FALLBACK_UID:
          raise
  elif cfg["mode"] == "userns":
    # Root inside the user namespace: empty the bounding and ambient capability sets and lock
    # "no root privileges on exec", so the program cannot undo the read-only mounts.
    for cap in range(cfg["last_cap"] + 1):
      _prctl(_PR_CAPBSET_DROP, cap)
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    _prctl(_PR_SET_SECUREBITS, _SECBIT_NOROOT | _SECBIT_NOROOT_LOCKED)
  _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries cannot regain privileges; lets us load the filter
  _install_seccomp(cfg["seccomp"])
  interpreter = cfg["interpreter"]
  if not os.access(interpreter, os.X_OK):  # checked with the sandbox's (real) uid
    raise OSError(f"the Python interpreter {interpreter} is not executable by the sandbox uid")
  return interpreter, [interpreter, "-I", "-S", "-B", "main.py"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--launch":
  import marshal
  sys.exit(_launcher(marshal.loads(bytes.fromhex(sys.argv[2]))))

# ----------------------------------------------------------------------------------------------------
# Caller side.

import ast  # noqa: E402 - imported after the launcher entry point on purpose (see above)
import dataclasses  # noqa: E402
import marshal  # noqa: E402
import secrets  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Callable, Sequence  # noqa: E402

MODES = ("namespaces", "userns")
# What to do where no mode works (the SandboxError says it).
HOW_TO_ENABLE = ("run as root where `unshare` may create namespaces, or allow unprivileged user namespaces "
                 "(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu also "
                 "kernel.apparmor_restrict_unprivileged_userns=0; in a container: --privileged or a seccomp "
                 "profile that allows unshare)")

# Sandboxed runs get a random uid from this range: far above any allocated account (and above the
# 16-bit ranges systemd hands out), so RLIMIT_NPROC counts only this run's processes and the uid
# sweep after a run cannot hit anything else.
SANDBOX_UID_RANGE = (1_700_000_000, 1_800_000_000)

_MEMORY_POLL_S = 0.02  # how often the caller sums a run's memory where no cgroup limits it
_UNSHARE_FLAGS = ("--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc")
_SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


@dataclasses.dataclass(frozen=True)
class Limits:
  """Resource limits of one sandboxed run.

  Attributes:
    cpu_seconds: CPU seconds per process (RLIMIT_CPU soft limit; SIGKILL one second later).
    wall_seconds: Wall-clock seconds for the whole run, after which the process group is killed.
    memory_bytes: Address-space limit per process (RLIMIT_AS). Python itself needs ~20 MiB.
    max_output_bytes: stdout+stderr bytes kept; the run is killed when the program writes more.
    max_file_bytes: Largest file the program may write (RLIMIT_FSIZE).
    disk_bytes: Size of the tmpfs working directory (namespace modes only).
    max_processes: Processes/threads the program may have at once (RLIMIT_NPROC).
    max_open_files: File descriptors per process (RLIMIT_NOFILE).
    check_memory_bytes: Resident memory of all the run's processes together (a cgroup's limit where one
      can be made, else a polled budget); None means `memory_bytes`.
  """
  cpu_seconds: int = 2
  wall_seconds: float = 5.0
  memory_bytes: int = 256 * 2**20
  max_output_bytes: int = 64 * 2**10
  max_file_bytes: int = 1 * 2**20
  disk_bytes: int = 8 * 2**20
  max_processes: int = 16
  max_open_files: int = 64
  check_memory_bytes: int | None = None

  def __post_init__(self):
    if not isinstance(self.cpu_seconds, int) or self.cpu_seconds < 1:
      raise ValueError(f"cpu_seconds must be an int >= 1, got {self.cpu_seconds!r}")
    if not isinstance(self.wall_seconds, (int, float)) or not self.wall_seconds > 0:
      raise ValueError(f"wall_seconds must be a number > 0, got {self.wall_seconds!r}")
    minimums = dict(memory_bytes=32 * 2**20, max_output_bytes=1, max_file_bytes=4096,
                    disk_bytes=64 * 2**10, max_processes=1, max_open_files=8)
    for field, minimum in minimums.items():
      value = getattr(self, field)
      if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be an int >= {minimum}, got {value!r}")
    if self.check_memory_bytes is not None and (
        not isinstance(self.check_memory_bytes, int) or self.check_memory_bytes < 32 * 2**20):
      raise ValueError(f"check_memory_bytes must be None or an int >= {32 * 2**20}, "
                       f"got {self.check_memory_bytes!r}")

  @property
  def memory_budget(self) -> int:
    """Bytes all of one run's processes may hold together."""
    return self.memory_bytes if self.check_memory_bytes is None else self.check_memory_bytes


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Outcome of one sandboxed run.

  Attributes:
    ok: The program exited with status 0 within every limit.
    stdout: Captured standard output (UTF-8, invalid bytes replaced; at most max_output_bytes).
    stderr: Captured standard error, same rules.
    returncode: Exit status, or minus the signal number that killed the program; None when the run was
      killed from outside before the program's status was known.
    timed_out: The wall-clock limit was hit.
    killed_reason: None for a normal exit (even a non-zero one), else why the run was stopped:
      "wall_timeout", "output_limit", "memory_limit" (the check's processes together went over
      `Limits.memory_budget`), "cpu_limit" (SIGXCPU) or "signal:<NAME>".
    mode: The isolation mode used (see `MODES`).
  """
  ok: bool
  stdout: str
  stderr: str
  returncode: int | None
  timed_out: bool
  killed_reason: str | None
  mode: str

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    if self.ok and (self.returncode != 0 or self.killed_reason is not None or self.timed_out):
      raise ValueError("ok=True requires returncode 0, no killed_reason and timed_out False")
    if self.timed_out != (self.killed_reason == "wall_timeout"):
      raise ValueError("timed_out must be True exactly when killed_reason is 'wall_timeout'")


class SandboxError(RuntimeError):
  """The sandbox itself could not be set up (never raised because of what the program does)."""


def run_python(code: str, *, stdin: str = "", limits: Limits = Limits(), mode: str | None = None
               ) -> SandboxResult:
  """Runs `code` as a Python program in a fresh sandbox.

  Args:
    code: Program text (untrusted).
    stdin: Text fed to the program's standard input.
    limits: Resource limits.
    mode: One of `MODES`, or None for the strongest mode that works here.

  Returns:
    The program's outcome. Misbehaviour of the program (crash, timeout, a limit) is reported here,
    never raised.

  Raises:
    SandboxError: The sandbox cannot be set up in the requested mode.
    ValueError: The program is larger than half the working directory.
  """
  if mode is None:
    modes = available_modes()
    if not modes:
      why = "; ".join(f"{m}: {_probe_errors.get(m)}" for m in MODES)
      raise SandboxError(f"cannot run model-written code safely here: the sandbox needs Linux namespaces "
                         f"({why}). To enable it: {HOW_TO_ENABLE}")
    mode = modes[0]
  elif not _probe(mode):
    raise SandboxError(f"sandbox mode {mode!r} does not work here: {_probe_errors.get(mode)}")
  return _run(code, stdin, limits, mode)


def available_modes() -> tuple[str, ...]:
  """The isolation modes that work on this machine, strongest first (probed once, then cached)."""
  return tuple(m for m in MODES if _probe(m))


_probe_lock = threading.Lock()
_probe_results: dict[str, bool] = {}
_probe_errors: dict[str, str] = {}


def _probe(mode: str) -> bool:
  """Whether `mode` works, found by running a trivial program in it, so that a missing interpreter or
  a refused mount shows up as 'mode unavailable' and not as a failing model answer."""
  if mode not in MODES:
    removed = " ('rlimits' was removed: it could not contain a hostile program)" if mode == "rlimits" else ""
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}{removed}")
  with _probe_lock:
    if mode not in _probe_results:
      ok, why = False, ""
      if mode == "namespaces" and os.geteuid() != 0:
        why = "needs root"
      elif mode == "userns" and os.geteuid() == 0:
        why = "root uses 'namespaces' instead"
      elif not shutil.which("unshare", path=_SYSTEM_PATH):
        why = "no unshare binary"
      else:
        try:
          result = _run("import sys; print(sys.version_info[0])", "", Limits(wall_seconds=30), mode)
          ok = result.ok and result.stdout.strip() == "3"
          why = "" if ok else f"probe program failed: {result}"
        except SandboxError as e:
          why = str(e)
      _probe_results[mode], _probe_errors[mode] = ok, why
    return _probe_results[mode]


def _cannot_hold(mode: str) -> str:
  """Why `mode` cannot give every guarantee of the module doc on this machine ('' when it can)."""
  arch = os.uname().machine
  if arch not in _SECCOMP_ARCH:
    return f"the seccomp filter knows {sorted(_SECCOMP_ARCH)}, not {arch}"
  extra = sorted(set(os.getgroups()) - {os.getegid()})
  if mode == "userns" and extra:
    # An unprivileged process must deny setgroups before it may map its gid in a user namespace, so it
    # keeps these groups, and with them whatever they may open.
    return (f"the caller has supplementary groups {extra}, which a user namespace cannot drop: run as a "
            f"user without them (setpriv --clear-groups as root), or as root ('namespaces')")
  return ""


_pdeathsig: list[tuple[str, ...]] = []


def _pdeathsig_prefix() -> tuple[str, ...]:
  """`setpriv --pdeathsig KILL` when available: unshare then dies with the caller (and, through
  --kill-child, the whole namespace) instead of lingering until the launcher's wall-clock backstop."""
  if not _pdeathsig:
    setpriv = shutil.which("setpriv", path=_SYSTEM_PATH)
    ok = bool(setpriv) and "--pdeathsig" in subprocess.run(
        [setpriv, "--help"], capture_output=True, text=True, env={}).stdout
    _pdeathsig.append(("setpriv", "--pdeathsig", "KILL") if ok else ())
  return _pdeathsig[0]


def _root_contents() -> tuple[str, list[str], list[tuple[str, str]]]:
  """What the program's root holds: (interpreter, read-only binds, symlinks).

  The interpreter is the real file behind this process's (a venv's python is a link to it; `-I -S`
  never reads the venv), its installation prefix (or only its stdlib and binary where the prefix is a
  shared one such as /usr), the shared-library directories the dynamic loader searches and the loader's
  cache. Top-level links such as /lib -> usr/lib are recreated as links.
  """
  import sysconfig
  interpreter = os.path.realpath(sys.executable)
  binds, links = [], []
  for prefix in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}:
    if prefix in ("/", "/usr", "/usr/local"):
      paths = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix, "installed_base": prefix,
                                        "installed_platbase": prefix})
      binds += [os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])]
    else:
      binds.append(prefix)
  binds.append(interpreter)
  for path in ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32",
               "/usr/local/lib", "/etc/ld.so.cache"):
    if os.path.islink(path):
      links.append((path, os.readlink(path)))
    elif os.path.exists(path):
      binds.append(path)
  kept = []
  for path in sorted(set(binds), key=lambda p: (p.count("/"), p)):
    if not any(_is_under(path, k) for k in kept) and os.path.exists(path):
      kept.append(path)
  return interpreter, kept, links


def _new_uid() -> int:
  """A fresh uid for one run (root modes): no other process on the machine holds it, so nothing of
  the host can be signalled or ptraced by the program, and a leftover of this run is findable by it."""
  return SANDBOX_UID_RANGE[0] + secrets.randbelow(SANDBOX_UID_RANGE[1] - SANDBOX_UID_RANGE[0])


def _new_workdir() -> str:
  """The host directory behind one run's root, removed when the run ends (the tests record it: other
  runs, in other processes, make theirs in the same parent at the same time)."""
  return tempfile.mkdtemp(prefix="dinfer-sandbox-", dir=_workdir_parent())


# ----------------------------------------------------------------------------------------------------
# Memory per check. RLIMIT_AS bounds one process; a check may have max_processes of them.

_cgroup_parent: list = []  # [(version, directory) or None], found once


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _find_cgroup_parent() -> tuple[int, str] | None:
  """(cgroup version, directory) under which this process may make memory-limited child cgroups.

  v2: this process's cgroup, when `memory` is enabled in its subtree_control and it is writable (a
  delegated cgroup). v1: this process's cgroup in a writable memory hierarchy. None elsewhere.
  """
  try:
    own = [line.split(":", 2) for line in _read("/proc/self/cgroup").splitlines()]
    mounts = [line.split() for line in _read("/proc/self/mountinfo").splitlines()]
  except OSError:
    return None
  for want in (2, 1):
    for hierarchy, controllers, path in own:
      if (want == 2) != (hierarchy == "0" and controllers == ""):
        continue
      if want == 1 and "memory" not in controllers.split(","):
        continue
      for m in mounts:
        dash = m.index("-")
        fstype, options = m[dash + 1], m[dash + 3] if len(m) > dash + 3 else ""
        if fstype != ("cgroup2" if want == 2 else "cgroup"):
          continue
        if want == 1 and "memory" not in options.split(","):
          continue
        root, mountpoint = _unescape_mount_path(m[3]), _unescape_mount_path(m[4])
        if not _is_under(path, root):
          continue
        directory = os.path.join(mountpoint, path[len(root):].lstrip("/"))
        try:
          if want == 2:
            usable = "memory" in _read(os.path.join(directory, "cgroup.subtree_control")).split()
          else:
            usable = os.path.exists(os.path.join(directory, "memory.limit_in_bytes"))
        except OSError:
          usable = False
        if usable and os.access(directory, os.W_OK):
          return want, directory
  return None


class _MemoryGroup:
  """A memory cgroup of one run, limited to the run's budget with no swap; removed by close()."""

  def __init__(self, version: int, parent: str, limit: int):
    self.version = version
    self.path = os.path.join(parent, f"dinfer-sandbox-{secrets.token_hex(8)}")
    os.mkdir(self.path)
    try:
      if version == 2:
        self._write("memory.max", limit)
        self._write("memory.swap.max", 0, optional=True)
        self._write("memory.oom.group", 1, optional=True)  # one OOM kill ends the whole check
      else:
        self._write("memory.limit_in_bytes", limit)
        self._write("memory.memsw.limit_in_bytes", limit, optional=True)  # absent without swap accounting
    except BaseException:
      self.close()
      raise

  def _write(self, name: str, value: int, optional: bool = False) -> None:
    try:
      with open(os.path.join(self.path, name), "w") as f:
        f.write(str(value))
    except OSError:
      if not optional:
        raise

  def oom_killed(self) -> bool:
    name = "memory.events" if self.version == 2 else "memory.oom_control"
    try:
      fields = dict(line.split() for line in _read(os.path.join(self.path, name)).splitlines())
      return int(fields.get("oom_kill", 0)) > 0
    except (OSError, ValueError):
      return False

  def close(self) -> None:
    # The run's processes are gone by now (the launcher was reaped after its namespace ended), but the
    # kernel may take a moment to release an emptied cgroup.
    for _ in range(100):
      try:
        os.rmdir(self.path)
        return
      except FileNotFoundError:
        return
      except OSError:
        time.sleep(0.01)


def _memory_group(limit: int) -> _MemoryGroup | None:
  """A memory cgroup for one run, or None where none can be made (the caller then polls)."""
  if not _cgroup_parent:
    _cgroup_parent.append(_find_cgroup_parent())
  if _cgroup_parent[0] is None:
    return None
  try:
    return _MemoryGroup(*_cgroup_parent[0], limit)
  except OSError:
    return None


def _descendants(pid: int) -> list[int]:
  """`pid` and every process below it (orphans of a run are re-parented to its launcher, still below)."""
  found, todo = [], [pid]
  while todo:
    p = todo.pop()
    found.append(p)
    try:
      tasks = os.listdir(f"/proc/{p}/task")
    except OSError:
      continue
    for tid in tasks:
      try:
        todo += [int(c) for c in _read(f"/proc/{p}/task/{tid}/children").split()]
      except OSError:
        pass
  return found


def _anon_resident_bytes(pids: list[int]) -> int:
  """Resident memory the processes hold that no file backs (statm: resident minus shared), summed.

  Pages a fork shares copy-on-write count once per process: an overcount, on the safe side.
  """
  total = 0
  for p in pids:
    try:
      fields = _read(f"/proc/{p}/statm").split()
    except OSError:
      continue
    total += max(0, int(fields[1]) - int(fields[2]))
  return total * os.sysconf("SC_PAGE_SIZE")


def max_code_bytes(limits: Limits) -> int:
  """The largest program a run takes: half its disk (the program file lives there)."""
  return limits.disk_bytes // 2


def _run(code: str, stdin: str, limits: Limits, mode: str) -> SandboxResult:
  code_bytes = code.encode("utf-8", "surrogateescape")
  if len(code_bytes) > max_code_bytes(limits):
    raise ValueError(f"code is {len(code_bytes)} bytes; at most disk_bytes/2 = {max_code_bytes(limits)}")
  why = _cannot_hold(mode)
  if why:
    raise SandboxError(f"sandbox mode {mode!r} cannot hold here: {why}")
  is_root = os.geteuid() == 0
  uid = _new_uid()
  workdir = _new_workdir()
  interpreter, binds, links = _root_contents()
  cfg = dict(mode=mode, workdir=workdir, uid=uid if is_root else None, interpreter=interpreter,
             binds=binds, links=links, arch=os.uname().machine, limits=dataclasses.asdict(limits))
  proc = None
  stopped = []  # [whether the launcher exited on its own terms], once the run was stopped
  group = _memory_group(limits.memory_budget)

  def stop() -> bool:
    if not stopped:
      stopped.append(_stop(proc, mode))
    return stopped[0]

  status_r, status_w = os.pipe()
  code_file = tempfile.TemporaryFile()
  stdin_file = tempfile.TemporaryFile()
  try:
    # Code and stdin travel as inherited, already-unlinked files: nothing to clean up, no pipe to keep
    # fed, no path the program could find.
    code_file.write(code_bytes)
    code_file.seek(0)
    stdin_file.write(stdin.encode("utf-8", "surrogateescape"))
    stdin_file.seek(0)
    cfg.update(code_fd=code_file.fileno(), status_fd=status_w)
    launcher = [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), "--launch",
                marshal.dumps(cfg).hex()]
    if mode == "namespaces":
      argv = [*_pdeathsig_prefix(), "unshare", *_UNSHARE_FLAGS, "--", *launcher]
    elif mode == "userns":
      argv = [*_pdeathsig_prefix(), "unshare", "--user", "--map-root-user", *_UNSHARE_FLAGS, "--", *launcher]
    else:
      argv = launcher
    if group is not None:
      # The shell joins the cgroup, then execs the sandbox: every process of the run starts inside it.
      argv = ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', os.path.join(group.path, "cgroup.procs"),
              *argv]
    # No caller environment for the launcher either: in userns mode a same-uid program could
    # otherwise read it from /proc/<launcher pid>/environ.
    proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=(code_file.fileno(), status_w), start_new_session=True,
                            env={"PATH": _SYSTEM_PATH}, close_fds=True)
    os.close(status_w)
    status_w = -1
    out, err, status, timed_out, over_output, over_memory = _collect(
        proc, status_r, limits, stop, poll_memory=group is None)
  except FileNotFoundError as e:
    raise SandboxError(f"cannot start the sandbox: {e}") from e
  finally:
    if status_w >= 0:
      os.close(status_w)
    os.close(status_r)
    code_file.close()
    stdin_file.close()
    if proc is not None:
      stop()
    _rmtree(workdir)
    if group is not None:
      over_memory = group.oom_killed()
      group.close()
  if "error" in status:
    raise SandboxError(f"sandbox setup failed ({mode}): {status['error']}")
  returncode = status.get("exit", -status["signal"] if "signal" in status else None)
  killed_reason = None
  if timed_out:
    killed_reason = "wall_timeout"
  elif over_output:
    killed_reason = "output_limit"
  elif over_memory:
    killed_reason = "memory_limit"
  elif "signal" in status:
    sig = status["signal"]
    killed_reason = "cpu_limit" if sig == signal.SIGXCPU else f"signal:{_signal_name(sig)}"
  elif returncode is None:
    killed_reason = "signal:unknown"  # the launcher died without reporting (killed from outside)
  text = lambda b: b[:limits.max_output_bytes].decode("utf-8", "replace")
  return SandboxResult(ok=returncode == 0 and killed_reason is None, stdout=text(out), stderr=text(err),
                       returncode=returncode, timed_out=timed_out, killed_reason=killed_reason, mode=mode)


def _collect(proc: subprocess.Popen, status_r: int, limits: Limits, stop: Callable[[], bool],
             poll_memory: bool = True):
  """Reads stdout/stderr/status until the launcher is done, enforcing wall time and output size, and
  (`poll_memory`, where no cgroup holds the run) the run's memory budget every `_MEMORY_POLL_S`.

  Returns:
    (stdout bytes, stderr bytes, status dict, timed_out, over_output, over_memory).
  """
  out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
  bufs = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
  sel = selectors.DefaultSelector()
  for fd in bufs:
    os.set_blocking(fd, False)
    sel.register(fd, selectors.EVENT_READ)
  deadline = time.monotonic() + limits.wall_seconds
  timed_out = over_output = over_memory = False
  drain_until = None  # once the launcher is done or the run was killed: read what is left, briefly
  try:
    while sel.get_map():
      now = time.monotonic()
      if now >= (drain_until or deadline):
        if drain_until is not None:
          break
        timed_out = True
        stop()
        drain_until = time.monotonic() + 0.5
        continue
      if poll_memory and drain_until is None and (
          _anon_resident_bytes(_descendants(proc.pid)) > limits.memory_budget):
        over_memory = True
        stop()
        drain_until = time.monotonic() + 0.5
        continue
      wait = (drain_until or deadline) - now
      for key, _ in sel.select(min(wait, _MEMORY_POLL_S) if poll_memory else wait):
        try:
          data = os.read(key.fd, 65536)
        except BlockingIOError:
          continue
        if not data:
          sel.unregister(key.fd)
          if key.fd == status_r and drain_until is None:
            # The launcher exited. Whatever still holds stdout open is a leftover background process
            # (possible only without a pid namespace): stop soon rather than wait for the deadline.
            drain_until = time.monotonic() + 0.5
          continue
        bufs[key.fd] += data
        if key.fd != status_r and not over_output and (
            len(bufs[out_fd]) + len(bufs[err_fd]) > limits.max_output_bytes):
          over_output = True
          stop()
          drain_until = time.monotonic() + 0.5
  finally:
    sel.close()
  status = {}
  for line in bufs[status_r].decode("utf-8", "replace").splitlines():
    kind, _, value = line.partition(" ")
    status[kind] = value if kind == "error" else int(value)
  return bytes(bufs[out_fd]), bytes(bufs[err_fd]), status, timed_out, over_output, over_memory


def _stop(proc: subprocess.Popen, mode: str) -> bool:
  """Ends a run. Returns whether the launcher exited on its own terms, i.e. after cleaning up behind
  the program.

  The launcher is asked (SIGUSR1) to kill the program; it then cleans up and exits, which in the
  namespace modes tears the pid namespace down (the kernel kills and reaps every process in it before
  the launcher's exit completes). Waiting for that, rather
  than killing everything at once, means no process of the run is left when `run_python` returns.
  Killing the group is the fallback.
  """
  clean = _wait_unreaped(proc, 0)
  if not clean:
    _signal_launcher(proc, mode)
    clean = _wait_unreaped(proc, 3.0)
  # The launcher (or unshare) is still unreaped here, so its pid (= the group id) cannot have been
  # reused: killpg only reaches this run's processes.
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()
  return clean


def _signal_launcher(proc: subprocess.Popen, mode: str) -> None:
  """Sends SIGUSR1 to the launcher, unshare's only child."""
  for pid in _children_of(proc.pid):
    # Through a pidfd, and only if the pid still belongs to a child of unshare (which forks once and
    # is our unreaped child): a launcher that just exited cannot have its pid recycled under us.
    try:
      fd = os.pidfd_open(pid)
    except OSError:
      continue
    try:
      if pid in _children_of(proc.pid):
        signal.pidfd_send_signal(fd, signal.SIGUSR1)
    except OSError:
      pass
    finally:
      os.close(fd)


def _wait_unreaped(proc: subprocess.Popen, timeout: float) -> bool:
  """Waits up to `timeout` s for the launcher to exit, leaving it a zombie (WNOWAIT)."""
  deadline = time.monotonic() + timeout
  while True:
    if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
      return True
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.005)


def _rmtree(path: str) -> None:
  def onexc(func, p, exc_info):
    # A program may have made its own files or directories unwritable; undo that and retry once.
    try:
      os.chmod(os.path.dirname(p), 0o700)
      if os.path.isdir(p) and not os.path.islink(p):
        os.chmod(p, 0o700)
        shutil.rmtree(p, ignore_errors=True)
      else:
        func(p)
    except OSError:
      pass
  shutil.rmtree(path, onerror=onexc)


def _workdir_parent() -> str:
  """The temp dir, if the sandboxed uid can reach a directory in it; else /tmp.

  A private TMPDIR (mode 0700 somewhere on its path, as under pytest or in a home directory) would make
  the program's own working directory unreachable to the unprivileged uid it runs as.
  """
  tmp = os.path.realpath(tempfile.gettempdir())
  path = tmp
  while True:
    try:
      if not os.stat(path).st_mode & 0o001:
        return "/tmp"
    except OSError:
      return "/tmp"
    parent = os.path.dirname(path)
    if parent == path:
      return tmp
    path = parent


def _signal_name(sig: int) -> str:
  try:
    return signal.Signals(sig).name
  except ValueError:
    return str(sig)


# ----------------------------------------------------------------------------------------------------
# Expression evaluation: the program-synthesis verifier's entry point.

# Names an answer expression may use. This is a cheap early rejection only (it saves a process launch
# on garbage from an untrained model); the sandbox is what makes running the expression safe.
EXPRESSION_NAMES = frozenset({"x", "abs", "min", "max"})
MAX_EXPRESSION_CHARS = 200

# The whole evaluation is one process per problem. Plain text out (no json import in the child: the
# interpreter start dominates the cost of a check).
_EVAL_PROGRAM = """
import sys
expr = compile({expr!r}, "<answer>", "eval")
env = {{"__builtins__": {{"abs": abs, "min": min, "max": max}}}}
out = []
for x in {inputs!r}:
  y = eval(expr, env, {{"x": x}})
  if type(y) is not int:
    sys.exit("answer produced " + type(y).__name__ + ", not int")
  out.append(str(y))
print(" ".join(out))
"""

EVAL_LIMITS = Limits(cpu_seconds=1, wall_seconds=5.0, memory_bytes=128 * 2**20, max_output_bytes=16384)


def parse_expression(expr: str) -> ast.Expression | None:
  """Parses an answer as a Python expression over `EXPRESSION_NAMES`; None when it is not one.

  Parsing never runs the code (`ast.parse` does not even fold constants), so it is safe in-process.
  """
  if not isinstance(expr, str) or len(expr) > MAX_EXPRESSION_CHARS:
    return None
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except (SyntaxError, ValueError, MemoryError, RecursionError):
    return None
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and node.id not in EXPRESSION_NAMES:
      return None
    if isinstance(node, (ast.Attribute, ast.Lambda, ast.NamedExpr, ast.Starred, ast.Await, ast.Yield,
                         ast.YieldFrom)):
      return None
  return tree


def eval_expression(expr: str, inputs: Sequence[int], *, limits: Limits = EVAL_LIMITS,
                    mode: str | None = None) -> list[int] | None:
  """Evaluates the untrusted expression `expr` in `x` at every input, in one sandboxed process.

  Args:
    expr: Expression text, e.g. "x*3+2".
    inputs: Integer values for x.
    limits: Sandbox limits for the whole evaluation.
    mode: Sandbox mode (None: strongest available).

  Returns:
    One int per input, or None when the text is not an expression over `EXPRESSION_NAMES` or the
    evaluation fails in any way (exception, non-int result, timeout, a limit).
  """
  if parse_expression(expr) is None:
    return None
  inputs = [int(v) for v in inputs]
  result = run_python(_EVAL_PROGRAM.format(expr=expr.strip(), inputs=inputs), limits=limits, mode=mode)
  if not result.ok:
    return None
  try:
    out = [int(tok) for tok in result.stdout.split()]
  except ValueError:
    return None
  return out if len(out) == len(inputs) else None
