"""A rank's exception, told apart in a torchrun job's stderr and explained, without processes.

The stderr texts under ``recorded/`` are real: 2-rank gloo jobs of tests/diag/jobs/ run by ``nsa-diag watch
-- torchrun`` on torch 2.13 (``recorded/record_ddp_stderr.py`` regenerates them, with each rank's probe
record of DDP's parameter order in ``<name>.meta.json``); ``ddp_interleaved`` is the tee run's two ranks
merged line by line. One test runs the probe in a real (single-rank) DDP process to check the order it
records against DDP's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from diag_cli import cli_env
from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_diag.analysis.ddp_errors import explain_ddp_error
from nsa_diag.analysis.ranks import ends_said, rank_exit_codes
from nsa_diag.analysis.tracebacks import last_exception, rank_exceptions, split_by_rank, thread_deaths
from nsa_diag.classify import cpp_terminate
from nsa_diag.launchers import job
from nsa_diag.launchers.base import Ending
from nsa_diag.records import JobNotes, ProcessRecord, StopReport
from nsa_diag.spec import CaseResult, CaseSpec

RECORDED = Path(__file__).resolve().parent / "recorded"
AUX = ["aux_head.weight", "aux_head.bias"]


def _stderr(name: str) -> str:
    return (RECORDED / f"{name}.stderr.txt").read_text()


def _meta(name: str) -> dict[str, Any]:
    return json.loads((RECORDED / f"{name}.meta.json").read_text())


def _case(tmp_path: Path, name: str, *, probe: bool = True) -> tuple[Path, dict[int, dict[str, Any]]]:
    """A watched case's folder as the job left it: its stderr.log and each rank's probe.json (with its
    record of DDP's parameter order unless ``probe`` is False); the infos by pid."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "stderr.log").write_text(_stderr(name))
    infos = {}
    for info in _meta(name)["ranks"].values():
        if not probe:
            info = {k: v for k, v in info.items() if not k.startswith("ddp_")}
        folder = tmp_path / "procs" / f"pid-{info['pid']}"
        folder.mkdir(parents=True)
        (folder / "probe.json").write_text(json.dumps(info))
        infos[info["pid"]] = info
    return tmp_path, infos


# --- the stderr, per rank ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ddp_unused", "ddp_unused_info", "ddp_unused_tee", "ddp_interleaved"])
def test_each_rank_gets_its_own_exception_whatever_the_prefixes_and_interleaving(name: str) -> None:
    text = _stderr(name)
    found = rank_exceptions(text, (0, 1), rank_exit_codes(text))
    assert sorted(found) == [0, 1]
    for rank, tb in found.items():
        assert (tb.type, tb.found_by) == ("RuntimeError", "prefix")
        assert tb.first_line.startswith("Expected to have finished reduction in the prior iteration")
        # the message runs over torch's further lines, up to the rank's own indices
        assert f"Parameter indices which did not receive grad for rank {rank}: 20 21" in tb.message
        assert 'ddp_unused_param.py", line 52, in main' in tb.text
        assert "[rank" not in tb.text
        assert "[default" not in tb.text
        assert "ChildFailedError" not in tb.text


def test_interleaved_ranks_read_as_the_ranks_apart() -> None:
    apart = rank_exceptions(_stderr("ddp_unused_tee"), (0, 1))
    together = rank_exceptions(_stderr("ddp_interleaved"), (0, 1))
    assert {r: (tb.message, tb.text) for r, tb in apart.items()} == {
        r: (tb.message, tb.text) for r, tb in together.items()
    }


def test_two_prefixed_tracebacks_merged_line_by_line_keep_their_ranks() -> None:
    lines = _stderr("ddp_reentrant").splitlines()
    rank0 = [line for line in lines if line.startswith("[rank0]:")]
    rank1 = [line for line in lines if line.startswith("[rank1]:")]
    merged = "\n".join(line for pair in zip(rank1, rank0, strict=True) for line in pair)
    found = rank_exceptions(merged, (0, 1))
    assert sorted(found) == [0, 1]
    for tb in found.values():
        assert "Parameter at index 19 with name layers.2.mlp.2.bias" in tb.message
        assert "utils/checkpoint.py" in tb.text


def test_torchrun_summary_is_never_the_exception() -> None:
    text = _stderr("ddp_reentrant")
    assert "ChildFailedError" in text
    last = last_exception(text)
    assert last is not None
    assert last.type == "RuntimeError"
    assert job.last_traceback(text).type == "RuntimeError"  # type: ignore[union-attr]


def test_torch_multiprocessing_spawn_says_which_process_ended_and_how() -> None:
    """mp.spawn's account of a process that ended without an exception is the ranks' exit codes (its
    process index is the rank), never the exception; the processes it stopped after it are by pid."""
    text = (
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 20 vs 4.\n"
        "W1202 14:09:05.178000 24129 torch/multiprocessing/spawn.py:165] Terminating process 24135 via "
        "signal SIGTERM\n"
        "Traceback (most recent call last):\n"
        '  File "/tmp/train.py", line 31, in <module>\n'
        "    mp.spawn(worker, args=(2,), nprocs=2)\n"
        '  File "/x/torch/multiprocessing/spawn.py", line 192, in join\n'
        "    raise ProcessExitedException(\n"
        "torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with signal SIGABRT\n"
    )
    assert rank_exit_codes(text) == {0: -6}
    assert rank_exit_codes(text.replace("with signal SIGABRT", "with exit code 3")) == {0: 3}
    assert ends_said(text) == {24135: -15}
    killed = "RuntimeError: DataLoader worker (pid 4093) is killed by signal: Killed. \n"
    assert ends_said(killed) == {4093: -9}
    assert ends_said("DataLoader worker (pid 7) is killed by signal: Segmentation fault. ") == {7: -11}
    assert rank_exceptions(text, (0, 1), rank_exit_codes(text)) == {}  # spawn's own exception is no rank's
    assert cpp_terminate(text) == (
        "C++ exception gloo::EnforceNotMet: [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. "
        "20 vs 4."
    )
    assert cpp_terminate("Traceback (most recent call last):\nValueError: x") is None
    raised = (  # a process that raised: spawn's exception carries its traceback
        "Traceback (most recent call last):\n"
        '  File "/tmp/train.py", line 50, in <module>\n'
        "    mp.spawn(worker, args=(2,), nprocs=2)\n"
        "torch.multiprocessing.spawn.ProcessRaisedException: \n\n"
        "-- Process 1 terminated with the following error:\n"
        "Traceback (most recent call last):\n"
        '  File "/x/torch/multiprocessing/spawn.py", line 87, in _wrap\n'
        "    fn(i, *args)\n"
        '  File "/tmp/train.py", line 31, in worker\n'
        '    raise RuntimeError("corrupt shard 17")\n'
        "RuntimeError: corrupt shard 17\n"
    )
    assert rank_exit_codes(raised) == {1: 1}
    found = rank_exceptions(raised, (0, 1), rank_exit_codes(raised))
    assert list(found) == [1]
    assert (found[1].type, found[1].message) == ("RuntimeError", "corrupt shard 17")


def test_a_broken_dataloader_connection_names_the_workers_that_ended() -> None:
    """The main process's error after a DataLoader worker was killed is a race: torch's own message names
    the signal; "exited unexpectedly" or a ConnectionResetError inside multiprocessing do not, so the
    workers that ended without a normal exit are named with the OOM killer. Other errors get nothing."""
    processes = {
        "10": ProcessRecord(label="pid 10", role="training", state="exited with code 1"),
        "11": ProcessRecord(label="pid 11", role="dataloader-worker", state="ended (exit status unknown)"),
        "12": ProcessRecord(label="pid 12", role="dataloader-worker", state="idle: waiting for indices"),
    }
    roles = {10: "training", 11: "dataloader-worker", 12: "dataloader-worker"}
    reset = (
        "Traceback (most recent call last):\n"
        '  File "/x/python3.11/multiprocessing/connection.py", line 395, in _recv\n'
        "    chunk = read(handle, remaining)\n"
        "ConnectionResetError: [Errno 104] Connection reset by peer\n"
    )
    said = job._lost_workers(reset, processes, roles)
    assert said.startswith("; DataLoader workers ended without a normal exit (pid 11): "), said
    assert "OOM killer" in said
    unexpected = (
        'Traceback (most recent call last):\n  File "/x/torch/utils/data/dataloader.py", line 1304, in f\n'
        "RuntimeError: DataLoader worker (pid(s) 11) exited unexpectedly\n"
    )
    assert job._lost_workers(unexpected, processes, roles) == said
    other = (
        'Traceback (most recent call last):\n  File "t.py", line 1, in <module>\nConnectionResetError: x\n'
    )
    assert job._lost_workers(other, processes, roles) == ""  # not inside the DataLoader
    assert job._lost_workers(reset, {"10": processes["10"]}, roles) == ""  # no worker ended


# CPython's own fallback when a signal handler raises into the printing of a traceback (torch's SIGCHLD
# handler as a DataLoader worker dies): the frames printed so far, then the exception object dumped
# (3 of 30 runs of tests/diag/jobs/dataloader_worker_killed.py here, as these three)
_DUMP = (
    "object address  : 0x7f460b8018c0\nobject refcount : 2\nobject type     : 0x7f463c250f20\n"
    "object type name: ConnectionResetError\n"
    "object repr     : ConnectionResetError(104, 'Connection reset by peer')\nlost sys.stderr\n"
)
_DL_FRAMES = (
    "Traceback (most recent call last):\n"
    '  File "/w/jobs/dataloader_worker_killed.py", line 24, in <module>\n'
    "    for step, (x, y) in enumerate(DataLoader(Shards(), batch_size=8, num_workers=2)):\n"
)
_TORCH_FRAME = (
    '  File "/v/site-packages/torch/utils/data/dataloader.py", line 1291, in _try_get_data\n'
    "    data = self._data_queue.get(timeout=timeout)\n"
    "           ^^^^^^^^^^^^^"
)


@pytest.mark.parametrize(
    "text",
    [_DL_FRAMES + _TORCH_FRAME + _DUMP, _DL_FRAMES + _DUMP, _DUMP],
    ids=["cut-in-a-frame", "cut-after-a-frame", "no-frame"],
)
def test_an_exception_python_could_not_print_is_read_from_its_dump(text: str) -> None:
    """Before, such a job "exited with code 1 ...; its last stderr line: lost sys.stderr", a crash."""
    tb = last_exception(text)
    assert tb is not None
    assert tb.cut
    assert (tb.type, tb.message) == ("ConnectionResetError", "[Errno 104] Connection reset by peer")
    assert tb.text.endswith("\nConnectionResetError: [Errno 104] Connection reset by peer") or tb.text == (
        "ConnectionResetError: [Errno 104] Connection reset by peer"
    )
    assert "object address" not in tb.text
    if "line 1291" in text:
        assert tb.text.splitlines()[-2].rstrip().endswith("^^^^^^^^^^^^^")
    processes = {
        "10": ProcessRecord(label="pid 10", role="training", state="exited with code 1"),
        "11": ProcessRecord(label="pid 11", role="dataloader-worker", state="killed by SIGKILL"),
    }
    said = job._lost_workers(text, processes, {10: "training", 11: "dataloader-worker"})
    assert said.startswith("; DataLoader workers ended without a normal exit (pid 11): "), said


def test_an_object_dump_without_lost_stderr_is_no_exception() -> None:
    """A fatal error's dump (no "lost sys.stderr" after it) is not an exception the job raised."""
    assert last_exception(_DUMP.replace("lost sys.stderr\n", "Fatal Python error: bad\n")) is None


def test_bare_tracebacks_go_to_the_failed_ranks() -> None:
    text = _stderr("early_unprefixed")
    found = rank_exceptions(text, (0, 1), rank_exit_codes(text))
    assert sorted(found) == [0, 1]
    assert {tb.found_by for tb in found.values()} == {"order"}
    assert {tb.type for tb in found.values()} == {"FileNotFoundError"}
    # one failed rank without a prefixed traceback: the bare one is its
    only = "\n".join([
        "[rank0]: Traceback (most recent call last):", '[rank0]:   File "t.py", line 1, in <module>',
        "[rank0]: ValueError: bad",
        "Traceback (most recent call last):", '  File "t.py", line 3, in <module>', "KeyError: 'x'",
    ])  # fmt: skip
    found = rank_exceptions(only, (0, 1), {0: 1, 1: 1})
    assert (found[0].type, found[1].type, found[1].found_by) == ("ValueError", "KeyError", "only rank")
    # a message that names its rank
    named = (
        'Traceback (most recent call last):\n  File "t.py", line 3, in f\nRuntimeError: no grad for rank 1'
    )
    assert rank_exceptions(named, (0, 1))[1].found_by == "message"
    # a single process: no rank to give it to
    assert rank_exceptions(named.replace("for rank 1", "here")) == {}
    assert last_exception(named) is not None


def test_a_threads_uncaught_exception_is_told_by_threadings_header() -> None:
    """threading's default excepthook prints "Exception in thread <name>:" before the traceback; a
    traceback without it (the process's own, a rank's) is no thread's death. A hang's reason names the
    last thread that died (`job._dead_threads`)."""
    thread = [
        "Exception in thread Thread-1 (producer):",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.11/threading.py", line 1045, in _bootstrap_inner',
        "    self.run()",
        '  File "/data/prefetch.py", line 9, in producer',
        '    raise RuntimeError("corrupt record in shard-00042.tar")',
        "RuntimeError: corrupt record in shard-00042.tar",
    ]
    own = ["Traceback (most recent call last):", '  File "t.py", line 2, in <module>', "KeyError: 'x'"]
    text = "\n".join(
        ["step 4 loss 0.37", *thread, "step 5 loss 0.36", *own, *(f"[rank1]: {x}" for x in thread)]
    )
    deaths = thread_deaths(text)
    assert [(name, tb.type, tb.rank) for name, tb in deaths] == [
        ("Thread-1 (producer)", "RuntimeError", None)
    ] * 2
    assert thread_deaths("\n".join(own)) == []
    clause = job._dead_threads("\n".join(thread))
    assert clause == (
        "; earlier, the job's thread 'Thread-1 (producer)' died of an uncaught exception: RuntimeError: "
        "corrupt record in shard-00042.tar at prefetch.py:9 in producer"
    )
    assert "(2 threads died; the last)" in job._dead_threads(text)
    assert job._dead_threads("\n".join(own)) == ""


def test_a_world_size_the_job_did_not_start_is_named() -> None:
    """The probe notes the world size a rank's own init_process_group asks for (before the call) beside
    torchrun's WORLD_SIZE; a hang's reason names a difference. After a call that returned both are the
    group's, so no difference is left to name."""
    waiting = {11: {"rank": 0, "world_size": 2, "init_world_size": 3}, 12: {"rank": 1, "world_size": 2}}
    assert job._world_mismatch(waiting) == (  # type: ignore[arg-type]
        "; rank 0's init_process_group asked for world_size=3, but the job started 2 ranks (WORLD_SIZE=2): "
        "the process group waits for ranks that never come"
    )
    joined = {11: {"rank": 0, "world_size": 2, "init_world_size": 2}}
    assert job._world_mismatch(joined) == ""  # type: ignore[arg-type]
    assert job._world_mismatch({11: {"init_world_size": 4}}) == ""  # type: ignore[arg-type]  # spawn: unknown


def test_message_ends_at_a_log_record_and_a_chained_exception_is_the_last() -> None:
    text = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "t.py", line 1, in <module>',
        "[rank0]: KeyError: 'step'",
        "",
        "[rank0]: During handling of the above exception, another exception occurred:",
        "",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "t.py", line 4, in <module>',
        "[rank0]: RuntimeError: checkpoint has no step",
        "[rank0]: (saved by an older version)",
        "[rank0]:[W1127 12:45:03.970983715 ProcessGroupNCCL.cpp:1538] Warning: destroy_process_group() ...",
        "Traceback (most recent call last):",
        '  File "t.py", line 9, in <module>',
    ])  # fmt: skip
    (tb,) = rank_exceptions(text, (0,)).values()
    assert (tb.type, tb.message) == ("RuntimeError", "checkpoint has no step\n(saved by an older version)")
    ranks, bare = split_by_rank(text)
    assert list(ranks) == [0]
    assert len(bare) == 4  # two empty lines and the traceback that was cut short


