"""The life of one run folder: a `Session` runs a plan and owns the folder, env.json, the live display,
interrupts, the follow-ups (--repeat, --minimize, --triage, --junit), the summary and the exit code.

- `nsa_diag.session.core`: `Session`, the `Plan` interface, `build_summary`;
- `nsa_diag.session.plans`: `CaseList` (run, branch, backend, selftest, verify, ddp), `Sweep` (scale),
  `Bisection` (gc-bisect);
- `nsa_diag.session.matrix`: `MatrixPlan` (matrix: parallel, resumable, GPU slots);
- `nsa_diag.session.followups`: `FollowUps`, `check_follow_ups` and the follow-up runs.

A command reads: validate -> build specs -> plan -> ``Session(plan, ...).run()`` -> ``typer.Exit(code)``.
"""

from nsa_diag.session.core import Plan, Session, build_summary
from nsa_diag.session.followups import FollowUps, check_follow_ups

__all__ = ["FollowUps", "Plan", "Session", "build_summary", "check_follow_ups"]
