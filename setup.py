"""The sandbox's kernel calls as a C extension (`lorapop.verify._kernel`); the rest of the
project's metadata is in pyproject.toml. Optional: without a compiler the sandbox makes the same
calls through ctypes, and its isolation report says that is weaker (`native_calls`)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lorapop.verify._kernel",
            ["src/lorapop/verify/_kernel.c"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        )
    ]
)