_STDERR_CHARS = list("[]:rankdefault0123 \n\tTraceback(mostrecentcall)File:Err\x00é")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(_STDERR_CHARS)) | st.text())
def test_bad_input_never_raises(text: str) -> None:
    rank_exceptions(text, (0, 1), {0: 1})
    last_exception(text)
    explain_ddp_error(text, ["a"], traceback=text)
    job.last_traceback(text)


# --- DDP's errors explained --------------------------------------------------------------------------


def test_ddp_errors_explained_with_names_and_fix() -> None:
    names = ["embed.weight", "blocks.0.attn.kv_win.weight", "lm_head.weight"]
    unfinished = (
        "Expected to have finished reduction in the prior iteration before starting a new one. ... "
        "Parameter indices which did not receive grad for rank 1: 1"
    )
    explained = explain_ddp_error(unfinished, names)
    assert explained is not None
    assert (explained.kind, explained.params, explained.ranks) == (
        "unused-parameters", ("blocks.0.attn.kv_win.weight",), (1,)
    )  # fmt: skip
    assert "find_unused_parameters=True" in explained.explanation
    assert "--find-unused" not in explained.explanation  # our flag only for our own worker
    assert "--find-unused" in explain_ddp_error(unfinished, names, cli=True).explanation  # type: ignore[union-attr]
    twice = explain_ddp_error(
        "Expected to mark a variable ready only once. ... Parameter at index 2 has been marked as ready "
        "twice.",
        names,
    )
    assert twice is not None
    assert (twice.kind, twice.params) == ("marked-ready-twice", ("lm_head.weight",))
    assert "use_reentrant=False" in twice.explanation
    assert "static_graph=True" in twice.explanation
    # torch's static-graph message begins with the unfinished-reduction one's words
    changed = explain_ddp_error(
        "Expected to have finished reduction in the prior iteration before starting a new one. This error "
        "indicates that your training graph has changed in this iteration, e.g., one parameter is used in "
        "first iteration, but then got unused in the second iteration. this is not compatible with "
        "static_graph set to True.\nParameter indices which did not receive grad for rank 0: 0",
        names,
    )
    assert changed is not None
    assert (changed.kind, changed.params) == ("static-graph-changed", ("embed.weight",))
    assert explain_ddp_error("CUDA out of memory", names) is None


