"""pip install --no-build-isolation .  builds gradsync's Python package with CMake (against the
torch, pybind11 and numpy already installed for this interpreter) and installs it. On Debian's
system Python pip refuses system-wide installs (PEP 668): use `make install`, or a virtual
environment made with --system-site-packages (so that it sees Debian's torch)."""
import pathlib
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent
VERSION = re.search(r"project\(gradsync VERSION ([0-9.]+)",
                    (ROOT / "CMakeLists.txt").read_text()).group(1)


class CMakeBuild(build_ext):
    def run(self):
        build = pathlib.Path(self.build_temp).resolve() / "cmake"
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
                               "-DCMAKE_BUILD_TYPE=Release", "-DGRADSYNC_BUILD_BENCH=OFF",
                               f"-DPython3_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", str(build), "--target", "gradsync_shared", "gradsync_numpy",
                               "gradsync_torch", "gradsync_python_sources"])
        shutil.copytree(build / "python" / "gradsync", pathlib.Path(self.build_lib) / "gradsync",
                        dirs_exist_ok=True)


setup(name="gradsync", version=VERSION, description="Fast collective communication for "
      "data-parallel training: numpy API and a torch.distributed backend",
      ext_modules=[Extension("gradsync._gradsync", sources=[])],
      cmdclass={"build_ext": CMakeBuild}, zip_safe=False)
