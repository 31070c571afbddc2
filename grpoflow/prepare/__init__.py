"""Stage 1, prepare: the model (an HF dir, or the built-in GGUF converted once), the Harbor task set, the
prompts split by the seed, the recipes (`presets`), and `stage`, which records them in a new run dir."""
