"""grpoflow core library: no Prefect imports here."""
