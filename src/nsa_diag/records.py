"""The records that pass between the worker, the launchers, the executor and the readers of run folders,
declared once: what stopping a job took (`StopReport`), what a launcher notes of its job (`JobNotes`), and
the parts of ``result.json`` and of the worker's ``worker_result.json`` that were dicts: `Metrics`,
`Parity`, `NonFinite`, `Rate`, `RankDdp` (one rank's DDP report), `DdpResult` (the case's) and
`CaseEvidence`, with the smaller records they hold.

Each is a `Record`: a pydantic model whose JSON is the dict it replaced, key for key. A field is written
when it was given (to the constructor, by assignment, or by the file read back), also as null; a field
never given is left out, as the key was. So a ``result.json`` written before these records existed reads
into them and is written back equal (`tests/diag/test_records.py`). A float that is not finite (a NaN
loss) is written as null, as it was.

A record also reads like that JSON (``stop["exit_code"]``, ``"survivors" in stop``, ``stop.get("pid")``,
``stop == {"sigterm": False, "sigkill": False}``), as `nsa_diag.summary`'s records do, so that tests and
scripts written against the files read it unchanged; code reads its fields.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
)


def _finite(value: object) -> object:
    """``value`` with every float that is not finite replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


class Record(BaseModel):
    """A JSON object with declared keys: only the fields given are written (module docstring)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, validate_by_name=True, serialize_by_alias=True
    )

    @model_serializer(mode="wrap")
    def _given_fields(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        data = handler(self)
        given = {self._key(name) for name in self.model_fields_set}
        kept = {key: value for key, value in data.items() if key in given}
        return _finite(kept) if info.mode_is_json() else kept

    @classmethod
    def _key(cls, name: str) -> str:
        return cls.model_fields[name].alias or name

    def given(self) -> dict[str, Any]:
        """The fields given, by name, as they are (records stay records): to build another record from."""
        return {name: getattr(self, name) for name in self.model_fields_set}

    def add(self, other: Record) -> None:
        """Give this record the fields ``other`` was given (as dict.update), each declared here too."""
        for name in other.model_fields_set:
            setattr(self, name, getattr(other, name))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, dict):  # the JSON it reads like
            return bool(self.model_dump(mode="json") == other)
        return super().__eq__(other)

    @classmethod
    def _field(cls, key: str) -> str | None:
        """The field a JSON key names (its name, or its alias where the key is no Python name)."""
        if key in cls.model_fields:
            return key
        return next((name for name, info in cls.model_fields.items() if info.alias == key), None)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._field(key) in self.model_fields_set

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, self._field(key) or key)

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key`` where it was given, else ``default`` (dict.get)."""
        if key not in self:
            return default
        return self[key]


# --- stopping a job ----------------------------------------------------------------------------------


class StopReport(Record):
    """What stopping a job took (``evidence.stop`` of result.json): the signals sent, its exit status and
    what survived (nothing should). ``{"started": false}`` alone when nothing was started. Each way of
    stopping writes its own fields: a worker's process group (sigterm, sigkill, unreaped, exit_code,
    survivors), torchrun and its ranks (also rank_pids), a watched command's tree (also signalled) or the
    pids `watch --keep-alive` left running (kept_alive, exit_code); one rank's part of a ddp stop holds its
    exit_code and pid. The executor adds the pids it swept by the case's marker afterwards (swept)."""

    started: bool = True  # False: nothing was started, so nothing was stopped
    sigterm: bool = False
    sigkill: bool = False
    signalled: list[int] = []  # a watched command: the pids SIGTERM went to besides its process group
    unreaped: int | None = None  # the pid that was not reaped within 5 s of the SIGKILL
    exit_code: int | None = None
    rank_pids: list[int] = []  # torchrun: the ranks' pids, signalled with torchrun's session
    survivors: list[int] = []  # pids still alive after the SIGKILL
    kept_alive: list[int] = []  # watch --keep-alive: the pids left running on purpose
    swept: list[int] = []  # pids of the case found by its marker after the stop (left its session)
    pid: int | None = None  # one rank's part of a ddp stop: that rank's pid


# --- what the worker measured ------------------------------------------------------------------------


class PhaseSeconds(Record):
    """Seconds per phase: setup once, then one value per step (``metrics.phase_s``; ``phase_issue_s``: the
    host's time to issue forward and backward on CUDA)."""

    setup: float | None = None
    forward: list[float] = []
    backward: list[float] = []
    optimizer: list[float] = []
    check: list[float] = []  # the step's checks (reference check, non-finite re-run), left out of step_s

    def of(self, phase: str) -> list[float]:
        """The per-step values of ``phase`` (forward, backward, optimizer, check)."""
        values = getattr(self, phase, None)
        return values if isinstance(values, list) else []


