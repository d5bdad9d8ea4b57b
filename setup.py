"""Build driver: setup.py only configures and builds the CMake project (CMakeLists.txt).

Honours CMAKE_ARGS and CMAKE_BUILD_PARALLEL_LEVEL. The extension never links libtorch, so the
same sources build for any Python/torch pair.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
VERSION = (ROOT / "VERSION").read_text().strip()
# Runs at interpreter start from site-packages: the DeepSpeed import hook
# (deepcompile_remat/deepspeed/autoinstall.py says what it does, and DCR_AUTOINSTALL=0 how to
# turn it off).
PTH = ROOT / "deepcompile_remat" / "deepspeed" / "deepcompile_remat_autoinstall.pth"


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        ext_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_temp = Path(self.build_temp) / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={ext_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
            "-G", "Ninja",
        ]
        cmake_args += [a for a in os.environ.get("CMAKE_ARGS", "").split() if a]
        build_args = []
        if "CMAKE_BUILD_PARALLEL_LEVEL" not in os.environ:
            build_args += [f"-j{os.cpu_count() or 1}"]
        subprocess.run(["cmake", str(ROOT), *cmake_args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", *build_args], cwd=build_temp, check=True)
        # The CUDA module and its build-info file are extra outputs setuptools does not know
        # about: a wheel picks them up from ext_dir, an editable install needs them copied.
        if getattr(self, "editable_mode", False) or self.inplace:
            package_dir = ROOT / "deepcompile_remat"
            for extra in [*ext_dir.glob("_cuda*.so"), *ext_dir.glob("_cuda_build_info.json")]:
                if extra.parent.resolve() != package_dir.resolve():
                    shutil.copy2(extra, package_dir / extra.name)


class BuildPyWithPth(build_py):
    """build_py, and PTH at the top of what is installed: site-packages, not the package."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(PTH), os.path.join(self._top(), PTH.name))

    def _top(self) -> str:
        # A wheel installs build_lib; an editable wheel (PEP 660) is made of the folder
        # setuptools points install_lib at (its unpacked wheel), and build_lib is thrown away.
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def get_outputs(self, include_bytecode: bool = True) -> list:
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH.name))
        return outputs


setup(
    name="deepcompile_remat",
    version=VERSION,
    description="ZeRO-3-aware min-cut rematerialization for torch.compile",
    # The product, and beside it the measurement tools (benchmarks/dcr_bench: the
    # `deepcompile-remat` command), which the product never imports.
    packages=[*find_packages(include=["deepcompile_remat", "deepcompile_remat.*"]),
              *find_packages("benchmarks", include=["dcr_bench", "dcr_bench.*"])],
    package_dir={"dcr_bench": "benchmarks/dcr_bench"},
    ext_modules=[CMakeExtension("deepcompile_remat._C")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPyWithPth},
    python_requires=">=3.10",
    install_requires=["numpy"],
    extras_require={"test": ["pytest", "networkx"]},
    entry_points={"console_scripts": ["deepcompile-remat=dcr_bench.cli:main"]},
    zip_safe=False,
)