def test_unused_parameters_named_by_index_by_torch_or_not_at_all() -> None:
    tb = rank_exceptions(_stderr("ddp_unused"), (0, 1))[0]
    names = _meta("ddp_unused")["ranks"]["0"]["ddp_params"]
    assert explain_ddp_error(tb.message, names).params == tuple(AUX)  # type: ignore[union-attr]
    unnamed = explain_ddp_error(tb.message)
    assert unnamed is not None
    assert unnamed.params == ("#20", "#21")
    assert "TORCH_DISTRIBUTED_DEBUG=INFO" in unnamed.explanation
    info = rank_exceptions(_stderr("ddp_unused_info"), (0, 1))[0]
    assert set(explain_ddp_error(info.message).params) == set(AUX)  # type: ignore[union-attr]
    enabled = explain_ddp_error(
        "Expected to have finished reduction in the prior iteration before starting a new one. ... Since "
        "`find_unused_parameters=True` is enabled, this likely  means that not all `forward` outputs "
        "participate in computing loss."
    )
    assert enabled is not None
    assert "every output of forward" in enabled.fix


def test_reentrant_checkpointing_is_named_from_the_traceback() -> None:
    tb = rank_exceptions(_stderr("ddp_reentrant"), (0, 1))[1]
    cases = [(True, "find_unused_parameters=True took its parameters for unused"),
             (False, "a module checkpointed twice"), (None, "use_reentrant=True")]  # fmt: skip
    for find_unused, says in cases:
        explained = explain_ddp_error(tb.message, traceback=tb.text, find_unused=find_unused)
        assert explained is not None
        assert explained.params == ("layers.2.mlp.2.bias",)
        assert "reentrant activation checkpointing" in explained.cause
        assert says in explained.cause
    plain = explain_ddp_error(tb.message)  # without the traceback: a cause among others
    assert "reentrant activation checkpointing (use_reentrant=True)" in plain.cause  # type: ignore[union-attr]


