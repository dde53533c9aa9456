/* lorapop.verify._kernel: the sandbox's kernel calls, without a foreign-function interface.
 *
 * The fork server, its zygote, the inits and the jobs make these calls (namespaces, mounts,
 * seccomp, clone with a chosen pid, rlimits, capabilities, Landlock). Made through ctypes, they
 * would leave `_ctypes` loaded in every job's image, and its C types (static types the
 * interpreter never frees) would let a job call any libc function, whatever its policy hides.
 * This module defines no type: only functions, which the zygote keeps out of a job's reach.
 * Every function raises OSError on failure. `lorapop.verify.kernel_ctypes` is the same API
 * through ctypes, for where this module is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/sendfile.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef O_TMPFILE
#define O_TMPFILE (020000000 | O_DIRECTORY)
#endif
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_restrict_self 446
#endif
#define LANDLOCK_CREATE_RULESET_VERSION 1U
#define PR_SET_SECCOMP_ 22
#define SECCOMP_MODE_FILTER_ 2
#define CAP_VERSION_3 0x20080522
#define SLOT_FLAGS (MS_NOSUID | MS_NODEV | MS_NOEXEC)

/* The kernel's own layouts (uapi), spelled out: the headers that carry them clash with libc's. */
struct clone_args_ {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid,
        set_tid_size, cgroup;
};
struct sock_filter_ {
    uint16_t code;
    uint8_t jt, jf;
    uint32_t k;
};
struct sock_fprog_ {
    unsigned short len;
    struct sock_filter_ *filter;
};
struct cap_header_ {
    uint32_t version;
    int pid;
};
struct cap_data_ {
    uint32_t effective, permitted, inheritable;
};
struct landlock_ruleset_attr_ {
    uint64_t handled_access_fs;
};

static PyObject *
fail(const char *what)
{
    int err = errno;
    PyObject *msg = PyUnicode_FromFormat("%s: %s", what, strerror(err));
    if (msg != NULL) {
        PyObject *exc = PyObject_CallFunction(PyExc_OSError, "iO", err, msg);
        Py_DECREF(msg);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
    }
    return NULL;
}

PyDoc_STRVAR(unshare_doc, "unshare(flags): leave the namespaces `flags` names.");
static PyObject *
k_unshare(PyObject *self, PyObject *args)
{
    int flags;
    if (!PyArg_ParseTuple(args, "i:unshare", &flags))
        return NULL;
    if (unshare(flags) != 0)
        return fail("unshare");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mount_doc, "mount(source, target, fstype, flags, data): mount(2); None for NULL.");
static PyObject *
k_mount(PyObject *self, PyObject *args)
{
    const char *source, *target, *fstype, *data;
    unsigned long flags;
    if (!PyArg_ParseTuple(args, "zszkz:mount", &source, &target, &fstype, &flags, &data))
        return NULL;
    if (mount(source, target, fstype, flags, data) != 0)
        return fail(target);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(umount2_doc, "umount2(target, flags)");
static PyObject *
k_umount2(PyObject *self, PyObject *args)
{
    const char *target;
    int flags;
    if (!PyArg_ParseTuple(args, "si:umount2", &target, &flags))
        return NULL;
    if (umount2(target, flags) != 0)
        return fail("umount");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(renew_doc,
             "renew(target, options): a new empty tmpfs (nosuid, nodev, noexec) at `target`, "
             "the one there detached whole (its files go with it).");
static PyObject *
k_renew(PyObject *self, PyObject *args)
{
    const char *target, *options;
    if (!PyArg_ParseTuple(args, "ss:renew", &target, &options))
        return NULL;
    if (umount2(target, MNT_DETACH) != 0)
        return fail("umount slot");
    if (mount("tmpfs", target, "tmpfs", SLOT_FLAGS, options) != 0)
        return fail("mount slot");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pivot_root_doc, "pivot_root(new_root, put_old)");
static PyObject *
k_pivot_root(PyObject *self, PyObject *args)
{
    const char *new_root, *put_old;
    if (!PyArg_ParseTuple(args, "ss:pivot_root", &new_root, &put_old))
        return NULL;
    if (syscall(SYS_pivot_root, new_root, put_old) != 0)
        return fail("pivot_root");
    Py_RETURN_NONE;
}

/* sethostname and setdomainname: a name as bytes, one libc call */
static PyObject *
set_name(PyObject *args, const char *format, int (*call)(const char *, size_t), const char *what)
{
    const char *name;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, format, &name, &n))
        return NULL;
    if (call(name, (size_t)n) != 0)
        return fail(what);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sethostname_doc, "sethostname(name: bytes)");
