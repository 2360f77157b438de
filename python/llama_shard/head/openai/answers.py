"""A generation request's answer: OpenAI's server-sent events as the stream's tokens come (`streamed`),
or one JSON body once it has ended (`whole`); the text a client reads never holds a stop sequence,
and an error after the first byte is an error event."""

from __future__ import annotations

import json

from aiohttp import web

from ...proto import shard_pb2 as pb
from ..generation import Stream
from .errors import HttpError, outcome_status
from .responses import CompletionFormat, StopTrimmer
from .tool_calls import ToolCallStream, ToolRequest, parse_calls


def client_text(req: pb.GenerateRequest):
    """What a client reads of each token event: (text, logprob items or None), text held back
    where a stop sequence may begin and never including one."""
    trimmer = StopTrimmer(list(req.stop))
    stop_ids = set(req.stop_token_ids)
    want_logprobs = req.logprobs or req.top_logprobs

    def read(tok: pb.GeneratedToken) -> tuple[str, list | None]:
        text = "" if tok.token_id in stop_ids else trimmer.feed(tok.piece)
        return text, ([(tok.token_id, tok.logprob, list(tok.top_logprobs))] if want_logprobs else None)

    return trimmer, read


def finish_reason(final: pb.GenerateFinal, streamed: bool) -> str | HttpError:
    """OpenAI's finish_reason for a stream's end, or the error to answer instead."""
    if final.finish_reason in ("stop", "length"):
        return final.finish_reason
    if final.finish_reason == "error" or not streamed:
        where = f" (stage {final.stage})" if final.stage else ""
        return HttpError(outcome_status(final.outcome), f"generation failed{where}: {final.detail}")
    return "length"  # cancelled or shutdown while streaming: ended as OpenAI ends a cut stream


async def streamed(
    request: web.Request,
    req: pb.GenerateRequest,
    stream: Stream,
    events,
    fmt: CompletionFormat,
    include_usage: bool,
    started: list,
    tools: ToolRequest | None = None,
) -> web.StreamResponse:
    """Server-sent events: a chunk per token (its text empty while held back), the final chunk,
    usage when asked, [DONE]; an error after the first byte is an error event."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Session-Id": req.session_id}
    )
    await response.prepare(request)
    started.append(response)

    async def send(obj: dict) -> None:
        await write(request, response, b"data: " + json.dumps(obj).encode() + b"\n\n")

    if fmt.chat:
        await send(fmt.first_chunk())
    trimmer, read = client_text(req)
    # under the grammar of the calls (required, a named function) arguments stream as written
    calls = ToolCallStream(progressive=tools.choice == "required") if tools is not None else None
    while True:
        event = await events.queue.get()
        if event.HasField("final"):
            break
        if request.transport is None or request.transport.is_closing():
            stream.cancel("the client closed the connection")  # also without a write to fail
        text, lp = read(event.token)
        if calls is None:
            await send(fmt.chunk(text, None, lp))
            continue
        text, deltas = calls.feed(text)
        if text or lp is not None:  # no empty content between calls' deltas (a token's logprobs go out)
            await send(fmt.chunk(text or None, None, lp))
        for delta in deltas:
            await send(fmt.tool_chunk(delta))
    final = event.final
    finish = finish_reason(final, streamed=True)
    if isinstance(finish, HttpError):
        await send(json.loads(finish.response().body))
        return response
    tail = trimmer.flush() if final.finish_reason != "stop" else ""
    if calls is not None:
        tail, deltas = calls.feed(tail)
        rest, more = calls.flush()
        tail += rest
        for delta in deltas + more:
            await send(fmt.tool_chunk(delta))
        if calls.calls and finish == "stop":
            finish = "tool_calls"
    await send({**fmt.chunk(tail or None, finish, None), **fmt.proof(final)})
    if include_usage:
        await send(fmt.usage_chunk(fmt.usage(final)))
    await write(request, response, b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def whole(
    request: web.Request,
    req: pb.GenerateRequest,
    stream: Stream,
    events,
    fmt: CompletionFormat,
    with_tools: bool = False,
) -> web.Response:
    """One JSON answer once the stream has ended (a closed connection is seen at the next token)."""
    trimmer, read = client_text(req)
    texts: list[str] = []
    lp_items: list | None = [] if req.logprobs or req.top_logprobs else None
    while True:
        event = await events.queue.get()
        if event.HasField("final"):
            break
        if request.transport is None or request.transport.is_closing():
            stream.cancel("the client closed the connection")
        text, lp = read(event.token)
        texts.append(text)
        if lp:
            lp_items.extend(lp)
    final = event.final
    finish = finish_reason(final, streamed=False)
    if isinstance(finish, HttpError):
        raise finish
    tail = trimmer.flush() if final.finish_reason != "stop" else ""
    content, calls = "".join(texts) + tail, []
    if with_tools:
        content, calls = parse_calls(content)
        if calls and finish == "stop":
            finish = "tool_calls"
    return web.json_response(
        {**fmt.whole(content, finish, lp_items, fmt.usage(final), calls), **fmt.proof(final)},
        headers={"X-Session-Id": req.session_id},
    )


async def write(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    """A stream's write. A client that stops reading is dropped by the guard's sweep once its unsent
    bytes have not shrunk for the write timeout (a slow reader that makes progress is not): the
    pending write then fails (ConnectionError) and the stream stops at the next step."""
    await response.write(data)
