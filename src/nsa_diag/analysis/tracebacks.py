"""Python tracebacks in a job's stderr, told apart by rank (pure, standard library only).

A torchrun job's ranks write into one stderr (``nsa-diag watch`` keeps it as the case's ``stderr.log``):

- once a rank has joined its process group, torch prints its uncaught exception through an excepthook
  that puts ``[rank<N>]: `` before every line (empty lines stay bare); ``torchrun --tee`` puts
  ``[default<local rank>]:`` before every line of a rank's output, and ``[rank<N>]:[W... ]`` lines are
  torch's C++ log. So a line with a prefix belongs to that rank (``[rank<N>]`` over ``[default<N>]``),
  whatever the order in which the ranks' lines interleave;
- a rank that raises before it joins (a missing file, a bad argument) prints a bare traceback, as a
  single process does, and torchrun's agent prints its own (``ChildFailedError``: the summary of the
  ranks' failures, never the cause).

`parse` reads every traceback of one stream of lines: the frames (indented), the exception line
(``Type: message``), then the message's further lines (torch's messages run over several, unindented)
up to an empty line, the next traceback, a chained exception's header or a log record. Where Python
could not finish printing (a signal handler raised into the printing: torch's SIGCHLD handler as a
DataLoader worker dies), it dumps the exception object instead (``object type name: ConnectionResetError``,
``object repr : ...``, then ``lost sys.stderr``): that dump is the exception, after the frames printed
before it, if any. `rank_exceptions`
gives each rank its last exception; bare tracebacks go, in this order of evidence, to the rank the
message names ("... for rank 1"), to the only rank that failed without one, or to the failed ranks in
order (``found_by`` says which).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

TRACEBACK = "Traceback (most recent call last):"
_PREFIX = re.compile(r"^\[(rank|default)(\d+)\]: ?")
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
# glog-style records: torch's C++ warnings ("[W1127 12:34:46.85 ...]") and torchrun's logging.
_LOG_RECORD = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*)(?::(?: (.*)|$))?$")
_NAMES_RANK = re.compile(r"\bfor rank (\d+)\b")
# torch's ExceptionWrapper.reraise: "Caught <type> in DataLoader worker process 0." ("in replica 1 on
# device 1", "in pin memory thread for device 0"), then "Original Traceback ..." and the original
_CAUGHT = re.compile(r"^Caught \S+ (in .+?)\.?$")
LAUNCHER_ERRORS = (  # a launcher's account of a rank's failure, not the failure
    "ChildFailedError",  # torchrun's summary
    "ProcessExitedException",  # torch.multiprocessing.spawn's: a process ended without an exception
    "ProcessRaisedException",  # spawn's, around the traceback of the process that raised
)
MAX_MESSAGE_LINES = 80
# CPython's fallback when writing an exception to sys.stderr fails (_PyObject_Dump, then "lost sys.stderr")
# A script that does not compile: no "Traceback" header, its file and line, the code and a caret, the error
_SYNTAX_FILE = re.compile(r'^\s*File "([^"]+)", line (\d+)\s*$')
_SYNTAX_ERROR = re.compile(r"^(SyntaxError|IndentationError|TabError)(?:: (.*))?$")
_DUMP_TYPE = re.compile(r"object type name: ([A-Za-z_][\w.]*)\s*$")
_DUMP_REPR = re.compile(r"^object repr\s*: (.*)$")
_LOST = "lost sys.stderr"
_DUMP_LINES = 8  # the dump's lines from its first ("object address") to "lost sys.stderr"
_OS_ERROR_REPR = re.compile(r"^\((\d+), '(.*)'\)$")
# threading's default excepthook: the header it prints before an uncaught exception of a thread
_THREAD_DIED = re.compile(r"^Exception in thread (.+?):\s*$")


@dataclass(frozen=True)
class Traceback:
    """One exception as printed. ``order``: the log line it starts at; ``rank``: whose it is (None: no
    rank could be told); ``found_by``: how (``prefix``, ``message``, ``only rank``, ``order`` or "")."""

    type: str
    message: str  # every line of it, prefixes removed
    text: str  # the whole traceback as printed, prefixes removed
    order: int
    rank: int | None = None
    found_by: str = ""
    cut: bool = False  # printed in part: the frames before the dump CPython wrote instead (docstring)

    @property
    def first_line(self) -> str:
        """The message's first line; for an exception torch re-raised from a DataLoader worker (or a
        DataParallel replica, its ``ExceptionWrapper``: "Caught ValueError in DataLoader worker process
        0." then the original traceback), the original exception's own line and where it was caught:
        "sample 137: corrupt record (in DataLoader worker process 0)"."""
        lines = self.message.split("\n")
        head = lines[0].strip()
        caught = _CAUGHT.match(head)
        if caught is None or len(lines) < 2 or not lines[1].startswith("Original Traceback"):
            return head
        original = next((line.strip() for line in lines[2:] if line.strip() and not line[0].isspace()), "")
        if not original:
            return head
        kind, _, said = original.partition(": ")
        if kind.rsplit(".", 1)[-1] == self.type.rsplit(".", 1)[-1]:
            original = said or kind
        return f"{original} ({caught.group(1)})"

    @property
    def is_launcher(self) -> bool:
        return self.type.rsplit(".", 1)[-1] in LAUNCHER_ERRORS


Line = tuple[int, str]  # (position in the log, text without prefixes)


def split_by_rank(text: str) -> tuple[dict[int, list[Line]], list[Line]]:
    """Each rank's lines (prefixes removed) and the lines that carry no prefix, with their positions."""
    ranks: dict[int, list[Line]] = {}
    bare: list[Line] = []
    for i, line in enumerate(text.splitlines()):
        rank, kind = None, None
        while (m := _PREFIX.match(line)) is not None:
            if kind != "rank":  # [rankN] names the global rank; [defaultN] the local one
                kind, rank = m.group(1), int(m.group(2))
            line = line[m.end() :]
        (ranks.setdefault(rank, []) if rank is not None else bare).append((i, line))
    return ranks, bare