static PyObject *
k_sethostname(PyObject *self, PyObject *args)
{
    return set_name(args, "y#:sethostname", sethostname, "sethostname");
}

PyDoc_STRVAR(setdomainname_doc, "setdomainname(name: bytes)");
static PyObject *
k_setdomainname(PyObject *self, PyObject *args)
{
    return set_name(args, "y#:setdomainname", setdomainname, "setdomainname");
}

PyDoc_STRVAR(prctl_doc, "prctl(option, arg2=0, arg3=0, arg4=0, arg5=0) -> int (integer args)");
static PyObject *
k_prctl(PyObject *self, PyObject *args)
{
    int option;
    unsigned long a2 = 0, a3 = 0, a4 = 0, a5 = 0;
    if (!PyArg_ParseTuple(args, "i|kkkk:prctl", &option, &a2, &a3, &a4, &a5))
        return NULL;
    int r = prctl(option, a2, a3, a4, a5);
    if (r < 0)
        return fail("prctl");
    return PyLong_FromLong(r);
}

PyDoc_STRVAR(seccomp_load_doc,
             "seccomp_load(program: bytes): add a seccomp filter (a BPF program, 8 bytes an "
             "instruction) to this thread's; no_new_privs must be set already.");
static PyObject *
k_seccomp_load(PyObject *self, PyObject *args)
{
    Py_buffer code;
    if (!PyArg_ParseTuple(args, "y*:seccomp_load", &code))
        return NULL;
    if (code.len == 0 || code.len % 8 != 0 || code.len / 8 > 0xFFFF) {
        PyBuffer_Release(&code);
        PyErr_SetString(PyExc_ValueError, "seccomp_load: not a BPF program");
        return NULL;
    }
    struct sock_fprog_ prog = {(unsigned short)(code.len / 8), (struct sock_filter_ *)code.buf};
    int r = prctl(PR_SET_SECCOMP_, SECCOMP_MODE_FILTER_, &prog, 0, 0);
    PyBuffer_Release(&code);
    if (r != 0)
        return fail("seccomp filter");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(setrlimit_doc, "setrlimit(resource, soft, hard)");
static PyObject *
k_setrlimit(PyObject *self, PyObject *args)
{
    int which;
    unsigned long long soft, hard;
    if (!PyArg_ParseTuple(args, "iKK:setrlimit", &which, &soft, &hard))
        return NULL;
    struct rlimit rl = {(rlim_t)soft, (rlim_t)hard};
    if (setrlimit(which, &rl) != 0)
        return fail("setrlimit");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(drop_caps_doc, "drop_caps(): give up every capability (effective, permitted, "
                            "inheritable).");
static PyObject *
k_drop_caps(PyObject *self, PyObject *unused)
{
    struct cap_header_ hdr = {CAP_VERSION_3, 0};
    struct cap_data_ data[2];
    memset(data, 0, sizeof(data));
    if (syscall(SYS_capset, &hdr, data) != 0)
        return fail("capset");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(clone_doc,
             "clone(flags) -> pid: a raw clone(2) with no new stack (as fork, but with `flags` "
             "and none of libc's or CPython's at-fork work); 0 in the child.");
static PyObject *
k_clone(PyObject *self, PyObject *args)
{
    unsigned long flags;
    if (!PyArg_ParseTuple(args, "k:clone", &flags))
        return NULL;
    long pid = syscall(SYS_clone, flags, 0, NULL, NULL, 0);
    if (pid < 0)
        return fail("clone");
    return PyLong_FromLong(pid);
}

PyDoc_STRVAR(clone_pid_doc,
             "clone_pid(pid) -> pid: a raw clone3(2) of a child with the given pid in this "
             "process's pid namespace (set_tid: needs CAP_CHECKPOINT_RESTORE there); 0 in the "
             "child.");
static PyObject *
k_clone_pid(PyObject *self, PyObject *args)
{
    int want;
    if (!PyArg_ParseTuple(args, "i:clone_pid", &want))
        return NULL;
    pid_t tid[1] = {want};
    struct clone_args_ ca;
    memset(&ca, 0, sizeof(ca));
    ca.exit_signal = SIGCHLD;
    ca.set_tid = (uint64_t)(uintptr_t)tid;
    ca.set_tid_size = 1;
    long pid = syscall(SYS_clone3, &ca, sizeof(ca));
    if (pid < 0)
        return fail("clone3");
    return PyLong_FromLong(pid);
}

PyDoc_STRVAR(pidfd_getfd_doc, "pidfd_getfd(pidfd, fd) -> a copy of another process's fd");
static PyObject *
k_pidfd_getfd(PyObject *self, PyObject *args)
{
    int pidfd, fd;
    if (!PyArg_ParseTuple(args, "ii:pidfd_getfd", &pidfd, &fd))
        return NULL;
    long r = syscall(SYS_pidfd_getfd, pidfd, fd, 0);
    if (r < 0)
        return fail("pidfd_getfd");
    return PyLong_FromLong(r);
}

PyDoc_STRVAR(landlock_deny_files_doc,
             "landlock_deny_files() -> ABI version: forbid this thread and its children every "
             "file access Landlock knows (no rule allows any); sets no_new_privs.");
static PyObject *
k_landlock_deny_files(PyObject *self, PyObject *unused)
{
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    if (abi < 1)
        return fail("landlock");
    /* execute .. make_sym (13 rights), refer (ABI 2), truncate (3), ioctl_dev (5) */
    uint64_t fs = (1ULL << 13) - 1;
    if (abi >= 2)
        fs |= 1ULL << 13;
    if (abi >= 3)
        fs |= 1ULL << 14;
    if (abi >= 5)
        fs |= 1ULL << 15;
    struct landlock_ruleset_attr_ attr = {fs};
    long fd = syscall(SYS_landlock_create_ruleset, &attr, sizeof(attr), 0);
    if (fd < 0)
        return fail("landlock ruleset");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        syscall(SYS_landlock_restrict_self, (int)fd, 0) != 0) {
        int err = errno;
        close((int)fd);
        errno = err;
        return fail("landlock restrict");
    }
    close((int)fd);
    return PyLong_FromLong(abi);
}

PyDoc_STRVAR(trim_doc, "trim(): give the C heap's free memory back to the kernel (malloc_trim).");
static PyObject *
k_trim(PyObject *self, PyObject *unused)
{
    return PyLong_FromLong(malloc_trim(0));
}

/* One job's limits for serve_slot (RLIMIT_CPU is set later, from the job's own limit). */
#define MAX_LIMITS 8
struct limits_ {
    int n;
    int which[MAX_LIMITS];
    struct rlimit value[MAX_LIMITS];
};

static int
write_all(int fd, const char *buf, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The init's side of one job, after it: forward `<exit code> <length>\n` and the result file
 * (fd 3, copied by the kernel), close 0-3 and renew the slot; -1 on any failure. */
static int
finish_job(pid_t pid, int res_w, long cap, const char *slot, const char *options)
{
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return -1;
    int code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
    if (!WIFSIGNALED(status) && code > 127)
        code = 127;
    off_t end = lseek(3, 0, SEEK_CUR);
    if (end < 0)
        return -1;
    long left = end < cap ? (long)end : cap;
    char head[64];
    int n = snprintf(head, sizeof(head), "%d %ld\n", code, left);
    if (write_all(res_w, head, (size_t)n) != 0)
        return -1;
    off_t offset = 0;
    while (left > 0) {
        ssize_t m = sendfile(res_w, 3, &offset, (size_t)left);
        if (m < 0 && errno == EINTR)
            continue;
        if (m <= 0)
            return -1; /* the result file shrank */
        left -= m;
    }
    if (syscall(SYS_close_range, 0, 3, 0) != 0)
        return -1;
    if (umount2(slot, MNT_DETACH) != 0 || mount("tmpfs", slot, "tmpfs", SLOT_FLAGS, options) != 0)
        return -1;
    return 0;
}

PyDoc_STRVAR(
    serve_slot_doc,
    "serve_slot(slot, options, cap, limits, drop_caps, job_w, last_fd) -> 0, in a job only.\n\n"
    "An init's loop over its slot's jobs, in C (no Python runs in the init between jobs, so it "
    "writes almost none of the pages it shares with its jobs): make fds 0-3 new nameless files "
    "in the slot's tmpfs (3 with 64 KiB reserved for the result), clone the job as pid 2, wait "
    "for it, forward `<exit code> <length>\\n` and at most `cap` bytes of its result to `job_w + "
    "2`, close 0-3, renew the tmpfs, and again. The init exits (70) on any failure. In the "
    "job: close fds job_w..last_fd, chroot into the slot, a process group of its own, "
    "`limits` ((resource, soft, hard), ...) and no capabilities if `drop_caps`; then return 0 "
    "(OSError when one of those fails).");
static PyObject *
k_serve_slot(PyObject *self, PyObject *args)
{
    const char *slot, *options;
    long cap;
    PyObject *limits_obj;
    int drop_caps, job_w, last_fd;
    if (!PyArg_ParseTuple(args, "sslO!pii:serve_slot", &slot, &options, &cap, &PyTuple_Type,
                          &limits_obj, &drop_caps, &job_w, &last_fd))
        return NULL;
    struct limits_ lim = {0};
    Py_ssize_t nl = PyTuple_GET_SIZE(limits_obj);
    if (nl > MAX_LIMITS) {
        PyErr_SetString(PyExc_ValueError, "serve_slot: too many limits");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nl; i++) {
        unsigned long long soft, hard;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(limits_obj, i), "iKK", &lim.which[i], &soft,
                              &hard))
            return NULL;
        lim.value[i].rlim_cur = (rlim_t)soft;
        lim.value[i].rlim_max = (rlim_t)hard;
    }
    lim.n = (int)nl;
    int res_w = job_w + 2;
    for (;;) {
        for (int want = 0; want < 4; want++)
            if (open(slot, O_TMPFILE | O_RDWR, 0600) != want)
                _exit(70);
        if (posix_fallocate(3, 0, 1 << 16) != 0)
            _exit(70);
        pid_t tid[1] = {2};
        struct clone_args_ ca;
        memset(&ca, 0, sizeof(ca));
        ca.exit_signal = SIGCHLD;
        ca.set_tid = (uint64_t)(uintptr_t)tid;
        ca.set_tid_size = 1;
        long pid = syscall(SYS_clone3, &ca, sizeof(ca));
        if (pid < 0)
            _exit(70);
        if (pid == 0)
            break;
        if (finish_job((pid_t)pid, res_w, cap, slot, options) != 0)
            _exit(70);
    }
    /* the job */
    if (syscall(SYS_close_range, job_w, last_fd, 0) != 0)
        return fail("close_range");
    if (chroot(slot) != 0 || chdir("/") != 0)
        return fail("chroot");
    if (setpgid(0, 0) != 0)
        return fail("setpgid");
    for (int i = 0; i < lim.n; i++)
        if (setrlimit(lim.which[i], &lim.value[i]) != 0)
            return fail("setrlimit");
    if (drop_caps) {
        struct cap_header_ hdr = {CAP_VERSION_3, 0};
        struct cap_data_ data[2];
        memset(data, 0, sizeof(data));
        if (syscall(SYS_capset, &hdr, data) != 0)
            return fail("capset");
    }
    return PyLong_FromLong(0);
}

static PyMethodDef methods[] = {
    {"serve_slot", k_serve_slot, METH_VARARGS, serve_slot_doc},
    {"trim", k_trim, METH_NOARGS, trim_doc},
    {"unshare", k_unshare, METH_VARARGS, unshare_doc},
    {"mount", k_mount, METH_VARARGS, mount_doc},
    {"umount2", k_umount2, METH_VARARGS, umount2_doc},
    {"renew", k_renew, METH_VARARGS, renew_doc},
    {"pivot_root", k_pivot_root, METH_VARARGS, pivot_root_doc},
    {"sethostname", k_sethostname, METH_VARARGS, sethostname_doc},
    {"setdomainname", k_setdomainname, METH_VARARGS, setdomainname_doc},
    {"prctl", k_prctl, METH_VARARGS, prctl_doc},
    {"seccomp_load", k_seccomp_load, METH_VARARGS, seccomp_load_doc},
    {"setrlimit", k_setrlimit, METH_VARARGS, setrlimit_doc},
    {"drop_caps", k_drop_caps, METH_NOARGS, drop_caps_doc},
    {"clone", k_clone, METH_VARARGS, clone_doc},
    {"clone_pid", k_clone_pid, METH_VARARGS, clone_pid_doc},
    {"pidfd_getfd", k_pidfd_getfd, METH_VARARGS, pidfd_getfd_doc},
    {"landlock_deny_files", k_landlock_deny_files, METH_NOARGS, landlock_deny_files_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lorapop.verify._kernel",
    "The sandbox's kernel calls, without a foreign-function interface (no types).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__kernel(void)
{
    return PyModule_Create(&module);
}
