"""The sandbox's kernel calls through ctypes: `lorapop.verify._kernel`'s API, for where that C
extension is not built (a source tree on PYTHONPATH without `pip install -e .`).

Weaker, and reported so (`kernel.LAYERS`' "native_calls" is off, and `isolate="strict"`
refuses it): the zygote keeps `_ctypes` loaded, whose C types are static types the interpreter
never frees, so a job can reach them (`object.__subclasses__()`) and call libc, still inside
its seccomp filter and namespaces.

`api` rebinds these functions into a namespace of their own holding only ctypes objects (never
a module): the zygote empties the globals of every module a job may not import, ctypes' too,
and these functions must keep working in the zygote, its inits and jobs after that.
"""

from __future__ import annotations

import builtins
import ctypes
import os
import signal
import types

_SLOT_FLAGS = 2 | 4 | 8  # MS_NOSUID | MS_NODEV | MS_NOEXEC
_MNT_DETACH = 2
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_CAP_VERSION_3 = 0x20080522
# Bound by `api`: libc's functions (use_errno) and `syscall` through PyDLL (it keeps the GIL
# across clone, as fork does), syscall numbers, ctypes' C types and functions.
unshare_: object = None
mount_: object = None
umount2_: object = None
prctl_: object = None
setrlimit_: object = None
capset_: object = None
sethostname_: object = None
setdomainname_: object = None
syscall_: object = None
pysyscall_: object = None
SYSNO: dict[str, int] = {}
c_int = c_long = c_ulong = c_uint32 = c_uint64 = c_char = c_ushort = c_void_p = None
PAIR = CAPS = ARGS = TID = None
get_errno = byref = addressof = None


def _check(result: int, what: str) -> int:
    if result < 0:
        err = get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _nr(name: str) -> object:
    if name not in SYSNO:
        raise OSError(38, f"{name}: unknown syscall number")  # ENOSYS
    return c_long(SYSNO[name])


def unshare(flags: int) -> None:
    _check(unshare_(c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None):
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(mount_(enc[0], enc[1], enc[2], c_ulong(flags), enc[3]), target)


def umount2(target: str, flags: int) -> None:
    _check(umount2_(target.encode(), flags), "umount")


def renew(target: str, options: str) -> None:
    path = target.encode()
    _check(umount2_(path, _MNT_DETACH), "umount slot")
    _check(mount_(b"tmpfs", path, b"tmpfs", c_ulong(_SLOT_FLAGS), options.encode()), "mount slot")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(syscall_(_nr("pivot_root"), new_root.encode(), put_old.encode()), "pivot_root")


def sethostname(name: bytes) -> None:
    _check(sethostname_(name, len(name)), "sethostname")


def setdomainname(name: bytes) -> None:
    _check(setdomainname_(name, len(name)), "setdomainname")


def prctl(option: int, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0) -> int:
    return _check(prctl_(option, c_ulong(a2), c_ulong(a3), c_ulong(a4), c_ulong(a5)), "prctl")


def seccomp_load(program: bytes) -> None:
    if not program or len(program) % 8:
        raise ValueError("seccomp_load: not a BPF program")
    code = (c_char * len(program)).from_buffer_copy(program)
    # struct sock_fprog {unsigned short len; struct sock_filter *filter;}
    prog = (c_uint64 * 2)(len(program) // 8, addressof(code))
    _check(prctl_(_PR_SET_SECCOMP, c_ulong(_SECCOMP_MODE_FILTER), byref(prog), 0, 0), "seccomp")


def setrlimit(which: int, soft: int, hard: int) -> None:
    _check(setrlimit_(which, byref(PAIR(soft, hard))), "setrlimit")


def drop_caps() -> None:
    _check(capset_(byref(CAPS[0]), byref(CAPS[1])), "capset")


def clone(flags: int) -> int:
    z = c_long(0)
    return _check(pysyscall_(_nr("clone"), c_ulong(flags), z, z, z, z), "clone")


def clone_pid(pid: int) -> int:
    tid = TID(pid)
    args = ARGS()
    args[4] = signal.SIGCHLD  # exit_signal
    args[8], args[9] = addressof(tid), 1  # set_tid, set_tid_size
    return _check(pysyscall_(_nr("clone3"), byref(args), c_ulong(88)), "clone3")


def pidfd_getfd(pidfd: int, fd: int) -> int:
    return _check(syscall_(_nr("pidfd_getfd"), pidfd, fd, 0), "pidfd_getfd")


def landlock_deny_files() -> int:
    """Through the landlock package (ctypes too): forbid every file access."""
    import landlock

    ctypes.set_errno(0)  # landlock reads ctypes' saved errno, not each call's result
    try:
        landlock.Ruleset().apply()
    except landlock.LandlockError as e:
        raise OSError(str(e).splitlines()[0]) from None
    return 1


_API = (
    unshare, mount, umount2, renew, pivot_root, sethostname, setdomainname, prctl,
    seccomp_load, setrlimit, drop_caps, clone, clone_pid, pidfd_getfd, landlock_deny_files,
)  # fmt: skip


def api(sysno: dict[str, int]) -> types.SimpleNamespace:
    """The API's functions over libc, each with globals of their own (see the module's
    docstring); `sysno`: the numbers of clone, clone3, pivot_root and pidfd_getfd here."""
    libc = ctypes.CDLL(None, use_errno=True)
    pysyscall = ctypes.PyDLL(None, use_errno=True).syscall
    pysyscall.restype = ctypes.c_long
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    ns: dict[str, object] = {
        "__builtins__": builtins,
        "os": types.SimpleNamespace(strerror=os.strerror),
        "signal": types.SimpleNamespace(SIGCHLD=signal.SIGCHLD),
        "ctypes": types.SimpleNamespace(set_errno=ctypes.set_errno),
        **{k: v for k, v in globals().items() if k.startswith("_") and isinstance(v, int)},
        "unshare_": libc.unshare,
        "mount_": libc.mount,
        "umount2_": libc.umount2,
        "prctl_": libc.prctl,
        "setrlimit_": libc.setrlimit,
        "capset_": libc.capset,
        "sethostname_": libc.sethostname,
        "setdomainname_": libc.setdomainname,
        "syscall_": syscall,
        "pysyscall_": pysyscall,
        "SYSNO": dict(sysno),
        "PAIR": ctypes.c_ulong * 2,
        # header {version, pid}, then effective/permitted/inheritable x 2: no capability
        "CAPS": ((ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0), (ctypes.c_uint32 * 6)()),
        "ARGS": ctypes.c_uint64 * 11,  # struct clone_args
        "TID": ctypes.c_int * 1,
        "get_errno": ctypes.get_errno,
        "byref": ctypes.byref,
        "addressof": ctypes.addressof,
    }
    for name in ("c_int", "c_long", "c_ulong", "c_uint32", "c_uint64", "c_char", "c_ushort"):
        ns[name] = getattr(ctypes, name)
    for fn in (_check, _nr, *_API):
        ns[fn.__name__] = types.FunctionType(
            fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__
        )
    return types.SimpleNamespace(**{fn.__name__: ns[fn.__name__] for fn in _API})
