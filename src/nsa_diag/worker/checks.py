"""Correctness properties of an NSA model, run inside the worker instead of training steps (`CaseSpec.check`).

Each property compares two computations of the same model (same state_dict, same seeded batch):

- ``backends``: every selection, compression and window backend against the reference backends: the logits
  and every parameter's gradient of the next-token loss (above `REFERENCE_BUDGET` token-layers, e.g.
  m7c-125m, against the masked backends: the naive reference would take minutes; smaller presets check
  masked against the reference); a ``--model`` through copies of it whose NSAAttention modules run each
  backend (`nsa_diag.worker.nsa_variant`); the other properties rebuild an nsa_core.TinyLM from its config;
- ``causality``: changing the tokens at positions >= t changes no logit before t (several t);
- ``prefill``: batched prefill == sequential prefill == prefill of a prefix then one decode step per token;
- ``gc``: gradient checkpointing (all layers and a middle range, reentrant and not; or only the case's own
  ``gc`` range when it sets one) gives the gradients of no checkpointing, with the error per layer.

On the CPU everything runs in float64 and the bound is the spec's tolerance (default `CPU_TOLERANCE`). On
CUDA the computation under test runs in the case's dtype and the expected one in fp32; the bound is twice
the error of the same computation made with the masked backends in that dtype, plus `LOW_FLOOR` (fp32:
plus the spec's tolerance). A property that holds returns its errors (``parity`` of the result); one that
does not raises ``CaseFailed("mismatch")`` naming the property, the largest error and where it is; one with
nothing to compare (no backend to run, no cut point in a sequence too short) raises
``CaseFailed("unchecked")``: a property not shown is never a pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nsa_diag.records import Parity
from nsa_diag.worker.contract import logits_of
from nsa_diag.worker.nsa_variant import nsa_config, with_nsa
from nsa_diag.worker.outcome import CaseFailed, TrainingRun
from nsa_diag.worker.probes import checking

if TYPE_CHECKING:
    import torch
    from torch import nn

CPU_TOLERANCE = 1e-9  # relative error, float64
LOW_FLOOR = 1e-2  # added to the same-dtype bound in bf16/fp16
MASKED = {"sel_backend": "masked", "cmp_backend": "masked", "win_backend": "masked"}
REFERENCE = {"sel_backend": "reference", "cmp_backend": "reference", "win_backend": "reference"}
# Why a property compared nothing (`run_check`): the case ends unchecked.
NOTHING_TO_COMPARE = {
    "backends": "no backend of the computed branches other than the one compared against",
    "causality": "no position t with 1 <= t < S to change the tokens from",
    "prefill": "no prefill mode to compare",
    "gc": "no checkpointing range to compare",
}
REFERENCE_BUDGET = 2048  # batch x S x layers above which `backends` compares with masked, not reference


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (NaN when either has non-finite values)."""
    want64 = want.detach().double()
    return float((got.detach().double() - want64).norm() / want64.norm().clamp_min(1e-30))


def worst_position(got: torch.Tensor, want: torch.Tensor) -> str:
    """``"batch b, position t"`` of the largest absolute difference of two ``[B, S, V]`` logits."""
    diff = (got.detach().double() - want.detach().double()).abs().nan_to_num(float("inf"))
    per_position = diff.amax(dim=-1)  # [B, S]
    b, t = divmod(int(per_position.argmax()), per_position.shape[1])
    return f"batch {b}, position {t}"


@dataclasses.dataclass
class Outcome:
    """What one computation produced: logits and (when run with backward) every parameter's gradient."""

    logits: torch.Tensor
    grads: dict[str, torch.Tensor | None]


