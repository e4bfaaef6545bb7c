"""GPU evidence at a hang: NVML state per GPU (``gpu.json``) and the ``nvidia-smi`` text (``nvidia-smi.txt``).

NVML is asked from the runner's process, not the worker's, so it answers while the worker's CUDA context is
wedged: a GPU at 100% utilisation under a worker blocked in ``synchronize`` is a kernel that does not
finish; 0% is a host-side wait. Without NVML (no driver, no GPU, no ``nvidia-ml-py``) or without
``nvidia-smi`` every function returns ``{"available": False, "why": ...}`` instead of raising. Each query
runs under a time limit, because a GPU that has fallen off the bus can make NVML itself hang.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

NVML_TIMEOUT_S = 10.0
NVIDIA_SMI_TIMEOUT_S = 15.0
T = TypeVar("T")


def _with_timeout(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` in a daemon thread; TimeoutError if it does not return in time (the thread is abandoned)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="nsa-diag-nvml", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def nvml_text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _query_gpu(pynvml: Any, index: int) -> dict[str, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    facts: dict[str, Any] = {"index": index}
    unsupported: list[str] = []

    def put(key: str, fn: Callable[[], Any]) -> None:
        try:
            facts[key] = fn()
        except Exception as exc:  # NVMLError_NotSupported on some boards; an older binding lacks a call
            unsupported.append(f"{key}: {type(exc).__name__}: {exc}")

    put("name", lambda: nvml_text(pynvml.nvmlDeviceGetName(handle)))
    put("uuid", lambda: nvml_text(pynvml.nvmlDeviceGetUUID(handle)))
    put("utilization_gpu_percent", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    put("utilization_memory_percent", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).memory)
    put("memory_used_bytes", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    put("memory_total_bytes", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    put("power_w", lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
    put("power_limit_w", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0)
    put("clock_sm_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    put("clock_mem_mhz", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM))
    put("clock_sm_max_mhz", lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
    put("temperature_c", lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
    put("performance_state", lambda: pynvml.nvmlDeviceGetPerformanceState(handle))
    reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    put("clocks_event_reasons", lambda: reasons(handle))  # type: ignore[misc]
    put(
        "processes",
        lambda: [
            {"pid": p.pid, "used_memory_bytes": p.usedGpuMemory}
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        ],
    )
    if unsupported:
        facts["not_available"] = unsupported
    return facts


def with_nvml(query: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """``query(pynvml)`` between NVML's init and shutdown, or ``{"available": False, "why": ...}`` where
    pynvml cannot be imported, NVML does not initialise or the query fails."""
    try:
        import pynvml
    except ImportError as exc:
        return {"available": False, "why": f"pynvml (nvidia-ml-py) cannot be imported: {exc}"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"available": False, "why": f"NVML did not initialise (no NVIDIA driver or GPU here): {exc}"}
    try:
        return query(pynvml)
    except pynvml.NVMLError as exc:
        return {"available": False, "why": f"NVML query failed: {exc}"}
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _nvml_snapshot() -> dict[str, Any]:
    return with_nvml(_snapshot)


def _snapshot(pynvml: Any) -> dict[str, Any]:
    count = pynvml.nvmlDeviceGetCount()
    if count == 0:
        return {"available": False, "why": "NVML sees no GPU"}
    return {
        "available": True,
        "driver_version": nvml_text(pynvml.nvmlSystemGetDriverVersion()),
        "gpus": [_query_gpu(pynvml, index) for index in range(count)],
    }


def nvml_snapshot(timeout_s: float = NVML_TIMEOUT_S) -> dict[str, Any]:
    """Utilisation, memory, power, clocks, temperature and compute processes of every GPU, or why not."""
    try:
        return _with_timeout(_nvml_snapshot, timeout_s)
    except TimeoutError as exc:
        return {"available": False, "why": f"NVML did not answer: {exc}"}
    except Exception as exc:  # evidence gathering never fails the case
        return {"available": False, "why": f"NVML query failed: {type(exc).__name__}: {exc}"}


def nvidia_smi(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> tuple[str | None, str | None]:
    """(``nvidia-smi`` output, None) or (None, why not)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi is not on PATH"
    try:
        done = subprocess.run(
            [exe], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi did not finish within {timeout_s:g} s"
    except OSError as exc:
        return None, f"nvidia-smi could not run: {exc}"
    if done.returncode != 0:
        return None, f"nvidia-smi exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
    return done.stdout, None


def worker_utilization(snapshot: dict[str, Any], pids: Iterable[int]) -> float | None:
    """GPU utilisation (%) that concerns the case: the busiest GPU running one of ``pids``, else the busiest
    GPU (process lists may show host pids inside a container); None without NVML."""
    if not snapshot.get("available"):
        return None
    gpus = [g for g in snapshot.get("gpus", ()) if "utilization_gpu_percent" in g]
    ours = set(pids)
    mine = [g for g in gpus if any(p.get("pid") in ours for p in g.get("processes", ()))]
    values = [float(g["utilization_gpu_percent"]) for g in (mine or gpus)]
    return max(values) if values else None


PROCESS_UTIL_WINDOW_S = 5.0  # NVML keeps per-process utilisation samples; the last few seconds are asked


def _process_usage(pids: frozenset[int]) -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        found: dict[int, list[dict[str, Any]]] = {}
        since = int((time.time() - PROCESS_UTIL_WINDOW_S) * 1e6)  # NVML samples are stamped in microseconds
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            rows: dict[int, dict[str, Any]] = {}
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid in pids:
                    rows[p.pid] = {"gpu": index, "used_memory_bytes": p.usedGpuMemory}
            try:
                samples = pynvml.nvmlDeviceGetProcessUtilization(handle, since)
            except pynvml.NVMLError:  # NotFound: no sample in the window; NotSupported on some boards
                samples = []
            for s in samples:
                if s.pid in pids:
                    row = rows.setdefault(s.pid, {"gpu": index, "used_memory_bytes": None})
                    row["sm_util_percent"] = max(row.get("sm_util_percent", 0), s.smUtil)
                    row["mem_util_percent"] = max(row.get("mem_util_percent", 0), s.memUtil)
            for pid, row in rows.items():
                found.setdefault(pid, []).append(row)
        return {"available": True, "processes": {str(pid): rows for pid, rows in sorted(found.items())}}
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def process_usage(pids: Iterable[int], timeout_s: float = NVML_TIMEOUT_S) -> dict[str, Any]:
    """GPU memory and utilisation of each of ``pids`` that uses a GPU (NVML): ``{"available": True,
    "processes": {"<pid>": [{"gpu", "used_memory_bytes", "sm_util_percent", "mem_util_percent"}]}}``, or
    ``{"available": False, "why": ...}``. Utilisation is the highest of NVML's samples of the last
    `PROCESS_UTIL_WINDOW_S` seconds; a board without per-process samples gives memory only. In a container
    NVML may list host pids, which match none of ``pids``: the per-GPU snapshot (`nvml_snapshot`) still
    says how busy each GPU is."""
    wanted = frozenset(pids)
    try:
        import pynvml  # noqa: F401
    except ImportError as exc:
        return {"available": False, "why": f"pynvml (nvidia-ml-py) cannot be imported: {exc}"}
    try:
        return _with_timeout(lambda: _process_usage(wanted), timeout_s)
    except TimeoutError as exc:
        return {"available": False, "why": f"NVML did not answer: {exc}"}
    except Exception as exc:  # evidence gathering never fails
        return {"available": False, "why": f"NVML query failed: {type(exc).__name__}: {exc}"}
