"""The rows of a batching engine: what a request asks, what a step reports, and a row's state.

`BatchedSpeculativeEngine` (engine.py) holds one `BatchRow` per generation; its prefill
progress (`chunk_end`, `can_draft`), the room left for drafts and its own generator and stop
condition live here, so engine.py is only the step itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from inference.engine.config import DraftConfig, GenerationConfig
from inference.engine.constraints.matcher import GrammarMatcher
from inference.engine.decode.decoder import make_generator, sampling_params
from inference.engine.decode.draft_length import DraftLengthSchedule
from inference.engine.drafters import AUTO
from inference.engine.drafters.base import Drafter
from inference.engine.outputs import StepOutput
from inference.engine.decode.sampling import warp_probs
from inference.engine.stats import GenerationStats
from inference.engine.decode.stopping import StopCondition

FINISH_TIMEOUT = "timeout"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


@dataclass(frozen=True)
class BatchRequest:
    """One generation to run in the batch.

    drafter: a drafter kind, or "auto" to let the policy choose from running acceptance.
    deadline: a time.monotonic() value after which the row ends with finish_reason "timeout".
    resume_ids: tokens an earlier run of this request already generated (and committed); they
    are prefilled with the prompt and never generated again.
    corpus: an opaque key of the earlier outputs a corpus-fed drafter (suffix) may draft from.
    cache_scope: rows of different scopes never share cached prefixes (batch/prefix_reuse.py):
    the tenant, where tenants are isolated; None: shared by every request of the model pair.
    fair_group, fair_weight: whose share of the batch the row counts against, and that group's
    weight (batch/fair_admission.py: the worker passes the tenant); None for every request is
    one group, admitted first in, first out.
    preemptible: the engine may take the row out of a full batch for a group under its share and
    resume it later from its tokens (its output stays the same).
    """

    request_id: Hashable
    prompt_ids: list[int]
    config: GenerationConfig
    drafter: str = AUTO
    draft_config: DraftConfig = field(default_factory=DraftConfig)
    deadline: float | None = None
    resume_ids: tuple[int, ...] = ()
    corpus: Hashable | None = None
    cache_scope: Hashable | None = None
    fair_group: Hashable | None = None
    fair_weight: float = 1.0
    preemptible: bool = True


@dataclass
class RowEvent:
    """What one step did for one row; `step.finish_reason` set means the row has left the batch."""

    request_id: Hashable
    step: StepOutput
    stats: GenerationStats
    # the bonus token (a leaf of the draft was reached) rather than the target's correction
    bonus: bool = False
    error: str = ""
    # the drafter the row runs (what "auto" resolved to) and the policy's depths: {depth: steps}
    drafter: str = ""
    depth_choices: dict[int, int] = field(default_factory=dict)
    # prompt (and resumed) tokens the row fed the target in this step: it was prefilling
    prefill_tokens: int = 0
    # when the confidence scheduler chose this step's verification length (else None): the
    # draft depth verified, and the sum of the verified positions' survival estimates (the
    # accepted drafts it expected; step.accepted is what the target kept)
    verified_depth: int | None = None
    expected_accepted: float | None = None

    @property
    def finished(self) -> bool:
        return self.step.finish_reason is not None


@dataclass(frozen=True)
class StepTiming:
    """When one step's forwards ran (the worker's trace spans): wall-clock start, then draft, then verify."""

    started_ns: int  # time.time_ns() at the step's start
    draft_seconds: float
    verify_seconds: float  # the target forward and the verdicts (depth choice included)
    rows: int
    step: int
    # the prefill lane's forwards, before the draft (separate prefill mode; 0 in the shared one)
    prefill_seconds: float = 0.0


def default_prefill_chunk(device: torch.device, prefill: str = "shared") -> int:
    """Prompt tokens a newcomer feeds per step beside decoding rows, by device and prefill mode.

    Every row of a forward is padded to the widest (kv/ragged.py). On a GPU the padding is
    nearly free, so a newcomer takes 64 tokens a step. On a CPU it is compute: a 48-token
    chunk beside seven 5-token decode rows made an 8 x 56 forward (113 ms against 16 ms for the
    decode step, measured on the demo pair), so in the shared mode a newcomer feeds about what
    the decode rows do; in the separate mode (prefill.py) its chunk pads no decoding row
    and 64 tokens a step bound what a step's prefill adds to the decoding rows' step.
    """
    return 64 if device.type == "cuda" or prefill == "separate" else 8


class BatchRow:
    """Per-generation state of one batch row."""

    def __init__(self, request: BatchRequest, drafter_kind: str, max_new_tokens: int,
                 stop: StopCondition, device: torch.device, matcher: GrammarMatcher | None = None) -> None:
        self.request = request
        # the grammar state of a constrained row, rebuilt from the committed tokens on a resume
        self.matcher = matcher
        if matcher is not None:
            matcher.advance(list(request.resume_ids))
        self.forced_step = False  # this step verifies the grammar's forced tokens, not a draft
        self.drafter_kind = drafter_kind
        self.config = request.config
        self.context: list[int] = list(request.prompt_ids) + list(request.resume_ids)
        # everything known before the first step is prefilled: the prompt and any resumed tokens
        self.prompt_length = len(self.context)
        self.generated: list[int] = list(request.resume_ids)
        self.max_new_tokens = max_new_tokens
        self.stop = stop
        self.sampling = sampling_params(request.config)
        self.generator = make_generator(request.config.seed, device)
        # a seeded sampled row drafts on its own schedule so companions cannot change its tokens
        self.own_schedule = self.sampling is not None and request.config.seed is not None
        self.drafter: Drafter | None = None
        self.schedule: DraftLengthSchedule | None = None
        self.stats = GenerationStats(prompt_tokens=len(self.context))
        self.prefilled = 0  # prompt tokens in the target cache
        self.prefix_offered = False  # its prompt went to the prefix cache (batch/prefix_reuse.py)
        # a row whose drafter reads the target's features (DSpark) prefills all but its last prompt
        # token, which stays pending: its first step then drafts on the prompt's features, in
        # either prefill mode and alone (feature_rows.py)
        self.keeps_last_prompt_token = False
        # draft cache bookkeeping: the context prefix known to be in the draft cache, and the
        # drafted tokens fed after it
        self.draft_synced = 0
        self.draft_extra: list[int] = []
        self.finish_reason: str | None = None
        self.error = ""
        self.started = time.perf_counter()
        self.admitted = 0  # the engine's admission count when it last got a row: the youngest is preempted first
        self.depth_choices: dict[int, int] = {}
        self.fed_prompt = 0  # prompt tokens fed in the current step
        # confidence scheduling (batch/scheduling.py), set every step: a draft_model chain's
        # running survival estimate as it drafts (`confidence_of` maps a position's top draft
        # probability to its calibrated confidence), which decides whether it drafts on
        self.confidence_of: Callable[[float], float] | None = None
        self.draft_survival = 1.0
        self.last_confidence = 1.0  # the calibrated confidence of the last position drafted
        # this step's schedule: the survival estimates summed over the verified positions, and
        # the drafted nodes cut (None: the scheduler did not choose this row's length)
        self.scheduled_expected: float | None = None
        self.scheduled_cut = 0

    @property
    def prefilling(self) -> bool:
        """Whether prompt tokens are still to be fed to the target."""
        return self.prefilled < self.prompt_length

    @property
    def cached(self) -> int:
        """Context tokens in the target cache: the prompt so far, or all but the pending token."""
        return self.prefilled if self.prefilling else len(self.context) - 1

    @property
    def prefill_length(self) -> int:
        """Prompt tokens the prefill feeds: all, or all but the pending last one."""
        return self.prompt_length - 1 if self.keeps_last_prompt_token else self.prompt_length

    def chunk_end(self, chunk: int) -> int:
        """End (exclusive) of the context this step feeds: the next prompt chunk, or all of it."""
        if self.prefilling:
            return min(self.prefill_length, self.prefilled + chunk)
        return len(self.context)

    def note_prefilled(self, tokens: int) -> None:
        """Count `tokens` more prompt tokens fed; a row keeping its last prompt token pending is
        then done prefilling (that token is fed with its first draft)."""
        self.prefilled += tokens
        if self.prefilled >= self.prefill_length:
            self.prefilled = max(self.prefilled, self.prefill_length)
            if self.keeps_last_prompt_token:
                self.prefilled = self.prompt_length

    def can_draft(self, chunk: int) -> bool:
        """Drafting needs the whole context in this step's forward (decoding, or the last chunk)."""
        return self.chunk_end(chunk) == len(self.context)

    @property
    def room(self) -> int:
        """Draft positions the tokens left allow (one token of each step is the target's)."""
        return self.max_new_tokens - len(self.generated) - 1

    def draw_draft_token(self, logits: torch.Tensor, position: int, tokens: list[int],
                         log_probs: list[float], rows_q: list[torch.Tensor]) -> int | None:
        """Append the row's next draft token (greedy or sampled from q); None to stop drafting."""
        threshold = self.request.draft_config.confidence_threshold
        if self.sampling is None:
            log_q = logits.log_softmax(dim=-1)
            best, token_tensor = log_q.max(dim=-1)
            if threshold and position > 0 and float(best) < math.log(threshold):
                return None
            self._track_survival(math.exp(float(best)), position)
            token = int(token_tensor)
            log_probs.append(float(best))
        else:
            q = warp_probs(logits[None], self.sampling)[0]
            if threshold and position > 0 and float(q.max()) < threshold:
                return None
            self._track_survival(float(q.max()), position)
            token = int(torch.multinomial(q, 1, generator=self.generator))
            log_probs.append(float(q[token].log()))
            rows_q.append(q)
        tokens.append(token)
        return token

    def _track_survival(self, top_probability: float, position: int) -> None:
        """Update the chain's running survival estimate for `position` from the top probability
        of the distribution its token is about to be drawn from: never the drawn token's own
        probability, which would let a decision look at the token it decides about."""
        if self.confidence_of is None:
            return
        if position == 0:
            self.draft_survival = 1.0
        self.last_confidence = self.confidence_of(top_probability)
        self.draft_survival *= self.last_confidence
