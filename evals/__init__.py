"""Evaluations: acceptance rate (eval_acceptance), latency and serving benchmarks, prompt sets.

Installed as `specdec.evals` (setuptools package-dir); `specdec.cli` falls back to loading
these files from the source tree when the installed package predates that mapping.
"""
