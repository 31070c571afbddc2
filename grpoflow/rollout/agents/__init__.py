"""Harbor agents that talk tokens to an SGLang-API engine and record token-exact trajectories."""
