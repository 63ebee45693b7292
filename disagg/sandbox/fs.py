"""Filesystem isolation of the code sandbox: what an answer may see and change.

Model code must not read or change anything of the job (checkpoints, the model
cache, the run directory and its control token, the project, home directories),
nor keep anything between runs. In the box it sees only:

- read-only: the system (/usr, /etc, the merged-/usr links) and the Python install
  the sandbox runs (its ``sys.base_prefix``, not the venv);
- writable: a private /tmp and /dev/shm of ``TMP_BYTES`` each, and the run's
  temporary directory at its own path (the working directory, removed after the run);
- a minimal /dev and, with bwrap, a /proc of its own PID namespace.

Run as root, the answer also runs as nobody (``NOBODY``): no root-owned file is
writable and no file readable by root only, even where the view shows one. Run as
another user, it runs as that user.

Two ways to build the view; ``disagg.sandbox`` uses the first that works here:

- ``"bwrap"``: bubblewrap (Debian's ``bubblewrap``, which ``make venv`` installs where
  it is root and apt is there). As root it runs privileged, without a user
  namespace: one created by root would map the box's nobody to the real root. It
  keeps only CAP_SETUID, CAP_SETGID and CAP_KILL, for the supervisor to drop the
  answer to nobody and kill it; the network and PID namespaces are bwrap's, with the
  supervisor as the namespace's init.
- ``"namespaces"``: the same view built by hand in the forked child before exec (where
  bwrap is missing): a mount namespace (and, when not root, a user namespace mapping
  only the caller's uid) whose root is a tmpfs of read-only binds, entered with
  pivot_root; /dev holds null, zero, full, random and urandom; /proc is empty (bwrap
  mounts the PID namespace's own, this fallback does not), or the host's as root
  where no PID namespace could be made.

The host paths a box shows are those ``plan_view`` names, and a few devices. In the
forked child this module never raises: ``enter_view`` returns what failed.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import sys

Entry = tuple[str, str, str]
"""(kind, source, destination): kind "ro" / "rw" is a bind of source, "symlink" a link
whose target is source, "tmpfs" a private writable directory, "dir" a directory of mode 0755 on the
way to a bind (not the host's mode: /root is 0700); source unused for the last two."""

NOBODY = 65534
"""The uid and gid an answer runs as when the sandbox runs as root."""
TMP_BYTES = 64 << 20
"""Size of each of the box's private /tmp and /dev/shm (memory, not counted in the address-space limit)."""

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""What the box shows of the system, read-only, where it exists (links stay links)."""
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_ROOT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL")

BWRAP = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin:" + os.environ.get("PATH", ""))
"""bubblewrap's path, or None where it is not installed."""
INTERPRETER = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
"""The interpreter the box runs: the base install, not the venv (the runner uses the stdlib only)."""

_LIBC = ctypes.CDLL(None, use_errno=True)
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH = 2
# statvfs flag -> mount flag: a bind remounted in a user namespace must keep these (the kernel locks them)
_LOCKED = ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
           (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME))
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}.get(platform.machine())
"""pivot_root's syscall number (glibc has no wrapper); None on other architectures."""


def python_dirs() -> list[str]:
    """Where the Python install the box runs lives (``INTERPRETER`` and its stdlib)."""
    return sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix,
                                                 os.path.dirname(os.path.dirname(INTERPRETER)))})


def plan_view(box: str, pythons: list[str], system: tuple[str, ...] = SYSTEM) -> list[Entry]:
    """What the box is made of, in mount order: the system and ``pythons`` read-only (paths under
    an earlier entry are not bound again), a private /tmp and /dev/shm, then ``box`` writable at
    its own path."""
    entries: list[Entry] = []
    shown: list[str] = []
    for path in system:
        if os.path.islink(path):
            entries.append(("symlink", os.readlink(path), path))
        elif os.path.isdir(path):
            entries.append(("ro", path, path))
            shown.append(path)
    entries += [("tmpfs", "", "/tmp"), ("tmpfs", "", "/dev/shm")]
    made = {"/tmp", "/dev", "/dev/shm"}
    for kind, path in [("ro", p) for p in pythons] + [("rw", box)]:
        if any(path == s or path.startswith(s.rstrip("/") + "/") for s in shown):
            continue
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if parent not in made:
                entries.append(("dir", "", parent))
                made.add(parent)
        entries.append((kind, path, path))
        shown.append(path)
    return entries


