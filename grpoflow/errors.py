"""Error types. Each carries a one-line message that names the file or field at fault."""


class GrpoflowError(Exception):
    """Base of every error grpoflow raises on purpose (bad input, unreachable service, ...)."""


class ConfigError(GrpoflowError):
    """A run configuration value is invalid."""


class DatasetError(GrpoflowError):
    """A task directory or prompts file is malformed."""


class ModelError(GrpoflowError):
    """A model source cannot be resolved, read or converted."""


class EngineError(GrpoflowError):
    """The inference engine failed, answered malformed data, or could not be reached."""


class EngineUnavailableError(EngineError):
    """The engine did not answer (down, restarting, overloaded) for longer than a request waits it out: an
    infrastructure fault, retried as a trial and counted as such, never a policy outcome."""


class RunDirError(GrpoflowError):
    """A run directory cannot be created or would be overwritten."""


class CheckpointError(GrpoflowError):
    """A checkpoint could not be written (a full disk, a lost mount); nothing half-written is left."""


class RolloutError(GrpoflowError):
    """Rollouts keep producing nothing to train on (every trial of several steps in a row failed)."""


def one_line(text: object, limit: int | None = 300) -> str:
    """`text` (an exception: `Type: message`) with its whitespace runs folded to single spaces, cut at `limit`
    characters (None: whole): a message, a command's output or a traceback that fits one log line or table cell."""
    if isinstance(text, BaseException):
        text = f"{type(text).__name__}: {text}"
    out = " ".join(str(text or "").split())
    return out if limit is None else out[:limit]
