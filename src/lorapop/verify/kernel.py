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

The calls themselves are `lorapop.verify._kernel`'s, a C extension that defines no type, so no
foreign-function interface is loaded in the server or in any job's image. Where it is not
built, `lorapop.verify.kernel_ctypes` makes the same calls through ctypes, which leaves
`_ctypes`'s C types within a job's reach: the report's "native_calls" layer is then off. The
seccomp programs are built by the caller (libseccomp through pyseccomp, itself ctypes: the
caller is trusted) and handed to the server as BPF bytes (`filters`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import types
from typing import Any

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
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 4, 22, 38

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
REQUIRED = ("seccomp", "user_ns", "pid_ns", "net_ns", "fs_view", "job_tmpfs", "native_calls")
LAYERS = (*REQUIRED, "time_ns", "landlock")

#: Syscall numbers where libseccomp is missing (it knows every architecture; these the common two).
_SYSNO = {
    "x86_64": {"clone": 56, "clone3": 435, "pivot_root": 155, "pidfd_getfd": 438},
    "aarch64": {"clone": 220, "clone3": 435, "pivot_root": 41, "pidfd_getfd": 438},
}


@functools.cache
def _seccomp():  # noqa: ANN202 - the pyseccomp module, or None without libseccomp
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError):  # it raises when libseccomp.so.2 is missing
        return None
    return pyseccomp


@functools.cache
def syscall_numbers() -> dict[str, int]:
    """This machine's numbers of the calls the ctypes fallback makes by number (the caller
    resolves them: the server never loads libseccomp)."""
    sc = _seccomp()
    if sc is None:
        return dict(_SYSNO.get(os.uname().machine, {}))
    return {n: sc.resolve_syscall(sc.Arch.NATIVE, n) for n in _SYSNO["x86_64"]}


def calls(native: bool = True, sysno: dict[str, int] | None = None) -> tuple[Any, str | None]:
    """The kernel-call API (`lorapop.verify._kernel`'s functions) and None; or, where that
    extension is not built (or `native` is False), the same through ctypes and why."""
    if native:
        try:
            from lorapop.verify import _kernel

            return _kernel, None
        except ImportError:
            why = "lorapop.verify._kernel is not built"
    else:
        why = "asked for"
    from lorapop.verify import kernel_ctypes

    note = (
        f"kernel calls through ctypes ({why}; `pip install -e .` builds it): ctypes' C types"
        " stay within a job's reach"
    )
    return kernel_ctypes.api(syscall_numbers() if sysno is None else sysno), note


def unshare(flags: int) -> None:
    calls()[0].unshare(flags)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None):
    calls()[0].mount(source, target, fstype, flags, data)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class JobKernel:
    """The kernel calls of the zygote, its inits and jobs, chosen in the server and handed to
    the zygote as plain callables (`values`): no class or module of this package reaches a job.

    api: `calls()`'s; clone_flags: how the zygote makes an init (a new pid namespace where the
    server can make one, and always the server as its parent); drop_caps: jobs drop the
    capabilities the server holds in its user namespace; job_filter: the jobs' own seccomp
    program (BPF), loaded on top of the server's."""

    def __init__(
        self, api: Any, clone_flags: int, drop_caps: bool, job_filter: bytes | None = None
    ) -> None:
        self.api = api
        self.drop_caps = drop_caps
        self.clone_flags = clone_flags
        self.job_filter = job_filter

    def values(self, rlimits: list[tuple[int, int, int]], cpu_hard: int) -> dict[str, object]:
        """What `lorapop.verify.child` calls, by name: raw clones (no libc or CPython at-fork
        work: no thread can hold a lock here, the server starts none), prctl, setrlimit,
        capset, the slot renewal and the job filter."""
        api = self.api
        fork_job = functools.partial(api.clone, signal.SIGCHLD)
        clone_job = fork_job
        if self.clone_flags & CLONE_NEWPID:
            # clone3 with set_tid: each job of an init is pid 2 (the init holds
            # CAP_CHECKPOINT_RESTORE in its user namespace), so pids never count jobs.
            clone_job = functools.partial(api.clone_pid, 2)
        return {
            "CLONE_INIT": functools.partial(api.clone, self.clone_flags),
            "FORK_JOB": fork_job,
            "CLONE_JOB": clone_job,
            "RENEW": api.renew,
            "SLOT_OPTIONS": JOB_TMPFS,
            "PRCTL": api.prctl,
            "SETRLIMIT": api.setrlimit,
            "RLIMITS": tuple(rlimits),
            "CPU_HARD": cpu_hard,
            "DROP_CAPS": api.drop_caps if self.drop_caps else None,
            "SECCOMP": api.seccomp_load,
            "JOB_FILTER": self.job_filter,
            "TRIM": getattr(api, "trim", None),
            "SERVE": getattr(api, "serve_slot", None),
        }

    def getfd(self, pidfd: int, fd: int) -> int:
        """A copy of another process's fd (pidfd_getfd): the server takes its ends of an init's
        pipes, which the zygote made."""
        return self.api.pidfd_getfd(pidfd, fd)

    def new_slot(self, slot_dir: str) -> None:
        """Give a slot a new empty tmpfs (in the server): the old one is discarded whole."""
        self.api.renew(slot_dir, JOB_TMPFS)


