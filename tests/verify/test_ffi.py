"""No foreign-function interface in a job's reach: ctypes, by any route, gets the verdict an
`import ctypes` gets.

The sandbox's own kernel calls are a C extension without types (`lorapop.verify._kernel`), so
`_ctypes` is never loaded in the server, the zygote or a job (under a policy that does not
grant it). Each probe below looks for ctypes' C types by every route a job has (object's
subclasses, the collector if importable, the type and metaclass of every object reachable from
modules, frames and builtins) and then tries to use what it found: a CFuncPtr subclass on
handle 0 (RTLD_DEFAULT) calling getpid, write and syscall, and `c_char.from_address` reading
memory. Under FFI (ctypes granted) the same probes work: they would find it were it there.
Where the extension is not built, the ctypes fallback is reported (`native_calls` off),
`strict` refuses it, and the probes do reach ctypes (the weaker guarantee, stated).
"""

from __future__ import annotations

import pytest
from test_hostile import nr

from lorapop.verify import Job, Sandbox, Status
from lorapop.verify import sandbox as sandbox_module
from lorapop.verify.sandbox import SandboxError

S = Status

#: Every route to a C type a job has; `found()` maps each route to the ctypes-ish type names it
#: reached, `first(name)` is a type of that name from any route.
PROBE = """
import sys
def ctypish(t):
    mod = getattr(t, '__module__', None)
    return isinstance(t, type) and str(mod).split('.')[0] in ('ctypes', '_ctypes')
def subclasses():
    seen, stack = set(), [object, type]
    while stack:
        for s in type.__subclasses__(stack.pop()):
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return seen
def collector():
    try:
        gc = __import__('gc')
    except ImportError:
        return set()
    return {o if isinstance(o, type) else type(o) for o in gc.get_objects()}
WALK = ('__dict__', '__self__', '__func__', '__globals__', '__closure__', '__wrapped__',
        'cell_contents', '__mro__', 'f_globals', 'f_back')
def reachable(limit=200_000):
    roots = [sys.modules, vars(__builtins__) if not isinstance(__builtins__, dict) else __builtins__]
    fr = sys._getframe()
    while fr is not None:
        roots += [fr.f_globals, fr.f_locals, fr.f_code]
        fr = fr.f_back
    for c in subclasses():
        roots.append(vars(c))
    seen, types, stack = set(), set(), list(roots)
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        t = type(o)
        types.update(t.__mro__)
        types.update(type(t).__mro__)
        if isinstance(o, type):
            types.update(o.__mro__)
        if isinstance(o, dict):
            stack += list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        elif type(o) is type(sys):
            stack.append(vars(o))
        else:
            for a in WALK:
                try:
                    stack.append(getattr(o, a))
                except Exception:
                    pass
    return types
ROUTES = {'subclasses': subclasses, 'collector': collector, 'objects': reachable}
def found():
    return {route: sorted({t.__name__ for t in get() if ctypish(t)}) for route, get in ROUTES.items()}
def first(name):
    for get in ROUTES.values():
        for t in get():
            if isinstance(t, type) and t.__name__ == name:
                return t
    raise LookupError(name)
class _Lib:
    _handle = 0
    def __getattr__(self, name):
        if name.startswith('_') or name in WALK:
            raise AttributeError(name)
        class Fn(first('CFuncPtr')):
            _flags_ = 1
            _restype_ = first('c_long')
        return Fn((name, self))
"""

#: (what it tries, expr, its output where ctypes is reachable)
USES = [
    ("getpid through a CFuncPtr on handle 0", "_Lib().getpid()", "2"),
    ("write through libc", "_Lib().write(1, b'x', 1)", "1"),
    ("syscall(getpid) through libc", f"_Lib().syscall({nr('getpid')})", "2"),
    ("read memory with c_char.from_address", "first('c_char').from_address(id(b'q') + 32).value", "b'q'"),
    ("a C type through a metaclass", "type(first('c_int')).__name__", "'PyCSimpleType'"),
]  # fmt: skip
IMPORT = Job("import ctypes\ndef f():\n    return ctypes.CDLL(None).getpid()", "f()")


