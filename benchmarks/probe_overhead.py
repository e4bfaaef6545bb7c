"""What the progress probes cost a training step: blocks of steps with and without them, in one process.

Issue 17's bar: ``attach_progress`` (the hooks our cases and ``nsa-diag watch`` put on a model) costs at most
3% of an m7c-125m training step (Triton branches, bf16, AdamW, one GPU) at B x S = 8 x 2048, 1 x 16384 and
32 x 512. For each shape one model and optimizer run, after warm-up, ``--rounds`` rounds of one block of
``--steps`` timed steps per variant (the order rotates from round to round; the first step of each block is
not timed):

    plain    no probe
    old      the mechanism before graph hooks, copied here for the comparison only: full module backward
             hooks (a Python autograd Function on every hooked module's inputs and outputs) and a
             progress.jsonl line written per event
    probe    `nsa_diag.probe.hooks.attach_progress` as cases and watch use it by default (the blocks' hooks)
             with the worker's sink, `nsa_diag.worker.probes.Progress` (beacon per event, progress.jsonl
             lines queued and written by the heartbeat thread)
    marks    the same with ``branches=True`` (``--branch-marks``): a mark per NSA branch in backward too
    beacon   the probe's hooks with a sink that only updates the beacon (what a light probe's sink does)
    null     the probe's hooks with a sink that does nothing: what the hooks cost without any sink
    watch    ``probe`` plus what a watched job's probe adds each step (issue 48): the loss's check
             (`LossWatch`: on a GPU a copy into pinned memory behind an event, no sync) and the sum of each
             block's output (`BlockWatch`: one reduction a block, read with the loss), which name a NaN's
             first block

The worker's heartbeat thread (`Heartbeat`, 10 ticks a second, writing the queued lines) runs for the whole
run, as it does in a case. Each step is timed with CUDA events and ends with a synchronize (``--smoke``: the
process's CPU time, one torch thread). The table gives the median step per variant, what it adds to
``plain``'s in ms and in %, the paired overhead (per round, the variant's block median against plain's
block of the same round, then the median over rounds: a drift of the step time over the run cancels out),
the host time (the process's CPU time while it issues a step, before the synchronize) and what the variant
adds to it (paired the same way, in ms and in % of plain's step: what the probe adds to a step that the
host bounds),
the progress events per step as the beacon counted them (``null`` records
none) and the autograd graph's nodes per step (``old`` adds nodes; the graph hooks add none).

With ``--compile BACKEND`` (issue 30) every variant is its own copy of the model (the same weights), its
probe attached before ``torch.compile(model, backend=BACKEND)``, as ``nsa-diag run --compile`` and a
watched job that compiles its model have it: inside the compiled graph the blocks' hooks are traced as
nothing (no graph break), so what a variant adds is its events around the graph and any guard or
recompilation its hooks cause. Each copy compiles on its first steps (the warm-up, per variant); the
table then counts the graph breaks and recompilations of the whole run. ``old`` (an autograd Function
per hooked module) is left out there.

    python benchmarks/probe_overhead.py                   # the three shapes on the GPU
    python benchmarks/probe_overhead.py --smoke           # CPU, tiny widths at 12 layers, under a minute
    python benchmarks/probe_overhead.py --compile inductor --variants plain probe --shapes 8x2048 1x16384
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nsa_core
from nsa_diag.beacon import BeaconWriter, read_beacon
from nsa_diag.options import CompileBackend
from nsa_diag.probe.hooks import attach_progress, find_blocks, nsa_attentions
from nsa_diag.probe.runtime import BlockWatch, LossWatch
from nsa_diag.worker.probes import Heartbeat, Progress

VARIANTS = ("plain", "old", "probe", "marks", "beacon", "null", "watch")
SHAPES = ("8x2048", "1x16384", "32x512")
SMOKE_SHAPES = ("1x64", "4x64")
SMOKE_LAYERS = (
    12  # m7c-125m's depth, so the probes' Python per step is m7c's; tiny widths keep the math small
)


# ------------------------------------------------------------------------------------------------ sinks


class BeaconSink:
    """Beacon only, no progress.jsonl: the sink of a light probe in a user's process."""

    def __init__(self, beacon: BeaconWriter) -> None:
        self.beacon = beacon
        self.step: int | None = None
        self.in_backward = False

    @property
    def forward_phase(self) -> str:
        return "recompute" if self.in_backward else "forward"

    @property
    def backward_phase(self) -> str:
        return "backward"

    def event(
        self,
        phase: str,
        event: str | None = None,
        *,
        layer: int | None = None,
        branch: str | None = None,
        module: str | None = None,
        **extra: Any,
    ) -> int:
        return self.beacon.update(
            phase=phase, step=self.step, layer=layer, branch=branch, event=event, module=module
        )


