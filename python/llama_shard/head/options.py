"""What a head is told at start: its HTTP endpoint, its drafts and how a route verifies them
(`serve`'s flags for generation; every worker's are worker/options.py)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from ..errors import InvalidInputError
from ..proto.requests import DEFAULT_MAX_DRAFTS, check_max_drafts
from .openai.guard import HttpLimits
from .speculation import DRAFT_SOURCES, VERIFY_MODES


class MeshView(Protocol):
    """What a head asks of the mesh it plans (mesh/coordinator.py's `Mesh`)."""

    def restoring(self, stage: tuple[int, int]) -> float: ...  # how long a stream may wait for the stage

    def describe(self) -> str: ...

    def members(self) -> list: ...  # MeshMember messages


@dataclasses.dataclass
class HeadOptions:
    http_port: int | None = None  # the OpenAI-compatible endpoint on the worker's host (None: off)
    http_limits: HttpLimits = HttpLimits()  # its timeouts, connection cap, per-principal slots, allowed Host names
    http_split_special_tokens: bool = False  # messages' text tokenized as plain text (special tokens' text included)
    chat_template: str | None = None  # replaces the GGUF's chat template on the HTTP endpoint
    draft: str = "ngram"  # speculative decoding's draft source (DRAFT_SOURCES)
    max_drafts: int = DEFAULT_MAX_DRAFTS  # drafts per step a request gets unless it says (0: off)
    draft_model: str | None = None  # a small GGUF of the same vocabulary whose greedy tokens are the drafts
    verify: str = "exact"  # how the route computes a verification (VERIFY_MODES)
    mesh: MeshView | None = None  # the mesh this head plans (serve --mesh-members): members join its route
    receipts: bool = True  # every request's route commits to its bytes and signs receipts (serve --no-receipts: off)
    spot_check_rate: float = 0.0  # the share of requests replayed on other replicas, demanding equal bytes

    def check(self, first_layer: int, last_layer: int) -> None:
        """Refuses options a head cannot take, before anything of the head is built."""
        if self.verify not in VERIFY_MODES:
            raise InvalidInputError(f"verify is one of {', '.join(VERIFY_MODES)}, not {self.verify!r}")
        if self.draft not in DRAFT_SOURCES:
            raise InvalidInputError(f"draft source {self.draft!r}: one of {', '.join(DRAFT_SOURCES)}")
        check_max_drafts(self.max_drafts)
        if not self.receipts and first_layer != 0:
            raise InvalidInputError(
                f"--no-receipts is a head's (its requests carry the nonce): layers {first_layer}-{last_layer} "
                "sign what the head asks for"
            )
        if self.spot_check_rate and not self.receipts:
            raise InvalidInputError("--spot-check-rate compares receipts: it needs them (leave out --no-receipts)")
        if not 0.0 <= self.spot_check_rate <= 1.0:
            raise InvalidInputError(f"--spot-check-rate is a share of requests in [0, 1], not {self.spot_check_rate}")
        if self.draft_model is not None and self.draft == "off":
            raise InvalidInputError("--draft off and --draft-model: a draft model is a draft source; give one")
        if self.draft_model is not None and first_layer != 0:
            raise InvalidInputError(
                f"--draft-model drafts for Generate streams: it needs the head worker (layers "
                f"from 0), not layers {first_layer}-{last_layer}"
            )
        if self.spot_check_rate and first_layer != 0:
            raise InvalidInputError(
                f"--spot-check-rate replays a head's requests: it needs the head worker (layers from 0), "
                f"not layers {first_layer}-{last_layer}"
            )
        if self.http_port is not None and first_layer != 0:
            raise InvalidInputError(
                f"--http-port serves generation: it needs the head worker (layers from 0), "
                f"not layers {first_layer}-{last_layer}"
            )