_WORKER_ERROR = """Traceback (most recent call last):
  File "/home/me/train.py", line 31, in main
    for step, (x, y) in enumerate(loader, 1):
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1516, in _process_data
    data.reraise()
  File "/venv/lib/python3.11/site-packages/torch/_utils.py", line 749, in reraise
    raise exception
{outer}: Caught {inner_type} in DataLoader worker process 1.
Original Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", line 374, in _worker_loop
    data = fetcher.fetch(index)  # type: ignore[possibly-undefined]
  File "/home/me/train.py", line 15, in __getitem__
    raise {inner_type}(f"sample {{i}}: corrupt record")
{inner_type}: sample 137: corrupt record

"""


@pytest.mark.parametrize(
    ("outer", "inner_type", "says"),
    [
        ("ValueError", "ValueError", "sample 137: corrupt record (in DataLoader worker process 1)"),
        # an exception type torch cannot rebuild from a message comes back as a RuntimeError
        ("RuntimeError", "shards.BadShard",
         "shards.BadShard: sample 137: corrupt record (in DataLoader worker process 1)"),
    ],
)  # fmt: skip
def test_an_exception_from_a_dataloader_worker_says_its_own_line(
    outer: str, inner_type: str, says: str
) -> None:
    """torch re-raises a DataLoader worker's exception as "Caught X in DataLoader worker process N." with
    the original traceback in the message: the line a person reads is the original's, and where it was
    caught."""
    tb = last_exception(_WORKER_ERROR.format(outer=outer, inner_type=inner_type))
    assert tb is not None
    assert tb.type == outer
    assert tb.first_line == says


