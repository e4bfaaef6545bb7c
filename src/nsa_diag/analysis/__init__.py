"""Analyses over several cases: growth fits of a sweep (`scaling`) and the analytical memory estimate
(`memory_model`). Pure functions over measured numbers and configs; no processes, no files."""
