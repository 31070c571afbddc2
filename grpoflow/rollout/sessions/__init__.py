"""Token-exact chat sessions: the session server harnesses talk OpenAI chat to, the session tree it records, and
the segments -> samples step that trains a session as one rollout.

Importing this package does not import FastAPI or torch; `grpoflow.rollout.sessions.server` does.
"""

from grpoflow.rollout.sessions.segments import Segment, segment_samples, segments
from grpoflow.rollout.sessions.tree import SessionTree, Turn

__all__ = ["Segment", "SessionTree", "Turn", "segment_samples", "segments"]
