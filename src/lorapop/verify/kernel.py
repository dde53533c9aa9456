"""The kernel's side of the sandbox: namespaces, a minimal filesystem view, seccomp, Landlock.

The fork server (`lorapop.verify.server`) calls `confine_server` once, after its imports and
before its first child; everything here is inherited by the children or cheap per child
(`JobKernel`). Model text is assumed to reach any Python object in a job (frame walks,
`object.__subclasses__()`, the ctypes functions bound below), so every layer is enforced by the
kernel, never by hiding names:

- user namespace with a private uid map: jobs run as uid/gid 1000 inside; outside they are the
  caller's uid (not root) or, when the caller is root, `UID_BASE + the server's pid` (a uid no
  other live fork server of this pid namespace has). Children drop every capability before
  their job.
- network, IPC and UTS namespaces (no interfaces up: no network; no shared SysV objects).
- time namespace: the monotonic and boot-time clocks of the second (determinism) server are
  offset by `CLOCK_SKEW_S`, so a result that depends on them differs between the two runs.
- a mount namespace whose root is an empty read-only tmpfs (the host's files are gone: the
  server has imported all it needs), holding one size- and inode-limited tmpfs per child
  slot; a child chroots into its slot, and the server remounts the slot after the job (the
  kernel discards the old one; the server never walks it).
- a pid namespace per job (`clone(CLONE_NEWPID)`): the job is pid 1 and sees no other process.
- a seccomp allow-list (libseccomp through pyseccomp), loaded once in the server with
  no_new_privs and inherited: no exec, no new namespaces, no sockets, no ptrace, keyctl, bpf,
  perf, io_uring, no threads or forks. Calls the server needs and jobs must not make (mount,
  chroot, clone of a pid namespace) require a capability that children have dropped.
- where no user namespace can be made (the kernel forbids unprivileged ones): Landlock
  forbids all file access instead, and the report says which layers are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import signal

CLONE_NEWTIME = 0x80
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 1 << 14, 1 << 18
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4
_CAP_VERSION_3 = 0x20080522

#: First outer uid of a root caller's servers (unassigned ids far above real users).
UID_BASE = 0x7F000000
#: uid and gid of a job inside its user namespace (the same in both determinism runs).
JOB_ID = 1000
#: Monotonic/boot-time clock offset of the determinism server: ~31 years and a fraction, so a
#: reading of those clocks at any resolution from nanoseconds to decades differs between runs.
CLOCK_SKEW_S = 987_654_321.123456789
#: Each job's private tmpfs (its root and working directory).
JOB_TMPFS = "size=16m,nr_inodes=1024,mode=755"
#: Layers without which `isolate="strict"` refuses to run.
REQUIRED = ("seccomp", "user_ns", "pid_ns", "net_ns", "fs_view", "job_tmpfs")
LAYERS = (*REQUIRED, "time_ns", "landlock")

_libc = ctypes.CDLL(None, use_errno=True)
_pylibc = ctypes.PyDLL(None, use_errno=True)  # keeps the GIL across clone (as fork does)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


#: Syscall numbers without libseccomp (it knows every architecture; these are the common two).
_SYSNO = {"x86_64": {"clone": 56, "pivot_root": 155}, "aarch64": {"clone": 220, "pivot_root": 41}}


@functools.cache
def _seccomp():  # noqa: ANN202 - the pyseccomp module, or None without libseccomp
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError):  # it raises when libseccomp.so.2 is missing
        return None
    return pyseccomp


def _sysno(name: str) -> int | None:
    sc = _seccomp()
    if sc is not None:
        return sc.resolve_syscall(sc.Arch.NATIVE, name)
    return _SYSNO.get(os.uname().machine, {}).get(name)


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None):
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class JobKernel:
    """What each child does to the kernel: made in the server, called in the child after fork.

    The ctypes objects are built once here, so a child only makes the calls (each first touch
    of a page costs the child a copy-on-write fault)."""

    def __init__(self, clone_flags: int, drop_caps: bool) -> None:
        self.drop_caps = drop_caps
        self._clone = _pylibc.syscall
        self._clone.restype = ctypes.c_long
        number = _sysno("clone")
        self._sys_clone = None if number is None else ctypes.c_long(number)
        self._flags = ctypes.c_ulong(clone_flags)
        self._zero = ctypes.c_long(0)
        self._hdr = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
        self._caps = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2: none
        self._umount2 = _libc.umount2

    def fork(self) -> int:
        """A child (in a new pid namespace where the server can make one): the raw clone call,
        without libc's and CPython's at-fork work (`random` reseeding itself, lock resets: 5-7%
        of a child's CPU, and no thread can hold a lock here: the server starts none)."""
        if self._sys_clone is None:
            return os.fork()
        z = self._zero
        return _check(self._clone(self._sys_clone, self._flags, z, z, z, z), "clone")

    def enter(self, slot_dir: str | None) -> None:
        """In the child: die with the server, chroot into the job's tmpfs, drop capabilities."""
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if slot_dir is not None:
            os.chroot(slot_dir)
        os.chdir("/")
        if self.drop_caps:  # those the server holds in its user namespace
            _check(_libc.capset(self._hdr, self._caps), "capset")

    def new_slot(self, slot_dir: str) -> None:
        """Give a slot a new empty tmpfs (in the server): the old one is discarded whole."""
        _check(self._umount2(slot_dir.encode(), _MNT_DETACH), "umount slot")
        _mount_slot(slot_dir)


def _mount_slot(slot_dir: str) -> None:
    mount("tmpfs", slot_dir, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, JOB_TMPFS)


def _enter_user_ns(info: dict) -> bool:
    """A user namespace mapping JOB_ID to the server's outer uid (a fresh one if root)."""
    try:
        if os.geteuid() == 0:
            uid = UID_BASE + os.getpid()
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # else /proc/self is root's
        uid, gid = os.geteuid(), os.getegid()
        info["outer_uid"] = uid
        unshare(CLONE_NEWUSER)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{JOB_ID} {uid} 1")
        _write("/proc/self/gid_map", f"{JOB_ID} {gid} 1")
        return True
    except OSError as e:
        info["notes"].append(f"no user namespace ({e.strerror or e})")
        return False


def _build_view(n_slots: int, info: dict) -> list[str] | None:
    """pivot_root into an empty read-only tmpfs with one tmpfs per slot; the slots' paths."""
    try:
        mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)
        new = "/tmp" if os.path.isdir("/tmp") and not os.path.islink("/tmp") else "/mnt"
        mount("lorapop", new, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=64k,mode=755")
        os.mkdir(f"{new}/old")
        os.mkdir(f"{new}/slots")
        for i in range(n_slots):
            os.mkdir(f"{new}/slots/{i}")
        os.chdir(new)
        number = _sysno("pivot_root")
        if number is None:
            raise OSError(errno.ENOSYS, "pivot_root: unknown syscall number")
        _check(_libc.syscall(ctypes.c_long(number), b".", b"old"), "pivot_root")
        os.chdir("/")
        _check(_libc.umount2(b"/old", _MNT_DETACH), "umount old root")
        os.rmdir("/old")
        ro = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        mount(None, "/", None, ro, None)
        slots = [f"/slots/{i}" for i in range(n_slots)]
        for d in slots:
            _mount_slot(d)
        return slots
    except OSError as e:
        info["notes"].append(f"no private filesystem view ({e.strerror or e})")
        return None


def _enter_time_ns(skew: float, info: dict) -> bool:
    try:
        unshare(CLONE_NEWTIME)
        sec, nsec = int(skew), round((skew - int(skew)) * 1e9)
        _write("/proc/self/timens_offsets", f"monotonic {sec} {nsec}\nboottime {sec} {nsec}\n")
        return True
    except OSError as e:
        info["notes"].append(f"no time namespace ({e.strerror or e})")
        return False


#: What CPython needs to compute, and the server to run its children (ioctl, prctl, clone and
#: times are ruled on their arguments in `_seccomp_filter`); the rest fails with EPERM.
ALLOWED_SYSCALLS: tuple[str, ...] = (
    # memory, signals, clocks, exit
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "rt_sigaction",
    "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "restart_syscall", "exit", "exit_group",
    "futex", "sched_yield", "getitimer", "setitimer", "alarm", "nanosleep", "clock_nanosleep",
    "clock_gettime", "clock_getres", "gettimeofday", "time", "getrandom", "getcpu", "uname",
    "getrlimit", "setrlimit", "prlimit64", "umask",
    # ids (inside the namespaces)
    "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid", "getresuid",
    "getresgid", "getgroups", "getpgid", "getpgrp", "getsid", "setpgid", "getpriority",
    "capget", "capset",
    # fds and files (a job reaches only its own tmpfs)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "lseek",
    "close", "close_range", "dup", "dup2", "dup3", "fcntl", "pipe", "pipe2", "poll", "ppoll",
    "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
    "epoll_pwait", "epoll_pwait2", "open", "openat", "openat2", "creat", "stat", "lstat",
    "fstat", "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2",
    "readlink", "readlinkat", "getdents", "getdents64", "getcwd", "chdir", "fchdir", "mkdir",
    "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link",
    "linkat", "symlink", "symlinkat", "chmod", "fchmod", "fchmodat", "truncate", "ftruncate",
    "fsync", "fdatasync", "fallocate", "fadvise64", "flock", "utimensat", "utime", "utimes",
    "futimesat", "sendfile", "copy_file_range",
    # the server: its children, their pipes and tmpfs slots (mount and chroot need
    # capabilities that children drop before their job)
    "wait4", "waitid", "kill", "pidfd_open", "mount", "umount2", "chroot",
)  # fmt: skip


def _seccomp_filter(sc, clone_flags: int):  # noqa: ANN001, ANN202 - pyseccomp, its filter
    """The allow-list: what CPython needs to compute, and the server to run its children."""
    f = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    for name in ALLOWED_SYSCALLS:
        with contextlib.suppress(OSError):  # not a syscall on this architecture
            f.add_rule(sc.ALLOW, name)
    for request in (0x5401, 0x5450, 0x5451, 0x5421):  # TCGETS, FIONCLEX, FIOCLEX, FIONBIO
        f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.EQ, request))
    f.add_rule(sc.ALLOW, "prctl", sc.Arg(0, sc.EQ, _PR_SET_PDEATHSIG))
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.EQ, clone_flags))  # exactly the server's
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # so libc falls back to clone (refused)
    # times() reports ticks since boot, which no time namespace offsets; refused, libc would
    # hand back an unfilled struct, so the job is killed instead (SIGSYS: crashed).
    f.add_rule(sc.KILL_PROCESS, "times")
    return f


