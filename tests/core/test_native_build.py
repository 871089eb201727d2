"""The native extension as setup.py links it, under a toolchain that links libstdc++
statically (as some CUDA images' compilers do) with Python's -Bsymbolic-functions.

Such a build exported its own copy of libstdc++: its functions bound to themselves, its
data (the locale, the facet ids) to torch's shared libstdc++, and the first error message
that formats a number came out cut short here ("gather_rows: index ") and crashed the
process on a GPU machine. setup.py keeps what static archives bring in private to the
extension (``-Wl,--exclude-libs,ALL``)."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RAISE_BAD_INDEX = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("_native", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
try:
    mod.gather_rows(torch.randn(5, 3), torch.tensor([0, 7]))
except IndexError as exc:
    print(exc)
"""


def _has_static_libstdcxx() -> bool:
    cxx = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(cxx) is None:
        return False
    out = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True)
    return out.returncode == 0 and os.path.isabs(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the link flags are GNU ld's")
def test_a_statically_linked_libstdcxx_stays_private(tmp_path):
    if not _has_static_libstdcxx():
        pytest.skip("no static libstdc++ (libstdc++.a) for the C++ compiler")
    env = dict(os.environ, EMBRACE_BUILD_CUDA="0", EMBRACE_BUILD_NATIVE="1",
               LDFLAGS="-static-libstdc++ -Wl,-Bsymbolic-functions")
    build = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
         "--build-temp", str(tmp_path / "tmp")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    built = tmp_path / "lib" / "embrace_fairseq" / ("_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    assert built.exists(), build.stdout[-2000:] + build.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", RAISE_BAD_INDEX, str(built)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "gather_rows: index 7 out of range for a table of 5 rows"
