"""The head's generation loop: `Generate` streams run inside the route, not in the client.

- Each stream is one session: the head keeps its tokens (the prompt, then every sampled token),
  how many of them the route holds, and its sampler's draw count. A step sends the tokens the
  route lacks (a prompt chunk of at most GENERATE_CHUNK, or the last sampled token) down the chain
  with the sampler state; the tail samples and its token comes back in the reply of the chained
  call; the head submits the next step itself.
- Streams of one principal on one route share a `RouteScheduler`: its streams are spread over one
  group per stage, each driven by its own thread, one StepBatch per step per group. While one
  group is on the tail the next is on the head (the pipelining `RouteClient.generate_many` does
  from the client side). A new stream joins the smallest group at its next step.
- A miss anywhere re-prefills the route from token zero with the same tokens and the same draw
  count, so it samples what it would have sampled anyway (MAX_REPREFILLS in a row, then an error).
- A stream whose client went away, or whose deadline passed, stops before its next step; its KV
  stays. The prompt may be the whole conversation: the longest prefix of it the session holds (by
  the head's record of its last stream) is kept, the rest truncated by the prefill's position.
- The final event is always the last one a stream gets: stop, length, cancelled, shutdown, error.
- Speculative decoding (head/speculation.py, a stream's `Drafting`): past the prompt, a stream stepping alone in its group may
  carry drafts after the last sampled token; the tail answers the drafts it accepted and one token of its own, so a step yields
  1 to k + 1 tokens. The route then holds the rejected drafts' positions too (`held`): the next
  step is a prefill at the position after the accepted ones, which cuts them on every shard.
- Pipelining: a stream stepping alone keeps several steps in flight (a long prompt's chunks, or
  verification windows each guessing the token the one before samples), settled in order; one
  that does not continue the stream drops those after it (`PipelinedStepper`, pipelined.py;
  docs/design.md#pipelining-a-stream-stepping-alone).
"""

from .host import HeadHost, max_generate_streams
from .loops import GenerationLoops, Refusal, RefusalReason
from .positions import GENERATE_CHUNK
from .stream import Stream

__all__ = [
    "GENERATE_CHUNK",
    "GenerationLoops",
    "HeadHost",
    "Refusal",
    "RefusalReason",
    "Stream",
    "max_generate_streams",
]