def _probes() -> list[Job]:
    return [Job(PROBE, "found()", entry=None, timeout_s=30.0)] + [
        Job(PROBE, expr, entry=None, timeout_s=30.0) for _, expr, _ in USES
    ]


@pytest.mark.parametrize("policy", ["azr", "benchmark"])
def test_ctypes_reached_by_no_route_gets_the_import_verdict(policy):
    with Sandbox(workers=2, timeout_s=5.0, policy=policy) as sb:
        assert sb.isolation["layers"]["native_calls"], sb.isolation
        census, *uses = sb.run(_probes())
        (imported,) = sb.run([IMPORT])
    assert census.ok and eval(census.output) == {"subclasses": [], "collector": [], "objects": []}
    assert imported.status is S.RUNTIME_ERROR and "ctypes" in imported.error
    for (what, _, _), v in zip(USES, uses, strict=True):
        assert v.status is imported.status, (what, v.status, v.error)
        assert v.error.startswith("LookupError"), (what, v.error)


def test_the_probes_work_where_ctypes_is_granted(ffi):
    """The same probes under FFI find ctypes' types by every route that reaches objects and
    call libc with them: their failure above is ctypes' absence, not a broken probe."""
    census, *uses = ffi.run(_probes())
    assert census.ok, census.error
    routes = eval(census.output)
    assert "CFuncPtr" in routes["subclasses"] and "CFuncPtr" in routes["objects"]
    assert routes["collector"] == []  # gc stays hidden under FFI
    for (what, _, want), v in zip(USES, uses, strict=True):
        assert (v.status, v.output) == (S.OK, want), (what, v.error)


@pytest.fixture
def ctypes_fallback(monkeypatch):
    """Servers started meanwhile make their kernel calls through ctypes, as where
    `lorapop.verify._kernel` is not built."""
    monkeypatch.setattr(sandbox_module, "_NATIVE_CALLS", False)


def test_the_ctypes_fallback_runs_and_is_reported_weaker(ctypes_fallback):
    with Sandbox(workers=2, timeout_s=5.0) as sb:
        info = sb.isolation
        layers = info["layers"]
        assert not layers["native_calls"]
        assert all(layers[k] for k in ("seccomp", "user_ns", "pid_ns", "fs_view", "job_tmpfs"))
        assert any("ctypes' C types stay within a job's reach" in n for n in info["notes"])
        honest = [Job("def f(x):\n    return sorted(str(x))", f"f({i})") for i in range(40)]
        det = Job("def f():\n    return list(range(3))", "f()", deterministic=True)
        verdicts = sb.run([*honest, det])
        assert [v.output for v in verdicts] == [repr(sorted(str(i))) for i in range(40)] + [
            "[0, 1, 2]"
        ]
        census, *uses = sb.run(_probes())
    # the weaker guarantee, as the report states it: ctypes' C types are within reach
    assert census.ok and "CFuncPtr" in eval(census.output)["subclasses"]
    assert (uses[0].status, uses[0].output) == (S.OK, "2")


def test_strict_refuses_the_ctypes_fallback(ctypes_fallback):
    with pytest.raises(SandboxError, match="native_calls"):
        Sandbox(workers=1, isolate="strict")


#: Modules whose C types would give a job more than computation (a foreign-function interface,
#: sockets, polling, process spawning, memory maps, rlimits, fd control): none is loaded in a
#: job's image under the shipped policies, so none of their types is in reach.
POWERFUL = ("_ctypes", "ctypes", "_socket", "socket", "select", "selectors", "_posixsubprocess",
            "subprocess", "mmap", "resource", "fcntl", "_multiprocessing", "termios", "pyseccomp",
            "landlock", "lorapop")  # fmt: skip


@pytest.mark.parametrize("policy", ["azr", "benchmark"])
def test_no_powerful_c_type_is_in_reach(policy):
    expr = f"sorted({{(str(t.__module__), t.__name__) for get in ROUTES.values() for t in get() if isinstance(t, type) and str(t.__module__).split('.')[0] in {POWERFUL!r}}})"
    with Sandbox(workers=1, timeout_s=30.0, policy=policy) as sb:
        (v,) = sb.run([Job(PROBE, expr, entry=None, timeout_s=30.0)])
    assert (v.status, v.output) == (S.OK, "[]"), v.error or v.output
