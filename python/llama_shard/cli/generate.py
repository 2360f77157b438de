"""`llama-shard generate`: in process (whole or split) or down a route of workers."""

from __future__ import annotations

import argparse
import secrets
import sys
import time

import numpy as np

from .._native import MAX_CONTEXT_TOKENS, is_cpu_device
from ..engine.models import gguf_layer_count
from ..engine.pipeline import LocalPipeline, parse_split
from ..errors import InvalidInputError
from ..proto.requests import SAMPLING_PARAMETERS, sampling_problem
from .common import model_path, status


def _prompt_ids(model, text: str, chat: bool) -> list[int]:
    if chat:  # rendered as the HTTP endpoint and the demo render it (the model's own template)
        from ..head.openai.chat_template import ModelChat

        return ModelChat(model).tokens([{"role": "user", "content": text}])
    return model.tokenize(text)


def _parse_route(text: str) -> list[str]:
    """'0-14@127.0.0.1:5001,15-29@127.0.0.1:5002' -> addresses in order (ranges checked against Info)."""
    addresses = []
    for part in text.split(","):
        rng, sep, addr = part.strip().partition("@")
        if not sep or not addr:
            raise InvalidInputError(f"bad route entry {part!r}: use FIRST-LAST@HOST:PORT")
        addresses.append((parse_split(rng)[0], addr))
    return addresses


def cmd_generate_route(args: argparse.Namespace) -> int:
    from ..proto.credentials import ClientSecurity
    from ..route import RemoteStage, RouteClient

    entries = _parse_route(args.route)
    security = ClientSecurity(args.tls_ca, args.tls_cert, args.tls_key, args.token_file)
    stages = [RemoteStage(addr, security=security) for _, addr in entries]
    for (rng, addr), st in zip(entries, stages):
        if (st.info.first, st.info.last) != rng:
            raise InvalidInputError(f"{addr} serves layers {st.info.first}-{st.info.last}, not {rng[0]}-{rng[1]}")
    client = RouteClient(stages)
    sampling = _sampling(args)
    if args.max_drafts is not None and not (client.chained and client.route_loop):
        raise InvalidInputError("--max-drafts needs a chained route (a head started with --peer runs the loop)")
    if sampling is not None and not client.chained:
        stages[-1].return_logits = True  # this client samples from the tail's logits
    # the tokenizer runs on the head side, from the same GGUF the workers serve
    path = model_path(args.model)
    from .._native import ShardModel

    vocab = ShardModel(str(path), (0, 0), 1)
    prompt = _prompt_ids(vocab, args.prompt, args.chat)
    session = client.session()
    tokens: list[int] = []
    printed = ""
    t0 = time.perf_counter()
    for token in session.stream(
        prompt, args.max_tokens, stop=(vocab.token_eos,), sampling=sampling, max_drafts=args.max_drafts
    ):
        if token == vocab.token_eos:
            break
        tokens.append(token)
        text = vocab.detokenize(tokens)
        if text.startswith(printed):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    sys.stdout.write("\n")
    dt = time.perf_counter() - t0
    final = session.last_final
    where = "the route's loop (Generate)" if final is not None else "this client's loop"
    ttft = f", first token after {final.time_to_first_token_s * 1000:.0f} ms" if final is not None else ""
    drafts = (
        f"; {final.accepted_tokens} of {final.drafted_tokens} drafts accepted"
        if final is not None and final.drafted_tokens
        else ""
    )
    proof = f"; receipt: {final.receipt_verdict}" if final is not None and final.receipt_verdict else ""
    status(
        f"{len(tokens)} tokens in {dt:.2f}s through {len(stages)} workers, driven by {where}{ttft}; "
        f"{session.reprefills} re-prefill(s){drafts}{proof}"
    )
    session.release()
    client.close()
    return 0


