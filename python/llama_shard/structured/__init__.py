"""Structured output, one room: a response_format's JSON schema into a grammar (`schema`), the
grammar's checks, each bound stated once (`checks`: its size, the native MAX_GRAMMAR_BYTES; llama.cpp's
parser over the model's vocabulary, its verdict kept per model), and how the head and the tail agree
on the grammar's state between steps (`replay`: a running digest of the sampled tokens, the tokens
themselves only where the tail must replay them).

The path of a response_format (docs/design.md#walks): the OpenAI endpoint reads the schema
(head/openai/requests.py `output_schema`) and makes its grammar here; the request's checks parse it
once per model (`check_grammar`, the verdict kept: the head's loop and each tail find it); the stream
names its state by digest (`GrammarSync`); the tail's sampler (worker/sampling.py) advances it.
"""
