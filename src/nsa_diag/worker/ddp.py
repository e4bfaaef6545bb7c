"""One rank of `nsa-diag ddp`: ``python -m nsa_diag.worker.ddp <case_dir>``, started by torchrun per rank.

The rank works in ``<case_dir>/ranks/<rank>/`` exactly as the single-process worker works in its case folder
(``stacks.txt`` for faulthandler, ``beacon.bin``, ``progress.jsonl``, memory, ``worker_result.json``) and
sends its stdout and stderr to ``stdout.log`` / ``stderr.log`` there. On top of the training step of
`nsa_diag.worker.train.Trainer` it:

- joins the process group (gloo or NCCL, timeout longer than any watchdog stall, so that evidence is taken
  from live processes) and a gloo side group for nsa-diag's own exchanges, which never pair with the
  training group's collectives;
- pre-flight: before DDP wraps the model, one forward and backward of step 1's batch on the bare model
  finds the parameters that get a gradient; the sets of all ranks, gathered over the side group, give the
  verdict static_graph safe / find_unused needed / ranks disagree. It leaves no trace on the model
  (`untouched`), and its progress is its own phase ("pre-flight, layer 2 backward"), timed by the stall
  as a step is (the user's model runs in it: it may hang or fail there as in a step);
- wraps the model in DistributedDataParallel (static_graph, find_unused_parameters, bucket_cap_mb) and
  hooks every parameter (post-accumulate-grad) to record which gradients arrived on this rank;
- ``--trace-buckets``: a comm hook records each bucket's size, dtype and parameters at step 1, then hands
  the bucket to DDP's default all-reduce; with DDP's logging data (bucket sizes) for comparison;
- after each step: the mean loss over ranks (an all-reduce on the training group, as a training loop does
  for logging; ``skip-collective`` makes rank R skip it) and a hash of the parameters gathered over the
  side group (a silent desync between ranks -> ``mismatch``);
- DDP's own errors (a reduction not finished, a parameter marked ready twice, a graph that changed under
  static_graph) become one line naming the parameters and the fix.

The rank exits 0 whenever it has written its result, whatever the verdict: torchrun stops every other rank
as soon as one exits non-zero, and they must be able to write theirs. A crash (signal) still exits non-zero.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import hashlib
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nsa_diag import artifacts
from nsa_diag.analysis.ddp_errors import explain_ddp_error
from nsa_diag.artifacts import rank_dir
from nsa_diag.probe.runtime import flight_recorder_dump
from nsa_diag.records import BucketTrace, CollectiveCall, GradArrival, Preflight, RankDdp, TracedBucket
from nsa_diag.spec import PRE_FLIGHT, TRAIN_GROUP, pg_timeout_s
from nsa_diag.worker import agent, inject, tether
from nsa_diag.worker.contract import build_model
from nsa_diag.worker.outcome import CaseFailed, Outcome
from nsa_diag.worker.probes import Heartbeat, MemoryRecorder, Progress
from nsa_diag.worker.train import Trainer, resolve_device

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nsa_diag.spec import CaseSpec

USAGE = (
    "usage: torchrun ... -m nsa_diag.worker.ddp <case_dir> [<spec.json>]   (default: the case folder's; a "
    "node r > 0 of a multi-node case passes its own, nodes/<r>/spec.json)"
)
SIDE_GROUP = "nsa-diag"


def preflight_verdict(unused: dict[int, list[str]]) -> Preflight:
    """From each rank's parameters without gradient in the pre-flight: static_graph safe, find_unused
    needed (the same set on every rank), or ranks disagree."""
    sets = {rank: frozenset(names) for rank, names in unused.items()}
    distinct = set(sets.values())
    if distinct == {frozenset()}:
        verdict = "static-graph-safe"
        text = "every parameter gets a gradient on every rank: static_graph=True is safe"
    elif len(distinct) == 1:
        (names,) = distinct
        verdict = "find-unused-needed"
        text = (
            f"{len(names)} parameter(s) get no gradient on every rank ({', '.join(sorted(names)[:3])}"
            + (" ..." if len(names) > 3 else "")
            + "): find_unused_parameters=True is needed (static_graph=True also works if the set never "
            "changes)"
        )
    else:
        verdict = "ranks-disagree"
        union = frozenset().union(*distinct)
        parts = [
            f"rank {rank}: {len(names)} without gradient"
            + (f" ({', '.join(sorted(names)[:2])})" if names else "")
            for rank, names in sorted(sets.items())
        ]
        text = (
            f"ranks disagree on the parameters that get a gradient ({len(union)} differ; "
            + "; ".join(parts)
            + "): DDP with find_unused_parameters=True is needed, static_graph is not safe"
        )
    return Preflight(verdict=verdict, text=text, unused={str(r): sorted(n) for r, n in sets.items()})


@contextlib.contextmanager
def untouched(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run the body on ``model`` and leave no trace of it: each parameter and buffer is the same tensor
    with the same values again (one reassigned in ``forward`` is put back), every gradient is what it was,
    and the random number generators (torch's on the CPU and on ``device``, Python's, NumPy's where loaded)
    are where they were. Plain Python attributes the model changes on itself are not restored."""
    import torch

    saved: list[tuple[nn.Module, str, torch.Tensor]] = []
    values: dict[int, torch.Tensor] = {}  # one copy of a tensor two modules share
    grads: dict[int, torch.Tensor | None] = {}
    for module in model.modules():
        for name, tensor in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
            saved.append((module, name, tensor))
            values.setdefault(id(tensor), tensor.detach().clone())
            if isinstance(tensor, torch.nn.Parameter):
                grads[id(tensor)] = tensor.grad
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    python_rng = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_rng = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, tensor in saved:
                tensor.copy_(values[id(tensor)])
                if getattr(module, name) is not tensor:
                    setattr(module, name, tensor)
        for _, _, tensor in saved:
            if id(tensor) in grads:
                tensor.grad = grads[id(tensor)]
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)


