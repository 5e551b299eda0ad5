"""Decoding one sequence: the speculative loop, the verifier, sampling, stopping, draft trees.

* ``decoder``: `SpeculativeDecoder` (draft, verify in one target forward, keep the accepted path);
* ``verify``: the rejection sampler (`verify_greedy`, `verify_sampling`); it knows no drafter;
* ``draft_tree``: `DraftTree`, what every drafter returns, and the mask and positions that score it;
* ``sampling``: temperature, top-k and top-p, the same for target and draft (`SamplingParams`);
* ``stopping``: max_new_tokens, EOS and stop strings (`StopCondition`);
* ``draft_length``: the adaptive draft length (`DraftLengthSchedule`);
* ``target_only``: `generate_plain`, one token per forward, the reference the loop must equal.

The leaves come first below: drafters import them while `decoder` (which imports the drafters'
interface) is still loading.
"""

from inference.engine.decode.draft_tree import DraftTree, tree_attention_mask, tree_position_ids
from inference.engine.decode.sampling import SamplingParams, sample_token, warp_probs
from inference.engine.decode.stopping import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, StopCondition
from inference.engine.decode.verify import VerifyResult, verify_greedy, verify_sampling
from inference.engine.decode.draft_length import DraftLengthSchedule
from inference.engine.decode.decoder import SpeculativeDecoder, check_prompt, resolve_eos
from inference.engine.decode.target_only import generate_plain

__all__ = [
    "FINISH_EOS",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "DraftLengthSchedule",
    "DraftTree",
    "SamplingParams",
    "SpeculativeDecoder",
    "StopCondition",
    "VerifyResult",
    "check_prompt",
    "generate_plain",
    "resolve_eos",
    "sample_token",
    "tree_attention_mask",
    "tree_position_ids",
    "verify_greedy",
    "verify_sampling",
    "warp_probs",
]