class Checker:
    """The properties, on the model the worker built (its class and config, its initial weights)."""

    def __init__(self, trainer: TrainingRun) -> None:
        import torch

        loaded = trainer.loaded
        assert loaded is not None
        assert trainer.device is not None
        self.trainer, self.progress, self.device = trainer, trainer.progress, trainer.device
        self.base, self.prefix = loaded.model, loaded.prefix
        self.cfg = getattr(self.base, "cfg", None)
        # An nsa_core.TinyLM is rebuilt from its config per variant; a --model's `backends` is checked on
        # copies of it whose NSA modules run each backend (its own --gc wrapping kept).
        self.rebuilds = self.cfg is not None and hasattr(self.base, "decode")
        if not self.rebuilds:
            self.cfg = nsa_config(self.base) if trainer.spec.check == "backends" else None
        if self.cfg is None:  # refused before the case runs (`check_model_facts`); a safeguard
            why = (
                f"check {trainer.spec.check}: needs an nsa_core.TinyLM (or subclass) built from a config"
                + (" or, for backends, a model holding nsa_core NSAAttention modules"
                   if trainer.spec.check == "backends" else "")
            )  # fmt: skip
            raise CaseFailed(
                "unchecked", why, parity=Parity(property=trainer.spec.check, checked=False, why=why)
            )
        self.state = {k: v.detach().cpu() for k, v in self.base.state_dict().items()}
        self.tokens = trainer.batch(1)  # [B, S + 1], as the first training step would see
        self.cpu = self.device.type == "cpu"
        spec = trainer.spec
        if self.cpu:
            self.exact_dtype = self.test_dtype = torch.float64
            self.autocast_dtype = None
            self.floor = spec.tolerance or CPU_TOLERANCE
        else:
            self.exact_dtype = torch.float32
            self.autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
            self.test_dtype = torch.float32
            self.floor = spec.tolerance or (LOW_FLOOR if self.autocast_dtype is not None else 1e-4)
        self.precision = "float64" if self.cpu else spec.dtype

    # -------------------------------------------------------------------------------- building blocks

    def variant(self, exact: bool = False, **changes: Any) -> nn.Module:
        """The model's class with config `changes` (ModelConfig or NSAConfig fields) and the same weights; for
        a ``--model``, a copy whose NSA modules take the NSAConfig `changes` (the others do not apply)."""
        nsa_fields = {f.name for f in dataclasses.fields(self.cfg.nsa)}
        dtype = self.exact_dtype if exact else self.test_dtype
        if not self.rebuilds:  # a --model: only its NSA modules change
            variant = with_nsa(self.base, **{k: v for k, v in changes.items() if k in nsa_fields})
            return variant.to(self.device, dtype)
        nsa = dataclasses.replace(self.cfg.nsa, **{k: v for k, v in changes.items() if k in nsa_fields})
        model_changes = {k: v for k, v in changes.items() if k not in nsa_fields}
        cfg = dataclasses.replace(self.cfg, nsa=nsa, **model_changes)
        model = type(self.base)(cfg)
        model.load_state_dict(self.state)
        return model.to(self.device, dtype)

    @contextlib.contextmanager
    def watched(self, model: nn.Module, what: str) -> Iterator[None]:
        """Progress events of `model`'s blocks while it runs (the watchdog sees the check advance)."""
        spec, loaded = self.trainer.spec, self.trainer.loaded
        assert loaded is not None  # a variant keeps its layers where the model has them
        self.progress.event("check", "begin", check=spec.check, variant=what)
        try:
            with checking(model, self.progress, loaded.prefix, spec.branch_marks):
                yield
        finally:
            self.progress.event("check", "end", check=spec.check, variant=what)

    def autocast(self, exact: bool) -> contextlib.AbstractContextManager[Any]:
        import torch

        if exact or self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def run(self, what: str, *, exact: bool = False, backward: bool = True, **changes: Any) -> Outcome:
        """Logits (and gradients of the next-token loss) of the variant with `changes` on the batch."""
        import torch
        import torch.nn.functional as F

        model = self.variant(exact, **changes)
        inputs, targets = self.tokens[:, :-1], self.tokens[:, 1:]
        with self.watched(model, what):
            with torch.set_grad_enabled(backward), self.autocast(exact):
                logits = logits_of(model(inputs))
            if backward:
                loss = F.cross_entropy(logits.to(self.exact_dtype).flatten(0, 1), targets.flatten())
                self.progress.in_backward = True
                try:
                    loss.backward()
                finally:
                    self.progress.in_backward = False
        grads = {
            name: (p.grad.detach() if p.grad is not None else None) for name, p in model.named_parameters()
        }
        return Outcome(logits.detach(), grads)

    def compare(self, got: Outcome, want: Outcome) -> tuple[float, str, dict[str, float]]:
        """Largest relative error of logits and gradients, where it is, and the error of every gradient."""
        worst, where = rel_err(got.logits, want.logits), f"logits ({worst_position(got.logits, want.logits)})"
        per_param: dict[str, float] = {}
        for name, ref in want.grads.items():
            grad = got.grads.get(name)
            if grad is None and ref is None:
                continue
            err = 1.0 if grad is None or ref is None else rel_err(grad, ref)
            per_param[name] = err
            if not err <= worst:  # NaN wins
                worst, where = err, f"gradient of {name}"
        return worst, where, per_param

    def bound(self, baseline: float | None) -> float:
        """Error limit: the floor alone (float64), or twice the same-dtype baseline plus the floor."""
        return self.floor if baseline is None else 2 * baseline + self.floor

    # ----------------------------------------------------------------------------------- properties

    def backends(self) -> Parity:
        inputs = self.tokens[:, :-1]
        size = inputs.shape[0] * inputs.shape[1] * self.cfg.layers
        against = REFERENCE if size <= REFERENCE_BUDGET else MASKED
        if against is MASKED and self.rebuilds:  # big: checkpoint every layer (gather's float64: 20+ GB)
            against = {**MASKED, "gc": "all", "gc_reentrant": False}
        truth = self.run("reference" if against is REFERENCE else "masked", exact=True, **against)
        baseline = None
        if not self.cpu:
            baseline = self.compare(self.run(f"masked {self.precision}", **MASKED), truth)[0]
        from nsa_core import CMP_BACKENDS, SEL_BACKENDS, TRITON_BACKENDS, WIN_BACKENDS

        triton = () if self.cpu else TRITON_BACKENDS  # the Triton kernels run on CUDA only (here)
        choices = {"sel": SEL_BACKENDS + triton, "cmp": CMP_BACKENDS + triton, "win": WIN_BACKENDS + triton}
        lists = {
            branch: [
                b
                for b in choices[branch]
                if not (b == against[f"{branch}_backend"] and self.cpu)  # compared with itself
                and not (b == "reference" and against is not REFERENCE)  # too slow here (REFERENCE_BUDGET)
            ]
            for branch in self.cfg.nsa.branches
        }
        if against is REFERENCE:  # one run per backend
            rounds = [{branch: b} for branch, names in lists.items() for b in names]
        else:  # big model: the i-th backend of every branch at once; a mismatch is then split per branch
            rounds = [
                {branch: names[i] for branch, names in lists.items() if i < len(names)}
                for i in range(max(map(len, lists.values()), default=0))
            ]
        bound = self.bound(baseline)
        errors: dict[str, float] = {}
        worst, where = 0.0, "-"
        pending = list(rounds)
        while pending:
            combo = pending.pop(0)
            name = ",".join(f"{branch}={b}" for branch, b in combo.items())
            changes = {**against, **{f"{branch}_backend": b for branch, b in combo.items()}}
            err, at, _ = self.compare(self.run(name, **changes), truth)
            errors[name] = err
            if len(combo) > 1 and not err <= bound:
                pending[:0] = [{branch: b} for branch, b in combo.items()]  # which branch's backend
            if not err <= worst:
                worst, where = err, f"{name}: {at}"
        against_text = (
            "reference"
            if against is REFERENCE
            else (
                f"masked{', gc all' if self.rebuilds else ''} (the naive reference loops over tokens in "
                f"Python: over {REFERENCE_BUDGET} token-layers "
                "it would take minutes, so it is checked against masked on smaller presets)"
            )
        )
        return Parity(max_err=worst, where=where, bound=bound, baseline=baseline, errors=errors,
                      against=against_text)  # fmt: skip

    def positions(self, seq_len: int) -> list[int]:
        """Cut points t for causality: near the start, at and around block boundaries, the end."""
        nsa = self.cfg.nsa
        candidates = {1, nsa.block_len, nsa.sel_block_len + 1, seq_len // 3, seq_len // 2 + 1, seq_len - 1}
        return sorted(t for t in candidates if 1 <= t < seq_len)

    def causality(self) -> Parity:
        import torch

        model = self.variant(exact=False)
        inputs = self.tokens[:, :-1]
        vocab = int(self.base.cfg.vocab)
        gen = torch.Generator().manual_seed(self.trainer.spec.seed + 17)
        errors: dict[str, float] = {}
        worst, where = 0.0, "-"
        with self.watched(model, "causality"), torch.no_grad(), self.autocast(False):
            base = model(inputs)
            for t in self.positions(inputs.shape[1]):
                changed = inputs.clone()
                shift = torch.randint(1, vocab, changed[:, t:].shape, generator=gen).to(changed.device)
                changed[:, t:] = (changed[:, t:] + shift) % vocab  # every token from t on differs
                logits = model(changed)
                err = rel_err(logits[:, :t], base[:, :t])
                errors[f"t={t}"] = err
                if not err <= worst:
                    worst = err
                    where = f"tokens changed from t={t}: logits before t differ, most at " + worst_position(
                        logits[:, :t], base[:, :t]
                    )
        return Parity(max_err=worst, where=where, bound=self.bound(None), errors=errors)

    def prefill(self) -> Parity:
        import torch

        inputs = self.tokens[:, :-1]
        seq_len = inputs.shape[1]
        split = max(1, seq_len // 2 + 1)
        outcomes: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            batched = self.variant(exact=True, prefill="batched", gc="none")
            with self.watched(batched, "batched (exact)"):
                want = batched(inputs)
            del batched
            baseline = None
            model = self.variant(prefill="batched", gc="none")
            with self.watched(model, "batched"), self.autocast(False):
                outcomes["batched"] = model(inputs)
                logits, cache = model.prefill(inputs[:, :split])
                steps = [logits]
                for t in range(split, seq_len):
                    step_logits, cache = model.decode(inputs[:, t : t + 1], cache)
                    steps.append(step_logits)
                outcomes[f"prefill {split} + decode"] = torch.cat(steps, dim=1)
            if not self.cpu:
                baseline = rel_err(outcomes["batched"], want)
            sequential = self.variant(prefill="sequential", gc="none")
            with self.watched(sequential, "sequential"), self.autocast(False):
                outcomes["sequential"] = sequential(inputs)
        errors: dict[str, float] = {}
        worst, where = 0.0, "-"
        for name, logits in outcomes.items():
            err = rel_err(logits, want)
            errors[name] = err
            if not err <= worst:
                worst, where = err, f"{name} vs batched: {worst_position(logits, want)}"
        return Parity(max_err=worst, where=where, bound=self.bound(baseline), baseline=baseline,
                      errors=errors, split=split)  # fmt: skip

    def gc_configs(self) -> list[tuple[str, bool]]:
        """The case's own checkpointing when it sets one; else all and a middle range, reentrant and not."""
        if self.cfg.gc != "none":
            return [(self.cfg.gc, self.cfg.gc_reentrant)]
        layers = self.cfg.layers
        start = max(1, layers // 4) if layers > 1 else 0
        stop = max(start + 1, layers - max(1, layers // 4))
        ranges = list(dict.fromkeys(["all", f"{start}:{stop}"]))
        return [(gc, reentrant) for gc in ranges for reentrant in (False, True)]

    def layer_of(self, name: str) -> int | None:
        match = re.match(re.escape(self.prefix) + r"\.(\d+)\.", name)
        return int(match.group(1)) if match else None

    def gc(self) -> Parity:
        inputs = self.tokens[:, :-1]
        big = self.cpu and inputs.shape[0] * inputs.shape[1] * self.cfg.layers > REFERENCE_BUDGET
        # A big model in float64 without checkpointing (the truth) keeps every layer's activations: with
        # gather at m7c-125m's geometry that is 27 GB. Checkpointing does not depend on the attention
        # backend, so big models compare with the masked backends (0.5 GB a layer at its default S).
        backends = MASKED if big else {}
        truth = self.run("gc none (exact)", exact=True, gc="none", gc_reentrant=False, **backends)
        baseline = None
        if not self.cpu:
            baseline = self.compare(
                self.run(f"gc none {self.precision}", gc="none", gc_reentrant=False), truth
            )[0]
        bound = self.bound(baseline)
        errors: dict[str, float] = {}
        per_layer: dict[str, float] = {}
        worst, where = 0.0, "-"
        for gc, reentrant in self.gc_configs():
            name = f"gc {gc}" + (" reentrant" if reentrant else "")
            err, at, per_param = self.compare(
                self.run(name, gc=gc, gc_reentrant=reentrant, **backends), truth
            )
            errors[name] = err
            for param, perr in per_param.items():
                layer = self.layer_of(param)
                key = "other" if layer is None else str(layer)
                if key not in per_layer or not perr <= per_layer[key]:
                    per_layer[key] = perr
            if not err <= worst:
                worst, where = err, f"{name}: {at}"
        differ = sorted(int(k) for k, v in per_layer.items() if k != "other" and not v <= bound)
        backends_text = (
            "masked (float64 activations of the case's own backends would not fit)" if big else "own"
        )
        return Parity(max_err=worst, where=where, bound=bound, baseline=baseline, errors=errors,
                      per_layer=per_layer, layers_differ=differ, backends=backends_text)  # fmt: skip


def run_check(trainer: TrainingRun) -> tuple[Parity, str]:
    """Run the spec's property; ``(parity, reason)`` when it holds, CaseFailed("mismatch") when not. A
    relative error that is not finite is written as null (`nsa_diag.records`) and fails its bound."""
    prop = trainer.spec.check
    assert prop is not None
    checker = Checker(trainer)
    parity = Parity.model_validate(getattr(checker, prop)())
    parity.property, parity.precision = prop, checker.precision
    if not parity.errors:  # nothing was compared (no backend, no cut point): the property is not shown
        why = f"{prop}: nothing to compare ({NOTHING_TO_COMPARE[prop]})"
        raise CaseFailed("unchecked", why, parity=Parity(property=prop, checked=False, why=why))
    err, bound = parity.max_err, parity.bound
    assert err is not None
    assert bound is not None
    text = f"{prop}: largest relative error {err:.3g} (bound {bound:.3g}, {checker.precision})"
    if not err <= bound:
        raise CaseFailed("mismatch", f"{text} at {parity.where}", parity=parity)
    return parity, text