# --- the job's account and its verdict ----------------------------------------------------------------


@pytest.mark.parametrize("we_killed", [False, True], ids=["not-by-nsa-diag", "by-nsa-diag"])
def test_a_dataloader_worker_killed_by_sigkill_points_at_the_oom_killer(
    tmp_path: Path, we_killed: bool
) -> None:
    """torch's "DataLoader worker (pid N) is killed by signal: Killed." in a job nsa-diag did not kill: the
    kernel's OOM killer is the usual sender (as for a process of the job killed by SIGKILL)."""
    said = "RuntimeError: DataLoader worker (pid 32384) is killed by signal: Killed. at train.py:23 in main"
    root = _unit("error", said, 1)
    end = Ending(
        tmp_path, "exited", {99: root}, None, StopReport(exit_code=1, sigkill=we_killed), 1.0, JobNotes()
    )
    result = job.combine(CaseSpec(name="watch"), end, root=99, infos={}, ranks={}, rates={}, folders={})
    assert result.verdict == "error"
    note = "; nsa-diag did not send that SIGKILL: the kernel's OOM killer usually does (see dmesg)"
    assert result.reason == said + ("" if we_killed else note)


def test_a_helper_that_ended_with_the_job_is_not_said_to_have_crashed(tmp_path: Path) -> None:
    """A multiprocessing Pool's worker (a helper) that its pool terminated as the job ended: its exit
    status is not nsa-diag's to know, and its account says so, not "exited with code None without a
    result" (its own unit's crash classification, which never was a verdict of the job)."""
    root = _unit("pass", "the job exited with code 0", 0)
    helper = _unit_ended_unknown()
    end = Ending(tmp_path, "exited", {99: root, 120: helper}, None, StopReport(exit_code=0), 1.0, JobNotes())
    result = job.combine(
        CaseSpec(name="watch"), end, root=99, infos={}, ranks={}, rates={}, folders={},
        roles={99: "training", 120: "helper"}, parents={120: 99},
    )  # fmt: skip
    assert result.verdict == "pass"
    record = result.evidence.processes["120"]
    assert record.verdict is None
    assert record.reason == record.state
    assert record.state.startswith("ended (exit status unknown")
    assert "code None" not in record.reason


def _unit_ended_unknown() -> CaseResult:
    # what a unit's classification gives a process that ended without a result or a known exit status
    from nsa_diag.classify import Evidence, classify
    from nsa_diag.spec import Where

    c = classify(Evidence(outcome="exited", exit_code=None, where=Where(phase="done", event="begin")))
    assert c.verdict == "crash"
    assert "ended (exit status unknown) without a result at done" in c.reason
    return _unit(c.verdict, c.reason, None)


def test_a_breakpoint_left_in_the_code_is_said_as_such(tmp_path: Path) -> None:
    """pdb's BdbQuit (no message) from a breakpoint() left in a watched job, whose stdin is /dev/null: the
    reason says the debugger was entered and quit, at the job's line."""
    (tmp_path / "stderr.log").write_text(
        "Traceback (most recent call last):\n"
        '  File "/home/me/train.py", line 10, in <module>\n'
        "    opt.zero_grad()\n"
        '  File "/usr/lib/python3.11/bdb.py", line 90, in trace_dispatch\n'
        "    return self.dispatch_line(frame)\n"
        '  File "/usr/lib/python3.11/bdb.py", line 115, in dispatch_line\n'
        "    if self.quitting: raise BdbQuit\n"
        "bdb.BdbQuit\n"
    )
    report = job.job_report(1, tmp_path, {})
    assert report is not None
    assert report.status == "error"
    assert report.reason == (
        "bdb.BdbQuit: the debugger was entered (a breakpoint() or pdb.set_trace() in the code) and quit at "
        "once: the job's stdin is not a terminal at bdb.py:115 in dispatch_line, called from train.py:10 in "
        "<module> (exit code 1)"
    )