def param_hash(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in named order (fp32 on the CPU): equal on ranks in sync."""
    import torch

    digest = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class DdpTrainer(Trainer):
    """`Trainer` on one rank of a DDP job (see the module docstring for what it adds)."""

    def __init__(self, spec: CaseSpec, case_dir: Path, progress: Progress, memory: MemoryRecorder) -> None:
        super().__init__(spec, case_dir, progress, memory)
        assert spec.ddp is not None
        self.ddp_spec = spec.ddp
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.ddp_model: nn.Module | None = None
        self.side: Any = None
        self.arrived: set[str] = set()
        self.train_collectives = 0  # explicit collectives entered on the training group
        self.report = RankDdp(rank=self.rank, world_size=self.world, local_rank=self.local_rank,
                              backend=self.ddp_spec.backend, grad_arrival={}, param_hash={},
                              collectives=[])  # fmt: skip
        self._bucket_log: list[TracedBucket] | None = [] if self.ddp_spec.trace_buckets else None

    # -------------------------------------------------------------------------------------- setup

    def _setup(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        spec, ds, progress = self.spec, self.ddp_spec, self.progress
        progress.event("setup", detail="torch imported")
        if ds.backend == "nccl":
            if not torch.cuda.is_available():
                raise CaseFailed("skipped", "backend nccl: torch sees no CUDA device on this rank")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = resolve_device(spec.device)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.local_rank)
                self.device = torch.device("cuda", self.local_rank)
        self.memory.device = self.device
        reason = inject.skip_reason(spec.inject, self.device)
        if reason:
            raise CaseFailed("skipped", reason)
        timeout = datetime.timedelta(seconds=pg_timeout_s(spec))
        dist.init_process_group(backend=ds.backend, timeout=timeout)
        self.side = dist.new_group(backend="gloo", timeout=timeout)
        progress.event("setup", detail=f"process group {ds.backend} rank {self.rank}/{self.world}")
        if spec.anomaly:
            torch.autograd.set_detect_anomaly(True)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.loaded = loaded = build_model(spec, self.device)
        self._model_built()
        self._report_progress(loaded.model)  # the pre-flight's progress too
        self._preflight()
        progress.event("setup", detail="preflight done")
        self.faults = inject.attach(spec.inject, loaded.blocks, loaded.prefix, progress, self.device)
        if ds.fsdp:  # FSDP2: the blocks, then the rest, sharded in place (parameters become DTensors)
            from torch.distributed.fsdp import fully_shard

            for block in loaded.blocks:
                fully_shard(block)
            self.ddp_model = fully_shard(loaded.model)
            self.notes.append(
                "fsdp: every block and the model fully_shard (FSDP2); the parameter hash check and the "
                "gradient arrival record are DDP's and did not run"
            )
        else:
            self.ddp_model = DistributedDataParallel(
                loaded.model,
                device_ids=[self.local_rank] if self.device.type == "cuda" else None,
                bucket_cap_mb=ds.bucket_mb,  # None: DDP's default (25)
                find_unused_parameters=ds.find_unused,
                static_graph=ds.static_graph,
            )
            for name, p in loaded.model.named_parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(lambda _p, n=name: self.arrived.add(n))
        if self._bucket_log is not None:
            self._register_bucket_trace()
        self.optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=spec.lr)
        self.scaler = torch.amp.GradScaler(self.device.type) if spec.dtype == "fp16" else None
        progress.event("setup", "end", device=str(self.device), params=self._params(), rank=self.rank)

    def _preflight(self) -> None:
        """One forward and backward of step 1's batch on the bare model (with step 1's unused-param faults,
        which shape the graph; not the faults that hang or crash): which parameters get a gradient.

        The model is left as it was (`untouched`: parameters, buffers, gradients, random state; there is no
        optimizer step), so step 1 computes what it computes without the pre-flight. Its events are in
        phase "pre-flight" (its forward "pre-flight forward", ...): the watchdog times them by the stall,
        not by setup's start-up limit, and a hang there reads "pre-flight, layer 2 backward"."""
        import torch.distributed as dist

        assert self.loaded is not None
        progress, model = self.progress, self.loaded.model
        graph_faults = [i for i in self.spec.inject if i.kind == "unused-param" and i.step == 1]
        faults = inject.attach(graph_faults, self.loaded.blocks, self.loaded.prefix, progress, self.device)
        progress.event(PRE_FLIGHT, "begin")
        with untouched(model, self.device):
            progress.step, progress.pre_flight = 1, True  # the faults fire at their step
            try:
                loss = self._loss(model, self.batch(1))
                progress.in_backward = True  # block forwards from here on are checkpoint recomputes
                loss.backward()
            finally:
                progress.step, progress.pre_flight, progress.in_backward = None, False, False
                for fault in faults:
                    if fault.handle is not None:
                        fault.handle.remove()
            idle = set(self.loaded.idle)
            unused = sorted(
                n for n, p in model.named_parameters() if p.requires_grad and p.grad is None and n not in idle
            )
        gathered: list[Any] = [None] * self.world
        progress.event(PRE_FLIGHT, "begin", module="all_gather_object", collective="all_gather_object",
                       group=SIDE_GROUP)  # fmt: skip
        dist.all_gather_object(gathered, unused, group=self.side)
        progress.event(PRE_FLIGHT, "end")
        self.report.preflight = preflight_verdict(dict(enumerate(gathered)))

    def _register_bucket_trace(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        assert self.ddp_model is not None
        assert self.loaded is not None
        names = {id(p): n for n, p in self.loaded.model.named_parameters()}
        log = self._bucket_log

        def trace(state: Any, bucket: Any) -> Any:
            if log is not None and self.progress.step == 1:
                buffer = bucket.buffer()
                params = [names.get(id(p), "?") for p in bucket.parameters()]
                log.append(TracedBucket(index=bucket.index(), numel=buffer.numel(), dtype=str(buffer.dtype),
                                        bytes=buffer.numel() * buffer.element_size(), params=len(params),
                                        first_param=params[0] if params else None,
                                        last_param=params[-1] if params else None))  # fmt: skip
            return default_hooks.allreduce_hook(state, bucket)

        # DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation).
        import torch
        import torch.distributed as dist

        trace.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        self.ddp_model.register_comm_hook(state=None, hook=trace)

    # --------------------------------------------------------------------------------------- step

    def _training_module(self) -> nn.Module | None:
        return self.ddp_model

    def _loss(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        # The training step's forward goes through the DDP wrapper (buffers, reducer); checks on the bare
        # model (pre-flight, the non-finite re-run) pass another model and run as they are.
        if self.ddp_model is not None and self.loaded is not None and model is self.loaded.model:
            model = self.ddp_model
        return super()._loss(model, tokens)

    def _backward(self, loss: torch.Tensor, *, scaled: bool) -> None:
        self.arrived.clear()
        super()._backward(loss, scaled=scaled)
        if self.loaded is None or self.progress.step is None or self.ddp_spec.fsdp:
            return
        idle = set(self.loaded.idle)
        expected = [n for n, p in self.loaded.model.named_parameters() if p.requires_grad and n not in idle]
        missing = [n for n in expected if n not in self.arrived]
        self.report.grad_arrival[str(self.progress.step)] = GradArrival(
            arrived=len(expected) - len(missing), missing=missing
        )

    def _missing_grads(self, step: int, missing: list[str]) -> None:
        """find_unused_parameters or static_graph declare parameters without a gradient tolerated: the run
        goes on (DDP itself now decides, and its errors are explained), with a warning naming them."""
        ds = self.ddp_spec
        if not (ds.find_unused or ds.static_graph):
            super()._missing_grads(step, missing)
            return
        declared = "find_unused_parameters=True" if ds.find_unused else "static_graph=True"
        if not any(w.startswith("unused-parameters") for w in self.warnings):
            self.warnings.append(
                f"unused-parameters: {len(missing)} parameter(s) got no gradient at step {step} "
                f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}), tolerated by {declared}"
            )
        self.report.tolerated_missing = {**self.report.tolerated_missing, str(step): missing}

    def _step(self, step: int) -> None:
        super()._step(step)
        if step == 1 and self._bucket_log is not None:
            self.report.buckets = BucketTrace(
                traced=list(self._bucket_log), logging_data=self._logging_data()
            )
            self._bucket_log = None
        self._mean_loss(step)
        if not self.ddp_spec.fsdp:  # sharded: each element on one rank, nothing to compare
            self._hash_check(step)

    def _skips_collective(self, step: int) -> bool:
        return any(i.kind == "skip-collective" and i.step == step for i in inject.active(self.spec.inject))

    def _mean_loss(self, step: int) -> None:
        """The loss averaged over ranks (an all-reduce on the training group), as a training loop logs it."""
        import torch
        import torch.distributed as dist

        n = self.train_collectives + 1
        if self._skips_collective(step):
            self.progress.note("inject", kind="skip-collective", step=step, skipped=f"all_reduce #{n}")
            self.report.collectives.append(
                CollectiveCall(group=TRAIN_GROUP, op="all_reduce", n=n, step=step, skipped=True)
            )
            return
        self.train_collectives = n
        value = self.losses[-1] if self.losses and self.losses[-1] is not None else float("nan")
        tensor = torch.tensor([value], dtype=torch.float32, device=self.device)
        self.progress.event("check", "begin", module=f"all_reduce#{n}.loss", collective="all_reduce",
                            group=TRAIN_GROUP, n=n)  # fmt: skip
        dist.all_reduce(tensor)
        mean = float(tensor.item()) / self.world
        self.progress.event("check", "end", module=f"all_reduce#{n}.loss", collective="all_reduce",
                            group=TRAIN_GROUP, n=n, mean_loss=mean)  # fmt: skip
        self.report.collectives.append(CollectiveCall(group=TRAIN_GROUP, op="all_reduce", n=n, step=step))
        self.report.mean_loss = [*self.report.mean_loss, mean]

    def _hash_check(self, step: int) -> None:
        """Parameters hashed on every rank and compared over the side group: a silent desync -> mismatch."""
        import torch.distributed as dist

        assert self.loaded is not None
        mine = param_hash(self.loaded.model)
        self.progress.event("check", "begin", module="param_hash", collective="all_gather_object",
                            group=SIDE_GROUP)  # fmt: skip
        hashes: list[Any] = [None] * self.world
        dist.all_gather_object(hashes, mine, group=self.side)
        self.progress.event("check", "end", module="param_hash", group=SIDE_GROUP)
        self.report.param_hash[str(step)] = hashes
        if len(set(hashes)) > 1:
            reference = max(set(hashes), key=hashes.count)
            odd = [r for r, h in enumerate(hashes) if h != reference]
            raise CaseFailed(
                "mismatch",
                f"parameters differ across ranks after step {step}: rank(s) {', '.join(map(str, odd))} "
                f"out of sync with the others (parameter hash {hashes[odd[0]]} vs {reference})",
            )

    def _logging_data(self) -> dict[str, object]:
        try:
            data = self.ddp_model._get_ddp_logging_data()  # type: ignore[union-attr, operator]
        except Exception as exc:  # a private API: say why it is missing rather than fail the case
            return {"unavailable": f"{type(exc).__name__}: {exc}"}
        keep = ("bucket", "find_unused", "static_graph", "gradient_as_bucket_view", "backend_name")
        return {k: v for k, v in data.items() if any(word in k for word in keep)}

    # ------------------------------------------------------------------------------------- result

    def _exception_outcome(self, exc: Exception) -> Outcome:
        outcome = super()._exception_outcome(exc)
        # DDP's index order: named_parameters() keeps DDP's module-by-module order and its dedup; our
        # models ignore no parameter (nsa_diag.analysis.ddp_errors).
        model = self.loaded.model if self.loaded is not None else None
        names = [n for n, p in model.named_parameters() if p.requires_grad] if model is not None else []
        traceback = outcome.exception.traceback if outcome.exception is not None else ""
        explained = explain_ddp_error(
            str(exc), names, traceback=traceback, find_unused=self.ddp_spec.find_unused, cli=True
        )
        if explained is not None:
            self.report.ddp_error = explained.info()
            outcome.reason = f"{explained.explanation} (at {outcome.reason})"
            if explained.kind == "unused-parameters":
                outcome.status, outcome.missing_grads = "grad-missing", list(explained.params)
        return outcome

    def _ddp_report(self) -> RankDdp:
        self.report.train_collectives = self.train_collectives
        return self.report