class PeakMemory(Record):
    """The worker's peak memory: the CUDA caching allocator's maxima, or the process's peak RSS."""

    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    cpu_peak_rss_bytes: int | None = None

    def headline(self) -> tuple[int | None, str | None]:
        """The peak a case is summed up by and its key: CUDA max allocated, else the peak RSS."""
        for key in ("cuda_max_allocated_bytes", "cpu_peak_rss_bytes"):
            value = getattr(self, key)
            if isinstance(value, int):
                return value, key
        return None, None


class Injected(Record):
    """One injected fault and how often it fired (``metrics.injections``)."""

    inject: str  # as given: KIND[:key=value,...]
    module: str | None = None
    fired: int = 0


class Metrics(Record):
    """What the worker measured of its steps (``metrics`` of result.json): phase and step times, tokens/s
    over the timed steps (``tokens_per_s_steps``: ``2..`` when step 1, the warm-up, is left out), losses,
    gradient norms, parameters, dtype, peak memory; for fp16 the steps the GradScaler skipped, the faults
    injected and the worker's notes."""

    phase_s: PhaseSeconds | None = None
    phase_issue_s: PhaseSeconds | None = None  # CUDA: seconds to issue forward and backward
    step_s: list[float] = []
    tokens_per_s: float | None = None
    tokens_per_s_steps: str | None = None
    loss: list[float | None] = []
    grad_norm: list[float | None] = []
    params: int | None = None
    dtype: str | None = None
    peak_memory: PeakMemory | None = None
    scaler_skipped_steps: int | None = None
    injections: list[Injected] = []
    notes: list[str] = []

    def last_loss(self) -> float | None:
        return self.loss[-1] if self.loss else None


class ReducedCheck(Record):
    """The smaller size a reference check ran at, where the case's own would not fit."""

    batch: int
    seq_len: int
    layers: int | None = None
    what: str
    why: str


class Parity(Record):
    """A numeric comparison (``parity`` of result.json). ``--reference-check``: the relative errors of the
    loss and the worst gradient against the reference backends, with their bounds; ``verify``: one
    property's largest error, where, its bound and every comparison's error; either one that could not
    run: ``checked`` false and why (never a pass)."""

    # a verify property
    property: str | None = None
    precision: str | None = None
    checked: bool = True  # False: the check could not run
    why: str | None = None  # why it could not
    max_err: float | None = None
    where: str | None = None
    bound: float | None = None
    baseline: float | None = None
    errors: dict[str, float | None] = {}
    against: str | None = None  # backends: what every backend is compared with
    per_layer: dict[str, float | None] = {}  # gc: the largest error per layer ("other": outside the layers)
    layers_differ: list[int] = []
    backends: str | None = None  # gc: the backends it ran with
    split: int | None = None  # prefill: the prefix length before the decode steps
    # --reference-check
    loss_rel_err: float | None = None
    grad_rel_err_max: float | None = None
    worst_param: str | None = None
    tolerance: float | None = None
    reference: str | None = None
    baseline_loss_rel_err: float | None = None
    baseline_grad_rel_err_max: float | None = None
    reference_out_of_memory: list[str] = []
    reference_backends: dict[str, str] = {}
    reference_sized: str | None = None
    reduced: ReducedCheck | None = None
    loss_bound: float | None = None
    grad_bound: float | None = None


class NonFinite(Record):
    """Where values first went non-finite (``nonfinite`` of result.json): in our worker, the module a re-run
    of the step found them in (``where`` loss or grad); in a watched job, the loss its probe was told of
    (its value, time and pid) and, where its probe found the model's blocks, the first block whose output
    was non-finite and its step ``module_step`` (None: all ``blocks_checked`` were finite)."""

    where: str | None = None  # loss | grad
    module: str | None = None
    seen: str | None = None
    step: int | None = None
    value: str | None = None
    time: float | None = None
    pid: int | None = None
    module_step: int | None = None
    blocks_checked: int | None = None


class Rate(Record):
    """The progress of a case past its timeout (``rate`` of result.json, verdict slow): events and steps
    per second, the fraction done and the time it would still need. A watched job whose total steps are
    unknown has no fraction nor ETA: ``eta`` says why."""

    elapsed_s: float = 0.0
    steps_total: int | None = None
    events: int | None = None
    events_per_s: float = 0.0
    steps_done: int = 0
    steps_per_s: float = 0.0
    fraction_done: float | None = None
    eta_s: float | None = None
    estimated_total_s: float | None = None
    eta: str | None = None


