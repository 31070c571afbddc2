"""What every config section shares: unknown keys refused, credentials refused before they reach a saved config."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # Unknown keys are refused so a typo in a config file ("temprature") is an error, not a silent default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Name parts that mark a kwarg or field as a credential: kwargs are written to every trial's config.json.
# The most new tokens one turn may ask for (`rollout.sampling.max_new_tokens`), which bounds how long any
# generation may take (`Engine.longest_generation_s`)
MOST_NEW_TOKENS = 131072
_CREDENTIAL_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "secrets", "password", "passwd", "credential", "credentials"}
)


def looks_like_credential(name: str) -> bool:
    return bool(_CREDENTIAL_WORDS & set(re.split(r"[^a-z0-9]+", str(name).lower())))


def refuse_credentials(section: str, model: type[BaseModel], data: Any, known: Iterable[str] = ()) -> Any:
    """Refused before pydantic's "extra fields" error, which would echo the value (a key) into logs. `known`: names
    that are settings elsewhere (of another variant of the section), left to that error."""
    if isinstance(data, dict):
        secret = [k for k in data if k not in model.model_fields and k not in known and looks_like_credential(k)]
        if secret:
            raise ValueError(
                f"`{section}.{secret[0]}`: credentials are never part of the config (it is saved with the run); "
                "put the key in the provider's environment variable (e.g. E2B_API_KEY) or name a key file "
                "in rollout.sandbox.api_key_file"
            )
    return data


def any_of_schema(schema: dict[str, Any]) -> None:
    """A variant section's JSON schema with `anyOf` for pydantic's `oneOf`. Prefect checks a deployment's parameters
    against the schema without their required fields, so a partial section (`{deterministic: true}`) fits every
    variant's type and `oneOf` refuses it; the discriminator still tells the variants apart."""
    schema["anyOf"] = schema.pop("oneOf")
