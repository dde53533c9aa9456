"""The kernel's side of the sandbox: namespaces, a minimal filesystem view, seccomp, Landlock.

The fork server (`lorapop.verify.server`) calls `confine_server` once, after its imports and
before its zygote; everything here is inherited by the zygote, the inits and the jobs, or
cheap per job (`JobKernel`). Model text is assumed to reach any Python object in a job, so every
layer is enforced by the kernel, never by hiding names:

- user namespace with a private uid map: jobs run as uid/gid 1000 inside; outside they are the
  caller's uid (not root) or, when the caller is root, `UID_BASE + the server's pid` (a uid no
  other live fork server of this pid namespace has). Jobs drop every capability.
- network, IPC and UTS namespaces (no interfaces up: no network; no shared SysV objects; the
  host name is `HOSTNAME` on every node).
- time namespace: the monotonic and boot-time clocks of the children are offset by an amount
  the caller draws at random and writes itself (no process of the sandbox knows it); the
  determinism server's are `CLOCK_SKEW_S` further, so a result that depends on them differs
  between the two runs.
- a mount namespace whose root is an empty read-only tmpfs (the host's files are gone: the
  server has imported all it needs), holding one size- and inode-limited tmpfs per slot; a job
  chroots into its slot, whose tmpfs is renewed after each job (the kernel discards the old
  one; nothing walks it).
- a pid namespace per init (`clone(CLONE_NEWPID | CLONE_PARENT)`): its jobs are pid 2 and see
  no other process; when the init dies (with the server: PDEATHSIG) the kernel kills them.
- seccomp allow-lists (libseccomp through pyseccomp), with no_new_privs: the server's, loaded
  once and inherited, and the jobs' (`JOB_SYSCALLS`), which each init adds: no exec, no new
  namespaces, no sockets, pipes or polling, no ptrace, keyctl, bpf, perf, io_uring, no
  threads or forks, no CPU number. PDEATHSIG may only be set to SIGKILL.
- where no user namespace can be made (the kernel forbids unprivileged ones): Landlock
  forbids all file access instead, and the report says which layers are missing.

ctypes stays in a job's image (the zygote's own calls use it) with emptied module globals; its
C types can still call into libc, within the jobs' seccomp filter.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import signal

CLONE_NEWTIME = 0x80
CLONE_PARENT = 0x00008000
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 1 << 14, 1 << 18
_MNT_DETACH = 2
_SLOT_FLAGS = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP = 1, 4, 22
_SECCOMP_MODE_FILTER = 2
_CAP_VERSION_3 = 0x20080522

#: First outer uid of a root caller's servers (unassigned ids far above real users).
UID_BASE = 0x7F000000
#: uid and gid of a job inside its user namespace (the same in both determinism runs).
JOB_ID = 1000
#: How much further the determinism server's monotonic/boot-time clocks are offset than the main
#: server's: ~31 years and a fraction, so a reading of those clocks at any resolution from
#: nanoseconds to decades differs between runs. Each server's own offset adds a random part
#: (below `CLOCK_RANDOM_S`) that the caller writes into its time namespace: no job can read it.
CLOCK_SKEW_S = 987_654_321.123456789
CLOCK_RANDOM_S = 100_000_000.0
#: Every job's host name (its UTS namespace): the same on every node.
HOSTNAME = b"sandbox"
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
    """The kernel calls of the zygote, its inits and jobs: built in the server, handed to the
    zygote as plain ctypes objects (`values`), so no class of this package reaches a job.

    clone_flags: how the zygote makes an init (a new pid namespace where the server can make
    one, and always the server as its parent); drop_caps: jobs drop the capabilities the
    server holds in its user namespace; job_filter: the jobs' own seccomp program (BPF), loaded
    on top of the server's."""

    def __init__(self, clone_flags: int, drop_caps: bool, job_filter: bytes | None = None) -> None:
        self.drop_caps = drop_caps
        self.clone_flags = clone_flags
        self.job_filter = job_filter
        self._umount2 = _libc.umount2
        number = _sysno("pidfd_getfd")
        self._getfd = None if number is None else (_libc.syscall, ctypes.c_long(number))

    def values(self, rlimits: list[tuple[int, int, int]], cpu_hard: int) -> dict[str, object]:
        """What `lorapop.verify.child` calls, by name: raw clones (no libc or CPython at-fork
        work: no thread can hold a lock here, the server starts none), prctl, setrlimit,
        capset and the job filter's `struct sock_fprog`."""
        syscall = _pylibc.syscall  # keeps the GIL across clone (as fork does)
        syscall.restype = ctypes.c_long
        number = _sysno("clone")
        z = ctypes.c_long(0)
        if number is None:
            clone_init = fork_job = os.fork
        else:
            nr = ctypes.c_long(number)
            flags = ctypes.c_ulong(self.clone_flags)
            clone_init = functools.partial(syscall, nr, flags, z, z, z, z)
            fork_job = functools.partial(syscall, nr, ctypes.c_ulong(signal.SIGCHLD), z, z, z, z)
        clone_job = fork_job
        number3 = _sysno("clone3")
        if self.clone_flags & CLONE_NEWPID and number3 is not None:
            # clone3 with set_tid: each job of an init is pid 2 (the init holds
            # CAP_CHECKPOINT_RESTORE in its user namespace), so pids never count jobs.
            tid = (ctypes.c_int * 1)(2)
            args = (ctypes.c_uint64 * 11)()
            args[4] = signal.SIGCHLD  # exit_signal
            args[8], args[9] = ctypes.addressof(tid), 1  # set_tid, set_tid_size
            clone_job = functools.partial(
                syscall, ctypes.c_long(number3), args, ctypes.c_size_t(ctypes.sizeof(args))
            )
            clone_job.keep = tid  # type: ignore[attr-defined]
        pair = ctypes.c_ulong * 2
        job_filter = None
        if self.job_filter:
            code = ctypes.create_string_buffer(self.job_filter, len(self.job_filter))
            # struct sock_fprog {unsigned short len; struct sock_filter *filter;}
            prog = ctypes.create_string_buffer(16)
            ctypes.memmove(prog, ctypes.byref(ctypes.c_ushort(len(self.job_filter) // 8)), 2)
            ctypes.c_void_p.from_buffer(prog, 8).value = ctypes.addressof(code)
            job_filter = (prog, code)
        return {
            "CLONE_INIT": clone_init,
            "FORK_JOB": fork_job,
            "CLONE_JOB": clone_job,
            "UMOUNT": _libc.umount2,
            "MOUNT": _libc.mount,
            "SLOT_FLAGS": ctypes.c_ulong(_SLOT_FLAGS),
            "SLOT_OPTIONS": JOB_TMPFS.encode(),
            "PRCTL": _libc.prctl,
            "SETRLIMIT": _libc.setrlimit,
            "RLIMIT_PAIR": pair,
            "RLIMITS": tuple((which, pair(soft, hard)) for which, soft, hard in rlimits),
            "CPU_HARD": cpu_hard,
            "CAPSET": _libc.capset,
            "CAP_HDR": (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0),
            "CAP_DATA": (ctypes.c_uint32 * 6)(),  # effective, permitted, inheritable x 2: none
            "DROP_CAPS": self.drop_caps,
            "JOB_FILTER": None if job_filter is None else job_filter[0],
            "JOB_FILTER_CODE": None if job_filter is None else job_filter[1],
        }

    def getfd(self, pidfd: int, fd: int) -> int:
        """A copy of another process's fd (pidfd_getfd): the server takes its ends of an init's
        pipes, which the zygote made."""
        if self._getfd is None:
            raise OSError(errno.ENOSYS, "pidfd_getfd: unknown syscall number")
        call, nr = self._getfd
        return _check(call(nr, pidfd, fd, 0), "pidfd_getfd")

    def new_slot(self, slot_dir: str) -> None:
        """Give a slot a new empty tmpfs (in the server): the old one is discarded whole."""
        _check(self._umount2(slot_dir.encode(), _MNT_DETACH), "umount slot")
        _mount_slot(slot_dir)


def _mount_slot(slot_dir: str) -> None:
    mount("tmpfs", slot_dir, "tmpfs", _SLOT_FLAGS, JOB_TMPFS)


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


def _enter_time_ns(info: dict) -> bool:
    """A time namespace for the children; its offsets are the caller's to write (through
    /proc/PID/timens_offsets) before the zygote enters it: this process never knows them."""
    try:
        unshare(CLONE_NEWTIME)
        return True
    except OSError as e:
        info["notes"].append(f"no time namespace ({e.strerror or e})")
        return False


#: What a job may call: what CPython needs to compute (ioctl and times are ruled on their
#: arguments in `_filter`); the rest fails with EPERM. No pipes, sockets, polling or CPU
#: number: their inode numbers and values come from host-wide counters.
JOB_SYSCALLS: tuple[str, ...] = (
    # memory, signals (a job's own pid namespace holds only it and its init), clocks, exit
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "rt_sigaction",
    "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "restart_syscall", "exit", "exit_group",
    "futex", "sched_yield", "getitimer", "setitimer", "alarm", "nanosleep", "clock_nanosleep",
    "clock_gettime", "clock_getres", "gettimeofday", "time", "getrandom", "uname",
    "getrlimit", "setrlimit", "prlimit64", "umask", "kill", "tgkill", "tkill", "pause",
    "rt_sigsuspend", "rt_sigtimedwait", "rt_sigpending",
    # ids (inside the namespaces)
    "getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid", "getresuid",
    "getresgid", "getgroups", "getpgid", "getpgrp", "getsid", "getpriority", "capget",
    # fds and files (a job reaches only its own tmpfs)
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "lseek",
    "close", "close_range", "dup", "dup2", "dup3", "fcntl", "open", "openat", "openat2",
    "creat", "stat", "lstat", "fstat", "newfstatat", "statx", "statfs", "fstatfs", "access",
    "faccessat", "faccessat2", "readlink", "readlinkat", "getdents", "getdents64", "getcwd",
    "chdir", "fchdir", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename",
    "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat", "chmod", "fchmod",
    "fchmodat", "truncate", "ftruncate", "fsync", "fdatasync", "fallocate", "fadvise64",
    "flock", "utimensat", "utime", "utimes", "futimesat", "sendfile", "copy_file_range",
)  # fmt: skip

#: What the server, its zygote and the inits need beyond that (prctl and clone are ruled on
#: their arguments). mount and chroot need capabilities that jobs drop; jobs also load
#: `JOB_SYSCALLS` on top of this list.
SERVER_SYSCALLS: tuple[str, ...] = (
    "pipe", "pipe2", "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1",
    "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2", "setpgid", "capset", "wait4",
    "waitid", "pidfd_open", "pidfd_getfd", "mount", "umount2", "chroot", "memfd_create",
)  # fmt: skip
#: The server's whole allow-list (the jobs' and its own).
ALLOWED_SYSCALLS = JOB_SYSCALLS + SERVER_SYSCALLS


def _filter(sc, names: tuple[str, ...]):  # noqa: ANN001, ANN202 - pyseccomp, its filter
    f = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    for name in names:
        with contextlib.suppress(OSError):  # not a syscall on this architecture
            f.add_rule(sc.ALLOW, name)
    for request in (0x5401, 0x5450, 0x5451, 0x5421):  # TCGETS, FIONCLEX, FIOCLEX, FIONBIO
        f.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.EQ, request))
    # times() reports ticks since boot, which no time namespace offsets; refused, libc would
    # hand back an unfilled struct, so the job is killed instead (SIGSYS: crashed).
    f.add_rule(sc.KILL_PROCESS, "times")
    return f


def _seccomp_filter(sc, clone_flags: int):  # noqa: ANN001, ANN202 - pyseccomp, its filter
    """The server's allow-list, inherited by the zygote, the inits and the jobs."""
    f = _filter(sc, ALLOWED_SYSCALLS)
    f.add_rule(sc.ALLOW, "clone3")  # an init's job (set_tid); jobs' own filter refuses it
    # PDEATHSIG may be set to SIGKILL only: nobody can clear it (an init dies with the server).
    f.add_rule(sc.ALLOW, "prctl", sc.Arg(0, sc.EQ, _PR_SET_PDEATHSIG), sc.Arg(1, sc.EQ, 9))
    f.add_rule(sc.ALLOW, "prctl", sc.Arg(0, sc.EQ, _PR_SET_SECCOMP))  # only ever adds rules
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.EQ, clone_flags))  # an init
    f.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.EQ, signal.SIGCHLD))  # the zygote, a job
    return f