# --- DDP ------------------------------------------------------------------------------------------------


class DdpErrorInfo(Record):
    """One of DDP's own errors, explained (`nsa_diag.analysis.ddp_errors.DdpError`)."""

    kind: str
    params: list[str] = []
    explanation: str


class Preflight(Record):
    """The ddp pre-flight: whether every rank's parameters all get a gradient (``static-graph-safe``),
    the same ones on every rank do not (``find-unused-needed``) or the ranks disagree."""

    verdict: str
    text: str
    unused: dict[str, list[str]] = {}  # by rank


class GradArrival(Record):
    """One step of one rank: how many parameters' gradients arrived, and which did not."""

    arrived: int
    missing: list[str] = []


class CollectiveCall(Record):
    """An explicit collective a rank entered on the training group (or skipped: an injected fault)."""

    group: str
    op: str
    n: int
    step: int | None = None
    skipped: bool | None = None


class TracedBucket(Record):
    """One gradient bucket of step 1 as DDP's comm hook saw it."""

    index: int
    numel: int
    dtype: str
    bytes: int
    params: int
    first_param: str | None = None
    last_param: str | None = None


class BucketTrace(Record):
    """DDP's gradient buckets of step 1 (``--trace-buckets``): each bucket as the comm hook saw it, and
    DDP's own logging data about them (torch's private API: its keys and values are torch's)."""

    traced: list[TracedBucket] = []
    logging_data: dict[str, Any] = {}


class RankDdp(Record):
    """What one rank of `nsa-diag ddp` adds to its report (``ddp`` of worker_result.json)."""

    rank: int
    world_size: int
    local_rank: int = 0
    backend: str | None = None
    grad_arrival: dict[str, GradArrival] = {}  # by step
    param_hash: dict[str, list[str | None]] = {}  # by step: every rank's hash of its parameters
    collectives: list[CollectiveCall] = []
    preflight: Preflight | None = None
    tolerated_missing: dict[str, list[str]] = {}  # by step: no gradient, tolerated by find_unused/static
    buckets: BucketTrace | None = None
    mean_loss: list[float | None] = []
    ddp_error: DdpErrorInfo | None = None
    train_collectives: int = 0


class RankVerdict(Record):
    """One rank's own verdict in a ddp case (``ddp.ranks``)."""

    verdict: str
    reason: str
    hang_kind: str | None = None
    where: str | None = None
    steps_done: int = 0
    exit_code: int | None = None
    missing_grads: list[str] = []
    hang_kind_from_stacks: str | None = None  # the kind its stacks alone gave, before its collective


class StackCluster(Record):
    """Ranks whose training threads stand at the same stack, and its innermost frame."""

    ranks: list[int]
    top: str | None = None


class DivergentFrame(Record):
    """A minority rank's first frame that differs from the majority's, and the majority's there."""

    frame: str | None = None
    majority_frame: str | None = None


class CollectiveWait(Record):
    """The collective a rank waits in (its last progress record's)."""

    group: str | None = None
    op: str | None = None
    n: int | None = None
    module: str | None = None


class CollectiveState(Record):
    """A rank's explicit collectives from its progress records: entered per group, the one it waits in."""

    entered: dict[str, int] = {}
    waiting: CollectiveWait | None = None
    skipped_at_steps: list[int | None] = []


class StackDiff(Record):
    """The ranks' stacks compared (`nsa_diag.analysis.ranks.cross_rank_diff`): clusters, the minority and
    on what basis, each minority rank's first divergent frame, and the ranks' collectives."""

    clusters: list[StackCluster] = []
    minority_ranks: list[int] = []
    basis: str = ""
    majority_ranks: list[int] = []
    first_divergent_frame: dict[str, DivergentFrame] = {}
    collectives: dict[str, CollectiveState] = {}


class FrCall(Record):
    """One collective a rank entered, from its flight recorder dump: the group's sequence number, the op,
    the sizes and dtypes of its inputs, its state as recorded, and the Python frames of the call (innermost
    first, ``name (file:line)``) with the user's own among them."""

    seq: int
    op: str
    sizes: list[Any] = []
    dtypes: list[str] = []
    state: str | None = None
    frames: list[str] = []
    site: str | None = None  # the innermost frame outside installed packages: where the user's code called

    def describe(self) -> str:
        """``#4 all_reduce [[4096]] Float``."""
        dtypes = ",".join(self.dtypes)
        return f"#{self.seq} {self.op} {self.sizes}" + (f" {dtypes}" if dtypes else "")


