"""The environment snapshot: the software, hardware and settings a run depends on, as a JSON-ready dict.

It is what `nsa-diag env` prints and what every run folder records as `env.json`. Each probe records the
fact or, where the fact cannot be had (no CUDA, no NVML, not a git checkout), why not, and never raises.

Environment variables: only those whose names start with one of `ENV_VAR_PREFIXES` or are one of
`ENV_VAR_NAMES` (threads, the distributed rendezvous, cuBLAS determinism) are recorded, and no other
variable; of those, one whose name says it holds a secret (`artifacts.is_secret_name`: token,
secret, key, password, credential, auth) is listed by name in ``env_vars_withheld``, its value never
recorded, so that tokens and passwords never reach an artifact.

The ``system`` section holds the OS, C library, compiler and CPU facts that `torch.utils.collect_env`
reports, read directly: its ``get_env_info()`` runs pip, lscpu, gcc, cmake and nvidia-smi in subprocesses
(0.6 s on an idle 2-core CPU machine, seconds with a large pip environment), where these take
milliseconds (one ``gcc --version``).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nsa_diag import __version__
from nsa_diag.artifacts import is_secret_name
from nsa_diag.devices import worth_asking_torch
from nsa_diag.evidence.gpu import nvml_text, with_nvml

ENV_VAR_PREFIXES = ("NSA_", "TORCH_", "NCCL_", "CUDA_", "PYTORCH_", "TRITON_", "SLURM_")
# What a distributed or slow job is debugged by: thread counts, torchrun's rendezvous and ranks, cuBLAS's
# deterministic workspace.
ENV_VAR_NAMES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "CUBLAS_WORKSPACE_CONFIG",
)  # fmt: skip

_GIT_TIMEOUT_S = 5.0
_GCC_TIMEOUT_S = 5.0


def is_recorded_name(name: str) -> bool:
    """Whether env.json records the variable `name` (its value, or its name alone for a secret)."""
    return name.startswith(ENV_VAR_PREFIXES) or name in ENV_VAR_NAMES


def select_env_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that `is_recorded_name` names, sorted by name, less those whose names say
    they hold a secret (`withheld_env_vars`)."""
    return {
        name: environ[name] for name in sorted(environ) if is_recorded_name(name) and not is_secret_name(name)
    }


def withheld_env_vars(environ: Mapping[str, str]) -> list[str]:
    """The names `select_env_vars` leaves out for holding a secret (NSA_TOKEN, TORCH_SECRET, ...), sorted."""
    return sorted(name for name in environ if is_recorded_name(name) and is_secret_name(name))


def _python() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
    }


def _platform() -> dict[str, Any]:
    return {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
    }


def _system() -> dict[str, Any]:
    """OS, C library, compiler, CPU model and Python build: collect_env's facts without its subprocesses."""
    try:
        os_name: str | None = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:  # not Linux, or no os-release
        os_name = None
    libc, libc_version = platform.libc_ver()
    build, built = platform.python_build()
    return {
        "os": os_name or f"{platform.system()} {platform.release()}",
        "libc": f"{libc}-{libc_version}" if libc else None,
        "gcc": _gcc_version(),
        "cpu_model": _cpu_model(),
        "python_build": f"{build}, {built}",
        "python_compiler": platform.python_compiler(),
    }


def _gcc_version() -> str:
    """The first line of ``gcc --version`` (Triton compiles its launchers with the system C compiler)."""
    try:
        done = subprocess.run(
            ["gcc", "--version"],
            capture_output=True,
            text=True,
            timeout=_GCC_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=True,
        )
    except FileNotFoundError:
        return "gcc is not installed"
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"gcc --version failed: {type(exc).__name__}"
    return (done.stdout.splitlines() or ["?"])[0]


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model"):  # x86; arm64 kernels say Model
                return value.strip()
    return platform.processor() or None


def _cpu_and_memory() -> dict[str, Any]:
    import psutil

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = psutil.virtual_memory()
    return {
        "cpu_count_logical": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "cpu_count_usable": usable,
        "memory_total_bytes": memory.total,
        "memory_available_bytes": memory.available,
    }


def _torch(runtime: bool) -> dict[str, Any]:
    """torch's build (its version module, read without importing torch) and, where `runtime`, its view of
    the machine (CUDA devices, cuDNN, NCCL, threads), which takes importing torch: seconds of CPU."""
    if not runtime:
        build = _torch_build()
        if build.get("version") is None:
            return build
        return {
            **build,
            "cuda_available": False,
            "cuda_why": "no GPU device node on this machine (nsa_diag.devices)",
            "devices": [],
            "runtime_why": "torch not imported: no GPU to ask about (cuDNN, NCCL, threads: `nsa-diag env`)",
        }
    try:
        import torch
    except Exception as exc:  # a broken CUDA install fails with OSError, not only ImportError
        return {"version": None, "why": f"torch cannot be imported: {type(exc).__name__}: {exc}"}

    facts: dict[str, Any] = {
        "version": torch.__version__,
        "git_version": getattr(torch.version, "git_version", None),
        "debug_build": bool(torch.version.debug),
        "num_threads": torch.get_num_threads(),
        "cuda_build": torch.version.cuda,  # None for a CPU-only build
        "hip_build": getattr(torch.version, "hip", None),
        "cuda_available": torch.cuda.is_available(),
    }
    if not facts["cuda_available"]:
        facts["cuda_why"] = (
            "torch is a CPU-only build"
            if torch.version.cuda is None
            else "no CUDA device is visible to torch"
        )
    facts["cudnn_available"] = torch.backends.cudnn.is_available()
    facts["cudnn_version"] = torch.backends.cudnn.version() if facts["cudnn_available"] else None
    facts["nccl_version"] = _nccl_version(torch)
    devices = []
    if facts["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "index": index,
                    "name": props.name,
                    "capability": f"{props.major}.{props.minor}",
                    "total_memory_bytes": props.total_memory,
                    "multiprocessors": props.multi_processor_count,
                }
            )
    facts["devices"] = devices
    return facts


