"""Build script for ds-native; the project metadata lives in pyproject.toml.

[Note: optional native build]
The C extension is an accelerator, never a requirement: when there is no C compiler or the compile
fails, ``OptionalBuildExt`` prints a warning, writes the error to ``ds_native/_build_error.txt``
next to where the extension would have gone, and lets the install finish. At run time
``ds_native._ext`` finds no extension, reads that file for the reason, and the dispatchers use the
torch reference kernels, warning once (``NativeFallbackWarning``). Installers hide build output on
success, so the file is how a user learns why the extension is missing. DeepSpeed's JIT builds at
first use were its users' largest complaint; building at install time and never failing the install
keeps both the failure and its explanation in one place.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

BUILD_ERROR_FILE = "_build_error.txt"
_BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError)


class OptionalBuildExt(build_ext):
    """``build_ext`` that reports a failed C build instead of failing the install."""

    def run(self) -> None:
        try:
            super().run()
        except PlatformError as exc:  # no usable compiler toolchain at all
            for ext in self.extensions:
                self._record_failure(ext, exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except _BUILD_ERRORS as exc:
            self._record_failure(ext, exc)
        else:
            for path in self._error_files(ext):
                path.unlink(missing_ok=True)

    def _error_files(self, ext: Extension) -> list[Path]:
        """Next to the built extension, and in the source package for editable installs."""
        paths = [Path(self.get_ext_fullpath(ext.name)).parent / BUILD_ERROR_FILE]
        if self.editable_mode:
            command = self.get_finalized_command("build_py")
            assert isinstance(command, build_py)
            package_dir = command.get_package_dir(ext.name.rpartition(".")[0])
            paths.append(Path(package_dir) / BUILD_ERROR_FILE)
        return paths

    def _record_failure(self, ext: Extension, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}".strip()
        print(
            f"WARNING: building {ext.name} failed ({reason}); ds-native installs without its C "
            "extension and uses the torch reference kernels.",
            file=sys.stderr,
        )
        for path in self._error_files(ext):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(reason + "\n")


setup(
    cffi_modules=["build_ffi.py:ffibuilder"],
    cmdclass={"build_ext": OptionalBuildExt},
)
