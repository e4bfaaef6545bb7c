"""Which values are secrets, so that no artifact records them (standard library only: the probe uses it).

- An environment variable holds a secret when its name contains a `SECRET_NAME_PARTS` word in any case
  (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``NSA_DIAG_PASSWORD``): `is_secret_name`.
- A command's argument holds a secret when it follows an option whose name has a secret word
  (``--api-key X``, ``--hf_token=X``, ``--password X``), assigns a secret-named variable
  (``HF_TOKEN=X``, as ``env`` and shells take it) or is a Hydra override whose key ends in a secret word
  (``trainer.api_key=X``, ``+db.password=X``): `secret_words`. Option names and keys are matched word by
  word, so ``--tokenizer``, ``--max-tokens``, ``--keep-alive`` and ``data.tokenizer=X`` are not secrets.
- A command line in one argument (what follows ``bash -c`` or ``sh -c``, or any argument with blanks,
  e.g. a launcher's ``--cmd "python t.py --api-key X"``) is read as the shell reads it, and the same rules
  apply to its words: `shell_secrets`.

`nsa_diag.artifacts` replaces every such value it is told of (`artifacts.withhold`) by `WITHHELD` in the
files it writes, and `artifacts.write_replay` makes ``replay.sh`` ask for them instead.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence

# A variable whose name contains one of these (in any case) holds a secret, whatever its prefix
# (NSA_TOKEN, TORCH_SECRET, NSA_DIAG_PASSWORD, AWS_SECRET_ACCESS_KEY): its value is never written.
SECRET_NAME_PARTS = ("token", "secret", "key", "password", "passwd", "credential", "auth")
# The words of an option's name that make its value a secret (`--api-key`, `--wandb_token`, `--apikey`).
SECRET_OPTION_WORDS = frozenset(
    {"token", "secret", "key", "apikey", "password", "passwd", "pwd", "credential", "credentials", "auth"}
)
WITHHELD = "<withheld>"
# An environment secret shorter than this is not searched for in the files written (``AUTH=1`` would
# otherwise withhold every "1"); it is still never recorded as the variable's value.
MIN_SECRET_LEN = 6

_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)
# A Hydra override (``trainer.api_key=X``, ``+db.password=X``, ``++a/b.key=X``): a dotted or slashed key,
# or a plain one after an add (+, ++) or delete (~) prefix.
_OVERRIDE = re.compile(r"^((?:\+\+|\+|~)?)([A-Za-z_][\w-]*(?:[./@][A-Za-z_][\w-]*)*)=(.*)$", re.DOTALL)
# Shells whose ``-c`` argument is a command line.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox"})
# One word of a shell command line as written: quoted parts, escapes and plain characters up to a blank or
# an operator (an unterminated quote runs to the end: the shell would refuse it, the secret is still there).
_SHELL_WORD = re.compile(r"""(?:'[^']*'?|"(?:\\.|[^"\\])*"?|\\.?|[^\s'"\\;&|<>()`])+""", re.DOTALL)
_VARIABLE = re.compile(r"^\$(?:\w+|\{\w+\})$")  # ``$TOKEN``: the shell passes the variable's value
_SHORT_OPTIONS_WITH_C = re.compile(r"^-[A-Za-z]*c[A-Za-z]*$")  # -c, -lc, -ec: the next word is the line


def is_secret_name(name: str) -> bool:
    """Whether the variable `name` holds a secret (`SECRET_NAME_PARTS`): its value is never written."""
    lowered = name.lower()
    return any(part in lowered for part in SECRET_NAME_PARTS)


def is_secret_option(option: str) -> bool:
    """Whether the option ``--name`` (or ``-name``) takes a secret: a word of its name is a secret word."""
    if not option.startswith("-") or option in ("-", "--"):
        return False
    words = re.split(r"[-_.]+", option.lstrip("-").lower())
    return any(word in SECRET_OPTION_WORDS for word in words)


def is_secret_key(key: str) -> bool:
    """Whether the Hydra key ``a.b.c`` (or ``a/b``) names a secret: a word of its last part is a secret
    word (``trainer.api_key``, ``hub.hf_token``; not ``data.tokenizer``)."""
    last = re.split(r"[./@]", key)[-1]
    return any(word in SECRET_OPTION_WORDS for word in re.split(r"[-_]+", last.lower()))


def is_shell_line(argv: Sequence[str], i: int) -> bool:
    """Whether ``argv[i]`` is a shell's command line: it follows ``-c`` (or ``-lc``, ...) of a shell."""
    if i < 1 or not _SHORT_OPTIONS_WITH_C.match(argv[i - 1]):
        return False
    return any(os.path.basename(word) in SHELLS for word in argv[: i - 1])


def _assignment(word: str) -> tuple[str, str] | None:
    """``NAME=X`` of a secret-named variable, or a Hydra override of a secret key: (name, X)."""
    match = _ASSIGNMENT.match(word)
    if match:
        return (match.group(1), match.group(2)) if is_secret_name(match.group(1)) else None
    match = _OVERRIDE.match(word)
    if match and (match.group(1) or "." in match.group(2) or "/" in match.group(2)):
        return (match.group(1) + match.group(2), match.group(3)) if is_secret_key(match.group(2)) else None
    return None