def _sampling(args: argparse.Namespace, announce: bool = True):
    """SamplingParams from the sampling flags (None: greedy, no flag given); a sampler without
    --seed gets a random one, printed so the run can be repeated."""
    given = {p.native: _flag_value(args, p.flag) for p in SAMPLING_PARAMETERS if _flag_value(args, p.flag) is not None}
    if not given and args.seed is None:
        return None
    from .._native import SamplingParams

    seed = args.seed if args.seed is not None else secrets.randbelow(0xFFFFFFFF)
    if args.seed is None and announce:
        status(f"sampling with seed {seed} (--seed {seed} repeats this run)")
    return SamplingParams(seed=seed, **given)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.route:
        if not is_cpu_device(args.device):
            raise InvalidInputError(
                "--device places an in-process split; a route's devices are its workers' (serve --device)"
            )
        return cmd_generate_route(args)
    if args.max_drafts is not None:
        raise InvalidInputError("--max-drafts needs --route: drafts are a route's (its head's speculative decoding)")
    path = model_path(args.model)
    pipe = _load_pipeline(args, path)

    prompt = _prompt_ids(pipe.head, args.prompt, args.chat)
    if not prompt:
        status("the prompt tokenizes to nothing")
        return 2
    eos = pipe.head.token_eos
    tokens: list[int] = []
    logits_seen: list[np.ndarray] = []
    printed = ""
    t1 = time.perf_counter()
    sampling = _sampling(args)
    sampler = None
    if sampling is not None:
        from .._native import TokenSampler

        window = sampling.penalty_last_n
        sampler = TokenSampler(
            pipe.head.info.n_vocab, sampling, args.context_tokens, history=prompt[-window:] if window else []
        )
    for token, logits in pipe.generate(prompt, args.max_tokens, stop=(eos,) if eos >= 0 else (), sampler=sampler):
        if token == eos:
            break
        tokens.append(token)
        if args.compare_whole:
            logits_seen.append(logits)
        text = pipe.head.detokenize(tokens)
        if text.startswith(printed):  # print only complete characters
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    dt = time.perf_counter() - t1
    sys.stdout.write("\n")
    status(
        f"{len(tokens)} tokens in {dt:.2f}s ({len(tokens) / dt if dt > 0 else 0:.1f} tokens/s, prompt {len(prompt)} tokens)"
    )

    if args.compare_whole:
        return _compare_whole(args, path, prompt, tokens, logits_seen)
    return 0


def _load_pipeline(args: argparse.Namespace, path) -> LocalPipeline:
    """The model, whole or split in process (--split), as the flags say."""
    status(f"model: {path}")
    t0 = time.perf_counter()
    whole_layers = None
    if args.split == "half":
        n_layer = gguf_layer_count(path)
        whole_layers = n_layer
        split = [(0, n_layer // 2 - 1), (n_layer // 2, n_layer - 1)] if n_layer > 1 else None
    elif args.split in ("none", "whole"):
        split = None
    else:
        split = parse_split(args.split)
    pipe = LocalPipeline(
        path,
        split,
        n_ctx=args.context_tokens,
        n_seq_max=1,
        n_batch=args.batch,
        n_threads=args.threads,
        device=args.device,
    )
    desc = ",".join(f"{m.info.first}-{m.info.last}" for m in pipe.models)
    status(
        f"shards: {desc} of {whole_layers or pipe.head.info.n_layer} layers, loaded in {time.perf_counter() - t0:.2f}s; "
        + ", ".join(f"{m.info.first}-{m.info.last}: {m.info.weight_bytes / 2**20:.1f} MiB" for m in pipe.models)
    )

    return pipe


def _compare_whole(args: argparse.Namespace, path, prompt: list[int], tokens: list[int], logits_seen: list) -> int:
    """The split's tokens and logits against the whole model's on the same backend (exit 0: equal to the bit)."""
    whole = LocalPipeline(
        path,
        None,
        n_ctx=args.context_tokens,
        n_seq_max=1,
        n_batch=args.batch,
        n_threads=args.threads,
        device=args.device,
    )  # the same backend: split = whole to the bit
    ref = list(whole.generate(prompt, len(tokens)))
    same_tokens = [t for t, _ in ref] == tokens
    same_bits = all(a.tobytes() == b.tobytes() for (_, a), b in zip(ref, logits_seen))
    status(f"verify against the whole model: tokens identical: {same_tokens}; logits bit-identical: {same_bits}")
    return 0 if same_tokens and same_bits else 1


def _flag_value(args: argparse.Namespace, flag: str):
    return getattr(args, flag.lstrip("-").replace("-", "_"))


def check_sampling_flags(args: argparse.Namespace) -> None:
    """The sampling flags against the native check (its ranges, the only ones), before a model loads;
    the vocabulary's bound on --top-k is checked again once the model is known."""
    params = _sampling(args, announce=False)
    if params is None:
        return
    problem = sampling_problem(params, 1 << 30, MAX_CONTEXT_TOKENS)
    if problem is not None:
        raise InvalidInputError(f"{problem[0].flag}: {problem[1]}")