def _enter_user_ns(api: Any, info: dict) -> bool:
    """A user namespace mapping JOB_ID to the server's outer uid (a fresh one if root)."""
    try:
        if os.geteuid() == 0:
            uid = UID_BASE + os.getpid()
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            api.prctl(_PR_SET_DUMPABLE, 1)  # else /proc/self is root's
        uid, gid = os.geteuid(), os.getegid()
        info["outer_uid"] = uid
        api.unshare(CLONE_NEWUSER)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{JOB_ID} {uid} 1")
        _write("/proc/self/gid_map", f"{JOB_ID} {gid} 1")
        return True
    except OSError as e:
        info["notes"].append(f"no user namespace ({e.strerror or e})")
        return False


def _build_view(api: Any, n_slots: int, info: dict) -> list[str] | None:
    """pivot_root into an empty read-only tmpfs with one tmpfs per slot; the slots' paths."""
    try:
        api.mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)
        new = "/tmp" if os.path.isdir("/tmp") and not os.path.islink("/tmp") else "/mnt"
        api.mount("lorapop", new, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=64k,mode=755")
        os.mkdir(f"{new}/old")
        os.mkdir(f"{new}/slots")
        for i in range(n_slots):
            os.mkdir(f"{new}/slots/{i}")
        os.chdir(new)
        api.pivot_root(".", "old")
        os.chdir("/")
        api.umount2("/old", _MNT_DETACH)
        os.rmdir("/old")
        ro = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        api.mount(None, "/", None, ro, None)
        slots = [f"/slots/{i}" for i in range(n_slots)]
        for d in slots:
            api.mount("tmpfs", d, "tmpfs", _SLOT_FLAGS, JOB_TMPFS)
        return slots
    except OSError as e:
        info["notes"].append(f"no private filesystem view ({e.strerror or e})")
        return None


def _enter_time_ns(api: Any, info: dict) -> bool:
    """A time namespace for the children; its offsets are the caller's to write (through
    /proc/PID/timens_offsets) before the zygote enters it: this process never knows them."""
    try:
        api.unshare(CLONE_NEWTIME)
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


#: The two ways the zygote clones an init: with a pid namespace of its own, or without (no
#: private filesystem view).
INIT_FLAGS = (CLONE_PARENT | signal.SIGCHLD | CLONE_NEWPID, CLONE_PARENT | signal.SIGCHLD)


def _bpf(f) -> bytes:  # noqa: ANN001 - a pyseccomp filter
    import tempfile  # the caller's only: the server never imports it (nor what it imports)

    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


@functools.cache
def filters() -> tuple[dict[str, bytes] | None, str | None]:
    """The seccomp programs, built here in the caller (libseccomp through pyseccomp): the
    jobs' ("job") and the server's for each of `INIT_FLAGS` (str(flags)); or None and why
    not."""
    sc = _seccomp()
    if sc is None:
        return None, "no seccomp filter (libseccomp.so.2 not found: apt install libseccomp2)"
    try:
        out = {"job": _bpf(_filter(sc, JOB_SYSCALLS + INIT_SYSCALLS))}
        for flags in INIT_FLAGS:
            out[str(flags)] = _bpf(_seccomp_filter(sc, flags))
    except (OSError, RuntimeError, ValueError) as e:
        return None, f"no seccomp filter ({e})"
    return out, None


def confine_server(
    n_slots: int, api: Any, progs: dict[str, bytes] | None, notes: list[str]
) -> tuple[dict, JobKernel, list[str] | None]:
    """Enter every layer this kernel allows; (report, per-child calls, slot dirs or None).

    api: `calls()`'s; progs: `filters()`'s seccomp programs (None: no seccomp); notes: why
    layers are missing already (the API's, the filters'). The report maps each of LAYERS to
    whether it is active, plus "notes" (why not) and "outer_uid". Call after all imports: the
    host's filesystem is gone afterwards."""
    info: dict = {"notes": list(notes), "layers": dict.fromkeys(LAYERS, False)}
    layers = info["layers"]
    layers["native_calls"] = isinstance(api, types.ModuleType)
    if _enter_user_ns(api, info):
        layers["user_ns"] = True
        try:
            api.unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
            layers["net_ns"] = True
            api.sethostname(HOSTNAME)
            api.setdomainname(b"(none)")
        except OSError as e:
            info["notes"].append(f"no network namespace ({e.strerror or e})")
        layers["time_ns"] = _enter_time_ns(api, info)
        try:
            api.unshare(CLONE_NEWNS)
            slots = _build_view(api, n_slots, info)
        except OSError as e:
            info["notes"].append(f"no mount namespace ({e.strerror or e})")
            slots = None
    else:
        slots = None
    layers["fs_view"] = layers["job_tmpfs"] = layers["pid_ns"] = slots is not None
    flags = INIT_FLAGS[0] if slots else INIT_FLAGS[1]
    kernel = JobKernel(api, flags, drop_caps=layers["user_ns"])
    if slots is None:
        try:
            api.landlock_deny_files()
            layers["landlock"] = True
        except (OSError, ImportError) as e:
            info["notes"].append(f"no Landlock ({e.strerror or e})")
    else:
        info["notes"].append("landlock unused: the private filesystem view replaces it")
    if progs is not None:
        try:
            with contextlib.suppress(OSError):  # set already (Landlock)
                api.prctl(_PR_SET_NO_NEW_PRIVS, 1)
            api.seccomp_load(progs[str(flags)])
            kernel.job_filter = progs["job"]
            layers["seccomp"] = True
        except OSError as e:
            info["notes"].append(f"no seccomp filter ({e.strerror or e})")
    return info, kernel, slots
