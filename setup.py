"""What pyproject.toml cannot say without setuptools' experimental configuration: the optional native module.

handoff_client._native (client/_native.c) copies each frame out of the shared-memory lane's ring and takes its
CRC32C in one pass. It is optional: where it cannot be built (no C compiler) the install goes on without it, and the
lane copies, then checks, in two passes (numpy, then the crc32c package), as fast as before it existed.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("handoff_client._native", ["client/_native.c"], optional=True, extra_compile_args=["-O3"]),
    ]
)