@pytest.mark.parametrize(
    ("last_line", "status"),
    [
        ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
         "memory: you tried to allocate 4000000000000 bytes. Error code 12 (Cannot allocate memory)", "oom"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", "oom"),
        ("MemoryError", "oom"),
        ("RuntimeError: shape '[8, 16]' is invalid for input of size 100", "error"),
    ],
)  # fmt: skip
def test_a_job_whose_memory_ran_out_is_oom_on_the_cpu_too(
    tmp_path: Path, last_line: str, status: str
) -> None:
    """torch's CPU allocator says "can't allocate memory" where CUDA's says "out of memory": both are oom
    for a watched job, as for the worker's own cases."""
    stderr = (
        "Traceback (most recent call last):\n"
        '  File "/home/me/train.py", line 8, in <module>\n'
        "    cache = torch.empty(10**12)\n"
        f"{last_line}\n"
    )
    (tmp_path / "stderr.log").write_text(stderr)
    report = job.job_report(1, tmp_path, {})
    assert report is not None
    assert report.status == status, report.reason
    assert "train.py:8 in <module>" in report.reason


def test_job_report_names_the_unused_parameters_and_the_fix(tmp_path: Path) -> None:
    case, infos = _case(tmp_path, "ddp_unused")
    report = job.job_report(1, case, infos)
    assert report is not None
    assert report.status == "grad-missing"
    assert report.missing_grads == AUX
    assert report.reason.startswith(
        "ranks 0, 1: DDP: parameters aux_head.weight, aux_head.bias got no gradient"
    )
    assert "find_unused_parameters=True" in report.reason
    assert "called from ddp_unused_param.py:52 in main; exit code 1)" in report.reason
    assert report.exception is not None
    assert "Parameter indices which did not receive grad" in report.exception.message


def test_job_report_without_the_probes_order_keeps_torchs_indices(tmp_path: Path) -> None:
    case, infos = _case(tmp_path, "ddp_unused", probe=False)
    report = job.job_report(1, case, infos)
    assert report is not None
    assert report.status == "grad-missing"
    assert report.missing_grads == ["#20", "#21"]


def test_job_report_names_reentrant_checkpointing(tmp_path: Path) -> None:
    case, infos = _case(tmp_path, "ddp_reentrant")
    report = job.job_report(1, case, infos)
    assert report is not None
    assert report.status == "error"
    assert report.reason.startswith("ranks 0, 1: DDP: parameter layers.2.mlp.2.bias marked ready twice")
    assert "find_unused_parameters=True took its parameters for unused" in report.reason
    assert "use_reentrant=False" in report.reason
    assert "ddp_reentrant_checkpoint.py:59 in main" in report.reason


def _unit(verdict: str, reason: str, code: int | None, signal: str | None = None) -> CaseResult:
    return CaseResult(
        name="watch", spec_hash="0", verdict=verdict, reason=reason, exit_code=code, signal=signal
    )  # type: ignore[arg-type]


def _combine(case: Path, name: str, per_rank: dict[int, CaseResult], root_result: CaseResult) -> CaseResult:
    ranks = {int(r): info["pid"] for r, info in _meta(name)["ranks"].items()}
    infos = {int(r): info for r, info in _meta(name)["ranks"].items()}
    end = Ending(
        case, "exited", {99: root_result, **per_rank}, None, StopReport(exit_code=1), 1.0, JobNotes()
    )
    return job.combine(CaseSpec(name="watch"), end, root=99, infos=infos, ranks=ranks, rates={}, folders={})


def test_a_rank_that_raised_is_the_cause_not_the_rank_torchrun_stopped(tmp_path: Path) -> None:
    case, infos = _case(tmp_path, "ddp_reentrant")
    codes = rank_exit_codes(_stderr("ddp_reentrant"))
    per_rank = {
        r: _unit("crash", "killed by SIGTERM" if c < 0 else "exited with code 1 without a result", c,
                 "SIGTERM" if c < 0 else None)
        for r, c in codes.items()
    }  # fmt: skip
    root = _unit("crash", "exited with code 1 without a result", 1)  # as if job_report had found nothing
    result = _combine(case, "ddp_reentrant", per_rank, root)
    assert result.verdict == "error", result.reason
    assert result.reason.startswith("ranks 0, 1: DDP: parameter layers.2.mlp.2.bias marked ready twice")
    for r in ("0", "1"):
        record = result.evidence["processes"][r]
        assert record["verdict"] == "error"
        assert record["reason"].startswith("DDP: parameter layers.2.mlp.2.bias marked ready twice")
        assert result.evidence["rank_exceptions"][r]["ddp_error"]["kind"] == "marked-ready-twice"
    case, _ = _case(tmp_path / "unused", "ddp_unused")
    result = _combine(case, "ddp_unused", {0: _unit("crash", "-", 1), 1: _unit("crash", "-", 1)}, root)
    assert (result.verdict, result.missing_grads) == ("grad-missing", AUX)


