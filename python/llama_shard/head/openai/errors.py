"""Errors in OpenAI's shape, and the status each outcome of the route gets."""

from __future__ import annotations

from aiohttp import web

from ...proto import shard_pb2 as pb
from ..generation import Refusal

#: the HTTP status of a route's outcome (others: 503, and 500 for OUTCOME_INTERNAL)
OUTCOME_STATUS = {pb.OUTCOME_INVALID_ARGUMENT: 400, pb.OUTCOME_BUDGET_EXCEEDED: 429}


class HttpError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "invalid_request_error",
        404: "not_found_error",
        408: "invalid_request_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        417: "invalid_request_error",
        429: "rate_limit_error",
    }

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, close: bool = False
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.close = close  # the connection ends after this answer (what the client still sends is not read)

    def response(self) -> web.Response:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


def outcome_status(outcome: int) -> int:
    return OUTCOME_STATUS.get(outcome, 500 if outcome == pb.OUTCOME_INTERNAL else 503)


def refusal_error(refusal: Refusal, param_names: dict[str, str] | None = None) -> HttpError:
    """The HTTP error for a stream the head refused; its `param` is the request's name of the field
    the refusal names (`param_names`: the wire's name -> this endpoint's, where they differ)."""
    param = refusal.param
    if param is not None and param_names:
        param = param_names.get(param, param)
    final = refusal.final
    # the loop refuses max_tokens only where the prompt and it overflow the context (the endpoint
    # checks the bounds of its type first): OpenAI's code for it, as for a long prompt
    code = "context_length_exceeded" if refusal.param == "max_tokens" else None
    return HttpError(OUTCOME_STATUS.get(final.outcome, 503), final.detail, param, code)