def _landlock(info: dict) -> bool:
    """Forbid every file access (for when there is no private filesystem view)."""
    try:
        import landlock
    except ImportError:
        info["notes"].append("no Landlock (the landlock package is not installed)")
        return False
    try:
        # landlock checks ctypes' saved errno rather than each call's result: clear what an
        # earlier refused call (the user namespace) left there.
        ctypes.set_errno(0)
        landlock.Ruleset().apply()
        return True
    except (OSError, landlock.LandlockError) as e:
        info["notes"].append(f"no Landlock ({str(e).splitlines()[0]})")
        return False


def confine_server(n_slots: int, clock_skew: float) -> tuple[dict, JobKernel, list[str] | None]:
    """Enter every layer this kernel allows; (report, per-child calls, slot dirs or None).

    The report maps each of LAYERS to whether it is active, plus "notes" (why not) and
    "outer_uid". Call after all imports: the host's filesystem is gone afterwards."""
    info: dict = {"notes": [], "layers": dict.fromkeys(LAYERS, False)}
    layers = info["layers"]
    sc = _seccomp()  # before the host's filesystem goes: it looks libseccomp up
    if _enter_user_ns(info):
        layers["user_ns"] = True
        try:
            unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
            layers["net_ns"] = True
        except OSError as e:
            info["notes"].append(f"no network namespace ({e.strerror or e})")
        layers["time_ns"] = _enter_time_ns(clock_skew, info)
        try:
            unshare(CLONE_NEWNS)
            slots = _build_view(n_slots, info)
        except OSError as e:
            info["notes"].append(f"no mount namespace ({e.strerror or e})")
            slots = None
    else:
        slots = None
    layers["fs_view"] = layers["job_tmpfs"] = layers["pid_ns"] = slots is not None
    flags = CLONE_NEWPID | signal.SIGCHLD if slots else signal.SIGCHLD
    kernel = JobKernel(flags, drop_caps=layers["user_ns"])
    if slots is None:
        layers["landlock"] = _landlock(info)
    else:
        info["notes"].append("landlock unused: the private filesystem view replaces it")
    if sc is None:
        info["notes"].append(
            "no seccomp filter (libseccomp.so.2 not found: apt install libseccomp2)"
        )
    else:
        try:
            _seccomp_filter(sc, flags).load()  # sets no_new_privs too
            layers["seccomp"] = True
        except OSError as e:
            info["notes"].append(f"no seccomp filter ({e})")
    return info, kernel, slots