def secret_words(argv: Sequence[str]) -> dict[int, tuple[str, str]]:
    """The words of `argv` that hold a secret: index -> (what names it, the secret value).

    ``--api-key X``: the word ``X`` (named ``--api-key``); ``--api-key=X``, ``HF_TOKEN=X`` and
    ``trainer.api_key=X``: that word, whose value is the part after ``=``. Nothing after ``--`` is treated
    differently: a launcher's argv (``torchrun ... train.py --api-key X``) has the user's options further
    on. A shell's command line (`is_shell_line`) is not one value: its secrets are `shell_secrets`.
    """
    found: dict[int, tuple[str, str]] = {}
    for i, word in enumerate(argv):
        if i in found or is_shell_line(argv, i):
            continue
        if word.startswith("-"):
            option, eq, value = word.partition("=")
            if not is_secret_option(option):
                continue
            if eq:
                if value:
                    found[i] = (option, value)
            elif (
                i + 1 < len(argv)
                and argv[i + 1]
                and not argv[i + 1].startswith("-")
                and not is_shell_line(argv, i + 1)
            ):
                found[i + 1] = (option, argv[i + 1])
            continue
        assigned = _assignment(word)
        if assigned is not None and assigned[1]:
            found[i] = assigned
    return found


def _shell_words(line: str) -> list[tuple[int, int, str]]:
    """The words of the shell command line `line`: (start, end) of each as written, and its value as the
    shell passes it (quotes and escapes removed; ``$VAR`` left as it is)."""
    words = []
    for match in _SHELL_WORD.finditer(line):
        raw = match.group()
        try:
            (value,) = shlex.split(raw) or [""]
        except ValueError:  # an unterminated quote: the characters are what matters
            value = raw.replace("\\", "").strip("'\"")
        words.append((match.start(), match.end(), value))
    return words


def shell_secrets(line: str) -> list[tuple[int, int, str]]:
    """The secrets of the shell command line `line` (`secret_words` of its words, and those of a command
    line quoted within it, ``bash -c 'python t.py --key X'``): (start, end) of each as written in `line`,
    and its value as the command receives it. A variable's name (``--token $TOKEN``) is no secret."""
    words = _shell_words(line)
    values = [value for _, _, value in words]
    found = []
    for i, (_, value) in secret_words(values).items():
        if _VARIABLE.match(value):
            continue
        start, end, whole = words[i]
        raw = line[start:end]
        at = raw.rfind(value)  # the value ends the word: its last occurrence, inside any quotes
        if at >= 0:
            start, end = start + at, start + at + len(value)
        elif whole != value and "=" in raw:  # ``--key="a\"b"``, written otherwise: all after the ``=``
            start += raw.index("=") + 1
        found.append((start, end, value))
    for i in command_lines(values):
        start, end, inner = words[i]
        raw = line[start:end]
        if raw[1:-1] == inner and raw[0] == raw[-1] and raw[0] in "'\"":  # quoted as it is: same places
            found += [(start + 1 + a, start + 1 + b, value) for a, b, value in shell_secrets(inner)]
    return found


def command_lines(argv: Sequence[str]) -> list[int]:
    """The words of `argv` that are command lines: a shell's ``-c`` argument (`is_shell_line`), or a word
    with blanks that is not a secret value itself (``--cmd "python t.py --api-key X"``)."""
    positional = secret_words(argv)
    return [
        i
        for i, word in enumerate(argv)
        if i not in positional and (is_shell_line(argv, i) or any(c.isspace() for c in word))
    ]


def embedded_secrets(argv: Sequence[str]) -> dict[int, list[tuple[int, int, str]]]:
    """The secrets inside the words of `argv` that are command lines (`command_lines`, `shell_secrets`),
    by word index."""
    found = {i: shell_secrets(argv[i]) for i in command_lines(argv)}
    return {i: spans for i, spans in found.items() if spans}


def _withhold_spans(word: str, spans: Sequence[tuple[int, int, str]]) -> str:
    for start, end, _ in sorted(spans, reverse=True):
        word = word[:start] + WITHHELD + word[end:]
    return word


def redact_argv(argv: Sequence[str], values: Iterable[str] = ()) -> list[str]:
    """`argv` with every secret value (`secret_words`, and `shell_secrets` in a word that is a command
    line) replaced by `WITHHELD`, and any of `values` (known secrets, e.g. `env_secret_values`) wherever it
    appears in a word."""
    out = list(argv)
    for i, (_, value) in secret_words(argv).items():
        out[i] = out[i][: len(out[i]) - len(value)] + WITHHELD
    for i, spans in embedded_secrets(argv).items():
        out[i] = _withhold_spans(out[i], spans)
    for value in sorted(values, key=len, reverse=True):
        out = [word.replace(value, WITHHELD) for word in out]
    return out


def redact_line(line: str) -> str:
    """A command line recorded as one string (``python train.py --token=X``, py-spy's header), its
    secrets withheld: read as the shell reads it (`shell_secrets`)."""
    return _withhold_spans(line, shell_secrets(line))


def env_secret_values(environ: Mapping[str, str]) -> set[str]:
    """The values of `environ`'s secret-named variables long enough to search for (`MIN_SECRET_LEN`).
    An absolute path is left out: it names where a secret is (``GOOGLE_APPLICATION_CREDENTIALS``,
    ``SSH_AUTH_SOCK``), and withholding it would blank every path under it (``KEY_DIR=/work``)."""
    secret = (v for k, v in environ.items() if is_secret_name(k))
    return {v for v in secret if len(v) >= MIN_SECRET_LEN and not v.startswith("/")}


def argv_secret_values(argvs: Iterable[Sequence[str]]) -> set[str]:
    """The secret values in these command lines (`secret_words`), also those inside a word that is a
    command line (`command_lines`): as written there, and as the command receives them (a command line
    within that one too)."""
    found: set[str] = set()
    for argv in argvs:
        found |= {value for _, value in secret_words(argv).values() if value}
        for i in command_lines(argv):
            found |= {argv[i][start:end] for start, end, _ in shell_secrets(argv[i])}
            inner = [value for _, _, value in _shell_words(argv[i])]
            found |= {v for v in argv_secret_values([inner]) if not _VARIABLE.match(v)}
    return found
