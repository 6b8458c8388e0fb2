"""Build hook for the one compiled piece: the fast path's publish-and-spin (protocol/_fastpage.c).

Everything else is in pyproject.toml.  The extension is optional: where no C
compiler is found, the install still succeeds and the fast path publishes and spins in Python
(slower where ranks outnumber cores; see README, "Small collectives").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gradsync.protocol._fastpage",
            sources=["protocol/_fastpage.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
