"""Evidence from a live process tree that nsa-diag did not start (`nsa-diag attach PID`), taken without
stopping or changing it.

For the process and its descendants (psutil), `observe_tree` takes ``rounds`` rounds ``interval`` seconds
apart of ``/proc`` state, wait channel, CPU time and I/O bytes (`nsa_diag.evidence.procfs`) and of the
probe's beacon where the process has the probe (`nsa_diag.evidence.probefiles`), and stops early when the
caller's ``until`` says the rounds so far settle it (attach: work was seen). Stack samples come at the first
two rounds, then every `DUMP_EVERY_S` seconds and at the last round: a faulthandler dump from each process
that handles SIGUSR1, a ``py-spy dump`` (Python frames) of each other Python process when py-spy is on
PATH. At the end one ``py-spy dump --native`` per Python process (`PYSPY_MORE` more of one that used the
CPU: C code that computes shows different functions across them), the probe's ``at_hang.json`` where a
watchdog left one, and NVML's per-process GPU memory and utilisation. ptrace refused once is refused for
all: py-spy is not tried again, and the advice (`pyspy_advice`) is said once for the tree.

Signals: SIGUSR1's default action terminates a process, so it goes only to a Python process whose
``/proc/<pid>/status`` ``SigCgt`` mask says it catches SIGUSR1 (its own ``faulthandler.register``, or the
probe's), and the mask is read again just before each signal. A probe record that says its probe handles
SIGUSR1 while the kernel says nothing catches it gets no signal. ``signal=False`` sends none at all. The
handler writes where it was registered: the probe's ``stacks.txt``, the job's stderr, a file of its own.
Whatever regular file of the process grows after the signal is read back from that point (nothing is
read from a pipe or a terminal: that would take the bytes from their reader).

`check_target` refuses what attach must not look at: no such process, another user's (as root too, unless
the user asked for it: `other_user_refusal`), PID 1, a kernel thread, nsa-diag itself or one of its
ancestors, a zombie (`UsageError`, one line, exit 2).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import psutil

from nsa_diag import artifacts, redact
from nsa_diag.beacon import BeaconState
from nsa_diag.errors import UsageError
from nsa_diag.evidence import gpu, procfs, stacks
from nsa_diag.evidence.env import select_env_vars, withheld_env_vars
from nsa_diag.evidence.probefiles import ProbeInfo, ProbeInfoJson, find_probe, read_at_hang, read_probe_beacon
from nsa_diag.records import PyspyDump
from nsa_diag.wire import AtHang

SIGUSR1_BIT = 1 << (signal.SIGUSR1 - 1)
PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
DUMP_SETTLE_S = 0.5  # after a dump starts to appear, how long it may keep growing
# Stack samples (a SIGUSR1 dump, a py-spy dump) at the first two rounds, then once this long has passed
# since the last, and at the last round: over attach's default 10 s, 5 samples (0, 1, 4, 7, 10 s). Each
# dump of a job's own handler lands in its log; two a second apart show a moving frame, the later ones
# that a stuck frame stayed.
DUMP_EVERY_S = 3.0
# A process that used this much of a core (watchdog.WORK_CPU_MIN) gets PYSPY_MORE more native dumps after
# the first: C code that computes shows different functions across them, one that spins the same.
PYSPY_MORE_CPU = 20.0
PYSPY_MORE = 2
PROCESSES = "processes"  # run folder: processes/<pid>/ holds each process's evidence
PYSPY_SAMPLES = "pyspy_samples.txt"  # processes/<pid>/: the rounds' py-spy dumps of a process without handler
PTRACE_MEANING = {
    0: "any process of the same user may be traced",
    1: "only a parent may trace its descendants (or root / CAP_SYS_PTRACE)",
    2: "only root (CAP_SYS_PTRACE) may trace",
    3: "no process may be traced",
}


# --- the target ---------------------------------------------------------------------------------------


ALLOW_OTHER_USER = "--allow-other-user"


def other_user_refusal(pid: int, euid: int, owner: tuple[int, int], *, allow_other_user: bool) -> str | None:
    """Why attach, running with effective uid ``euid``, refuses ``pid`` owned by ``owner`` (its real and
    effective uid), or None. Another user's job is refused; root could look into it (send it SIGUSR1, read
    it with ptrace), but that is for the one who runs nsa-diag as root to ask for (``allow_other_user``),
    never a side effect of running as root."""
    if euid in owner:
        return None
    if euid != 0:
        return (
            f"PID {pid} belongs to another user (uid {owner[0]}): attach only to your own processes, "
            "or run nsa-diag as that user"
        )
    if allow_other_user:
        return None
    return (
        f"PID {pid} belongs to another user (uid {owner[0]}) and nsa-diag runs as root: attach would send "
        f"it SIGUSR1 and read it with ptrace; pass {ALLOW_OTHER_USER} to do so, or run nsa-diag as that user"
    )


def check_target(pid: int, *, allow_other_user: bool = False) -> None:
    """Refuse, in one line (`UsageError`), a PID that attach must not or cannot look at; another user's
    process only with ``allow_other_user``, as root (`other_user_refusal`)."""
    hint = "give the PID of your training process (e.g. from `pgrep -f train.py`)"
    if pid <= 0:
        raise UsageError(f"PID {pid} is not a process id: {hint}")
    if pid == 1:
        raise UsageError(f"PID 1 is the system's init process, not a job: {hint}")
    me = psutil.Process()
    if pid == me.pid:
        raise UsageError(f"PID {pid} is this nsa-diag process itself: {hint}")
    if pid in {p.pid for p in me.parents()}:
        raise UsageError(f"PID {pid} is an ancestor of this nsa-diag process (its shell or launcher): {hint}")
    tgid = _thread_group(pid)
    if tgid is not None and tgid != pid:  # /proc/<tid> exists for every thread, unlisted
        raise UsageError(f"PID {pid} is a thread of process {tgid}, not a process: attach {tgid}")
    try:
        proc = psutil.Process(pid)
        status, ppid = proc.status(), proc.ppid()
        if status == psutil.STATUS_ZOMBIE:  # before cmdline(), which psutil refuses for a zombie
            raise UsageError(
                f"PID {pid} has exited: a zombie its parent (PID {ppid}) has not reaped; nothing to attach to"
            )
        uids, cmdline = proc.uids(), proc.cmdline()
    except psutil.NoSuchProcess:
        raise UsageError(f"no process with PID {pid} (it may have ended): {hint}") from None
    except psutil.AccessDenied:
        raise UsageError(f"PID {pid}: not permitted to read it (another user's process?)") from None
    refusal = other_user_refusal(
        pid, os.geteuid(), (uids.real, uids.effective), allow_other_user=allow_other_user
    )
    if refusal is not None:
        raise UsageError(refusal)
    if not cmdline and ppid in (0, 2):
        raise UsageError(f"PID {pid} is a kernel thread, not a job: {hint}")


def _thread_group(pid: int) -> int | None:
    """The process (thread group) that the task `pid` belongs to, from /proc (Linux); None: unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def tree_pids(pid: int, children: bool = True) -> list[int]:
    """``pid`` and (with ``children``) its live descendants, parents first; never nsa-diag's own."""
    mine = os.getpid()
    try:
        found = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))] if children else [pid]
    except psutil.Error:
        found = [pid]
    return [p for p in dict.fromkeys(found) if p != mine]


