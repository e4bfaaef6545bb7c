"""The CLI contract: help, `env` and its variable filter, exit codes, and the error table.

Most tests run `python -m nsa_diag` in a real subprocess, as a user or a script would, so that exit codes,
stdout and stderr are the real ones.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from diag_cli import cli_env

from nsa_diag.app import report_error, run_cli
from nsa_diag.errors import EXIT_INTERNAL, EXIT_USAGE, ConfigError, UsageError, describe_error
from nsa_diag.evidence.env import is_recorded_name, select_env_vars

CLI_TIMEOUT_S = 120


def run_nsa_diag(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nsa_diag", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        stdin=subprocess.DEVNULL,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def test_help_lists_env_and_exits_0() -> None:
    done = run_nsa_diag("--help")
    assert done.returncode == 0, done.stderr
    assert "Native Sparse Attention" in done.stdout
    assert "env" in done.stdout.split("Commands", 1)[1]


def test_no_arguments_shows_help() -> None:
    done = run_nsa_diag()
    assert done.returncode == 0, done.stderr
    assert "Usage: nsa-diag" in done.stdout


def test_help_does_not_import_torch() -> None:
    code = "import sys; from nsa_diag.app import run_cli; run_cli(['--help']); print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_shell_completion_is_on_and_completes_commands_and_shipped_matrices() -> None:
    assert "--install-completion" in run_nsa_diag("--help").stdout
    # Typer detects the shell from the process tree (sh under make); its test switch takes the name given.
    script = run_nsa_diag(
        "--show-completion", "bash", env={"_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    )
    assert script.returncode == 0, script.stderr
    assert "_NSA_DIAG_COMPLETE" in script.stdout

    def complete(words: str) -> list[str]:
        cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
        env = {"_NSA_DIAG_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword}
        done = run_nsa_diag(env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert complete("nsa-diag mat") == ["matrix"]
    assert "--device" in complete("nsa-diag run --dev")
    assert complete("nsa-diag matrix cpu") == ["cpu-smoke"]


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("nsa-diag")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable}: the package is not pip-installed here")
    start = time.perf_counter()
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert "env" in done.stdout
    assert time.perf_counter() - start < 10  # generous; it takes well under a second without torch


def test_env_json_is_valid_and_names_torch() -> None:
    import torch

    done = run_nsa_diag("env", "--json")
    assert done.returncode == 0, done.stderr
    snapshot = json.loads(done.stdout)
    assert snapshot["torch"]["version"] == torch.__version__
    assert snapshot["torch"]["cuda_available"] == torch.cuda.is_available()
    assert snapshot["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    nvml = snapshot["nvml"]
    assert nvml["available"] or nvml["why"]  # either the facts or the reason they are missing
    system = snapshot["system"]  # collect_env's OS, libc, compiler and CPU facts
    assert set(system) == {"os", "libc", "gcc", "cpu_model", "python_build", "python_compiler"}
    assert system["os"]
    assert system["gcc"]  # the version, or why there is none
    if sys.platform == "linux":
        assert system["libc"]


def test_the_system_facts_are_cheap() -> None:
    # torch.utils.collect_env.get_env_info() runs pip, lscpu, gcc, cmake and nvidia-smi: the facts are
    # read directly instead (one `gcc --version`)
    from nsa_diag.evidence.env import _system

    start = time.perf_counter()
    _system()
    assert time.perf_counter() - start < 1.0


def test_run_folders_read_torchs_build_without_importing_torch_where_no_gpu_can_answer() -> None:
    """A run folder's env.json on a machine without a GPU device node: torch's version and build from its
    version module, CUDA unavailable and why, in a process that never imports torch (seconds of CPU on
    every nsa-diag start); `nsa-diag env` imports it (test_env_json_is_valid_and_names_torch)."""
    import torch

    from nsa_diag.devices import gpu_device_nodes

    if gpu_device_nodes():
        pytest.skip("this machine has a GPU device node: torch is imported to ask it")
    code = (
        "import json, sys; from nsa_diag.evidence.env import collect_env; "
        "env = collect_env(); print(json.dumps([env['torch'], env['triton'], 'torch' in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=True
    )
    facts, triton_facts, imported = json.loads(done.stdout)
    assert imported is False
    assert facts["version"] == torch.__version__
    assert facts["git_version"] == torch.version.git_version
    assert facts["cuda_build"] == torch.version.cuda
    assert facts["cuda_available"] is False
    assert "no GPU device node" in facts["cuda_why"]
    assert "torch not imported" in facts["runtime_why"]
    assert "num_threads" not in facts  # not asked, so not recorded: no guess
    triton = pytest.importorskip("triton")
    assert triton_facts == {"version": triton.__version__}


def run_env_in_process(
    *args: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """`nsa-diag env ARGS` in this process (the CLI's own `run_cli`) with `env` added to the environment:
    the snapshot reads os.environ as a subprocess's would; the entry point's own test is
    test_env_json_is_valid_and_names_torch (a subprocess costs a torch import, ~3 s of CPU)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = run_cli(["env", *args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["nsa-diag", "env", *args], code, captured.out, captured.err)


def test_env_records_only_the_listed_variables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secrets = {"SECRET_TOKEN": "hunter2-secret", "AWS_SECRET_ACCESS_KEY": "aws-secret-value"}
    listed = {"NSA_FOO": "bar", "TORCH_SHOW_CPP_STACKTRACES": "1", "OMP_NUM_THREADS": "4", "RANK": "1"}
    listed |= {"MASTER_ADDR": "10.0.0.1", "SLURM_JOB_ID": "77", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    withheld = {"SLURM_AUTH_TOKEN": "slurm-secret"}  # a recorded prefix: its name only
    env = {**listed, "HOME_MADE": "x", **secrets, **withheld}
    done = run_env_in_process("--json", env=env, monkeypatch=monkeypatch, capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert "slurm-secret" not in done.stdout
    assert "SLURM_AUTH_TOKEN" in json.loads(done.stdout)["env_vars_withheld"]
    env_vars = json.loads(done.stdout)["env_vars"]
    assert listed.items() <= env_vars.items()
    assert "HOME_MADE" not in env_vars
    assert all(is_recorded_name(name) for name in env_vars)
    for name, value in secrets.items():
        assert name not in done.stdout
        assert value not in done.stdout


def test_env_table_shows_nsa_variable_and_hides_others(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"NSA_FOO": "bar", "SECRET_TOKEN": "hunter2-secret"}
    done = run_env_in_process(env=env, monkeypatch=monkeypatch, capsys=capsys)
    assert done.returncode == 0, done.stderr
    assert "NSA_FOO" in done.stdout
    assert "torch" in done.stdout
    assert "SECRET_TOKEN" not in done.stdout
    assert "hunter2-secret" not in done.stdout


SECRETS = {"NSA_TOKEN": "tok-0a1b2c", "TORCH_SECRET": "sec-3d4e5f", "NSA_DIAG_PASSWORD": "pw-6a7b8c"}


@pytest.mark.parametrize(
    ("out", "says"),
    [
        pytest.param("/proc/self/x", "No such file or directory", id="proc"),
        pytest.param("/proc/self/status/x", "Not a directory", id="under-a-file"),
    ],
)
def test_an_out_where_no_run_folder_can_be_made_is_exit_2(
    out: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # in process, as test_bad_values_are_refused_before_any_case: refused before any case, so a subprocess
    # would add only its start-up (the entry point's one-line refusals: test_usage_error_exits_2_...)
    code = run_cli(["run", "--out", out])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert err.splitlines() == [f"nsa-diag: --out {out}: cannot create a run folder there: {says}"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_out_is_exit_2_and_left_as_it_was(tmp_path: Path) -> None:
    tmp_path.chmod(0o555)
    try:
        done = run_nsa_diag("run", "--out", str(tmp_path / "runs"))
    finally:
        tmp_path.chmod(0o755)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "cannot create a run folder there: Permission denied" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_full_file_system_is_refused_before_the_first_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from nsa_diag import artifacts

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(artifacts.shutil, "disk_usage", lambda path: usage._replace(free=4096))
    out = tmp_path / "a" / "runs"
    assert run_cli(["run", "--out", str(out)]) == EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == [
        f"nsa-diag: --out {out}: its file system is full (4 KiB free; a run needs 16 MiB)"
    ]
    assert list(tmp_path.iterdir()) == []  # not even the folders of --out


def test_a_run_folder_whose_first_file_cannot_be_written_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    from nsa_diag import artifacts

    def disk_full(path: Path, data: object) -> Path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(artifacts, "write_json", disk_full)
    assert run_cli(["run", "--out", str(tmp_path)]) == EXIT_USAGE
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("cannot write the run's files: No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_env_json_withholds_secret_values_and_names_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {**SECRETS, "NSA_DIAG_Auth_Header": "hdr-9d0e"}
    done = run_env_in_process("--json", env=env, monkeypatch=monkeypatch, capsys=capsys)
    assert done.returncode == 0, done.stderr
    for value in [*SECRETS.values(), "hdr-9d0e"]:
        assert value not in done.stdout
    snapshot = json.loads(done.stdout)
    assert snapshot["env_vars_withheld"] == sorted([*SECRETS, "NSA_DIAG_Auth_Header"])
    assert not set(snapshot["env_vars"]) & set(snapshot["env_vars_withheld"])


def test_replay_names_a_secret_variable_without_its_value(tmp_path: Path) -> None:
    from nsa_diag.artifacts import write_replay

    path = write_replay(tmp_path / "replay.sh", ["python", "-V"], {"NSA_API_KEY": "k-123", "NSA_X": "1"})
    text = path.read_text()
    assert "k-123" not in text
    assert "NSA_API_KEY" in text
    assert "export NSA_X=1" in text


def test_select_env_vars_matches_prefixes_exactly() -> None:
    environ = {
        "NSA_SEQ": "1",
        "NCCL_DEBUG": "INFO",
        "CUDA_VISIBLE_DEVICES": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TRITON_INTERPRET": "1",
        "TORCH_LOGS": "+dynamo",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/x",  # TORCHINDUCTOR_ is not TORCH_
        "nsa_lower": "1",  # names are case-sensitive
        "MY_NSA_THING": "1",  # a prefix, not a substring
        "HF_TOKEN": "secret",
        "OMP_NUM_THREADS": "8",  # named exactly
        "LOCAL_RANK": "0",
        "MASTER_PORT": "29500",
        "MY_RANK": "3",  # a name, not a suffix
        "SLURM_PROCID": "2",
        "SLURM_JOB_KEY": "k",  # a secret's name under a recorded prefix
    }
    assert select_env_vars(environ) == {
        "CUDA_VISIBLE_DEVICES": "0",
        "LOCAL_RANK": "0",
        "MASTER_PORT": "29500",
        "NCCL_DEBUG": "INFO",
        "NSA_SEQ": "1",
        "OMP_NUM_THREADS": "8",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "SLURM_PROCID": "2",
        "TORCH_LOGS": "+dynamo",
        "TRITON_INTERPRET": "1",
    }


def run_as_console_script(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`nsa-diag ARGS` in `cwd` as the console script runs it: the working directory is not on sys.path
    (`-P`; `python -m nsa_diag` would put it there itself), tests/diag is (the planted models); `env`
    adds variables."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "nsa_diag", *args],
        capture_output=True,
        text=True,
        env=cli_env(planted=True, **(env or {})),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


# A module that leaves a mark when it is executed.
MARKING_MODULE = """\
import pathlib
pathlib.Path(__file__).with_suffix(".ran").write_text("imported")
{rest}
"""


@pytest.fixture(
    scope="module",
    params=[  # the torchrun path of the same checks: make test-slow
        pytest.param(["run"], id="run"),
        pytest.param(["ddp", "--nproc", "2"], id="ddp", marks=pytest.mark.slow),
    ],
)
def secret_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One case run as the console script runs it, with secret variables in its environment, from a
    working directory that plants a `pydantic` module; the tests below read its run folder (one worker
    start for both: ~10 s of CPU each)."""
    work = tmp_path_factory.mktemp("work")
    (work / "pydantic.py").write_text(MARKING_MODULE.format(rest="raise ImportError('planted')"))
    done = run_as_console_script(*request.param, "--steps", "1", "--out", "runs", cwd=work, env=SECRETS)
    return done, work


def test_no_artifact_records_a_secret_value(
    secret_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, work = secret_run
    assert done.returncode == 0, done.stderr + done.stdout
    (run_dir,) = (work / "runs").iterdir()
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"env.json", "summary.json", "summary.md", "replay.sh"} <= {p.name for p in written}
    for path in written:
        data = path.read_bytes()
        for value in SECRETS.values():
            assert value.encode() not in data, f"{path.relative_to(run_dir)} records {value}"
    assert json.loads((run_dir / "env.json").read_text())["env_vars_withheld"] == sorted(SECRETS)


def test_the_worker_does_not_import_from_the_working_directory(
    secret_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, work = secret_run
    assert done.returncode == 0, done.stderr + done.stdout
    assert not (work / "pydantic.ran").exists()


@pytest.mark.slow
def test_a_model_module_runs_only_once_the_command_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "user_model.py").write_text(MARKING_MODULE.format(rest="from diag_user_model import build"))
    ran = tmp_path / "user_model.ran"
    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        "defaults: {seq_len: 16, batch: 1, device: cpu}\ncases: [{model: 'user_model:build'}]\n"
    )

    done = run_as_console_script("matrix", str(matrix), "--dry-run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = run_as_console_script("run", "--model", "user_model:build", "--lr", "0", cwd=tmp_path)
    assert done.returncode == EXIT_USAGE, done.stderr
    done = run_as_console_script("run", "--model", "user_model:nope", cwd=tmp_path)
    assert (done.returncode, done.stderr.strip()) == (
        EXIT_USAGE,
        "nsa-diag: --model user_model:nope: module user_model has no attribute 'nope'",
    )
    assert not ran.exists()

    # accepted: the worker imports it from the working directory
    done = run_as_console_script(
        "run", "--model", "user_model:build", "--seq-len", "16", "--out", "runs", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert ran.exists()


@pytest.mark.parametrize(
    ("target", "says"),
    [
        pytest.param("json.decoder:JSONDecoder", None, id="module-of-a-package"),
        pytest.param("os.path:join", None, id="imported-already"),
        pytest.param("os.path:nope", "module os.path has no attribute 'nope'", id="imported-no-attribute"),
        pytest.param("json.decoder.x:f", "cannot import json.decoder.x: no such module", id="not-a-package"),
    ],
)
def test_check_model_factory_finds_modules_without_importing_them(target: str, says: str | None) -> None:
    from nsa_diag.cases import check_model_factory

    if says is None:
        check_model_factory(target)
    else:
        with pytest.raises(UsageError, match=says):
            check_model_factory(target)


@pytest.mark.parametrize(
    "target", ["pkg.mod:Outer.build", "pkg.mod:", ":build", "pkg..mod:build", "pkg mod:b"]
)
def test_model_takes_a_module_path_and_a_function_name(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # in process: the syntax is refused before anything is imported or run (through the entry point:
    # test_commands.py's test_bad_input_from_the_shell[model])
    monkeypatch.chdir(tmp_path)
    code = run_cli(["run", "--model", target])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    expected = "expected 'pkg.module:factory' (a module path, a colon, a function's name)"
    assert err.strip().splitlines() == [f"nsa-diag: --model {target!r}: {expected}"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(["run", "--seed", str(10**23)], "--seed", id="seed-overflow"),
        pytest.param(["run", "--seed", "-1"], "--seed", id="seed-negative"),
        pytest.param(
            ["run", "--lr", "inf"], "--lr inf: the learning rate must be > 0, and finite", id="lr-inf"
        ),
        pytest.param(
            ["run", "--lr", "nan"], "--lr nan: the learning rate must be > 0, and finite", id="lr-nan"
        ),
        pytest.param(
            ["run", "--timeout", "inf"], "--timeout inf: must be more than 0 seconds", id="timeout-inf"
        ),
        pytest.param(["run", "--stall", "1e-9"], "--stall 1e-9: give at least 0.5 seconds", id="stall-tiny"),
        pytest.param(["run", "--stall", "inf"], "--stall inf: give at least 0.5 seconds", id="stall-inf"),
        pytest.param(
            ["run", "--inject", "slow:seconds=inf"], "seconds: Input should be a finite number", id="slow-inf"
        ),
        pytest.param(
            ["ddp", "--rdzv-endpoint", "127.0.0.1:99999"], "port 99999 is not in 1..65535", id="rdzv-port"
        ),
        pytest.param(
            ["scale", "--seq-lens", "32,64", "--memory-budget", "1.2.3GiB"],
            "--memory-budget '1.2.3GiB': expected a size",
            id="budget",
        ),
        pytest.param(["run", "--tag", "t" * 250], "250 characters; at most 64", id="tag-long"),
        pytest.param(["run", "--name", "n" * 300], "name: String should have at most 128", id="name-long"),
    ],
)
def test_bad_values_are_refused_before_any_case(
    args: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # in process (the CLI's own `run_cli`): a refusal comes before any case, so nothing would differ in a
    # subprocess but the interpreter's start (the entry point's own test: test_usage_error_exits_2...)
    code = run_cli([*args, "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    (line,) = err.splitlines()
    assert line.startswith("nsa-diag: ")
    assert says in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--bogus"], id="root"),
        pytest.param(["env", "--bogus"], id="env"),
        pytest.param(["no-such-command"], id="command"),
    ],
)
def test_usage_error_exits_2_with_one_line(args: list[str]) -> None:
    done = run_nsa_diag(*args)
    assert done.returncode == EXIT_USAGE
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("nsa-diag: ")
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_debug_adds_the_traceback_and_keeps_the_exit_code() -> None:
    done = run_nsa_diag("--debug", "env", "--bogus")
    assert done.returncode == EXIT_USAGE
    assert "Traceback" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("nsa-diag: No such option: --bogus")


def _raise_and_catch(fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:  # the test hands any exception to the table
        return exc
    raise AssertionError("expected an exception")


def test_config_value_error_from_nsa_core_maps_to_2() -> None:
    import nsa_core

    exc = _raise_and_catch(lambda: nsa_core.preset("tiny", heads=3))
    assert isinstance(exc, ValueError)
    code, message = describe_error(exc)
    assert code == EXIT_USAGE
    assert "heads=3" in message
    assert "\n" not in message


def test_unknown_preset_maps_to_2() -> None:
    import nsa_core

    code, message = describe_error(_raise_and_catch(lambda: nsa_core.preset("huge")))
    assert code == EXIT_USAGE
    assert "huge" in message


def test_value_error_outside_nsa_core_is_internal() -> None:
    code, message = describe_error(_raise_and_catch(lambda: int("not a number")))
    assert code == EXIT_INTERNAL
    assert message.startswith("internal error: ValueError")


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        pytest.param(UsageError("--gc 3:1 needs A < B"), EXIT_USAGE, id="usage"),
        pytest.param(ConfigError("seq_len must be\npositive"), EXIT_USAGE, id="config-multiline"),
        pytest.param(RuntimeError("boom"), EXIT_INTERNAL, id="runtime"),
        pytest.param(KeyError("x"), EXIT_INTERNAL, id="key"),
    ],
)
def test_error_table(exc: BaseException, code: int) -> None:
    got_code, message = describe_error(exc)
    assert got_code == code
    assert message
    assert "\n" not in message


def test_pydantic_errors_print_one_field_per_line() -> None:
    from pydantic import BaseModel, ConfigDict

    class Spec(BaseModel):
        model_config = ConfigDict(extra="forbid")
        seq_len: int
        batch: int

    exc = _raise_and_catch(lambda: Spec.model_validate({"seq_len": "x", "batch": 1, "extra": 2}))
    code, message = describe_error(exc)
    assert code == EXIT_USAGE
    lines = message.splitlines()
    assert len(lines) == 3  # a heading, then seq_len and extra
    assert lines[1].strip().startswith("seq_len:")
    assert lines[2].strip().startswith("extra:")


def test_report_error_prints_traceback_only_with_debug() -> None:
    exc = _raise_and_catch(lambda: 1 / 0)

    quiet = io.StringIO()
    assert report_error(exc, debug=False, stream=quiet) == EXIT_INTERNAL
    assert quiet.getvalue().count("\n") == 1
    assert "Traceback" not in quiet.getvalue()
    assert "--debug" in quiet.getvalue()

    loud = io.StringIO()
    assert report_error(exc, debug=True, stream=loud) == EXIT_INTERNAL
    assert "Traceback" in loud.getvalue()
    assert loud.getvalue().rstrip().splitlines()[-1].startswith("nsa-diag: internal error: ZeroDivisionError")


def test_run_cli_returns_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--version"]) == 0
    assert "nsa-diag" in capsys.readouterr().out
    assert run_cli(["env", "--no-such-flag"]) == EXIT_USAGE
    assert capsys.readouterr().err.count("\n") == 1


def test_a_failing_probe_becomes_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from nsa_diag.evidence import env as env_module

    def broken() -> dict[str, object]:
        raise RuntimeError("CUDA unknown error")

    monkeypatch.setattr(env_module, "_nvml", broken)
    snapshot = env_module.collect_env(environ={"NSA_X": "1", "PASSWORD": "p"})
    assert snapshot["nvml"] == {"why": "probe failed: RuntimeError: CUDA unknown error"}
    assert snapshot["env_vars"] == {"NSA_X": "1"}


@pytest.mark.parametrize(
    ("args", "code"),
    [
        pytest.param(["watch", "--", "true"], 0, id="pass"),
        pytest.param(["watch", "--", "false"], 1, id="fail-keeps-1"),
        pytest.param(["watch", "--json", "--", "true"], 0, id="json"),
        pytest.param(["run", "--device", "cpu"], 0, id="run", marks=pytest.mark.slow),
    ],
)
def test_a_closed_stdout_does_not_change_the_exit_code(args: list[str], code: int, tmp_path: Path) -> None:
    """``nsa-diag run | head -c 10``: the reader is gone when the table is written (here before the
    first byte, so that every write meets EPIPE); the exit code is still the verdict's, with no traceback
    and no 'Broken pipe' on stderr."""
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nsa_diag", *args[:1], "--out", str(tmp_path / "runs"), *args[1:]],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=cli_env(),
            cwd=tmp_path,
        )
        assert proc.stdout is not None
        proc.stdout.close()  # as `head -c 10` does once it has its bytes
        assert proc.wait(timeout=CLI_TIMEOUT_S) == code, stderr.read_text()
    said = stderr.read_text()
    assert "Traceback" not in said
    assert "Broken pipe" not in said
    assert "BrokenPipeError" not in said


@pytest.mark.parametrize(
    "command", [["run", "--device", "cpu"], ["watch", "--", "true"]], ids=["run", "watch"]
)
def test_a_removed_working_directory_is_one_line_and_exit_2(command: list[str], tmp_path: Path) -> None:
    """``cd d && rmdir ../d && nsa-diag run``: said before torch loads (whose MKL died on it with "Intel
    oneMKL FATAL ERROR"); no run folder."""
    out = tmp_path / "runs"
    line = 'cd gone && rmdir ../gone && exec "$@"'
    argv = [sys.executable, "-m", "nsa_diag", command[0], "--out", str(out), *command[1:]]
    (tmp_path / "gone").mkdir()
    done = subprocess.run(
        ["sh", "-c", line, "sh", *argv], capture_output=True, text=True, env=cli_env(), cwd=tmp_path,
        stdin=subprocess.DEVNULL, timeout=CLI_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.splitlines() == [
        "nsa-diag: the working directory no longer exists (it was removed); cd into one that does and run "
        "again"
    ]
    assert not out.exists()
