"""Which values are secrets, so that no artifact records them (standard library only: the probe uses it).

- An environment variable holds a secret when its name contains a `SECRET_NAME_PARTS` word in any case
  (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``NSA_DIAG_PASSWORD``): `is_secret_name`.
- A command's argument holds a secret when it follows an option whose name has a secret word
  (``--api-key X``, ``--hf_token=X``, ``--password X``) or assigns a secret-named variable
  (``HF_TOKEN=X``, as ``env`` and shells take it): `secret_words`. Option names are matched word by word,
  so ``--tokenizer``, ``--max-tokens`` and ``--keep-alive`` are not secrets.

`nsa_diag.artifacts` replaces every such value it is told of (`artifacts.withhold`) by `WITHHELD` in the
files it writes, and `artifacts.write_replay` makes ``replay.sh`` ask for them instead.
"""

from __future__ import annotations

import re
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


def secret_words(argv: Sequence[str]) -> dict[int, tuple[str, str]]:
    """The words of `argv` that hold a secret: index -> (what names it, the secret value).

    ``--api-key X``: the word ``X`` (named ``--api-key``); ``--api-key=X`` and ``HF_TOKEN=X``: that word,
    whose value is the part after ``=``. Nothing after ``--`` is treated differently: a launcher's argv
    (``torchrun ... train.py --api-key X``) has the user's options further on.
    """
    found: dict[int, tuple[str, str]] = {}
    for i, word in enumerate(argv):
        if i in found:
            continue
        if word.startswith("-"):
            option, eq, value = word.partition("=")
            if not is_secret_option(option):
                continue
            if eq:
                if value:
                    found[i] = (option, value)
            elif i + 1 < len(argv) and argv[i + 1] and not argv[i + 1].startswith("-"):
                found[i + 1] = (option, argv[i + 1])
            continue
        match = _ASSIGNMENT.match(word)
        if match and is_secret_name(match.group(1)) and match.group(2):
            found[i] = (match.group(1), match.group(2))
    return found


def redact_argv(argv: Sequence[str], values: Iterable[str] = ()) -> list[str]:
    """`argv` with every secret value (`secret_words`) replaced by `WITHHELD`, and any of `values` (known
    secrets, e.g. `env_secret_values`) wherever it appears in a word."""
    out = list(argv)
    for i, (_, value) in secret_words(argv).items():
        out[i] = out[i][: len(out[i]) - len(value)] + WITHHELD
    for value in sorted(values, key=len, reverse=True):
        out = [word.replace(value, WITHHELD) for word in out]
    return out


def env_secret_values(environ: Mapping[str, str]) -> set[str]:
    """The values of `environ`'s secret-named variables long enough to search for (`MIN_SECRET_LEN`).
    An absolute path is left out: it names where a secret is (``GOOGLE_APPLICATION_CREDENTIALS``,
    ``SSH_AUTH_SOCK``), and withholding it would blank every path under it (``KEY_DIR=/work``)."""
    secret = (v for k, v in environ.items() if is_secret_name(k))
    return {v for v in secret if len(v) >= MIN_SECRET_LEN and not v.startswith("/")}


def argv_secret_values(argvs: Iterable[Sequence[str]]) -> set[str]:
    """The secret values in these command lines (`secret_words`)."""
    return {value for argv in argvs for _, value in secret_words(argv).values() if value}
