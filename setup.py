"""Build hook for the compiled pieces: the fast path's publish-and-spin and page
lock (protocol/_fastpage.c), the wire codecs of compressed collectives
(daemon/backends/_wirecodec.c) and the checkpoint writer's copy and page tables
(client/_checkpoint_memory.c).

Everything else is in pyproject.toml.  The extensions are optional: where no C
compiler is found, the install still succeeds, the fast path publishes and spins in
Python (slower where ranks outnumber cores; see docs/design.md, "The fast path for
small collectives"), numpy encodes and decodes compressed slices (slower; see
docs/compression.md) and a checkpoint save copies with torch (slower; see
docs/pytorch.md).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gradsync.protocol._fastpage",
            sources=["protocol/_fastpage.c"],
            # the page's robust mutex: libpthread where glibc is older than 2.34
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "gradsync.daemon.backends._wirecodec",
            sources=["daemon/backends/_wirecodec.c"],
            # no fused multiply-adds: every variant (avx512, avx2, baseline) and
            # numpy round each product and sum on its own, so all agree bit for bit
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        Extension(
            "gradsync.client._checkpoint_memory",
            sources=["client/_checkpoint_memory.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