class FrGroup(Record):
    """One process group across the ranks' dumps (`nsa_diag.analysis.flight`): each rank's last collective
    entered and last completed (``None``: its dump does not say), the furthest collective any rank entered,
    the ranks that never entered it, the first collective the ranks called differently (a desync: each
    rank's call there), and the ranks the group blames, with why."""

    name: str
    desc: str = ""
    ranks: list[int]  # ranks whose dumps show this group
    last_entered: dict[str, FrCall] = {}  # by rank
    last_completed: dict[str, int | None] = {}  # by rank: a sequence number
    frontier: FrCall | None = None
    never_entered: list[int] = []
    desync: dict[str, FrCall] = {}  # by rank: their calls at the first collective they disagree on
    culprits: list[int] = []
    finding: str = ""


class FrAnalysis(Record):
    """What the flight recorder dumps of a job say (`nsa-diag fr`, and the dumps ddp and watch collect):
    the ranks with and without a dump, each process group, the ranks to blame (or, where every rank waits
    for another, the suspects) and one line per finding."""

    ranks: list[int]  # with a dump
    world_size: int | None = None
    missing: list[int] = []  # ranks of the job without a dump
    groups: list[FrGroup] = []
    culprits: list[int] = []
    suspects: list[int] = []  # where each rank waits for another: the ranks on the paths that differ
    findings: list[str] = []


class FrRun(Record):
    """result.json of `nsa-diag fr`: the folder read, each rank's file, what the dumps say, the exit code."""

    command: str = "fr"
    directory: str
    files: dict[str, str]  # by rank
    analysis: FrAnalysis
    exit_code: int


class FlightRecorder(Record):
    """The flight recorder's dumps: asked of each rank through its debug pipe (NCCL), the files found, and
    what they say; or why none was asked for."""

    taken: bool | None = None
    why: str | None = None
    asked: dict[str, str] = {}  # by rank
    files: dict[str, str] = {}  # by rank: the dump's path in the case folder
    analysis: FrAnalysis | None = None  # what the files say (`nsa_diag.analysis.flight`), as `nsa-diag fr`
    unread: dict[str, str] = {}  # by rank: why its file could not be read


class StragglerRank(Record):
    """A rank whose own time per step is consistently above the others' (`nsa_diag.analysis.stragglers`)."""

    rank: int
    ratio: float  # its own step time over the other ranks' median, the median over the steps compared
    slower_steps: int  # steps in which the ratio reached the threshold
    steps: int  # steps compared
    phase: str | None = None  # where its extra time is: forward, optimizer, between steps (data, logging)
    extra_s: float | None = None  # its own step time minus the others' median, median over the steps


class Stragglers(Record):
    """Each rank's own time per step against the others' (``ddp.stragglers``; a watched job's:
    ``evidence.stragglers``): the threshold, the steps
    compared, each rank's median own step time, and the ranks consistently slower."""

    threshold: float
    steps: list[int]
    own_step_s: dict[str, float]  # by rank: its step time less its wait for the others in backward
    slow: list[StragglerRank] = []
    why: str | None = None  # why no rank could be named (too few steps)

    def describe(self) -> str:
        """One line per straggler: "rank 1: 1.40x the other ranks' median step, in forward"."""
        return "; ".join(
            f"rank {s.rank}: {s.ratio:.2f}x the other ranks' median step"
            + (f", in {s.phase}" if s.phase else "")
            + f" ({s.slower_steps} of {s.steps} steps)"
            for s in self.slow
        )


class Pause(Record):
    """A stall that was only a pause (a checkpoint save, a DataLoader worker's slow batch): the watch went
    on."""

    unit: int
    at_s: float
    idle_s: float | None = None
    why: str


class RestartedHang(Record):
    """A hang of a torchrun attempt with restarts left (``--max-restarts``): its evidence taken, its ranks
    stopped by nsa-diag so that torchrun restarts them, the watch gone on (``evidence.restarted_hangs``)."""

    attempt: int  # torchrun's restart count of the attempt that hung (0: the first)
    unit: int  # the rank the others waited for (the ranks' minority, one rank), else the unit that decided
    at_s: float
    hang_kind: str | None = None
    reason: str
    stopped: list[int] = []  # the pids nsa-diag killed: that attempt's ranks and what they started


