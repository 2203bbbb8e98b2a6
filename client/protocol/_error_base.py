"""The base of the error model (client/protocol/errors.py): what every error carries, and how much of what a caller sent
it may echo. A leaf: the error families import it, and it imports nothing of theirs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import grpc

DOMAIN = "handoff.v1"


class ManifestError(ValueError):
    """A manifest that is not a contract; the message names the file and the field. (A local error, never a call's:
    kept here, where nothing heavy is imported, so the command line can catch it cheaply.)"""


MAX_MESSAGE_CHARS = 2048
MAX_FIELD_CHARS = 256
"""What an error echoes of what a caller sent is bounded: a status must fit gRPC's metadata limit (8 KiB), and a
log line must not carry a megabyte a client made up."""


def bounded(text: str, limit: int) -> str:
    """`text`, or its first characters and how long it was."""
    if len(text) <= limit:
        return text
    note = f"… ({len(text)} characters)"
    return text[: limit - len(note)] + note


class HandoffError(Exception):
    """Base of every error a hand-off can meet; `code` and `reason` say how it travels on the wire."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    reason: ClassVar[str] = "ERROR_REASON_UNSPECIFIED"

    def __init__(self, message: str, **fields: object) -> None:
        message = bounded(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.fields: dict[str, str] = {
            key: bounded(str(value), MAX_FIELD_CHARS) for key, value in fields.items() if value is not None
        }

    @property
    def model(self) -> str | None:
        return self.fields.get("model")

    @property
    def tensor(self) -> str | None:
        return self.fields.get("tensor")

    @property
    def handoff_id(self) -> str | None:
        return self.fields.get("handoff_id")

    @classmethod
    def _rebuild(cls, message: str, fields: Mapping[str, str]) -> HandoffError:
        """The error as the other side raised it, without running a subclass's message-building constructor."""
        error = cls.__new__(cls)
        HandoffError.__init__(error, message, **fields)
        return error