def _ends_message(line: str) -> bool:
    stripped = line.strip()
    return (
        not stripped
        or stripped == TRACEBACK
        or stripped.startswith(_CHAINED)
        or _LOG_RECORD.match(stripped) is not None
    )


def _dumped(lines: Sequence[Line], at: int) -> tuple[str, str, int] | None:
    """The exception CPython dumped (module docstring) in the lines from ``at`` on: its type, its message
    (``str()`` of the repr where it can be told) and the index after "lost sys.stderr"; None if the lines
    there are not such a dump."""
    kind = message = None
    for k in range(at, min(at + _DUMP_LINES, len(lines))):
        text = lines[k][1].strip()
        if kind is None and (m := _DUMP_TYPE.search(text)) is not None:
            kind = m.group(1)
        elif kind is not None and message is None and (m := _DUMP_REPR.match(text)) is not None:
            message = m.group(1)
        elif message is not None and text == _LOST:
            return kind, _repr_message(kind, message), k + 1
    return None


def _repr_message(kind: str, text: str) -> str:
    """What ``str()`` of the exception whose repr is ``text`` says, where the repr tells it:
    ``ConnectionResetError(104, 'Connection reset by peer')`` -> ``[Errno 104] Connection reset by peer``,
    ``ValueError('bad')`` -> ``bad``; the repr itself otherwise."""
    args = text[len(kind) :] if text.startswith(kind) else ""
    if (m := _OS_ERROR_REPR.match(args)) is not None:
        return f"[Errno {m.group(1)}] {m.group(2)}"
    if len(args) > 4 and args[:2] in ("('", '("') and args[-2:] in ("')", '")') and args[1] == args[-2]:
        return args[2:-2]
    return text


def _syntax_error(lines: Sequence[Line], at: int) -> tuple[Traceback, int] | None:
    """The script Python could not compile, printed without a traceback (``File "train.py", line 12``, the
    code, a caret, ``SyntaxError: ...``), as a traceback whose frame is that line; and the next line."""
    start, head = lines[at]
    m = _SYNTAX_FILE.match(head)
    assert m is not None
    for j in range(at + 1, min(at + 5, len(lines))):
        error = _SYNTAX_ERROR.match(lines[j][1].rstrip())
        if error is not None:
            frame = f'  File "{m.group(1)}", line {m.group(2)}, in <module>'
            text = "\n".join([TRACEBACK, frame, *(line.rstrip() for _, line in lines[at + 1 : j + 1])])
            return Traceback(type=error.group(1), message=error.group(2) or "", text=text, order=start), j + 1
    return None


