"""Create or update the project venv (.venv) for the Makefile's targets; a no-op when up to date.

    python3 tools/setup_venv.py          # runtime: torch + requirements.txt (make quickstart, docs, bench)
    python3 tools/setup_venv.py --dev    # also requirements-dev/-optimizers/-demo.txt where present (make test)

Runs with the system python3 (3.11 or newer: diffusers 0.42 needs it; with its venv module). Steps, each
skipped when done:
1. create .venv with this python3;
2. install torch with pip, which honours your pip configuration: the CPU build when no CUDA GPU is
   found (nvidia-smi), the CUDA build otherwise (on Linux, PyPI's torch wheel is the CUDA build),
   its bytecode compiled afterwards on every core;
3. install the requirement files with uv (4-7 s here against pip's 37-40 s), falling back to pip,
   and compile their bytecode at install time: uv does not by default, and where
   PYTHONDONTWRITEBYTECODE is set (CI images often set it) every new process would then compile
   diffusers, transformers and peft again from source, about 5 s each;
4. write .venv/.setup-stamp: the torch choice and a hash of each requirement file installed;
5. with --dev, Debian's chromium and chromium-driver via apt-get when missing and run as root
   (the demo's browser test), else a note that the test will be skipped.
A second run reads the stamp, finds nothing to do and returns in milliseconds.

Environment: TORCH_BUILD=cpu|cuda overrides the detection; TORCH_INDEX_URL is passed to pip as
--index-url for torch (e.g. https://download.pytorch.org/whl/cpu, the small CPU-only build, or
.../whl/cu128); SETUP_INSTALLER=pip skips uv.
"""

import sys

# Checked before anything else, so that an old Python gets this line rather than a traceback.
if sys.version_info < (3, 11):  # noqa: UP036 (this file runs under whatever python3 the user has)
    sys.stderr.write(
        "error: Python 3.11 or newer is needed (diffusers 0.42 requires it), but python3 is "
        + sys.version.split()[0]
        + "; install one (Debian/Ubuntu: apt-get install python3.11 python3.11-venv) and run"
        + " make again with PYTHON3=python3.11\n"
    )
    sys.exit(2)

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = VENV / ".setup-stamp"
TORCH = "torch==2.13.0"  # the version the tests run with; requirements.txt says torch>=2.4
UV = "uv==0.13.9"  # the installer, pinned like everything else make installs
RUNTIME = ["requirements.txt"]
# absent ones are skipped
DEV = ["requirements-dev.txt", "requirements-optimizers.txt", "requirements-demo.txt", "requirements-trackers.txt"]
VENV_MISSING = (
    "python3 cannot create a virtual environment: install python3-venv (Debian/Ubuntu: apt-get install python3-venv)"
)


def say(message):
    print(f"setup: {message}", flush=True)


def fail(message):
    """One line on stderr and exit code 2: what is wrong and what to do, never a traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def venv_python():
    return VENV / "bin" / "python"


def torch_build():
    """'cuda' when nvidia-smi lists a GPU, else 'cpu'; TORCH_BUILD overrides."""
    forced = os.environ.get("TORCH_BUILD", "").strip().lower()
    if forced in ("cpu", "cuda"):
        return forced, f"TORCH_BUILD={forced}"
    if forced:
        fail(f"TORCH_BUILD must be cpu or cuda, not {forced!r}")
    if shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            listed = None
        if listed is not None and listed.returncode == 0 and "GPU" in listed.stdout:
            return "cuda", "a CUDA GPU was found"
    return "cpu", "no CUDA GPU found"


def wanted_files(dev):
    names = RUNTIME + DEV if dev else RUNTIME
    return {name: hashlib.sha256((ROOT / name).read_bytes()).hexdigest() for name in names if (ROOT / name).exists()}


def read_stamp():
    try:
        return json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return {}


def run(command, what):
    """Run a command, its output shown; exit with one line if it fails."""
    if subprocess.run(command, cwd=ROOT).returncode != 0:
        fail(f"{what} failed (command: {' '.join(map(str, command))}); see the messages above")


def create_venv():
    try:
        import ensurepip  # noqa: F401 (Debian ships ensurepip in python3-venv, not with python3)
        import venv  # noqa: F401
    except ImportError:
        fail(VENV_MISSING)
    say(f"creating .venv with Python {sys.version.split()[0]} ({sys.executable})")
    created = subprocess.run([sys.executable, "-m", "venv", str(VENV)], capture_output=True, text=True)
    if created.returncode != 0 or not venv_python().exists():
        shutil.rmtree(VENV, ignore_errors=True)  # a half-made venv would only fail later
        fail(VENV_MISSING)


def check_venv():
    """The venv's python runs and is 3.11+; else one line saying to remove .venv."""
    try:
        probe = subprocess.run(
            [str(venv_python()), "-c", "import sys; print(sys.version_info >= (3, 11))"],
            capture_output=True,
            text=True,
        )
        ok = probe.returncode == 0 and probe.stdout.strip() == "True"
    except OSError:
        ok = False
    if not ok:
        fail(f"{VENV} is broken or older than Python 3.11: remove it (rm -rf .venv) and run make again")