def _old_json(value: str | int | None) -> str:
    if value is None:
        return "null"
    if isinstance(value, int):
        return str(value)
    if value.isidentifier() or (value.replace(".", "_").isidentifier() and value.isascii()):
        return f'"{value}"'
    return json.dumps(value)


class _LossProbe:
    """What `LossWatch` uses of the probe (`nsa_diag.probe.runtime.Probe`): its sink, its block watch and
    the loss's record (here only whether it was finite: nonfinite.json is written once, at a NaN)."""

    def __init__(self, sink: Any, block_watch: BlockWatch) -> None:
        self.sink, self.block_watch = sink, block_watch
        self.nonfinite_seen = False

    def record_loss(self, value: Any, step: int | None = None, seen: str = "") -> None:
        self.nonfinite_seen = not math.isfinite(float(value))


class NullSink(BeaconSink):
    """Takes every event and does nothing: the hooks' own cost."""

    def event(self, phase: str, event: str | None = None, **where: Any) -> int:
        return 0


class OldProgress(BeaconSink):
    """`Progress` as it was before the lines were queued: lock, beacon, location and one line written to the
    line-buffered progress.jsonl per event (for the ``old`` variant only)."""

    def __init__(self, beacon: BeaconWriter, stream: Any) -> None:
        super().__init__(beacon)
        self._stream = stream
        self._lock = threading.Lock()
        self.where: dict[str, Any] = {}

    def event(
        self,
        phase: str,
        event: str | None = None,
        *,
        layer: int | None = None,
        branch: str | None = None,
        module: str | None = None,
        **extra: Any,
    ) -> int:
        with self._lock:
            step = self.step
            seq = self.beacon.update(
                phase=phase, step=step, layer=layer, branch=branch, event=event, module=module
            )
            self.where = {"phase": phase, "step": step, "layer": layer, "branch": branch,
                          "module": module, "event": event}  # fmt: skip
            line = (
                f'{{"seq": {seq}, "t": {time.time():.6f}, "phase": {_old_json(phase)}, '
                f'"step": {_old_json(step)}, "layer": {_old_json(layer)}, "branch": {_old_json(branch)}, '
                f'"module": {_old_json(module)}, "event": {_old_json(event)}'
            )
            self._stream.write(line + "}\n")
        return seq


# ------------------------------------------------------------------- the old hooks (comparison only)


def old_attach_progress(model: nn.Module, progress: Any) -> list[Any]:
    """The progress hooks before graph hooks: full module backward hooks on blocks and branch modules."""
    prefix, blocks = find_blocks(model)
    handles: list[Any] = []
    for layer, block in enumerate(blocks):
        name = f"{prefix}.{layer}"
        handles += _old_hooks(block, block, progress, layer, None, name, name)
        for rel, attn in nsa_attentions(block):
            for branch in attn.nsa.branches:
                kv, tap = getattr(attn, f"kv_{branch}"), attn.branch_out[branch]
                base = f"{name}.{rel}"
                names = f"{base}.kv_{branch}", f"{base}.branch_out.{branch}"
                handles += _old_hooks(kv, tap, progress, layer, branch, *names)
    return handles