def test_a_rank_that_left_the_loop_first_is_named_after_the_peers_lost_collective(tmp_path: Path) -> None:
    """ddp_uneven_data.py: rank 1's shard held fewer batches; it exited 0 after 4 steps and rank 0's
    all-reduce in step 5 raised "Connection closed by peer". The verdict is rank 0's error, at the job's
    own line (past the probe's wrapper of `Tensor.backward` in its traceback), and the reason says that
    rank 1 had left the loop and why that ends a peer's collective. A rank's own error gets no such
    sentence."""
    case, _ = _case(tmp_path, "ddp_uneven")
    ranks = _meta("ddp_uneven")["ranks"]
    assert {r: info["steps_done"] for r, info in ranks.items()} == {"0": 4, "1": 4}

    def unit(verdict: str, code: int, steps: int) -> CaseResult:
        return CaseResult(
            name="watch", spec_hash="0", verdict=verdict, reason="-", exit_code=code, steps_done=steps
        )  # type: ignore[arg-type]

    per_rank = {0: unit("crash", 1, 4), 1: unit("pass", 0, 4)}
    result = _combine(case, "ddp_uneven", per_rank, _unit("crash", "exited with code 1", 1))
    assert result.verdict == "error", result.reason
    assert result.reason.startswith("rank 0: RuntimeError: "), result.reason
    assert "Connection closed by peer" in result.reason
    assert "called from ddp_uneven_data.py:34 in main (exit code 1)" in result.reason
    assert "runtime.py" not in result.reason
    assert (
        "; rank 1 exited normally (code 0) after 4 step(s); rank 0 raised in step 5, in a collective rank 1 "
        "never joined: a rank that leaves the training loop before the others (fewer batches on that rank: "
        "data sharded unevenly across ranks" in result.reason
    )
    case, _ = _case(tmp_path / "own", "ddp_reentrant")  # each rank's own exception: no rank left first
    per_rank = {0: unit("crash", 1, 2), 1: unit("pass", 0, 2)}
    result = _combine(case, "ddp_reentrant", per_rank, _unit("crash", "exited with code 1", 1))
    assert "never joined" not in result.reason


def test_a_rank_killed_by_a_signal_of_its_own_stays_the_cause(tmp_path: Path) -> None:
    case, _ = _case(tmp_path, "ddp_unused")
    only_rank1 = [line for line in _stderr("ddp_unused").splitlines() if not line.startswith("[rank0]")]
    (case / "stderr.log").write_text("\n".join(only_rank1))
    per_rank = {0: _unit("crash", "killed by SIGSEGV", -11, "SIGSEGV"), 1: _unit("crash", "-", 1)}
    result = _combine(case, "ddp_unused", per_rank, _unit("error", "-", 1))
    assert result.verdict == "crash"
    assert result.reason == "rank 0: killed by SIGSEGV"
    assert result.evidence["processes"]["1"]["verdict"] == "grad-missing"  # its own exception still shown


# --- the probe's record of DDP's parameter order ------------------------------------------------------

# --- ranks that torchrun restarted (--max-restarts) ------------------------------------------------------


def _restarted_case(tmp_path: Path, name: str) -> tuple[Path, dict[int, dict[str, Any]]]:
    """A watched case of a restarted job: its stderr.log and the probe.json of every rank process of
    every attempt (the last attempt's with DDP's record); the infos by unit key: the last attempt's ranks
    by rank, the earlier attempts' processes by pid (as the watch keys them)."""
    case, _ = _case(tmp_path, name)
    meta = _meta(name)
    last = {info["pid"]: info for info in meta["ranks"].values()}
    infos: dict[int, dict[str, Any]] = {}
    for pid, proc in meta["procs"].items():
        info = {**proc, **last.get(int(pid), {})}
        folder = case / "procs" / f"pid-{pid}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "probe.json").write_text(json.dumps(info))
        infos[info["rank"] if int(pid) in last else int(pid)] = info
    return case, infos


def test_attempts_torchrun_restarted_are_split_at_its_failure_lines() -> None:
    from nsa_diag.analysis.restarts import split_attempts

    text = _stderr("elastic_fail")
    ends, last = split_attempts(text, 1)
    (end,) = ends
    first_attempt = {int(pid) for pid, p in _meta("elastic_fail")["procs"].items() if p["restart_count"] == 0}
    assert (end.exit_code, end.local_rank) == (1, 1)
    assert end.pid in first_attempt
    assert "(attempt 0)" in end.text
    assert "(attempt 1)" not in end.text
    assert "(attempt 1)" in last
    assert "(attempt 0)" not in last
    assert split_attempts(text, 0) == ([], text)
    assert len(split_attempts(text, 5)[0]) == 2  # as many as torchrun logged


def test_a_job_that_passed_after_torchrun_restarted_its_ranks_says_why_it_restarted(tmp_path: Path) -> None:
    """elastic_retry.py: rank 1 raised OSError in step 3 of the first attempt; torchrun restarted both
    ranks, which resumed and finished. The job passes; the reason says the restart and what ended the
    first attempt, which ``evidence.restarts`` records."""
    case, infos = _restarted_case(tmp_path, "elastic_retry")
    ranks = {int(r): info["pid"] for r, info in _meta("elastic_retry")["ranks"].items()}
    passed = CaseResult(name="watch", spec_hash="0", verdict="pass", reason="the job exited with code 0",
                        exit_code=0)  # type: ignore[arg-type]  # fmt: skip
    end = Ending(
        case, "exited", {99: passed, 0: passed, 1: passed}, None, StopReport(exit_code=0), 1.0, JobNotes()
    )
    result = job.combine(CaseSpec(name="watch"), end, root=99, infos=infos, ranks=ranks, rates={}, folders={})
    assert result.verdict == "pass"
    assert result.reason == (
        "the job exited with code 0; torchrun restarted the ranks 1 time: attempt 1 ended with rank 1: "
        "OSError: shard-003.bin: Input/output error (attempt 0) at elastic_retry.py:35 in main (exit code 1)"
    )
    (ended,) = result.evidence["restarts"]
    first = {int(pid) for pid, p in _meta("elastic_retry")["procs"].items() if p["restart_count"] == 0}
    assert ended["attempt"] == 1
    assert ended["rank"] == 1
    assert ended["pid"] in first
    assert ended["exception"]["type"] == "OSError"
    assert "rank_exceptions" not in result.evidence  # the last attempt raised nothing
    assert job.job_report(0, case, infos).reason == "the job exited with code 0"  # type: ignore[union-attr]