def parse(lines: Sequence[Line]) -> list[Traceback]:
    """Every complete traceback in ``lines`` (one stream: one rank's, or the bare lines), in order, with
    the exceptions CPython dumped when it could not print them."""
    found = []
    i, n = 0, len(lines)
    while i < n:
        start, line = lines[i]
        syntax = _syntax_error(lines, i) if _SYNTAX_FILE.match(line) else None
        if syntax is not None:
            found.append(syntax[0])
            i = syntax[1]
            continue
        if line.strip() != TRACEBACK:
            dump = _dumped(lines, i) if _DUMP_TYPE.search(line) or "object address" in line else None
            if dump is None:
                i += 1
                continue
            kind, message, i = dump
            found.append(
                Traceback(type=kind, message=message, text=f"{kind}: {message}", order=start, cut=True)
            )
            continue
        body = [TRACEBACK]
        j = i + 1
        while j < n and lines[j][1][:1].isspace() and lines[j][1].strip():
            body.append(lines[j][1])
            j += 1
        m = _EXCEPTION.match(lines[j][1].rstrip()) if j < n else None
        dump = _dumped(lines, j - 1) if m is None else None
        if dump is not None:  # the printing failed: its frames, then the exception CPython dumped
            kind, message, k = dump
            frames = [b.split("object address", 1)[0].rstrip() for b in body]
            text = "\n".join([*frames, f"{kind}: {message}"])
            found.append(Traceback(type=kind, message=message, text=text, order=start, cut=True))
            i = k
            continue
        if m is None:  # cut short (the process died, another traceback began): not an exception
            i = j
            continue
        message = [m.group(2) or ""]
        body.append(lines[j][1].rstrip())
        k = j + 1
        while k < n and len(message) < MAX_MESSAGE_LINES and not _ends_message(lines[k][1]):
            message.append(lines[k][1].rstrip())
            body.append(lines[k][1].rstrip())
            k += 1
        text = "\n".join(message).strip()
        found.append(Traceback(type=m.group(1), message=text, text="\n".join(body), order=start))
        i = k
    return found


def _named_rank(tb: Traceback, ranks: Collection[int]) -> int | None:
    named = {int(r) for r in _NAMES_RANK.findall(tb.message)}
    if len(named) == 1:
        (rank,) = named
        if not ranks or rank in ranks:
            return rank
    return None


def rank_exceptions(
    text: str, ranks: Collection[int] = (), exit_codes: Mapping[int, int] | None = None
) -> dict[int, Traceback]:
    """Each rank's last exception in ``text`` (a job's stderr; module docstring). ``ranks``: the job's
    ranks, where known; ``exit_codes``: the failed ranks' exit codes (torchrun's summary): a bare
    traceback goes only to a rank that failed without a prefixed one, those that exited with a code
    (not a signal) first."""
    streams, bare = split_by_rank(text)
    out: dict[int, Traceback] = {}
    for rank, lines in streams.items():
        own = [tb for tb in parse(lines) if not tb.is_launcher]
        if own:
            out[rank] = replace(own[-1], rank=rank, found_by="prefix")
    unplaced = []
    for tb in parse(bare):
        if tb.is_launcher:
            continue
        rank = _named_rank(tb, ranks)
        if rank is not None and rank not in out:
            out[rank] = replace(tb, rank=rank, found_by="message")
        else:
            unplaced.append(tb)
    codes = dict(exit_codes or {})
    known = set(ranks) | set(codes)
    failed = sorted((r for r in known if r not in out), key=lambda r: (not codes.get(r, 0) > 0, r))
    if codes:  # a rank torchrun saw exit 0 raised nothing
        failed = [r for r in failed if r in codes]
    if unplaced and len(failed) == 1:
        out[failed[0]] = replace(unplaced[-1], rank=failed[0], found_by="only rank")
    elif unplaced and failed:
        for tb, rank in zip(unplaced, failed, strict=False):
            out[rank] = replace(tb, rank=rank, found_by="order")
    return out


def last_exception(text: str) -> Traceback | None:
    """The last exception in ``text``, whoever printed it, torchrun's summary aside."""
    streams, bare = split_by_rank(text)
    found = [tb for lines in [*streams.values(), bare] for tb in parse(lines) if not tb.is_launcher]
    return max(found, key=lambda tb: tb.order, default=None)


def thread_deaths(text: str) -> list[tuple[str, Traceback]]:
    """The threads whose uncaught exception ``text`` (a job's stderr) shows, as threading's default
    excepthook prints it ("Exception in thread <name>:", then the traceback): ``(name, exception)`` in
    order. A thread that died this way leaves its process running: a loop that waits for what it would
    have produced (a prefetch queue, an event) then waits for ever."""
    streams, bare = split_by_rank(text)
    deaths = []
    for lines in [*streams.values(), bare]:
        before = {position: lines[i - 1][1] for i, (position, _) in enumerate(lines) if i}
        for tb in parse(lines):
            m = _THREAD_DIED.match(before.get(tb.order, "").strip())
            if m is not None:
                deaths.append((m.group(1), tb))
    return sorted(deaths, key=lambda death: death[1].order)
