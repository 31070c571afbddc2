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


def render_parameters(trigger: dict[str, Any], **context: Any) -> dict[str, Any]:
    """The parameters a deployment trigger's run gets, rendered as the server renders them (Prefect's own
    templating: a single `{{ expression }}` keeps its JSON type) in `context` (e.g. `flow_run=`)."""
    import asyncio
    import json

    from prefect.server.events.actions import RunDeployment
    from prefect.server.utilities.user_templates import render_user_template

    async def render(value: Any) -> Any:
        if not isinstance(value, str) or "{{" not in value:
            return value
        wrapped = RunDeployment._wrap_v1_template(value)  # {"__prefect_kind": "json", "value": {jinja template}}
        rendered = await render_user_template(wrapped["value"]["template"], context)
        return json.loads(rendered) if wrapped["__prefect_kind"] == "json" else rendered

    async def render_all() -> dict[str, Any]:
        return {k: await render(v) for k, v in trigger.get("parameters", {}).items()}

    return asyncio.run(render_all())
