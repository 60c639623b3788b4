"""Build targets of c/Makefile once per test run, shared by test workers under a file lock."""

import fcntl
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C_DIR = os.path.join(ROOT, "c")
BUILD = os.path.join(C_DIR, "build")
# the MPI compiler wrapper of the mpich wheel the test extra installs, else the system's
MPICC = shutil.which("mpicc", path=os.path.dirname(sys.executable)) or shutil.which("mpicc") or "mpicc"


def make(target: str, needs: str, **variables: str) -> str:
    """Run `make -C c TARGET` (serialised across workers) and return c/build; a failure says
    what the build `needs`."""
    with open(os.path.join(C_DIR, ".build-lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(["make", "-C", C_DIR, "-s", target, *(f"{k}={v}" for k, v in variables.items())],
                              capture_output=True, text=True)
    assert done.returncode == 0, f"make -C c {target} failed (needs {needs}):\n{done.stdout}\n{done.stderr}"
    return BUILD
