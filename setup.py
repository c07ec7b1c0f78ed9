"""Build step for the native CPU kernels (everything else lives in pyproject.toml).

``native/cpu_kernels.cc`` is compiled against the XLA FFI headers shipped in jaxlib
into ``llmeq_jax/_native_cpu*.so`` (loaded with ctypes by ``llmeq_jax/native.py``,
not imported as a Python module). A machine without a C++ compiler still installs:
the failure is printed as a warning and the package runs everything through XLA.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalNativeBuild(build_ext):
    """build_ext that adds jaxlib's FFI headers and never fails the install."""

    def build_extension(self, ext):
        try:
            import jax.ffi  # noqa: F401 - jaxlib is a build requirement (pyproject.toml)

            ext.include_dirs.append(jax.ffi.include_dir())
        except Exception:  # jax importable but ffi missing: fall back to jaxlib's layout
            try:
                import jaxlib

                ext.include_dirs.append(os.path.join(os.path.dirname(jaxlib.__file__), "include"))
            except Exception as e:
                self._warn(f"jaxlib headers not found ({e})")
                return
        try:
            super().build_extension(ext)
        except Exception as e:  # CompileError, LinkError, missing compiler, ...
            self._warn(str(e))

    # A library that failed to build must not fail the steps that copy or list it.
    def copy_extensions_to_source(self):
        try:
            super().copy_extensions_to_source()
        except Exception as e:
            self._warn(str(e))

    def get_outputs(self):
        return [p for p in super().get_outputs() if os.path.exists(p)]

    def get_output_mapping(self):
        return {k: v for k, v in super().get_output_mapping().items() if os.path.exists(v)}

    @staticmethod
    def _warn(why: str) -> None:
        print(
            f"WARNING: llmeq_jax native CPU kernels were not built ({why}); "
            "quantized matmuls will run through XLA.",
            file=sys.stderr,
        )


native = Extension(
    "llmeq_jax._native_cpu",
    sources=["native/cpu_kernels.cc"],
    depends=sorted(glob.glob("native/*.inc")),  # the parts cpu_kernels.cc includes
    language="c++",
    extra_compile_args=["-O3", "-g0", "-std=c++17", "-Wno-attributes", "-Wno-return-type",
                        # GCC 12 flags its own AVX-512 headers (_mm512_undefined_ps) as maybe-uninitialized.
                        "-Wno-maybe-uninitialized"],
)

setup(ext_modules=[native], cmdclass={"build_ext": OptionalNativeBuild})