def bwrap_argv(plan: list[Entry], box: str, *, as_root: bool) -> list[str]:
    """bubblewrap's command line for ``plan``, up to the ``--`` before the command."""
    argv = [BWRAP or "bwrap", "--die-with-parent", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--unshare-net", "--unshare-pid", "--as-pid-1"]
    if as_root:
        argv += ["--cap-drop", "ALL"] + [a for cap in _ROOT_CAPS for a in ("--cap-add", cap)]
    else:
        argv.append("--unshare-user")
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for kind, src, dst in plan:
        if kind == "symlink":
            argv += ["--symlink", src, dst]
        elif kind == "dir":
            argv += ["--perms", "0755", "--dir", dst]
        elif kind == "tmpfs":
            argv += ["--size", str(TMP_BYTES), "--perms", "1777", "--tmpfs", dst]
        else:
            argv += ["--ro-bind" if kind == "ro" else "--bind", src, dst]
    return argv + ["--remount-ro", "/", "--chdir", box, "--"]


def enter_view(plan: list[Entry], new_root: str, box: str, *, as_root: bool, host_proc: bool) -> str | None:
    """In the forked child: build ``plan`` on a tmpfs at ``new_root`` (an empty directory) and
    make it the root, cwd ``box``. ``host_proc`` binds the host's /proc (as root without a PID
    namespace). Returns what failed, or None. Call ``unshare_mounts`` first."""
    step = "mount --make-rprivate /"
    os.umask(0o022)
    try:
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
        step = f"mount tmpfs {new_root}"
        _mount("tmpfs", new_root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
        for kind, src, dst in plan:
            target = new_root + dst
            step = f"{kind} {src} {dst}"
            if kind == "symlink":
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.symlink(src, target)
            elif kind == "dir":
                os.makedirs(target, exist_ok=True)
            elif kind == "tmpfs":
                os.makedirs(target, exist_ok=True)
                _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={TMP_BYTES}")
            else:
                _bind(src, target, _MS_NOSUID | _MS_NODEV | (_MS_RDONLY if kind == "ro" else 0))
        for dev in _DEVICES:
            step = f"bind {dev}"
            if os.path.exists(dev):
                _bind(dev, new_root + dev, None)
        step = "/proc"
        if host_proc:
            _bind("/proc", new_root + "/proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        else:
            os.mkdir(new_root + "/proc", 0o555)
        step = "pivot_root"
        os.chdir(new_root)
        if _LIBC.syscall(PIVOT_ROOT, b".", b".") != 0:
            _raise()
        if _LIBC.umount2(b".", _MNT_DETACH) != 0:
            _raise()
        step = "remount / read-only"
        _mount(None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        os.chdir(box)
    except OSError as e:
        return f"{step}: {e.strerror or e}"
    return None


def unshare_mounts(*, as_root: bool) -> str | None:
    """In the forked child: a mount namespace, in a new user namespace mapping only the caller's
    uid and gid when not root. Returns what failed, or None."""
    uid, gid = os.getuid(), os.getgid()
    if _LIBC.unshare(_CLONE_NEWNS | (0 if as_root else _CLONE_NEWUSER)) != 0:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    if as_root:
        return None
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
    except OSError as e:
        return f"writing /proc/self/{name}: {e.strerror}"
    return None


def _bind(src: str, target: str, flags: int | None) -> None:
    """Bind ``src`` (not its submounts) on ``target``, created empty; remount it with ``flags`` plus
    the flags the kernel locks, unless ``flags`` is None (devices)."""
    if os.path.isdir(src):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    _mount(src, target, None, _MS_BIND)
    if flags is not None:
        st = os.statvfs(src).f_flag
        locked = 0
        for st_flag, ms_flag in _LOCKED:
            if st & st_flag:
                locked |= ms_flag
        _mount(None, target, None, _MS_REMOUNT | _MS_BIND | flags | locked)


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _LIBC.mount(_enc(src), _enc(target), _enc(fstype), flags, _enc(data)) != 0:
        _raise()


def _enc(s: str | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def _raise() -> None:
    errno = ctypes.get_errno()
    raise OSError(errno, os.strerror(errno))