def _torch_build() -> dict[str, Any]:
    """torch's version module (``torch/version.py``: constants only), read without importing torch."""
    spec = importlib.util.find_spec("torch")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    path = next((Path(f) / "version.py" for f in folders if (Path(f) / "version.py").is_file()), None)
    if path is None:
        return {"version": None, "why": "torch is not installed"}
    loaded = importlib.util.spec_from_file_location("_nsa_diag_torch_version", path)
    if loaded is None or loaded.loader is None:
        return {"version": None, "why": f"{path} cannot be read"}
    version = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(version)
    return {
        "version": version.__version__,
        "git_version": getattr(version, "git_version", None),
        "debug_build": bool(getattr(version, "debug", False)),
        "cuda_build": getattr(version, "cuda", None),
        "hip_build": getattr(version, "hip", None),
    }


def _nccl_version(torch: Any) -> str | None:
    if torch.version.cuda is None or not torch.distributed.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError, ImportError):
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return str(version)


def _triton(runtime: bool) -> dict[str, Any]:
    """Triton's version: imported where torch's runtime is asked for (`_torch`), else its package's."""
    if not runtime:
        try:
            return {"version": importlib.metadata.version("triton")}
        except importlib.metadata.PackageNotFoundError:
            return {"version": None, "why": "triton is not installed"}
    try:
        import triton
    except Exception as exc:
        return {"version": None, "why": f"triton cannot be imported: {type(exc).__name__}: {exc}"}
    return {"version": triton.__version__}


def _nvml() -> dict[str, Any]:
    """Driver and GPUs as NVML sees them, independent of torch (works while a CUDA context is wedged)."""
    return with_nvml(_nvml_facts)


def _nvml_facts(pynvml: Any) -> dict[str, Any]:
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        gpus.append(
            {
                "index": index,
                "name": nvml_text(pynvml.nvmlDeviceGetName(handle)),
                "uuid": nvml_text(pynvml.nvmlDeviceGetUUID(handle)),
                "pci_bus_id": nvml_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                "memory_total_bytes": memory.total,
                "memory_used_bytes": memory.used,
            }
        )
    return {
        "available": True,
        "driver_version": nvml_text(pynvml.nvmlSystemGetDriverVersion()),
        "cuda_driver_version": _cuda_driver_version(pynvml.nvmlSystemGetCudaDriverVersion_v2()),
        "gpus": gpus,
    }


def _cuda_driver_version(version: int) -> str:
    """NVML's integer form (12040) as a release string ("12.4")."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _git(cwd: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=True,
        )
        return done.stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
    except FileNotFoundError:
        return {"revision": None, "why": "git is not installed"}
    except subprocess.TimeoutExpired:
        return {"revision": None, "why": f"git did not answer within {_GIT_TIMEOUT_S:g} s"}
    except subprocess.CalledProcessError:
        return {"revision": None, "why": f"{cwd} is not inside a git working tree"}
    try:
        revision = git("rev-parse", "HEAD")
    except subprocess.CalledProcessError:
        return {"revision": None, "toplevel": top, "why": "the repository has no commit yet"}
    except subprocess.TimeoutExpired:
        return {"revision": None, "toplevel": top, "why": f"git did not answer within {_GIT_TIMEOUT_S:g} s"}
    try:
        dirty: bool | None = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        dirty = None
    return {"revision": revision, "toplevel": top, "dirty": dirty}


def _probe(section: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one section's probe; an unexpected failure becomes the section's `why`, never an exception."""
    try:
        return section()
    except Exception as exc:
        return {"why": f"probe failed: {type(exc).__name__}: {exc}"}


def collect_env(
    environ: Mapping[str, str] | None = None, cwd: Path | None = None, torch_runtime: bool | None = None
) -> dict[str, Any]:
    """Collect the snapshot. `environ` defaults to `os.environ` and `cwd` to the working directory;
    `torch_runtime`: whether to import torch for its view of the machine (`_torch`). None: where torch is
    imported already or a GPU could answer (`worth_asking_torch`); on a machine without a GPU device node
    CUDA cannot be available, and every nsa-diag run there would pay torch's import for facts that say
    only that. `nsa-diag env` asks for it always."""
    environ = os.environ if environ is None else environ
    runtime = worth_asking_torch() if torch_runtime is None else torch_runtime
    return {
        "nsa_diag_version": __version__,
        "collected_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": _probe(_python),
        "platform": _probe(_platform),
        "system": _probe(_system),
        "cpu_memory": _probe(_cpu_and_memory),
        "torch": _probe(lambda: _torch(runtime)),
        "triton": _probe(lambda: _triton(runtime)),
        "nvml": _probe(_nvml),
        "git": _probe(lambda: _git(cwd or Path.cwd())),
        "env_vars": select_env_vars(environ),
        "env_vars_withheld": withheld_env_vars(environ),
    }