def test_a_job_whose_every_attempt_failed_names_the_last_and_the_restart(tmp_path: Path) -> None:
    case, infos = _restarted_case(tmp_path, "elastic_fail")
    report = job.job_report(1, case, infos)
    assert report is not None
    assert report.reason.startswith("rank 1: OSError: shard-003.bin: Input/output error (attempt 1) at ")
    ranks = {int(r): info["pid"] for r, info in _meta("elastic_fail")["ranks"].items()}
    per_rank = {0: _unit("crash", "-", 1), 1: _unit("crash", "-", 1)}
    end = Ending(
        case, "exited", {99: _unit("crash", "exited with code 1", 1), **per_rank}, None,
        StopReport(exit_code=1), 1.0, JobNotes(),
    )  # fmt: skip
    result = job.combine(CaseSpec(name="watch"), end, root=99, infos=infos, ranks=ranks, rates={}, folders={})
    assert result.verdict == "error", result.reason
    assert result.reason.startswith("rank 1: OSError: shard-003.bin: Input/output error (attempt 1) at ")
    assert result.reason.endswith("; torchrun had restarted the ranks 1 time: attempt 1 ended the same way")
    assert result.evidence["rank_exceptions"]["1"]["message"].endswith("(attempt 1)")
    assert result.evidence["restarts"][0]["exception"]["message"].endswith("(attempt 0)")
    assert "init_process_group" not in result.reason  # the connect hint is for ranks that cannot connect


def test_restarted_ranks_that_cannot_connect_get_the_stores_hint() -> None:
    ended = [job.EndedAttempt(attempt=1, pid=4242, rank=1, exit_code=1)]
    again = job.Restarts(ended, ["rank 1: OSError: flaky (exit code 1)"], "")
    hung = (
        "rank 0: setup: blocked in torch.distributed at distributed_c10d.py:2169 in _new_process_group_helper"
    )
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in job._connect_hint(again, hung)
    assert job._connect_hint(again, "rank 0: step 4, backward: blocked in all_reduce") == ""
    assert job._connect_hint(job.Restarts([], [], ""), hung) == ""
    assert (
        again.text()
        == "; torchrun restarted the ranks 1 time: attempt 1 ended with rank 1: OSError: flaky (exit code 1)"
    )


_DDP_ORDER_JOB = """
import json, tempfile
import torch, torch.distributed as dist
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))           # the root's own, registered first
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.b[0].weight = self.a.weight                   # shared: counted once, where first seen
        self.skip = nn.Linear(4, 4)
        self.last = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.b(self.a(x * self.scale)) + self.last

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
net = Net()
net._ddp_params_and_buffers_to_ignore = ["skip.weight", "skip.bias"]
ddp = nn.parallel.DistributedDataParallel(net)
params, _ = ddp._build_params_for_reducer()  # DDP's index order, as its reducer got it
aliases = [[n for n, q in net.named_parameters(remove_duplicate=False) if q is p] for p in params]
print(json.dumps(aliases))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_probe_records_ddps_parameter_order(tmp_path: Path) -> None:
    from nsa_diag.launchers.command import probe_env

    env = {**cli_env(), **probe_env(tmp_path, cli_env()), "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run([sys.executable, "-c", _DDP_ORDER_JOB], capture_output=True, text=True, env=env,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    aliases = json.loads(proc.stdout.strip().splitlines()[-1])  # per DDP index: every name of its parameter
    (probe_json,) = (tmp_path / "procs").glob("pid-*/probe.json")
    info = json.loads(probe_json.read_text())
    assert len(info["ddp_params"]) == len(aliases)
    assert all(name in names for name, names in zip(info["ddp_params"], aliases, strict=True))
    assert info["ddp_params"] == ["scale", "last", "a.weight", "a.bias", "b.0.bias"]
    assert info["ddp_options"] == {"find_unused_parameters": False, "static_graph": False}


def test_a_script_that_does_not_compile_is_an_exception_at_its_line() -> None:
    """Issue 48: Python prints no "Traceback" for the script it cannot compile; the error is still the
    job's exception, at the file and line Python names."""
    stderr = (
        "  File \"/home/me/train.py\", line 12\n    x = (1,\n        ^\nSyntaxError: '(' was never closed\n"
    )
    tb = last_exception(stderr)
    assert tb is not None
    assert (tb.type, tb.message) == ("SyntaxError", "'(' was never closed")
    assert 'File "/home/me/train.py", line 12, in <module>' in tb.text
    assert last_exception('  File "/home/me/train.py", line 12\n    x = 1\n') is None