def _redirect_output(directory: Path) -> None:
    """This rank's stdout and stderr into its own folder (torchrun's own output stays in the case's)."""
    for fd, name in ((1, artifacts.STDOUT), (2, artifacts.STDERR)):
        f = artifacts.open_append(directory / name, binary=True)
        os.dup2(f.fileno(), fd)
        f.close()


def run(case_dir: Path, started: float, spec_path: Path | None = None) -> int:
    """Run this rank of the case in ``case_dir`` (its spec: ``spec_path``, by default the case folder's
    spec.json); the process exit code (0 once the result is written)."""
    rank = int(os.environ.get("RANK", "0"))
    directory = rank_dir(case_dir, rank)
    directory.mkdir(parents=True, exist_ok=True)
    _redirect_output(directory)
    stacks = artifacts.open_append(directory / artifacts.STACKS, binary=True)
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)

    from nsa_diag.beacon import BeaconWriter

    beacon = BeaconWriter(directory / artifacts.BEACON)
    progress = Progress(beacon, artifacts.open_append(directory / artifacts.PROGRESS))
    memory = MemoryRecorder(directory)
    from nsa_diag.spec import CaseSpec

    spec = CaseSpec.model_validate_json((spec_path or Path(case_dir) / artifacts.SPEC).read_text())
    backend = spec.ddp.backend if spec.ddp is not None else None

    def at_hang() -> None:  # the heartbeat thread, asked by the watchdog before it stops any rank
        memory.record("at_hang")
        memory.dump_snapshot()
        if backend is not None and (data := flight_recorder_dump(backend)):
            artifacts.write_bytes(directory / artifacts.FR_AT_HANG, data)

    Heartbeat(beacon, directory, on_dump=at_hang, stacks=stacks, progress=progress).start()
    progress.event("setup", detail="spec read")
    trainer = DdpTrainer(spec, directory, progress, memory)
    report = trainer.run(started)
    progress.event("done", "end", status=report.status, reason=report.reason)
    artifacts.write_json(directory / artifacts.WORKER_RESULT, report)
    _leave_group()
    return 0


def _leave_group() -> None:
    """Destroy the process group where every rank got this far; a rank whose peers hang just exits."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or not Path(args[0]).is_dir() or not Path(args[-1]).exists():
        print(USAGE, file=sys.stderr)
        return 2
    return run(Path(args[0]), started, Path(args[1]) if len(args) == 2 else None)


def _exit(code: int) -> None:
    """End the rank without the interpreter's teardown, once its result is written and its process group
    is gone: torch's C++ threads (c10d's, the flight recorder's) destroyed while still joinable at static
    teardown end a finished rank with std::terminate and SIGABRT ("terminate called without an active
    exception", seen once on two gloo ranks), a crash for a rank that passed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    tether.hold()  # dies with torchrun's agent, which dies with nsa-diag
    agent.bind_stores()  # a rank 0 that serves a store of its own listens on MASTER_ADDR only
    _exit(main())