#: What an init needs beyond `JOB_SYSCALLS`: each init loads the jobs' filter once, before its
#: first job, with these; a job holds no capability (mount, chroot, clone3's set_tid), no child
#: (wait4) and no process to spare (RLIMIT_NPROC) for them. (Without a private tmpfs each job
#: loads the filter itself: its init makes an anonymous file and forks with clone for it.)
INIT_SYSCALLS: tuple[str, ...] = (
    "clone3", "wait4", "mount", "umount2", "chroot", "capset", "setpgid",
)  # fmt: skip


def _job_filter(sc) -> bytes:  # noqa: ANN001 - pyseccomp
    """The jobs' allow-list as a BPF program, which each init loads before its first job."""
    f = _filter(sc, JOB_SYSCALLS + INIT_SYSCALLS)
    r, w = os.pipe()
    try:
        with os.fdopen(w, "wb", closefd=False) as out:
            f.export_bpf(out)
        os.close(w)
        w = -1
        parts = []
        while chunk := os.read(r, 1 << 16):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


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


def confine_server(n_slots: int) -> tuple[dict, JobKernel, list[str] | None]:
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
            _check(_libc.sethostname(HOSTNAME, len(HOSTNAME)), "sethostname")
            _check(_libc.setdomainname(b"(none)", 6), "setdomainname")
        except OSError as e:
            info["notes"].append(f"no network namespace ({e.strerror or e})")
        layers["time_ns"] = _enter_time_ns(info)
        try:
            unshare(CLONE_NEWNS)
            slots = _build_view(n_slots, info)
        except OSError as e:
            info["notes"].append(f"no mount namespace ({e.strerror or e})")
            slots = None
    else:
        slots = None
    layers["fs_view"] = layers["job_tmpfs"] = layers["pid_ns"] = slots is not None
    flags = CLONE_PARENT | signal.SIGCHLD | (CLONE_NEWPID if slots else 0)
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
            kernel.job_filter = _job_filter(sc)
            _seccomp_filter(sc, flags).load()  # sets no_new_privs too
            layers["seccomp"] = True
        except OSError as e:
            info["notes"].append(f"no seccomp filter ({e})")
    return info, kernel, slots