# --- one process: what it is and whether it may be signalled ------------------------------------------


def _sigusr1_caught(pid: int) -> bool | None:
    """SigCgt's SIGUSR1 bit: whether ``pid`` catches SIGUSR1 now; None when /proc cannot say."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        mask = next(line.split()[1] for line in lines if line.startswith("SigCgt:"))
        return bool(int(mask, 16) & SIGUSR1_BIT)
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def _is_python(pid: int, exe: str) -> bool:
    if os.path.basename(exe).startswith(("python", "pypy")):
        return True
    try:
        with open(f"/proc/{pid}/maps", errors="replace") as f:
            return any("libpython" in line for line in f)
    except OSError:
        return False


class ProcessInfoJson(TypedDict):
    """`ProcessInfo` as attach's result.json writes it (each process's record begins with it)."""

    pid: int
    ppid: int | None
    cmdline: list[str]
    python: bool
    started: float | None
    env_vars: dict[str, str]
    env_vars_withheld: list[str]
    probe: ProbeInfoJson | None
    probe_note: str
    sigusr1_caught: bool | None
    sigusr1: str


@dataclass(frozen=True)
class ProcessInfo:
    """What a process of the tree is, read once before sampling."""

    pid: int
    ppid: int | None
    cmdline: tuple[str, ...]
    python: bool
    started: float | None  # epoch s
    env_vars: dict[str, str]  # the variables env.json records (`evidence.env`), secrets withheld
    env_vars_withheld: tuple[str, ...]
    probe: ProbeInfo | None
    probe_note: str
    sigusr1_caught: bool | None  # SigCgt's SIGUSR1 bit; None if /proc cannot say
    signal_plan: str  # why it is or is not signalled
    signalled: bool  # whether attach sends it SIGUSR1

    def to_json(self) -> ProcessInfoJson:
        return {
            "pid": self.pid, "ppid": self.ppid, "cmdline": list(self.cmdline), "python": self.python,
            "started": self.started, "env_vars": self.env_vars,
            "env_vars_withheld": list(self.env_vars_withheld),
            "probe": self.probe.to_json() if self.probe else None, "probe_note": self.probe_note,
            "sigusr1_caught": self.sigusr1_caught, "sigusr1": self.signal_plan,
        }  # fmt: skip


def _signal_plan(python: bool, caught: bool | None, probe: ProbeInfo | None, send: bool) -> tuple[bool, str]:
    """Whether to send SIGUSR1, and why (or why not)."""
    says_probe = probe is not None and probe.sigusr1 == "probe"
    if not send:
        return False, "not signalled (--no-signal)"
    if not python:
        return False, "not signalled: not a Python process"
    if caught is None:
        return False, "not signalled: /proc does not say whether it handles SIGUSR1"
    if not caught:
        contradiction = " (its probe.json says the probe handles it, the kernel says nothing does)"
        return False, (
            "not signalled: no SIGUSR1 handler (SigCgt), and SIGUSR1's default action would kill it"
            + (contradiction if says_probe else "")
        )
    if says_probe:
        return True, "SIGUSR1 to the probe's faulthandler (dumps into the probe's stacks.txt)"
    return True, "SIGUSR1 to its own handler (SigCgt says it catches SIGUSR1)"


def process_info(pid: int, send_signal: bool) -> ProcessInfo | None:
    """`ProcessInfo` of ``pid``; None when it has gone."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            ppid, cmdline, started = proc.ppid(), tuple(proc.cmdline()), proc.create_time()
            try:
                exe = proc.exe()
            except psutil.AccessDenied:
                exe = cmdline[0] if cmdline else ""
        try:
            environ = proc.environ()
        except psutil.AccessDenied:
            environ = {}
    except psutil.NoSuchProcess:
        return None
    # the files written from here on withhold its secrets (py-spy's dump heads with its command line)
    artifacts.withhold(redact.env_secret_values(environ) | redact.argv_secret_values([cmdline]))
    python = _is_python(pid, exe)
    probe, note = find_probe(pid, environ, started)
    caught = _sigusr1_caught(pid)
    signalled, plan = _signal_plan(python, caught, probe, send_signal)
    return ProcessInfo(
        pid=pid, ppid=ppid, cmdline=cmdline, python=python, started=started,
        env_vars=select_env_vars(environ), env_vars_withheld=tuple(withheld_env_vars(environ)),
        probe=probe, probe_note=note, sigusr1_caught=caught, signal_plan=plan, signalled=signalled,
    )  # fmt: skip


