"""The OpenAI-compatible HTTP endpoint of a head worker (`serve --http-port P`).

- `endpoint`: `OpenAIEndpoint`, the serving: routes, chat and completions, tools, tokenizing; each
  request becomes a stream of the head's generation loop through its interface (`GenerationLoops.open`,
  a `Stream` or a typed `Refusal`), never the gRPC servicer;
- `server`: `HttpServer`, the HTTP plumbing under it: the port and TLS, callers, Host and CORS,
  bodies and slots (it knows nothing of generation);
- `requests`: a request's JSON into the wire's `GenerateRequest` (types only: ranges are checked
  once, by the loop); `responses`: OpenAI's chunk, completion, usage and logprob shapes, and the
  text a client reads up to a stop sequence; `errors`: OpenAI's error shape and the status of each
  outcome;
- `chat_template` and `template_sandbox`: the GGUF's chat template in a bounded jinja2 sandbox;
- `guard`: the port's connections (timeouts and cap from accept, `HttpLimits`); `bodies`: request
  bodies on their way in (places per caller and in memory, before a request's slot).

Importing this package loads nothing heavy; `endpoint` loads aiohttp and jinja2 (a worker without
--http-port never imports it).
"""
