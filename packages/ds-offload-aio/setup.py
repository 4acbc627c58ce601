"""Build script for ds-offload-aio; the project metadata lives in pyproject.toml.

[Note: libaio is optional]
The libaio engine is compiled when the wheel is built. Without a C compiler or the libaio headers
(``apt-get install libaio-dev``) the build must still produce a working wheel: ``_BuildOrExplain``
catches the compile or link error, prints a warning and writes the reason to
``ds_offload_aio/_build_error.txt``. At run time ``ds_offload_aio._ext`` finds no extension, and
every handle uses the thread-pool backend (``os.preadv``/``os.pwritev``), warning once with that
reason. ``ds_offload_aio.backend_info()`` reports the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

REASON_FILE = "_build_error.txt"


class _BuildOrExplain(build_ext):
    """``build_ext`` that records why the extension could not be built instead of failing."""

    def run(self) -> None:
        try:
            super().run()
        except PlatformError as exc:
            self._explain(self.extensions[0], exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, CompileError, ExecError, LinkError) as exc:
            self._explain(ext, exc)
            return
        for path in self._reason_files(ext):
            path.unlink(missing_ok=True)

    def _reason_files(self, ext: Extension) -> list[Path]:
        files = [Path(self.get_ext_fullpath(ext.name)).with_name(REASON_FILE)]
        if self.editable_mode:  # the source tree is what gets imported
            files.append(Path("src/ds_offload_aio") / REASON_FILE)
        return files

    def _explain(self, ext: Extension, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}".strip()
        print(
            f"WARNING: ds-offload-aio: the libaio engine was not built ({reason}); the package "
            "uses its thread-pool backend. Install a C compiler and libaio-dev, then reinstall.",
            file=sys.stderr,
        )
        for path in self._reason_files(ext):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(reason + "\n")


setup(cffi_modules=["build_ffi.py:ffibuilder"], cmdclass={"build_ext": _BuildOrExplain})
