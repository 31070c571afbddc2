"""Would a deployment's event trigger, as prefect.yaml declares it, fire on an event? Decided by Prefect's own
server-side trigger model, so what a test asserts is what the server does."""

from __future__ import annotations

from typing import Any

from prefect.server.events.schemas.automations import EventTrigger, Posture
from prefect.server.events.schemas.events import ReceivedEvent


def fires(trigger: dict[str, Any], event: Any) -> bool:
    """`trigger`: a deployment trigger from prefect.yaml; `event`: an event read back from the server (or its
    dict)."""
    spec = EventTrigger(
        expect=set(trigger["expect"]),
        match=trigger.get("match", {}),
        match_related=trigger.get("match_related", {}),
        posture=Posture.Reactive,
        threshold=1,
    )
    data = event if isinstance(event, dict) else event.model_dump(mode="json")
    return spec.covers(ReceivedEvent.model_validate(data))
