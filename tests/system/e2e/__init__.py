"""End-to-end checks against real external services; each skips unless its environment variables are set."""