class Barrier(Record):
    """How long a node of a multi-node case waited for the others' evidence before it stopped its ranks."""

    waited_s: float | None = None  # None (absent): the node did not wait
    skipped: str | None = None
    nodes_not_ready: list[int] = []


class NodeEnd(Record):
    """How a node of a multi-node case ended, as node 0 read it (``ddp.nodes``)."""

    host: str | None = None
    outcome: str | None = None
    decider: int | None = None
    stop: StopReport | None = None
    never_reported: bool | None = None
    state: str | None = None


class DdpResult(Record):
    """The case's DDP record (``ddp`` of result.json, `nsa_diag.analysis.ranks.aggregate`): the setup, each
    rank's verdict, missing gradients per rank and their difference, the pre-flight, parameter hashes,
    buckets, DDP's own errors; at a hang the stack diff, the minority and its first divergent frames; and
    the launcher's notes (torchrun's command line, the flight recorder, a multi-node case's nodes)."""

    nproc: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    static_graph: bool | None = None
    find_unused: bool | None = None
    bucket_mb: float | None = None
    ranks: dict[str, RankVerdict] = {}
    missing_grads: dict[str, list[str]] = {}
    grad_arrival_missing: dict[str, dict[str, list[str]]] = {}  # by rank, by step
    missing_grads_diff: dict[str, list[str]] = {}
    missing_grads_on_every_rank: list[str] = []
    preflight: Preflight | None = None
    param_hash: dict[str, list[str | None]] = {}
    params_in_sync: bool | None = None
    buckets: dict[str, BucketTrace] = {}
    ddp_error: dict[str, DdpErrorInfo] = {}
    # the launcher's notes
    torchrun: list[str] = []
    host: str | None = None
    barrier: Barrier | None = None
    nodes: dict[str, NodeEnd] = {}
    flight_recorder: FlightRecorder | None = None
    pauses: list[Pause] = []
    stragglers: Stragglers | None = None
    # at a hang
    stack_diff: StackDiff | None = None
    minority_ranks: list[int] = []
    first_divergent_frame: dict[str, DivergentFrame] | None = None


class JobNotes(Record):
    """What a launcher notes of its job for the case's result (`Launcher.evidence`, at each stage: the
    job's facts, what only the launcher takes before and after the stop): torchrun's command line, a
    multi-node case's node, host, barrier and nodes (into ``ddp``); a watched command's argv, directory,
    root pid and live processes (into ``evidence``); the flight recorder's dumps and the pauses the watch
    went on after (into either)."""

    torchrun: list[str] = []
    node_rank: int | None = None
    host: str | None = None
    barrier: Barrier | None = None
    nodes: dict[str, NodeEnd] = {}
    command: list[str] = []
    cwd: str | None = None
    root_pid: int | None = None
    processes_alive: list[int] = []
    flight_recorder: FlightRecorder | None = None
    pauses: list[Pause] = []
    restarted_hangs: list[RestartedHang] = []


# --- the evidence of a case ----------------------------------------------------------------------------


class Heartbeat(Record):
    """Whether the worker's heartbeat thread ran: before the stack samples, between them, and so."""

    advancing: bool | None = None
    before_samples: bool | None = None
    between_samples: bool | None = None


class MainThread(Record):
    """The main thread's state and kernel wait channel (/proc) at the hang."""

    state: str | None = None
    wchan: str | None = None


class MemoryDump(Record):
    """Whether the worker's heartbeat thread answered the request for memory evidence at the hang."""

    written: bool
    why: str | None = None
    answer: str | None = None


class PyspyDump(Record):
    """What came of ``py-spy dump`` (`nsa_diag.evidence.stacks.pyspy_dump`)."""

    taken: bool
    native: bool | None = None
    why: str | None = None
    file: str | None = None


class GpuFiles(Record):
    """The GPU evidence files of a hang (gpu.json, nvidia-smi.txt), or why there are none."""

    available: bool
    why: str | None = None
    file: str | None = None
    nvidia_smi: str | None = None  # its file, or why it has none


class WorkSeen(Record):
    """What a unit did between progress events in the last ``window_s`` (`nsa_diag.watchdog.Work`)."""

    window_s: float
    working: bool
    signals: list[str] = []
    moves: int = 0
    allocs: int = 0
    cpu_percent: float | None = None
    io_bytes: int | None = None
    frame: str | None = None
    waits_for_batch: bool = False
    saving: bool = False
    text: str = ""


