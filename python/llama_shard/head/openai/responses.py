"""What a client reads: the text up to a stop sequence, and OpenAI's chunk, completion and logprob
shapes."""

from __future__ import annotations

import base64
import codecs


class StopTrimmer:
    """The text a client sees: the pieces up to (not including) the first stop sequence, holding back
    a tail that could still begin one (OpenAI never sends a stop sequence's text)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent, self.stopped = "", 0, False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        window = max(0, self.sent - self.hold)
        hits = [i for i in (self.text.find(s, window) for s in self.stops) if i >= 0]
        end = min(hits) if hits else len(self.text) - self.hold
        self.stopped = bool(hits)
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def flush(self) -> str:
        out = "" if self.stopped else self.text[self.sent :]
        self.sent = len(self.text)
        return out


class CompletionFormat:
    """OpenAI's shapes for one request's answer: streamed chunks, the whole completion, usage and
    logprobs, for /v1/chat/completions (`chat`) or /v1/completions. `piece`: one token's own text;
    `token_bytes`: its bytes (a token inside a UTF-8 character has no text of its own). One per
    request: the text offsets of its logprobs run on across its chunks."""

    def __init__(self, rid: str, created: int, model_id: str, chat: bool, piece, token_bytes):
        self.rid, self.created, self.model_id, self.chat, self.piece = rid, created, model_id, chat, piece
        self.token_bytes = token_bytes
        self.text_at = 0  # where the next token's text starts in the completion (text_offset), in characters
        # the completion's bytes decoded token by token: a token inside a UTF-8 character adds nothing
        # until the one that completes it, so each offset is the character it belongs to
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def first_chunk(self) -> dict:
        """A chat stream's first chunk: the assistant's role."""
        out = self.chunk(None, None, None)
        out["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return out

    def chunk(self, text: str | None, finish: str | None, lp: list | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
            if lp is not None:
                choice["logprobs"] = self.chat_logprobs(lp)
        else:
            choice = {
                "index": 0,
                "text": text or "",
                "finish_reason": finish,
                "logprobs": self.completion_logprobs(lp) if lp is not None else None,
            }
        return {
            "id": self.rid,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model_id,
            "choices": [choice],
        }

    def tool_chunk(self, delta: dict) -> dict:
        """A chat stream's chunk of one tool call's delta (tool_calls.ToolCallStream)."""
        out = self.chunk(None, None, None)
        out["choices"][0]["delta"] = {"tool_calls": [delta]}
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return {
            "id": self.rid,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model_id,
            "choices": [],
            "usage": usage,
        }

    def whole(
        self, content: str | None, finish: str, lp_items: list | None, usage: dict, tool_calls: list | None = None
    ) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": self.chat_logprobs(lp_items) if lp_items is not None else None,
            }
        else:
            choice = {
                "index": 0,
                "text": content,
                "finish_reason": finish,
                "logprobs": self.completion_logprobs(lp_items) if lp_items is not None else None,
            }
        return {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model_id,
            "choices": [choice],
            "usage": usage,
        }

    @staticmethod
    def proof(final) -> dict:
        """llama-shard's fields of a final answer: the receipt's verdict, and the receipt (base64) when
        the request asked for it (`llama-shard verify-receipt` reads the saved answer)."""
        shown = final.receipt or (final.receipt_verdict and final.receipt_verdict != "verified")
        out = {"receipt_verdict": final.receipt_verdict} if shown else {}
        if final.receipt:
            out["receipt"] = base64.b64encode(final.receipt).decode("ascii")
        return out

    @staticmethod
    def usage(final) -> dict:
        """A GenerateFinal's counts in OpenAI's usage object."""
        return {
            "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            # reused from the caller's conversation, or opened from a shared prefix (not computed)
            "prompt_tokens_details": {
                "cached_tokens": min(final.prompt_tokens, final.cached_tokens + final.prefix_tokens)
            },
            # speculative decoding's drafts, in OpenAI's fields for predicted tokens: those the
            # tail accepted (part of the completion) and those it rejected (computed, not sent)
            "completion_tokens_details": {
                "accepted_prediction_tokens": final.accepted_tokens,
                "rejected_prediction_tokens": final.drafted_tokens - final.accepted_tokens,
            },
        }

    def chat_logprobs(self, items: list) -> dict:
        def entry(token: int, logprob: float) -> dict:  # bytes: the token's own (part of a character too)
            return {"token": self.piece(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}

        return {
            "content": [
                entry(t, lp) | {"top_logprobs": [entry(a.token_id, a.logprob) for a in alts]} for t, lp, alts in items
            ]
        }

    def completion_logprobs(self, items: list) -> dict:
        tokens = [self.piece(t) for t, _, _ in items]
        offsets = []  # each token's start in the completion's text (no echo: the prompt is not in it)
        for t, _, _ in items:
            offsets.append(self.text_at)
            self.text_at += len(self.decoder.decode(bytes(self.token_bytes(t))))
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in items],
            "text_offset": offsets,
            "top_logprobs": [{self.piece(a.token_id): a.logprob for a in alts} for _, _, alts in items],
        }
