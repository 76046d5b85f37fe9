"""The one thing pyproject.toml cannot say stably yet: the optional C extension.

`shardrun.aggregate._fastfold` is the C fold behind `report`, `publish` and `verify`
(shardrun/aggregate/_fast.py). It is optional: where it does not compile (no C compiler or no
Python headers), the install goes on and the pure-Python fold does the work. Everything else
about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardrun.aggregate._fastfold",
            sources=["shardrun/aggregate/_fastfold.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
        )
    ]
)