class ExecChange(Record):
    """The process runs another program than the one first seen (it exec'd)."""

    from_: str | None = Field(None, alias="from")
    into: str | None = None
    argv: list[str] = []


class Guardian(Record):
    """The case's guardian recorded it: nsa-diag ended while it ran; the pids it stopped, and when."""

    swept: list[int] = []
    at: float


class JobFacts(Record):
    """Where a case ran as a scheduler's job: its node, the scheduler's variables there, and the job as
    the submitting nsa-diag saw it (executor, cluster, id, state, nodes, log)."""

    host: str | None = None
    slurm_job_id: str | None = None
    slurm_array_job_id: str | None = None
    slurm_array_task_id: str | None = None
    submitit_local_job_id: str | None = None
    executor: str | None = None
    cluster: str | None = None
    id: str | None = None
    state: str | None = None
    nodes: str | None = None
    log: str | None = None
    log_tail: str | None = None


class ProcessRecord(Record):
    """One process of a watched job as the case ended (``evidence.processes``)."""

    label: str
    role: str | None = None
    state: str
    verdict: str | None = None
    hang_kind: str | None = None
    reason: str | None = None
    where: str | None = None
    exit_code: int | None = None


class RankException(Record):
    """The exception one rank of a watched job raised (``evidence.rank_exceptions``)."""

    type: str
    message: str
    found_by: str = ""
    ddp_error: DdpErrorInfo | None = None


class EndedAttempt(Record):
    """An attempt of a torchrun job that torchrun restarted (``evidence.restarts``): the first process that
    failed in it (its rank where its probe knew it), its exit code and the exception it raised."""

    attempt: int  # from 1
    pid: int
    rank: int | None = None
    exit_code: int
    exception: RankException | None = None
    hang: str | None = None  # it hung: nsa-diag took the evidence and stopped the ranks (`RestartedHang`)


class CaseEvidence(Record):
    """What the verdict of a case rests on (``evidence`` of result.json, `nsa_diag.results.unit_result`):
    how the watch ended and what stopping took; at a stall or timeout, what was gathered before any kill
    (CPU, heartbeat, main thread, GPU, stacks, progress, I/O, memory, py-spy, work); a ddp case's evidence
    per rank; a watched job's processes, the ranks' exceptions and minority, where it was; a scheduler's
    job facts; and how an interrupted or ended case ended."""

    outcome: str | None = None  # exited | stalled | timeout | interrupted | internal-error | ...
    stop: StopReport | None = None
    cpu_percent: float | None = None
    heartbeat: Heartbeat | None = None
    main_thread: MainThread | None = None
    gpu_utilization: float | None = None
    stack_samples: int | None = None
    progressed_during_evidence: bool | None = None
    longest_progress_gap_s: float | None = None
    io_bytes_during_evidence: int | None = None
    memory_at_hang: MemoryDump | None = None
    stack_samples_why: str | None = None
    stack_samples_written_by: list[str] = []
    heartbeat_ticks_between_samples: int | None = None
    pyspy: PyspyDump | None = None
    gpu: GpuFiles | None = None
    work: WorkSeen | None = None
    exec: ExecChange | None = None
    file_locks: list[str] = []  # held by other processes, where the stalled one waits in filelock
    activity: str | None = None  # what a unit that was not stuck was doing
    fatal_error: str | None = None
    interrupted_by: str | None = None
    state: str | None = None  # a scheduler's job that ended before its case: its state there
    traceback: str | None = None  # nsa-diag's own error
    guardian: Guardian | None = None
    job: JobFacts | None = None
    rank_of_verdict: int | None = None
    ranks: dict[str, CaseEvidence] = {}
    # a watched job: the launcher's notes, its processes, the ranks
    command: list[str] = []
    cwd: str | None = None
    root_pid: int | None = None
    processes_alive: list[int] = []
    flight_recorder: FlightRecorder | None = None
    pauses: list[Pause] = []
    stragglers: Stragglers | None = None  # the ranks' step times compared (`analysis.stragglers`)
    processes: dict[str, ProcessRecord] = {}
    rank_exceptions: dict[str, RankException] = {}  # the last attempt's, where torchrun restarted the ranks
    restarts: list[EndedAttempt] = []
    restarted_hangs: list[RestartedHang] = []
    stack_diff: StackDiff | None = None
    minority_ranks: list[int] = []
    waits_on: list[int] = []
    location: str | None = None
    stacks_file: str | None = None  # the deciding process's stacks.txt in the case folder
    stacks: list[str] = []  # interrupted: the stacks.txt files taken