def _old_hooks(
    first: nn.Module,
    last: nn.Module,
    progress: Any,
    layer: int,
    branch: str | None,
    first_name: str,
    last_name: str,
) -> list[Any]:
    def emit(phase: str, event: str, module: str) -> None:
        progress.event(phase, event, layer=layer, branch=branch, module=module)

    return [
        first.register_forward_pre_hook(lambda m, a: emit(progress.forward_phase, "begin", first_name)),
        last.register_forward_hook(lambda m, a, o: emit(progress.forward_phase, "end", last_name)),
        last.register_full_backward_pre_hook(lambda m, g: emit(progress.backward_phase, "begin", last_name)),
        first.register_full_backward_hook(lambda m, gi, go: emit(progress.backward_phase, "end", first_name)),
    ]


# --------------------------------------------------------------------------------------------- the run


def build(smoke: bool, device: torch.device, dtype: torch.dtype) -> nn.Module:
    if smoke:
        cfg = nsa_core.preset("tiny", layers=SMOKE_LAYERS)
    else:
        cfg = nsa_core.preset("m7c-125m", sel_backend="triton", cmp_backend="triton", win_backend="triton")
    return nsa_core.TinyLM(cfg).to(device=device, dtype=dtype)


def graph_nodes(loss: torch.Tensor) -> int:
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return len(seen)


class Bench:
    """One shape: the model, its optimizer, the sinks, and the timed step."""

    def __init__(self, args: argparse.Namespace, B: int, S: int) -> None:
        self.sync = args.device.type == "cuda"
        self.beacon_path = args.beacon.path
        self.backend: str | None = args.compile
        torch.manual_seed(0)
        self.model = build(args.smoke, args.device, args.dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        # --compile: per variant, its copy of the model with its probe attached, compiled, and its optimizer
        self.compiled: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
        self.base = self.model if self.backend else None  # the copies' weights: it never runs itself
        vocab = self.model.cfg.vocab
        self.tokens = torch.randint(0, vocab, (B, S + 1), device=args.device)
        self.sinks: dict[str, Any] = {
            "plain": None,
            "old": OldProgress(args.beacon, args.old_stream),
            "probe": args.progress,
            "beacon": BeaconSink(args.beacon),
            "null": NullSink(args.beacon),
            "marks": args.progress,
            "watch": args.progress,
        }
        self.sink: Any = None
        self.variant: str | None = None
        self.loss_watches: dict[str, LossWatch] = {}  # the ``watch`` variant's (per compiled copy)
        self.nodes = 0

    def step(self, count_nodes: bool = False) -> None:
        sink = self.sink
        if sink is not None:
            sink.step = (sink.step or 0) + 1
        logits = self.model(self.tokens[:, :-1])  # under --compile: the variant's compiled copy
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.tokens[:, 1:].flatten())
        if count_nodes:
            self.nodes = graph_nodes(loss)
        loss_watch = self.loss_watches.get(self.variant) if self.variant else None
        if loss_watch is not None:  # what the probe's Tensor.backward wrapper does with the loss
            loss_watch.seen(loss, torch)
        if sink is not None:
            sink.in_backward = True
        loss.backward()
        if sink is not None:
            sink.in_backward = False
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed_step(self) -> tuple[float, float]:
        """(step ms, host ms): the step on the device (CUDA events, then a synchronize), and the CPU time
        of this process while it issued the step, before the synchronize (every thread: the main one and
        autograd's device thread, where the backward hooks run). What the probe adds to the host time is
        what it can add to a step that the host bounds. On the CPU (``--smoke``) both are CPU time."""
        if not self.sync:  # the process's CPU time: on a shared machine, steadier than the wall clock
            start = time.process_time()
            self.step()
            ms = (time.process_time() - start) * 1e3
            return ms, ms
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        cpu = time.process_time()
        self.step()
        host = (time.process_time() - cpu) * 1e3
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host

    def _events(self) -> int:
        state = read_beacon(self.beacon_path)
        return state.seq if state else 0

    def _attach(self, model: nn.Module, variant: str) -> list[Any]:
        if variant == "old":
            return old_attach_progress(model, self.sink)
        if variant == "marks":
            return attach_progress(model, self.sink, branches=True)
        if variant == "watch":
            handles = attach_progress(model, self.sink)
            blocks = BlockWatch.attach(model, self.sink)
            self.loss_watches[variant] = LossWatch(_LossProbe(self.sink, blocks))  # type: ignore[arg-type]
            return handles + blocks.handles
        return [] if variant == "plain" else attach_progress(model, self.sink)

    def use(self, variant: str, warmup: int = 0) -> None:
        """--compile: make ``variant``'s compiled copy the model the steps run (the first use builds it,
        attaches its probe for good, compiles it and runs ``warmup`` steps, which compile)."""
        if variant not in self.compiled:
            assert self.base is not None
            model = copy.deepcopy(self.base)
            self.sink = self.sinks[variant]
            self._attach(model, variant)
            compiled = torch.compile(model, backend=self.backend)
            self.compiled[variant] = (compiled, torch.optim.AdamW(model.parameters(), lr=1e-4))
            self.model, self.opt = self.compiled[variant]
            for _ in range(warmup):
                self.step()
            self.sink = None
        self.model, self.opt = self.compiled[variant]

    def block(self, variant: str, steps: int) -> tuple[list[tuple[float, float]], int, int]:
        """``steps`` timed steps with ``variant``'s probe on: ((step ms, host ms) each, events per step,
        graph nodes)."""
        self.sink, self.variant = self.sinks[variant], variant
        handles: list[Any] = []
        if self.backend:
            self.use(variant)
        else:
            handles = self._attach(self.model, variant)
        try:
            seq = self._events()
            self.step(count_nodes=True)  # not timed: the first step after attaching
            events = self._events() - seq
            times = [self.timed_step() for _ in range(steps)]
        finally:
            for handle in handles:
                handle.remove()
            self.sink, self.variant = None, None
            if not self.backend:
                self.loss_watches.pop(variant, None)
        return times, events, self.nodes


