"""The training run of one case, inside the worker: build the model, run real training steps, measure them,
and check what the case asks for (non-finite values, missing gradients, parity with the reference backends).

A step is what a training job does: random tokens (seeded), next-token cross-entropy, backward, AdamW.
Checks that cost more than a norm run only on failure: a non-finite loss or gradient re-runs that step with
a hook on every module to find where the values first went non-finite.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nsa_diag import artifacts
from nsa_diag.records import Metrics, NonFinite, Parity, PeakMemory, PhaseSeconds, RankDdp, ReducedCheck
from nsa_diag.spec import OOM_MESSAGES, BuiltModel, CaseSpec, Where, WorkerReport
from nsa_diag.worker import inject
from nsa_diag.worker.checks import run_check
from nsa_diag.worker.contract import build_model, check_logits, logits_of
from nsa_diag.worker.nsa_variant import nsa_config, with_nsa
from nsa_diag.worker.outcome import CaseFailed, LoadedModel, Outcome, exception_info, worker_report
from nsa_diag.worker.probes import (
    MemoryRecorder,
    NonfiniteLocator,
    Progress,
    attach_profiler_ranges,
    attach_progress,
    checking,
    finite_or_none,
    grad_norm,
    graph_breaks,
    missing_grads,
    peak_memory,
    report_compiler,
    report_compiles,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nsa_diag.analysis.memory_model import CheckSize, ReferencePlan

ANOMALY_NAN = re.compile(r"Function '(\w+)' returned nan values")


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise CaseFailed("skipped", "device cuda: torch sees no CUDA device here")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


class Trainer:
    """Runs the steps of one case and builds its `WorkerReport` (`run` never raises)."""

    def __init__(self, spec: CaseSpec, case_dir: Path, progress: Progress, memory: MemoryRecorder) -> None:
        self.spec, self.case_dir, self.progress, self.memory = spec, Path(case_dir), progress, memory
        self.notes: list[str] = []
        self.warnings: list[str] = []  # a pass that holds with these said (its reason names them)
        self.phase_s = PhaseSeconds(setup=None, forward=[], backward=[], optimizer=[], check=[])
        # On CUDA, the seconds the host took to issue each phase's work before the sync that ends it: a
        # phase it takes about as long to issue as to finish is host-bound (the GPU waited for Python and
        # kernel launches; nsa-diag scale leaves such points out of its time fit).
        self.phase_issue_s = PhaseSeconds(forward=[], backward=[])
        self.step_s: list[float] = []
        self.losses: list[float | None] = []
        self.grad_norms: list[float | None] = []
        self.scaler_skipped = 0
        self.steps_done = 0
        self.device: torch.device | None = None
        self.loaded: LoadedModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None  # fp16 only
        self.parity: Parity | None = None
        self.faults: list[inject.Fault] = []
        self.compiled: nn.Module | None = None  # torch.compile of the training module (``--compile``)

    # ---------------------------------------------------------------------------------------- the run

    def run(self, started: float) -> WorkerReport:
        """All steps of the case; the worker's report (status ok or why not)."""
        outcome = Outcome()
        try:
            self._setup()
            self.phase_s.setup = time.perf_counter() - started
            if self.spec.check is not None:  # nsa-diag verify: a correctness property, no training steps
                self.parity, outcome.reason = run_check(self)
            else:
                with self._profiled():
                    for step in range(1, self.spec.steps + 1):
                        with self._range(f"step {step}"):
                            self._step(step)
                outcome.reason = self._ok_reason()
                if self.parity is not None and not self.parity.checked:
                    outcome.status = "unchecked"  # the steps ran, the check asked for did not: not a pass
        except CaseFailed as failed:
            outcome = Outcome.failed(failed)
        except Exception as exc:
            outcome = self._exception_outcome(exc)
        finally:
            self.progress.step = None
        return self._finish(outcome)

    def _exception_outcome(self, exc: Exception) -> Outcome:
        """How a run that raised ended: oom, nonfinite (anomaly mode) or error, with the exception."""
        where = Where.model_validate(self.progress.where).describe()
        exception = exception_info(exc)
        anomaly = ANOMALY_NAN.search(str(exc)) if isinstance(exc, RuntimeError) else None
        if anomaly:  # set_detect_anomaly stopped backward at the first Function that produced NaN
            seen = f"output of autograd Function {anomaly.group(1)} (anomaly mode)"
            module = str(self.progress.where.get("module") or "backward")
            nonfinite = NonFinite(where="grad", module=module, seen=seen, step=self.progress.step)
            reason = f"non-finite gradients at {where}, first seen in the {seen}"
            return Outcome("nonfinite", reason, exception, nonfinite=nonfinite)
        status = "oom" if is_oom(exc) else "error"
        what = "out of memory" if status == "oom" else type(exc).__name__
        return Outcome(status, f"{what} at {where}: {_first_line(str(exc))}", exception)

    def _report_progress(self, model: nn.Module) -> None:
        """Progress from ``model``'s blocks (and NSA branches with ``--branch-marks``) and, on CUDA, from
        every Triton kernel compiled (a cold first step compiles for seconds between two hook events)."""
        assert self.loaded is not None  # its layers where the model was built found them
        attach_progress(model, self.progress, self.loaded.prefix, branches=self.spec.branch_marks)
        if self.device.type == "cuda":
            report_compiles(self.progress)

    def _setup(self) -> None:
        # Setup events mark milestones, so a slow start (imports take seconds) still shows progress and a
        # start that hangs shows where.
        import torch

        spec = self.spec
        self.progress.event("setup", detail="torch imported")
        self.device = self.memory.device = resolve_device(spec.device)
        reason = inject.skip_reason(spec.inject, self.device)
        if reason:
            raise CaseFailed("skipped", reason)
        if spec.anomaly:
            torch.autograd.set_detect_anomaly(True)
        if spec.memory_snapshot:
            if self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
                self.memory.snapshot_path = self.case_dir / artifacts.MEMORY_SNAPSHOT
            else:
                self.notes.append("memory_snapshot: not available on the CPU (a CUDA allocator feature)")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.loaded = loaded = build_model(spec, self.device)
        self._model_built()
        self._report_progress(loaded.model)
        if spec.profile:
            attach_profiler_ranges(loaded.blocks, self.progress)
        self.faults = inject.attach(spec.inject, loaded.blocks, loaded.prefix, self.progress, self.device)
        self.optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=spec.lr)
        self.scaler = torch.amp.GradScaler(self.device.type) if spec.dtype == "fp16" else None
        self.progress.event("setup", "end", device=str(self.device), params=self._params())

    def _model_built(self) -> None:
        """The setup event "model built"; for a ``--model`` with what was found in it (`BuiltModel`: its
        layers, its vocabulary and where from), which result.json reads back whatever becomes of the case."""
        loaded = self.loaded
        assert loaded is not None
        if self.spec.model is None:
            self.progress.event("setup", detail="model built")
            return
        built = BuiltModel(
            type=type(loaded.model).__name__, layers_attr=loaded.prefix, layers=len(loaded.blocks),
            vocab=loaded.vocab, vocab_from=loaded.vocab_from,
        )  # fmt: skip
        self.progress.event("setup", detail="model built", model=built.model_dump())

    def _params(self) -> int:
        assert self.loaded is not None
        return sum(p.numel() for p in self.loaded.model.parameters())

    def _step(self, step: int) -> None:
        assert self.loaded is not None
        progress, model, spec = self.progress, self.loaded.model, self.spec
        progress.step = step
        progress.event("step", "begin")
        t_step = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = self.batch(step)

        progress.event("forward", "begin")
        t = time.perf_counter()
        with self._range("forward"):
            loss = self._loss(model, tokens)
            issued = time.perf_counter()
            loss_value = float(loss.detach())  # syncs the device
        self.phase_s.forward.append(time.perf_counter() - t)
        self._issued("forward", issued - t)
        progress.event("forward", "end", loss=finite_or_none(loss_value))
        if step == 1:
            self.memory.record("after_forward")
        if not math.isfinite(loss_value):
            self._nonfinite(step, tokens, "loss")

        progress.event("backward", "begin")
        t = time.perf_counter()
        with self._range("backward"):
            self._backward(loss, scaled=True)
            issued = time.perf_counter()
            self._sync()
        self.phase_s.backward.append(time.perf_counter() - t)
        self._issued("backward", issued - t)
        progress.event("backward", "end")
        if step == 1:
            self.memory.record("after_backward")

        missing = missing_grads(model, self.loaded.idle)
        if missing:
            self._missing_grads(step, missing)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        norm = grad_norm(model.parameters())
        if not math.isfinite(norm):
            self._nonfinite(step, tokens, "grad")  # returns only when fp16 loss scaling overflowed
        check_s = 0.0
        if step == 1 and spec.reference_check:
            t = time.perf_counter()
            self._reference_check(tokens, loss_value)
            check_s = time.perf_counter() - t

        progress.event("optimizer", "begin")
        t = time.perf_counter()
        with self._range("optimizer"):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self._sync()
        self.phase_s.optimizer.append(time.perf_counter() - t)
        progress.event("optimizer", "end")

        self.phase_s.check.append(check_s)
        self.step_s.append(time.perf_counter() - t_step - check_s)  # training time: checks left out
        if step == 1 and spec.compile is not None:
            self.notes.append(graph_breaks(spec.compile))
        self.losses.append(finite_or_none(loss_value))
        self.grad_norms.append(finite_or_none(norm))
        self.steps_done = step
        progress.event("step", "end", loss=finite_or_none(loss_value), grad_norm=finite_or_none(norm))

    # ------------------------------------------------------------------------------- step pieces

    def batch(self, step: int) -> torch.Tensor:
        """``[B, S + 1]`` token ids, the same for a step whatever else changes (seed and step only)."""
        import torch

        assert self.loaded is not None
        assert self.device is not None
        gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + step)
        shape = (self.spec.batch, self.spec.seq_len + 1)
        return torch.randint(0, self.loaded.vocab, shape, generator=gen).to(self.device)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        assert self.device is not None
        if self.spec.dtype == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.spec.dtype == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def _training_module(self) -> nn.Module | None:
        """What the training steps call (`DdpTrainer`: the DDP wrapper)."""
        return self.loaded.model if self.loaded is not None else None

    def _compiled(self, model: nn.Module) -> nn.Module:
        """``--compile``: the training module through torch.compile, made once (Dynamo compiles at the first
        call). The compiler's start and end count as progress (`report_compiler`); inside the compiled
        graph the block hooks stay silent (`nsa_diag.probe.hooks`: no graph break of theirs)."""
        if self.compiled is None:
            import torch

            report_compiler(self.progress)
            self.compiled = torch.compile(model, backend=self.spec.compile)
        return self.compiled

    def _loss(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of ``model`` on ``tokens [B, S + 1]`` (the model sees S tokens); the
        training module runs compiled with ``--compile`` (the checks' own runs stay eager)."""
        import torch.nn.functional as F

        if self.spec.compile is not None and model is self._training_module():
            model = self._compiled(model)
        with self._autocast():
            logits = logits_of(model(tokens[:, :-1]))
        assert self.loaded is not None
        check_logits(logits, tokens.shape[0], tokens.shape[1] - 1, self.loaded.vocab)
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def _missing_grads(self, step: int, missing: list[str]) -> None:
        """Parameters without a gradient after backward: grad-missing (a DDP rank may tolerate them)."""
        raise CaseFailed(
            "grad-missing",
            f"{len(missing)} parameter(s) got no gradient at step {step}: {_names(missing)}",
            missing_grads=missing,
        )

    def _backward(self, loss: torch.Tensor, *, scaled: bool) -> None:
        self.progress.in_backward = True  # block forwards from here on are checkpoint recomputes
        try:
            if scaled and self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        finally:
            self.progress.in_backward = False

    def _issued(self, phase: str, seconds: float) -> None:
        if self.device is not None and self.device.type == "cuda":
            self.phase_issue_s.of(phase).append(seconds)

    def _sync(self) -> None:
        import torch

        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------------------------- checks

    def _nonfinite(self, step: int, tokens: torch.Tensor, where: str) -> None:
        """Re-run the step with a finiteness hook on every module; raise CaseFailed("nonfinite") saying
        where the values first went non-finite. Returns only when fp16 loss scaling alone overflowed
        (unscaled gradients are finite): the GradScaler skips that step, as it is built to."""
        import torch

        assert self.loaded is not None
        model = self.loaded.model
        self.progress.event("check", "begin", check="nonfinite", where=where)
        self.optimizer.zero_grad(set_to_none=True)
        with NonfiniteLocator(
            model, self.progress, forward=where == "loss", backward=where == "grad"
        ) as locator:
            if where == "loss":
                with torch.no_grad():
                    self._loss(model, tokens)
            else:
                self._backward(self._loss(model, tokens), scaled=False)
        first = locator.first
        if where == "grad":
            first = first or locator.first_nonfinite_grad()
            if self.scaler is not None and math.isfinite(grad_norm(model.parameters())):
                self.scaler_skipped += 1
                self.notes.append(f"step {step}: fp16 loss scaling overflowed; the GradScaler skipped it")
                self.progress.event("check", "end", check="nonfinite", result="scaling overflow")
                return
        self.progress.event("check", "end", check="nonfinite", result=first)
        module = first["module"] if first else "loss"
        seen = first["seen"] if first else "cross-entropy of finite logits"
        what = "loss" if where == "loss" else "gradients"
        raise CaseFailed(
            "nonfinite",
            f"non-finite {what} at step {step}, first seen in the {seen} of {module}"
            if first
            else f"non-finite {what} at step {step}, first seen in the {seen}",
            nonfinite=NonFinite(where=where, module=module, seen=seen, step=step),
        )

    def _reference_check(self, tokens: torch.Tensor, loss_value: float) -> None:
        """Same weights, batch and device through the reference backends: relative errors of the loss and of
        every gradient. CaseFailed("mismatch") beyond the bound.

        fp32: the reference runs in fp32 and the bound is the spec's tolerance. bf16/fp16: rounding alone
        moves gradients by percents (and can flip near-tied block choices), so, as in flash-attention's tests,
        the bound is twice the error of the same computation with the reference backends in that dtype against
        the fp32 reference, plus the tolerance as a floor.

        The reference is sized to the case (`check_plans`): the dense reference backends where they fit the
        free memory, else lean ones (sel gather, win chunked, cmp masked) that are not the backend under test.
        Where no reference fits at the case's size, or it runs out of memory anyway, the check runs at a
        smaller size with the same weights (`smaller_sizes`: fewer batch rows, then for nsa_core's model its
        first layers, then the first tokens), the model under test run again there beside the reference;
        ``parity.reduced`` says which. A check that runs at no size says so in ``parity`` (checked False)
        and the case ends `unchecked`, never pass.

        A ``--model`` is compared with a copy of itself whose nsa_core NSAAttention modules run the reference
        backends (`nsa_diag.worker.nsa_variant`), sized by its first NSA module's config.
        """
        from nsa_diag.analysis.memory_model import CheckSize, check_plans

        assert self.loaded is not None
        assert self.device is not None
        model = self.loaded.model
        built = self.loaded.cfg  # None for a --model
        cfg = built if built is not None else nsa_config(model)
        if cfg is None:  # refused before the case runs (`check_model_facts`); a safeguard
            self._check_not_run(f"{type(model).__name__} holds no nsa_core NSAAttention module")
            return
        full = CheckSize(batch=self.spec.batch, seq_len=self.spec.seq_len, layers=cfg.layers)
        full_plan, attempts = check_plans(
            cfg, size=full, dtype=self.spec.dtype, device=str(self.device),
            budget_bytes=self._free_memory_bytes(), fewer_layers=built is not None,
        )  # fmt: skip
        if not attempts:
            self._check_not_run(
                f"the reference would not fit, at the case's size nor smaller: {full_plan.describe()}"
            )
            return
        tried: list[str] = []
        for size, first in attempts:
            candidate: ReferencePlan | None = first
            while candidate is not None:
                at = "" if size == full else f" at {size.describe(full)}"
                try:
                    parity, bounds = self._parity_at(size, full, candidate, tokens, loss_value)
                except Exception as exc:
                    if not is_oom(exc):
                        raise
                    self._release_memory()
                    tried.append(f"{candidate.describe()}{at}: {_first_line(str(exc))}")
                    candidate = candidate.fallback if candidate.fallback and candidate.fallback.fits else None
                    continue
                self._judge_parity(parity, bounds, candidate, size, full, tried, full_plan)
                return
        self._check_not_run("the reference ran out of memory (" + "; then ".join(tried) + ")")

    def _parity_at(
        self,
        size: CheckSize,
        full: CheckSize,
        plan: ReferencePlan,
        tokens: torch.Tensor,
        loss_value: float,
    ) -> tuple[Parity, tuple[float, float]]:
        """The parity errors and bounds of `plan`'s reference at `size`: at the case's size against the
        training step's own loss and gradients; smaller, against a copy of the model (same weights, its first
        layers) run again on the batch's first rows and tokens."""
        import nsa_core
        from nsa_diag.analysis.memory_model import with_layers

        assert self.loaded is not None
        progress, model, built = self.progress, self.loaded.model, self.loaded.cfg
        cfg = with_layers(built, size.layers) if built is not None else None
        progress.event("check", "begin", check="reference", backends=plan.backends,
                       size=None if size == full else size.describe(full))  # fmt: skip
        if size != full:
            tokens = tokens[: size.batch, : size.seq_len + 1]
            if cfg is not None:  # nsa_core's model: rebuilt with its first layers
                model = self._reduced_copy(nsa_core.TinyLM(cfg).to(self.device), model.state_dict())
            else:  # a --model: a copy without nsa-diag's hooks, every layer
                model = self._reduced_copy(with_nsa(model), None)
            with self._checking(model):
                loss = self._loss(model, tokens)
                loss.backward()
            loss_value = float(loss.detach())
        low_precision = self.spec.dtype != "fp32"
        source = model

        def reference(autocast: bool) -> tuple[nn.Module, float]:
            backends = {f"{branch}_backend": name for branch, name in plan.backends.items()}
            if cfg is not None:
                ref = nsa_core.TinyLM(replace(cfg, nsa=replace(cfg.nsa, **backends))).to(self.device)
                ref.load_state_dict(source.state_dict())
            else:  # a --model: a copy of it whose NSA modules run the reference backends
                ref = with_nsa(source, **backends)
            with self._checking(ref):
                if autocast:
                    ref_loss = self._loss(ref, tokens)
                else:
                    import torch.nn.functional as F

                    logits = logits_of(ref(tokens[:, :-1])).float()
                    ref_loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                ref_loss.backward()
            return ref, float(ref_loss.detach())

        return self._parity(reference, model, loss_value, low_precision)

    def _reduced_copy(self, copy: nn.Module, state: dict[str, torch.Tensor] | None) -> nn.Module:
        """`copy`, without gradients, with the weights of `state` it has (its first layers): the model under
        test of a reduced check."""
        if state is not None:
            own = copy.state_dict()
            copy.load_state_dict({key: value for key, value in state.items() if key in own})
        for param in copy.parameters():
            param.grad = None
        return copy

    def _checking(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Progress of `model`'s blocks in phase "check" while a parity check runs it."""
        assert self.loaded is not None  # a copy of the loaded model: its layers where the loaded ones are
        return checking(model, self.progress, self.loaded.prefix, self.spec.branch_marks)

    def _judge_parity(
        self,
        parity: Parity,
        bounds: tuple[float, float],
        plan: ReferencePlan,
        size: CheckSize,
        full: CheckSize,
        tried: list[str],
        full_plan: ReferencePlan,
    ) -> None:
        """Record the check's errors (and the size it ran at); CaseFailed("mismatch") beyond the bounds."""
        if tried:
            parity.reference_out_of_memory = tried
        loss_bound, grad_bound = bounds
        parity.reference_backends = plan.backends
        if plan.lean:
            parity.reference_sized = plan.describe()
        if size != full:
            why = (
                "ran out of memory" if tried and full_plan.fits else f"would not fit: {full_plan.describe()}"
            )
            parity.reduced = ReducedCheck(
                batch=size.batch,
                seq_len=size.seq_len,
                layers=size.layers,
                what=size.describe(full),
                why=f"at the case's size the reference {why}",
            )
        parity.loss_bound, parity.grad_bound = loss_bound, grad_bound
        self.progress.event("check", "end", check="reference", **parity.model_dump())
        loss_err, grad_err = _measured(parity.loss_rel_err), _measured(parity.grad_rel_err_max)
        loss_ok = loss_err <= loss_bound  # NaN counts as a mismatch
        grad_ok = grad_err <= grad_bound
        if not (loss_ok and grad_ok):
            what, err, bound = (
                ("loss", loss_err, loss_bound) if not loss_ok else (parity.worst_param, grad_err, grad_bound)
            )
            at = f" (checked at {size.describe(full)})" if size != full else ""
            raise CaseFailed(
                "mismatch",
                f"{what} differs from the reference backends by {err:.3g} (relative; bound {bound:.3g}){at}",
                parity=parity,
            )
        self.parity = parity

    def _parity(
        self,
        reference: Callable[[bool], tuple[nn.Module, float]],
        model: nn.Module,
        loss_value: float,
        low_precision: bool,
    ) -> tuple[Parity, tuple[float, float]]:
        """The parity errors against the fp32 reference and the (loss, gradient) bounds."""
        tolerance = self.spec.parity_tolerance
        ref32, ref32_loss = reference(False)
        parity = parity_errors(model, ref32, loss_value, ref32_loss, tolerance)
        if not low_precision:
            return parity, (tolerance, tolerance)
        same_dtype, same_dtype_loss = reference(True)
        baseline = parity_errors(same_dtype, ref32, same_dtype_loss, ref32_loss, tolerance)
        parity.reference = f"reference backends in fp32; bound 2x the {self.spec.dtype} reference + floor"
        parity.baseline_loss_rel_err = baseline.loss_rel_err
        parity.baseline_grad_rel_err_max = baseline.grad_rel_err_max
        return parity, (
            2 * _measured(baseline.loss_rel_err) + tolerance,
            2 * _measured(baseline.grad_rel_err_max) + tolerance,
        )

    def _check_not_run(self, why: str) -> None:
        """A parity check that could not run: said in ``parity`` and the notes, never counted as passed."""
        self.parity = Parity(checked=False, why=why)
        self.notes.append(f"reference check not run: {why}")
        self.progress.note("check-not-run", check="reference", why=why)

    def _free_memory_bytes(self) -> int | None:
        """What a check may still use: free device memory plus the allocator's cached, unused blocks on CUDA,
        available RAM on the CPU; 80% of it, leaving room for what the estimate does not model."""
        import torch

        assert self.device is not None
        try:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
                return int(0.8 * (free + cached))
            import psutil

            return int(0.8 * psutil.virtual_memory().available)
        except Exception:
            return None

    def _release_memory(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------ the result

    @contextlib.contextmanager
    def _profiled(self) -> Iterator[None]:
        """torch.profiler over the steps (``--profile``): trace.json, and the memory timeline on CUDA."""
        if not self.spec.profile:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        assert self.device is not None
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        prof = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=cuda)
        prof.start()
        try:
            yield
        finally:
            prof.stop()
            self._export(artifacts.TRACE, lambda p: prof.export_chrome_trace(str(p)))
            if cuda:
                device = f"cuda:{torch.cuda.current_device()}"
                self._export(artifacts.MEMORY_TIMELINE, lambda p: prof.export_memory_timeline(str(p), device))

    def _range(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A ``record_function`` range in the ``--profile`` trace (step, phase); nothing without it."""
        if not self.spec.profile:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(name)

    def _export(self, name: str, writer: Callable[[Path], object]) -> None:
        # an "export" phase: a profiler trace of a big model takes longer than a step (12 s after 1 s steps
        # on an H100), and the watchdog gives the phase its own limit instead of the step-derived one
        self.progress.event("export", "begin", module=name)
        try:
            artifacts.write_with(self.case_dir / name, writer)
        except Exception as exc:  # an exporter's failure must not hide the case's own outcome
            self.notes.append(f"{name}: not written ({type(exc).__name__}: {_first_line(str(exc))})")
        finally:
            self.progress.event("export", "end", module=name)

    def _ok_reason(self) -> str:
        loss = self.losses[-1] if self.losses else None
        text = f"{self.steps_done} step(s) done"
        text += f", final loss {loss:.4f}" if loss is not None else ""
        parity = self.parity
        if parity is not None and not parity.checked:  # said first: it is the verdict (unchecked)
            text = f"reference check not run: {parity.why}; {text}"
        elif parity is not None and parity.reduced is not None:
            text += f"; reference check at {parity.reduced.what} ({parity.reduced.why})"
        return text + "".join(f"; warning {warning}" for warning in self.warnings)

    def _finish(self, outcome: Outcome) -> WorkerReport:
        spec = self.spec
        if outcome.parity is None:
            outcome.parity = self.parity
        # Step 1 warms up (Triton compiles its kernels there, 10-15 s on a cold cache; cuDNN and the
        # allocator settle): with more steps the rate is over steps 2.., so two runs compare as they run.
        timed = self.step_s[1:] if len(self.step_s) > 1 else self.step_s
        tokens = spec.batch * spec.seq_len * len(timed)
        metrics = Metrics(
            phase_s=self.phase_s,
            step_s=self.step_s,
            tokens_per_s=tokens / sum(timed) if timed and sum(timed) > 0 else None,
            tokens_per_s_steps="2.." if len(self.step_s) > 1 else "1",
            loss=self.losses,
            grad_norm=self.grad_norms,
            params=self._params() if self.loaded is not None else None,
            dtype=spec.dtype,
            peak_memory=self._safe(lambda: PeakMemory.model_validate(peak_memory(self.device)), PeakMemory()),
        )
        if self.phase_issue_s.forward:
            metrics.phase_issue_s = self.phase_issue_s
        if self.scaler is not None:
            metrics.scaler_skipped_steps = self.scaler_skipped
        if self.faults:
            metrics.injections = [fault.report() for fault in self.faults]
        for fault in self.faults:
            if not fault.fired and self.steps_done >= fault.inj.step:
                hint = " (no checkpointed layer re-ran it: recompute needs --gc over that layer)"
                self.notes.append(
                    f"inject {fault.inj}: never fired" + (hint if fault.inj.phase == "recompute" else "")
                )
        if self.spec.memory_snapshot:
            self.progress.event("export", "begin", module=artifacts.MEMORY_SNAPSHOT)
        try:
            self.memory.dump_snapshot()
        except Exception as exc:
            self.notes.append(f"{artifacts.MEMORY_SNAPSHOT}: not written ({type(exc).__name__}: {exc})")
        finally:
            if self.spec.memory_snapshot:
                self.progress.event("export", "end", module=artifacts.MEMORY_SNAPSHOT)
        if self.notes:
            metrics.notes = self.notes
        return worker_report(
            outcome,
            device=str(self.device) if self.device is not None else None,
            steps_done=self.steps_done,
            metrics=metrics,
            ddp=self._ddp_report(),
        )

    def _ddp_report(self) -> RankDdp | None:
        """What a DDP rank adds to the report (`nsa_diag.worker.ddp.DdpTrainer`); None for one worker."""
        return None

    @staticmethod
    def _safe(fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except Exception:
            return default


def parity_errors(model: nn.Module, ref: nn.Module, loss: float, ref_loss: float, tolerance: float) -> Parity:
    """Relative errors ``|a - r| / |r|`` of the loss and ``||g - g_ref|| / ||g_ref||`` of every gradient (a
    gradient present on one side only counts as relative error 1: the other side is zero)."""
    ref_grads = dict(ref.named_parameters())
    worst_name, worst = None, 0.0
    for name, p in model.named_parameters():
        r = ref_grads[name].grad
        if p.grad is None and r is None:
            continue
        if p.grad is None or r is None:
            err = 1.0
        else:
            r64 = r.detach().double()
            err = float((p.grad.detach().double() - r64).norm() / r64.norm().clamp_min(1e-30))
        if not err <= worst:  # NaN wins
            worst_name, worst = name, err
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    return Parity(loss_rel_err=loss_err, grad_rel_err_max=worst, worst_param=worst_name,
                  tolerance=tolerance, reference="all reference backends")  # fmt: skip


def _measured(err: float | None) -> float:
    """A relative error as measured: NaN where it is missing (NaN fails every bound)."""
    return math.nan if err is None else err
