"""Regenerate the recorded stack texts that tests/diag/test_classify.py classifies.

    python tests/diag/recorded/record_stacks.py [KIND ...]

Each KIND starts this file again as a victim process that registers faulthandler for SIGUSR1 (all threads,
into ``<kind>.faulthandler.txt``, as the worker does), runs a heartbeat thread, and wedges inside a backward
hook of a small torch module, as an injected fault would. The recorder then takes two samples a second
apart with the runner's own code (header line + SIGUSR1), a ``py-spy dump --native`` when py-spy is
installed, and the CPU% between the samples; then kills the victim. ``segfault`` records the fatal-error
dump instead. ``collective`` runs two gloo ranks where rank 1 never joins the all_reduce.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KINDS = ("deadlock", "event", "busy", "gil-hog", "native-busy", "segfault", "collective")


def _fault(kind: str) -> None:
    if kind == "deadlock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    elif kind == "event":
        threading.Event().wait()
    elif kind == "busy":
        n = 0
        while True:
            n += 1
    elif kind == "gil-hog":
        mutex = ctypes.create_string_buffer(64)  # a zeroed pthread_mutex_t is an unlocked default mutex
        libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)
    elif kind == "native-busy":
        import torch

        a = torch.randn(2000, 2000)
        while True:
            a @ a
    elif kind == "segfault":
        ctypes.string_at(0)


def _victim(kind: str, out: str) -> None:
    import torch

    stream = open(out, "ab", buffering=0)  # noqa: SIM115 - kept open for faulthandler
    faulthandler.enable(file=stream, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True, chain=False)

    def heartbeat() -> None:
        while True:
            time.sleep(0.1)

    threading.Thread(target=heartbeat, daemon=True).start()
    if kind == "collective":
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=2)
        if rank == 1:
            time.sleep(3600)  # never joins
        dist.all_reduce(torch.ones(4))
        return
    layer = torch.nn.Linear(4, 4)
    layer.register_full_backward_pre_hook(lambda module, grad_output: _fault(kind))
    print("ready", flush=True)
    layer(torch.randn(2, 4, requires_grad=True)).sum().backward()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _record(kind: str) -> None:
    sys.path.insert(0, str(HERE.parents[2] / "src"))
    from nsa_diag.evidence import stacks

    out = HERE / f"{kind}.faulthandler.txt"
    out.unlink(missing_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0"}
    procs = [subprocess.Popen([sys.executable, __file__, "--victim", kind, str(out)], env=env)]
    if kind == "collective":
        other = HERE / ".collective-rank1.txt"
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--victim", kind, str(other)], env={**env, "RANK": "1"}
            )
        )
    try:
        time.sleep(6.0)
        pid = procs[0].pid
        if kind == "segfault":
            return
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        stacks.request_sample(pid, out, 1)
        time.sleep(1.0)
        stacks.request_sample(pid, out, 2)
        cpu = 100 * (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        time.sleep(0.3)
        taken = stacks.pyspy_dump(pid, HERE / f"{kind}.pyspy.txt")
        meta = {"cpu_percent": round(cpu, 1), "pyspy": taken.get("taken", False)}
        (HERE / f"{kind}.meta.json").write_text(json.dumps(meta) + "\n")
        print(kind, meta)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        (HERE / ".collective-rank1.txt").unlink(missing_ok=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--victim"]:
        _victim(sys.argv[2], sys.argv[3])
    else:
        for name in sys.argv[1:] or KINDS:
            _record(name)
