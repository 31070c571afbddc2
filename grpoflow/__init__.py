"""grpoflow core library: no Prefect imports here."""

from grpoflow.numerics import reproducible_cpu_env

# Before any torch op of the process: MKL fixes its reproducibility mode at its first call.
reproducible_cpu_env()