# --- faulthandler dumps through the handler the process registered -------------------------------------


@dataclass(frozen=True)
class OpenFile:
    """A regular file the process has open for writing: where its handler may dump."""

    fd_path: str  # /proc/<pid>/fd/<n>: reads the same file even when it was renamed or deleted
    name: str  # what the descriptor points to
    size: int


def writable_files(pid: int) -> dict[tuple[int, int], OpenFile]:
    """The regular files ``pid`` has open for writing, by (device, inode): stdout and stderr into a log,
    the probe's stacks.txt, a file of the job's own."""
    found: dict[tuple[int, int], OpenFile] = {}
    base = Path(f"/proc/{pid}/fd")
    try:
        fds = sorted(int(n) for n in os.listdir(base) if n.isdigit())
    except OSError:
        return found
    for fd in fds:
        path = base / str(fd)
        try:
            st = os.stat(path)
            flags = next(
                int(line.split()[1], 8)
                for line in (Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines())
                if line.startswith("flags:")
            )
            name = os.readlink(path)
        except (OSError, StopIteration, ValueError):
            continue
        if stat.S_ISREG(st.st_mode) and flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
            found.setdefault((st.st_dev, st.st_ino), OpenFile(str(path), name, st.st_size))
    return found


def _stderr_name(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return "unknown"


def _grown(files: dict[tuple[int, int], OpenFile]) -> dict[tuple[int, int], int]:
    sizes = {}
    for key, f in files.items():
        with contextlib.suppress(OSError):
            size = os.stat(f.fd_path).st_size
            if size > f.size:
                sizes[key] = size
    return sizes


def take_dump(pid: int) -> tuple[str | None, str]:
    """SIGUSR1 to ``pid`` (whose handler the caller has checked), and the faulthandler text it wrote into
    one of its regular files: (text or None, what happened). The SigCgt mask is read again first."""
    if not _sigusr1_caught(pid):
        return None, "not signalled: it no longer catches SIGUSR1"
    before = writable_files(pid)
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        return None, "it ended before the signal"
    deadline = time.monotonic() + stacks.DUMP_START_TIMEOUT_S
    while not _grown(before) and time.monotonic() < deadline:
        time.sleep(0.02)
    last: dict[tuple[int, int], int] = {}
    settle = time.monotonic() + DUMP_SETTLE_S
    while time.monotonic() < settle:
        now = _grown(before)
        if now and now == last:
            break
        last = now
        time.sleep(0.05)
    texts, where = [], []
    for key, size in last.items():
        f = before[key]
        try:
            with open(f.fd_path, "rb") as stream:
                stream.seek(f.size)
                text = stream.read(size - f.size).decode(errors="replace")
        except OSError:
            continue
        if stacks.parse_faulthandler(text):
            texts.append(text)
            where.append(f.name)
    if texts:
        return "".join(texts), f"dump read from {', '.join(where)}"
    return None, (
        "signalled; no dump came back in a file attach can read (its handler may write to its stderr, "
        f"{_stderr_name(pid)}, or be no faulthandler)"
    )


# --- the observation ----------------------------------------------------------------------------------


@dataclass
class Sample:
    """One round of one process: /proc (`procfs.process_snapshot`) and its probe's beacon."""

    at: float  # time.monotonic()
    wall: float  # time.time()
    proc: procfs.ProcessSnapshot
    beacon: BeaconState | None
    sched: tuple[int, int] | None = None  # main thread's ns on a CPU and ns waiting for one (schedstat)
    io_bytes: int | None = None  # read + written so far (/proc/<pid>/io)


@dataclass
class ProcessObservation:
    """Everything taken from one process of the tree."""

    info: ProcessInfo
    samples: list[Sample] = field(default_factory=list)
    dumps: list[str] = field(default_factory=list)  # faulthandler texts, one per signal that came back
    dump_notes: list[str] = field(default_factory=list)
    pyspy: PyspyDump | None = None  # the final dump's outcome; None: not tried (the process was gone)
    pyspy_text: str | None = None  # the final ``py-spy dump --native``
    pyspy_more: list[str] = field(default_factory=list)  # further native dumps of a process using the CPU
    pyspy_samples: list[str] = field(default_factory=list)  # py-spy dumps of the rounds (no handler)
    gpu: list[dict[str, Any]] = field(default_factory=list)  # NVML rows of this pid, one per GPU it uses
    at_hang: AtHang | None = None  # the probe's at_hang.json, where a watchdog left one
    no_more_dumps: bool = False  # a signal's dump did not come back: not signalled again
    file_locks: list[str] = field(default_factory=list)  # held by others, where it may wait for one

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def gone(self) -> bool:
        """It exited: no /proc entry left, or a zombie its parent has not reaped yet."""
        last = self.samples[-1].proc if self.samples else {"gone": True}
        return bool(last.get("gone")) or last.get("state") == "Z"

    def cpu_percent(self) -> float | None:
        live = [s for s in self.samples if not s.proc.get("gone")]
        if len(live) < 2:
            return None
        first, last = live[0], live[-1]
        cpu = [s.proc["utime_s"] + s.proc["stime_s"] for s in (first, last)]
        return procfs.cpu_percent(cpu[0], cpu[1], last.at - first.at)

    def runnable_percent(self) -> float | None:
        """How much of the time the main thread was on a CPU or waiting for one (100: it always wanted
        to run). Unlike CPU%, a busy loop on a loaded machine still scores high, and a blocked wait 0."""
        live = [s for s in self.samples if s.sched is not None and not s.proc.get("gone")]
        if len(live) < 2 or live[-1].at <= live[0].at:
            return None
        (run0, wait0), (run1, wait1) = live[0].sched, live[-1].sched  # type: ignore[misc]
        return round(100.0 * ((run1 - run0) + (wait1 - wait0)) / 1e9 / (live[-1].at - live[0].at), 1)

    def io_bytes(self) -> int | None:
        """Bytes read and written between the first and the last round (None where /proc did not say)."""
        values = [s.io_bytes for s in self.samples if s.io_bytes is not None and not s.proc.get("gone")]
        return max(values[-1] - values[0], 0) if len(values) >= 2 else None

    def main_threads(self) -> list[procfs.ThreadState]:
        """The main thread's record in every round it was alive."""
        found = [procfs.main_thread(s.proc) for s in self.samples if not s.proc.get("gone")]
        return [t for t in found if t is not None]

    def main_thread(self) -> procfs.ThreadState | None:
        live = [s for s in self.samples if not s.proc.get("gone")]
        return procfs.main_thread(live[-1].proc) if live else None

    def beacons(self) -> list[BeaconState]:
        return [s.beacon for s in self.samples if s.beacon is not None]


@dataclass
class TreeObservation:
    """The observation of a whole tree (`observe_tree`)."""

    root: int
    processes: list[ProcessObservation]
    started: float  # epoch s
    duration_s: float
    gpu_snapshot: dict[str, Any]
    gpu_usage: dict[str, Any]
    pyspy_installed: bool
    ptrace: PtraceFacts
    # Descendants not observed (--no-children), for what the observed ones are (a launcher of ranks)
    relatives: list[ProcessInfo] = field(default_factory=list)
    send_signal: bool = True
    pyspy_refused: bool = False  # ptrace was refused: py-spy was not tried again
    pyspy_advice: str | None = None  # what to run for stacks py-spy could not take (once for the tree)


class PtraceFacts(TypedDict, total=False):
    """kernel.yama.ptrace_scope (None where there is no Yama), what it means, and whether we are root."""

    ptrace_scope: int | None
    meaning: str | None
    root: bool


def ptrace_facts() -> PtraceFacts:
    """kernel.yama.ptrace_scope (None where there is no Yama), what it means, and whether we are root."""
    try:
        scope: int | None = int(PTRACE_SCOPE.read_text().strip())
    except (OSError, ValueError):
        scope = None
    return {
        "ptrace_scope": scope,
        "meaning": PTRACE_MEANING.get(scope, "no Yama ptrace restriction") if scope is not None else None,
        "root": os.geteuid() == 0,
    }


def ptrace_refused(why: str) -> bool:
    """Whether a py-spy failure says ptrace was not permitted."""
    return "ermission" in why or "not permitted" in why or "ptrace" in why


def pyspy_advice(pids: list[int], installed: bool, refused: bool, ptrace: PtraceFacts) -> str | None:
    """What to run when py-spy could not dump the processes ``pids`` (not installed, or ptrace not
    permitted); said once for the tree. None when neither."""
    if not pids:
        return None
    pid = pids[0]
    others = f" (and likewise for pid {', '.join(map(str, pids[1:]))})" if len(pids) > 1 else ""
    if not installed:
        scope = ptrace.get("ptrace_scope")
        then = (
            f"; with kernel.yama.ptrace_scope={scope} it will need `sudo py-spy dump --pid {pid}`{others}"
            if scope and not ptrace.get("root")
            else ""
        )
        missing = "py-spy is not installed (a dependency of nsa-diag: `pip install py-spy`)"
        return (
            f"{missing}: it adds the stack of every Python process (native frames too), handler or not{then}"
        )
    if refused:
        scope = ptrace.get("ptrace_scope")
        said = f" (kernel.yama.ptrace_scope={scope}: {ptrace.get('meaning')})" if scope is not None else ""
        return (
            f"ptrace is not permitted{said}: run `sudo py-spy dump --pid {pid}`{others}, or allow tracing "
            "until the next reboot with `echo 0 | sudo tee /proc/sys/kernel/yama/ptrace_scope`; in a "
            "container, start it with `--cap-add SYS_PTRACE`"
        )
    return None


def _schedstat(pid: int) -> tuple[int, int] | None:
    """``/proc/<pid>/schedstat`` of the main thread: (ns on a CPU, ns waiting on a run queue)."""
    try:
        run, wait, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


def _round(observations: list[ProcessObservation]) -> None:
    for ob in observations:
        if ob.samples and ob.gone:
            continue
        beacon = read_probe_beacon(ob.info.probe) if ob.info.probe else None
        sched = _schedstat(ob.pid)
        snapshot = procfs.process_snapshot(ob.pid)
        io = procfs.io_bytes(ob.pid)
        ob.samples.append(Sample(time.monotonic(), time.time(), snapshot, beacon, sched, io))


def _dumps(observations: list[ProcessObservation]) -> None:
    for ob in observations:
        if ob.info.signalled and not ob.gone and not ob.no_more_dumps:
            text, note = take_dump(ob.pid)
            ob.dump_notes.append(note)
            if text:
                ob.dumps.append(text)
            else:
                ob.no_more_dumps = True  # a handler that writes where attach cannot read, or none: once


class _PySpy:
    """py-spy for one tree: whether it is on PATH, and whether ptrace was refused (then never tried again)."""

    def __init__(self) -> None:
        self.installed = stacks.pyspy_exe() is not None
        self.refused = False

    def sample(self, ob: ProcessObservation) -> None:
        """A Python-frames dump of a process whose stacks no handler gives (a round's sample)."""
        if not self.installed or self.refused or ob.gone or not ob.info.python:
            return
        if ob.info.signalled and not ob.no_more_dumps:
            return
        text, why = stacks.pyspy_sample(ob.pid)
        if text:
            ob.pyspy_samples.append(text)
        elif ptrace_refused(why):
            self.refused = True

    def final(self, ob: ProcessObservation, folder: Path) -> None:
        """The ``py-spy dump --native`` of a live Python process, into ``pyspy.txt``."""
        if not self.installed:
            ob.pyspy = PyspyDump(taken=False, why=stacks.pyspy_missing())
        elif self.refused:
            ob.pyspy = PyspyDump(
                taken=False, why="not tried: ptrace was refused for this tree (see the advice)"
            )
        else:
            ob.pyspy = stacks.pyspy_dump(ob.pid, folder / artifacts.PYSPY)
            if ob.pyspy.taken:
                ob.pyspy_text = (folder / artifacts.PYSPY).read_text(errors="replace")
            elif ptrace_refused(ob.pyspy.why or ""):
                self.refused = True
            busy = (ob.cpu_percent() or 0.0) >= PYSPY_MORE_CPU
            for _ in range(PYSPY_MORE if ob.pyspy_text and busy else 0):
                more = stacks.pyspy_dump(ob.pid, folder / artifacts.PYSPY_MORE)
                if not more.taken:
                    break
                ob.pyspy_more.append((folder / artifacts.PYSPY_MORE).read_text(errors="replace"))


def _relatives(pid: int, children: bool) -> list[ProcessInfo]:
    """Without ``children``: the descendants attach does not watch, read once for what the watched process
    is (the launcher of ranks, the parent of DataLoader workers); none are signalled."""
    if children:
        return []
    found = (process_info(p, send_signal=False) for p in tree_pids(pid, children=True)[1:])
    return [info for info in found if info is not None]


def observe_tree(
    pid: int, out_dir: Path, *, rounds: int = 2, interval_s: float = 1.0, children: bool = True,
    send_signal: bool = True, until: Callable[[TreeObservation], bool] | None = None,
) -> TreeObservation:  # fmt: skip
    """Observe ``pid`` and its descendants for ``rounds`` rounds ``interval_s`` apart, fewer when ``until``
    (asked after each round from the second on) says the rounds so far settle it; each process's files go
    to ``out_dir/processes/<pid>/``."""
    started, t0 = time.time(), time.monotonic()
    infos = [process_info(p, send_signal) for p in tree_pids(pid, children)]
    observations = [ProcessObservation(info) for info in infos if info is not None]
    relatives = _relatives(pid, children)
    spy = _PySpy()
    ptrace = ptrace_facts()

    def tree() -> TreeObservation:
        return TreeObservation(
            root=pid, processes=observations, started=started, duration_s=time.monotonic() - t0,
            gpu_snapshot={}, gpu_usage={}, pyspy_installed=spy.installed, ptrace=ptrace,
            relatives=relatives, send_signal=send_signal, pyspy_refused=spy.refused,
        )  # fmt: skip

    last_dump = -DUMP_EVERY_S
    for n in range(rounds):
        round_start = time.monotonic()
        _round(observations)
        last = n == rounds - 1
        if n < 2 or last or round_start - last_dump >= DUMP_EVERY_S - interval_s / 2:
            last_dump = round_start
            _dumps(observations)
            for ob in observations:
                spy.sample(ob)
        if all(ob.gone for ob in observations) or (until is not None and n >= 1 and until(tree())):
            break
        if not last:
            time.sleep(max(0.0, t0 + (n + 1) * interval_s - time.monotonic()))
    without: list[int] = []
    for ob in observations:
        folder = out_dir / PROCESSES / str(ob.pid)
        if ob.info.python and not ob.gone:
            spy.final(ob, folder)
            if not ob.dumps and not ob.pyspy_samples and not ob.pyspy_text:
                without.append(ob.pid)
            main = ob.main_thread()
            texts = [*ob.dumps, *ob.pyspy_samples, ob.pyspy_text or ""]
            if procfs.may_wait_for_file_lock(texts, main["wchan"] if main else None):
                ob.file_locks = procfs.held_file_locks(ob.pid)
        if ob.info.probe is not None:
            ob.at_hang = read_at_hang(ob.info.probe)
    live = [ob.pid for ob in observations]
    snapshot = gpu.nvml_snapshot()
    usage = gpu.process_usage(live) if snapshot.get("available") else snapshot
    for ob in observations:
        ob.gpu = usage.get("processes", {}).get(str(ob.pid), []) if usage.get("available") else []
    write_process_files(out_dir, observations)
    result = tree()
    result.gpu_snapshot, result.gpu_usage = snapshot, usage
    result.pyspy_advice = pyspy_advice(without, spy.installed, spy.refused, ptrace)
    return result


def write_process_files(out_dir: Path, observations: list[ProcessObservation]) -> None:
    """``processes/<pid>/proc.json`` (every /proc sample), ``stacks.txt`` (the dumps, in the sample format
    `stacks.read_stacks` reads) and ``pyspy_samples.txt`` (the rounds' py-spy dumps) of each process."""
    for ob in observations:
        folder = out_dir / PROCESSES / str(ob.pid)
        artifacts.write_json(
            folder / artifacts.PROC,
            {"samples": [{"wall_time": s.wall, "io_bytes": s.io_bytes, **s.proc} for s in ob.samples]},
        )
        if ob.dumps:
            text = "".join(
                f"{stacks.SAMPLE_HEADER} {n} (SIGUSR1, read back from the process's own file)\n{dump}"
                for n, dump in enumerate(ob.dumps, 1)
            )
            artifacts.write_text(folder / artifacts.STACKS, text)
        if ob.pyspy_samples:
            text = "".join(
                f"=== py-spy sample {n} (a round's dump, Python frames)\n{dump}\n"
                for n, dump in enumerate(ob.pyspy_samples, 1)
            )
            artifacts.write_text(folder / PYSPY_SAMPLES, text)
