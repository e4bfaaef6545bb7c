"""The probe's files and variables: what a user's process under the probe (`nsa_diag.probe.runtime`) writes
and what nsa-diag reads of it (`nsa_diag.launchers.command`, `nsa_diag.evidence.probefiles`, analysis), the
beacon's own format aside (`nsa_diag.beacon`). Standard library only: a user's process imports it.
"""

from __future__ import annotations

import itertools
from typing import Any, TypedDict

PROBE_DIR_ENV = "NSA_DIAG_PROBE_DIR"
BRANCHES_ENV = "NSA_DIAG_PROBE_BRANCHES"  # "1": mark each NSA branch's backward too (`watch --branch-marks`)
PROBE_JSON = "probe.json"
NONFINITE_JSON = "nonfinite.json"
STEPS_JSONL = "steps.jsonl"
# The watchdog's files (`nsa_diag.artifacts` names them too; the probe must not import it: typer).
BEACON = "beacon.bin"
STACKS = "stacks.txt"
DUMP_REQUEST = "dump.request"
DUMP_DONE = "dump.done"
STACK_REQUEST = "stack.request"
AT_HANG_JSON = "at_hang.json"  # the heartbeat thread's answer to dump.request: memory, collectives
# Where a rank's probe writes its process group's flight recorder at a dump request (``<prefix><rank>``,
# set by watch): the recorder of a backend without NCCL's debug pipe (gloo's, with TORCH_FR_BUFFER_SIZE)
FR_PREFIX_ENV = "NSA_DIAG_FR_PREFIX"


class DdpOptions(TypedDict):
    """The DistributedDataParallel options a rank's job built its model with."""

    find_unused_parameters: bool
    static_graph: bool


class ModelFound(TypedDict):
    """The model the probe hooked: its class and where its blocks are."""

    type: str
    blocks: str


class ProbeJson(TypedDict, total=False):
    """``probe.json``: what the probe of one process knows of it, rewritten as it learns more (a rank, a
    DataLoader worker's role, DDP's parameters, its exit). Read by the launcher of a watched job
    (`nsa_diag.launchers.command`) and by attach (`nsa_diag.evidence.probefiles`)."""

    pid: int
    ppid: int
    argv: list[str]
    executable: str
    started: float
    rank: int | None
    local_rank: int | None
    world_size: int | None
    # the world size the job's own init_process_group call asked for (its world_size argument), noted
    # before the call: a group asked for more ranks than the job started waits in it for ever
    init_world_size: int
    restart_count: int | None  # torchrun's TORCHELASTIC_RESTART_COUNT: the ranks' attempt, from 0
    sigusr1: str  # probe | user
    torch: bool
    role: str | None  # launcher | dataloader-worker
    forked_from: int
    worker_id: int | None
    exit_code: int
    exited: float
    total_steps: int
    ddp_options: DdpOptions
    ddp_params: list[str]
    model: ModelFound
    torch_hooks_error: str
    loss_watch_error: str
    ddp_params_error: str
    model_hooks_error: str
    steps_error: str


class Waiting(TypedDict):
    """The collective a process's call is under way in, and its number among that op's calls."""

    op: str
    n: int


class AtHang(TypedDict, total=False):
    """``at_hang.json``: the heartbeat thread's answer to a watchdog's dump request: memory (RSS, and
    CUDA's allocator statistics: torch's keys), the step, the collectives entered per op, the one under
    way."""

    memory: dict[str, Any]
    step: int
    collectives: dict[str, int]
    waiting: Waiting | None
    # the name of each thread, by its id as faulthandler writes it ("0x00007f3a2c1fe6c0"): a stack sample
    # names no thread
    threads: dict[str, str]


class NonFiniteLoss(TypedDict, total=False):
    """``nonfinite.json``: the first non-finite loss the job told the probe of (`nsa_diag.probe.loss`, or
    the tensor ``backward()`` was called on); where the model's blocks were found and checked in its
    steps' forwards (`BlockWatch`), the first block whose output was non-finite and the step (that step's
    loss may have been finite: a NaN in a row the loss ignores reaches the weights through the gradients),
    None when all were, and how many blocks were checked."""

    where: str  # loss
    value: str
    step: int
    time: float
    seen: str
    module: str | None
    module_step: int
    blocks_checked: int


class StepTimes(TypedDict):
    """One line of ``steps.jsonl``: a step (the probe's number), when it ended (wall clock), its seconds
    (from the end of the step before; step 1 from its first event) and the part of them in each phase: forward
    (from the model's first block forward to the backward), backward (from ``Tensor.backward`` or the first
    block's backward to the optimizer: DDP's wait for the other ranks' gradients included) and the
    optimizer step. The rest is between steps (data loading, logging)."""

    step: int
    end: float
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float


def launcher_argv(argv: list[str]) -> bool:
    """Whether ``argv`` is torch's launcher (torchrun, ``python -m torch.distributed.run|launch``, or either
    file run as a script): a process that starts the ranks and waits on them, not one that trains."""
    if not argv:
        return False
    names = [a.replace("\\", "/").rsplit("/", 1)[-1] for a in argv[:2]]
    # torchrun itself, or its script run by Python (a shebang's exec: /proc's cmdline and sys.orig_argv
    # read ``python .../bin/torchrun ...``)
    if names[0] == "torchrun" or (names[0].startswith("python") and names[1:] == ["torchrun"]):
        return True
    modules = ("torch.distributed.run", "torch.distributed.launch")
    if any(a == "-m" and b in modules for a, b in itertools.pairwise(argv)):
        return True
    files = ("torch/distributed/run.py", "torch/distributed/launch.py")
    return any(a.replace("\\", "/").endswith(files) for a in argv[:3])
