"""Analyses over cases and their results: growth fits of a sweep (`scaling`, `sweep`), the analytical
memory estimate (`memory_model`), gc bisection (`bisect`), repeat statistics (`repeat`), minimization
(`minimize`), OOM triage (`triage`) and run comparison (`compare`). Pure functions over measured numbers,
results and configs: no processes, no files; what needs a run, a file or the GPU is handed in by the
caller (`nsa_diag.session`), as a value or a callback."""