def measure(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    B, S = (int(n) for n in shape.split("x"))
    row: dict[str, Any] = {"shape": shape, "B": B, "S": S}
    try:
        bench = Bench(args, B, S)
        if args.compile:
            from torch._dynamo.utils import counters

            torch._dynamo.reset()
            counters.clear()
            for variant in args.variants:  # each copy compiles in its warm-up
                bench.use(variant, args.warmup)
        for _ in range(0 if args.compile else args.warmup):
            bench.step()
        times: dict[str, list[float]] = {v: [] for v in args.variants}
        hosts: dict[str, list[float]] = {v: [] for v in args.variants}
        ratios: dict[str, list[float]] = {v: [] for v in args.variants}
        host_added: dict[str, list[float]] = {v: [] for v in args.variants}
        for r in range(args.rounds):
            order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
            medians, host_medians = {}, {}
            for variant in order:
                block, events, nodes = bench.block(variant, args.steps)
                times[variant] += [ms for ms, _ in block]
                hosts[variant] += [host for _, host in block]
                medians[variant] = statistics.median(ms for ms, _ in block)
                host_medians[variant] = statistics.median(host for _, host in block)
                row.setdefault(variant, {}).update(events=events, graph_nodes=nodes)
            for variant in args.variants:  # against plain's block of the same round: drift cancels
                ratios[variant].append(medians[variant] / medians["plain"])
                host_added[variant].append(host_medians[variant] - host_medians["plain"])
        plain = statistics.median(times["plain"])
        for variant in args.variants:
            ms = statistics.median(times[variant])
            row[variant].update(
                step_ms=ms,
                added_ms=ms - plain,
                overhead_pct=(ms / plain - 1) * 100,
                paired_pct=(statistics.median(ratios[variant]) - 1) * 100,
                paired_ratios=ratios[variant],  # per round: to pool calls, or to see the spread
                host_ms=statistics.median(hosts[variant]),
                host_added_ms=statistics.median(host_added[variant]),  # paired, as paired_pct
                host_added_pct=statistics.median(host_added[variant]) / plain * 100,
                steps=len(times[variant]),
            )
        if args.compile:
            row["compile"] = {
                "backend": args.compile,
                "graph_breaks": sum(counters["graph_break"].values()),
                "unique_graphs": counters["stats"]["unique_graphs"],
                "recompilations": counters["recompiles"].total() if "recompiles" in counters else 0,
            }
    except torch.cuda.OutOfMemoryError:
        row["error"] = "OOM"
    return row


def print_row(row: dict[str, Any], variants: list[str]) -> None:
    if "error" in row:
        print(f"{row['shape']:>8}  {row['error']}")
        return
    if "compile" in row:
        c = row["compile"]
        counts = f"{c['graph_breaks']} graph break(s), {c['unique_graphs']} graph(s)"
        print(f"{row['shape']:>8}  torch.compile ({c['backend']}), all variants: {counts}, "
              f"{c['recompilations']} recompilation(s)")  # fmt: skip
    for variant in variants:
        r = row[variant]
        added = "" if variant == "plain" else f"{r['added_ms']:+.2f}"
        overhead = "" if variant == "plain" else f"{r['overhead_pct']:+.1f}%"
        paired = "" if variant == "plain" else f"{r['paired_pct']:+.1f}%"
        host_added = "" if variant == "plain" else f"{r['host_added_ms']:+.2f} ({r['host_added_pct']:+.1f}%)"
        print(
            f"{row['shape']:>8}  {variant:<7} {r['step_ms']:>9.2f} {added:>9} {overhead:>9} {paired:>9} "
            f"{r['host_ms']:>8.2f} {host_added:>16} {r['events']:>7} {r['graph_nodes']:>7}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", help=f"BxS (default {' '.join(SHAPES)})")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: all (--compile: but old)")
    parser.add_argument("--rounds", type=int, default=5, help="blocks per variant (default 5)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per block (default 6)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, fp32, one thread: the tiny preset at 12 layers, small shapes",
    )
    parser.add_argument(
        "--compile",
        choices=[backend.value for backend in CompileBackend],
        help="each variant's model copy torch.compile'd with this backend",
    )
    parser.add_argument("--json", help="write the results to this file as well")
    args = parser.parse_args(argv)
    if args.compile and args.variants and "old" in args.variants:
        parser.error("--compile runs without the old variant: its autograd Function per module breaks graphs")
    if args.variants is None:
        args.variants = [v for v in VARIANTS if not (args.compile and v == "old")]
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")
    if args.smoke:
        args.device, args.dtype = torch.device("cpu"), torch.float32
        args.shapes = args.shapes or list(SMOKE_SHAPES)
        args.rounds, args.steps, args.warmup = min(args.rounds, 3), min(args.steps, 3), 2
        torch.set_num_threads(1)  # steadier on a shared machine
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/probe_overhead.py needs a CUDA device (or --smoke for the CPU)")
        args.device, args.dtype = torch.device("cuda"), torch.bfloat16
        args.shapes = args.shapes or list(SHAPES)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    header: dict[str, Any] = {"device": "cpu (smoke)", "torch": torch.__version__}
    if args.device.type == "cuda":
        import triton

        header |= {"device": torch.cuda.get_device_name(), "triton": triton.__version__}
    header |= {"date": datetime.date.today().isoformat(), "rounds": args.rounds, "steps": args.steps}
    if args.compile:
        header["compile"] = args.compile
    print(", ".join(f"{k} {v}" for k, v in header.items()))
    columns = f"{'variant':<7} {'step ms':>9} {'added ms':>9} {'overhead':>9} {'paired':>9} "
    columns += f"{'host ms':>8} {'host added':>16} {'events':>7} {'nodes':>7}"
    print(f"{'B x S':>8}  {columns}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="probe-overhead-") as tmp:
        folder = Path(tmp)
        args.beacon = BeaconWriter(folder / "beacon.bin")
        args.old_stream = open(folder / "old-progress.jsonl", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        stream = open(folder / "progress.jsonl", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        args.progress = Progress(args.beacon, stream)
        heartbeat = Heartbeat(args.beacon, folder, on_dump=lambda: None, progress=args.progress)
        heartbeat.start()
        try:
            for shape in args.shapes:
                row = measure(args, shape)
                if args.device.type == "cuda":
                    torch.cuda.empty_cache()  # the shape's model and optimizer are gone with `measure`
                print_row(row, args.variants)
                rows.append(row)
        finally:
            heartbeat.stopped = True
            heartbeat.join()
            args.progress.flush()
            for f in (stream, args.old_stream):
                f.close()
            args.beacon.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
