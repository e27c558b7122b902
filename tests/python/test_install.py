"""The package as installed: `cmake --install` (what `make install` runs) lays out an
importable gradsync for /usr/bin/python3, and gradsync.torch refuses a torch other than the
one it was built against, saying so."""
import os
import pathlib
import shutil
import subprocess
import sys

BUILD = pathlib.Path(os.environ.get("GRADSYNC_BUILD_DIR", "../../build")).resolve()


def python(code, pythonpath, cwd):
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=pythonpath),
                          cwd=cwd, capture_output=True, text=True)


def test_an_install_imports_from_its_prefix(tmp_path):
    subprocess.run(["cmake", "--install", str(BUILD), "--prefix", str(tmp_path / "prefix")],
                   check=True, capture_output=True)
    site = next((tmp_path / "prefix").glob("lib/python3*/dist-packages"))
    code = ("import gradsync, gradsync.torch, numpy as np; c = gradsync.init(rank=0, size=1); "
            "a = np.ones(4, np.float32); c.allreduce(a); print(gradsync.__file__, a.sum(), "
            "gradsync.__version__)")
    done = python(code, str(site), tmp_path)
    assert done.returncode == 0, done.stderr
    assert str(site) in done.stdout and "4.0" in done.stdout
    version = subprocess.run([str(tmp_path / "prefix" / "bin" / "gradsync-run"), "--version"],
                             check=True, capture_output=True, text=True).stdout.split()[1]
    assert done.stdout.split()[-1] == version


def test_another_torch_is_refused_naming_both_versions(tmp_path):
    copy = tmp_path / "python"
    shutil.copytree(BUILD / "python", copy)
    info = copy / "gradsync" / "_build_info.py"
    info.write_text(info.read_text().replace("torch_version = \"", "torch_version = \"0.0.1-"))
    done = python("import gradsync.torch", str(copy), tmp_path)
    assert done.returncode != 0
    assert "built against torch 0.0.1-" in done.stderr and "this interpreter has torch" in done.stderr