def install_torch(build, reason):
    """pip installs torch and its dependencies without compiling them, then compileall compiles
    them on every core: pip compiles on one (46 s of set-up against 25 s on 2 cores here)."""
    command = [str(venv_python()), "-m", "pip", "install", "-q", "--no-compile", TORCH]
    index = os.environ.get("TORCH_INDEX_URL")
    if index:
        command += ["--index-url", index]
    say(f"installing {TORCH}, the {build.upper()} build ({reason}){' from ' + index if index else ''}")
    run(command, f"installing {TORCH}")
    site_packages = subprocess.run([str(venv_python()), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    # Failures are left as pip leaves them: a file that does not compile is one no import reads.
    subprocess.run([str(venv_python()), "-m", "compileall", "-q", "-j", "0", site_packages],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = subprocess.run(
        [str(venv_python()), "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
        capture_output=True,
        text=True,
    )
    version, _, cuda = probe.stdout.strip().partition(" ")
    has_cuda = cuda not in ("", "None")
    say(f"torch {version}: {'CUDA ' + cuda if has_cuda else 'CPU-only'} build")
    if build == "cuda" and not has_cuda:
        say("warning: a GPU was found but this torch cannot use it; for the CUDA build:")
        say("  rm -rf .venv && make quickstart TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128")
    elif build == "cpu" and has_cuda:
        say("note: this torch carries CUDA (a few GB; it runs on the CPU too); for the small CPU-only build:")
        say("  rm -rf .venv && make quickstart TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu")


def uv_command():
    """A uv to install with: on PATH, in .venv, or pip-installed into .venv (2 s); None to use pip."""
    if os.environ.get("SETUP_INSTALLER", "").lower() == "pip":
        return None
    bindir = venv_python().parent
    for candidate in (shutil.which("uv"), bindir / "uv"):
        if candidate and Path(candidate).exists():
            return str(candidate)
    installed = subprocess.run([str(venv_python()), "-m", "pip", "install", "-q", UV], cwd=ROOT)
    return str(bindir / "uv") if installed.returncode == 0 and (bindir / "uv").exists() else None


def install_requirements(names):
    files = [arg for name in names for arg in ("-r", name)]
    say(f"installing {', '.join(names)}")
    uv = uv_command()
    if uv is not None:
        # The system's certificates, as pip uses: uv's own list fails behind a TLS-inspecting proxy.
        env = {"UV_NATIVE_TLS": "1", **os.environ}
        command = [uv, "pip", "install", "-q", "--compile-bytecode", "--python", venv_python(), *files]
        if subprocess.run(command, cwd=ROOT, env=env).returncode == 0:
            return
        say("uv failed; installing with pip instead")
    run([str(venv_python()), "-m", "pip", "install", "-q", *files], f"installing {', '.join(names)}")


def install_browser():
    """The demo's browser test drives Debian's chromium and chromium-driver: installed with apt
    where this runs as root with apt-get (CI, containers); elsewhere the test says it is skipped."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return
    if not shutil.which("apt-get") or os.geteuid() != 0:
        say("no chromium/chromedriver: the browser test will be skipped (apt-get install chromium chromium-driver)")
        return
    say("installing chromium and chromium-driver with apt (the demo's browser test)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        if subprocess.run(command, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            say(f"warning: {' '.join(command)} failed; the browser test will be skipped")
            return


def setup(dev):
    started = time.monotonic()
    if dev:
        install_browser()
    build, reason = torch_build()
    files = wanted_files(dev)
    stamp = read_stamp() if venv_python().exists() else {}
    if stamp.get("torch") == [TORCH, build] and all(stamp.get("files", {}).get(n) == h for n, h in files.items()):
        return  # up to date: the second `make quickstart` starts training at once
    if not venv_python().exists():
        if VENV.exists():
            fail(f"{VENV} has no bin/python: remove it (rm -rf .venv) and run make again")
        create_venv()
    check_venv()
    if stamp.get("torch") != [TORCH, build]:
        install_torch(build, reason)
    install_requirements(list(files))
    installed = stamp.get("files", {}) if stamp.get("torch") == [TORCH, build] else {}
    STAMP.write_text(json.dumps({"torch": [TORCH, build], "files": {**installed, **files}}, indent=1) + "\n")
    say(f".venv is ready ({time.monotonic() - started:.0f} s)")


def main(argv):
    if argv not in ([], ["--dev"]):
        sys.exit(__doc__)
    # One set-up at a time (make -j, two terminals): the others wait here, then find it done.
    with open(__file__) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            setup(dev=argv == ["--dev"])
        except KeyboardInterrupt:
            sys.exit("setup: interrupted; run make again to finish")


if __name__ == "__main__":
    main(sys.argv[1:])
