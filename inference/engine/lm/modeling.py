"""The one place that calls a transformers model: forward with a cache, context length, vocab.

Uses the transformers 5.x names (`cache=`, `logits_to_keep=`); a custom 4D additive mask and
explicit position ids are passed only for trees, chains use the model's own causal mask.

For the Llama and Qwen2 families (full attention, SDPA) the forward runs the model's own
modules (embeddings, rotary embedding, decoder layers, norm, LM head) without the top-level
wrappers: their output capturing, mask construction and output objects cost ~0.4 ms a call on
a CPU, a third of a one-layer draft's forward. Each decoder layer runs its own submodules
(`_lean_layer`) with SDPA's grouped-query attention on the cache's in-place keys (kv_slab.py),
not transformers' copy of the whole cache per layer (`repeat_kv`). Its linear layers run on
oneDNN for large row counts where that was measured exact and faster (linear_kernels.py). Tests
check the logits are those of transformers' own layers bit for bit; every other model takes the
wrapped path.
"""

from __future__ import annotations

import sys
import weakref

import torch
from transformers import DynamicCache, PreTrainedModel

from inference.engine.errors import UnsupportedModelError
from inference.engine.kv.row_attention import KeySpan, attention_by_row, is_row_exact, visible_keys
from inference.engine.kv.windows import model_attention_layout, windowed_masks
from inference.engine.lm.features import EMBEDDING_LAYER, active_tap
from inference.engine.lm.linear_kernels import linear_kernels

# Config attributes that hold the longest sequence a model was built for, most specific first.
_CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length",
                       "seq_length")


def context_length(model: PreTrainedModel) -> int:
    """The longest sequence (prompt + generated) the model's positions cover."""
    config = model.config.get_text_config(decoder=True)
    for name in _CONTEXT_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UnsupportedModelError(
        f"{type(model).__name__}: config names no context length ({', '.join(_CONTEXT_ATTRIBUTES)})")


def input_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the model's input embedding: every id it can read is below this."""
    return int(model.get_input_embeddings().num_embeddings)


def logits_width(model: PreTrainedModel) -> int:
    """Columns of the model's logits (the LM head may be padded past the tokenizer)."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


# Families whose decoder layers `_lean_layer` runs op for op: Llama's layout, plus Qwen3's per-head
# RMSNorm of queries and keys (DeepSpec's DSpark targets are Qwen3) and Mistral's (without a window).
_LEAN_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
_lean_support: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def supports_lean_forward(model: PreTrainedModel) -> bool:
    """Whether `model` is a full-attention Llama/Qwen2 model whose modules can be run directly."""
    supported = _lean_support.get(model)
    if supported is None:
        config = model.config
        inner = getattr(model, "model", None)
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        supported = (
            config.model_type in _LEAN_MODEL_TYPES
            and config._attn_implementation == "sdpa"
            and all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm"))
            and all(hasattr(layer.mlp, name) for layer in inner.layers
                    for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            and isinstance(getattr(model, "lm_head", None), torch.nn.Linear)
            and not getattr(config, "use_sliding_window", False)
            and not (config.model_type == "mistral" and getattr(config, "sliding_window", None))
            and layer_types == {"full_attention"}
            # a soft-cap (Gemma 2) lives in the model's own forward: never bypass it
            and getattr(config, "final_logit_softcapping", None) is None
        )
        _lean_support[model] = supported
    return supported


def _lean_hidden(
    model: PreTrainedModel,
    # [rows, new_tokens]
    input_ids: torch.Tensor,
    cache: DynamicCache,
    # [rows, 1, new_tokens, cached + new_tokens] or None
    attention_mask: torch.Tensor | None,
    # [rows, new_tokens] or None
    position_ids: torch.Tensor | None,
    # [rows, new_tokens] which slots hold a real token (the rest pad a row to the widest); None: all
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder stack of a Llama-family model, called module by module; [rows, new, hidden].

    With a `token_mask` that has holes, the linear layers run on the real tokens only (`Packing`):
    a row padded to the widest costs its own tokens there, not the widest row's.
    """
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    new_tokens = input_ids.shape[1]
    past = cache.get_seq_length()
    if position_ids is None:
        position_ids = torch.arange(past, past + new_tokens, device=input_ids.device)[None]
    # a model that rounds its rows (an int8 target) attends query by query (kv/row_attention.py)
    spans = visible_keys(attention_mask, input_ids.shape[0], new_tokens, past) if is_row_exact(model) else None
    if attention_mask is None and new_tokens > 1:
        attention_mask = torch.full((new_tokens, past + new_tokens), torch.finfo(hidden.dtype).min,
                                    dtype=hidden.dtype, device=input_ids.device)
        attention_mask = attention_mask.triu_(past + 1)[None, None]
    position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
    tap = active_tap(model)  # a feature-conditioned drafter's layers (features.py), else None
    packing = Packing.of(token_mask)
    if tap is not None:
        tap.record(EMBEDDING_LAYER, hidden)
    for index, (layer, cache_layer) in enumerate(zip(inner.layers[: model.config.num_hidden_layers],
                                                     cache.layers)):
        if getattr(layer, "_compiled_call_impl", None) is not None:  # torch.compile'd (variants/transforms.py)
            hidden = layer(hidden, attention_mask=attention_mask, position_embeddings=position_embeddings,
                           position_ids=position_ids, cache=cache, use_cache=True)
        else:
            hidden = _lean_layer(layer, hidden, attention_mask, position_embeddings, cache_layer, packing, spans)
        if tap is not None:
            tap.record(index, hidden)
    return inner.norm(hidden)


class Packing:
    """The real tokens of a padded [rows, new] forward, for running linear layers on them alone.

    Rows of a ragged forward are padded to the widest (kv/ragged.py); on a CPU the linear layers
    (about half a step) cost per token, so a padded slot costs as much as a real one. Here they
    take the real tokens only, gathered into one [tokens, in] matrix, and scatter their output
    back (zeros in the padding, whose keys no real token attends to). DSpark's deployment
    flattens tokens across requests the same way.

    Not bit for bit the padded forward's values: MKL's GEMM on this CPU computes rows in blocks
    of four and the rows of a last, partial block by another path, so a row's low bits depend on
    where the row count puts it (measured: the first m rows of an M-row product equal an m-row
    product for m = 4, 8, 12, ... and differ for m = 1-3, 5-7). Packing moves rows between the
    two paths, so logits move by an ulp or so; greedy outputs and the sampling tests do not
    (tests/inference/engine/test_packed_forward.py). Hence opt-in (`RaggedCache(packed=True)`,
    the engine's `pack_linear`) until every product runs in whole blocks.
    """

    def __init__(self, index: torch.Tensor, slots: int) -> None:
        self.index = index  # [tokens] flat indices of the real tokens among rows * new slots
        self.slots = slots

    @classmethod
    def of(cls, token_mask: torch.Tensor | None) -> Packing | None:
        if token_mask is None or bool(token_mask.all()):
            return None
        return cls(token_mask.reshape(-1).nonzero()[:, 0], token_mask.numel())

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, new, d] -> [tokens, d]"""
        return x.reshape(self.slots, x.shape[-1]).index_select(0, self.index)

    def scatter(self, packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """[tokens, d] -> [rows, new, d] (zeros in the padding), `like`'s leading shape."""
        full = packed.new_zeros(self.slots, packed.shape[-1])
        full.index_copy_(0, self.index, packed)
        return full.view(*like.shape[:-1], packed.shape[-1])


def _lean_layer(layer: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], cache_layer,
                packing: Packing | None = None, spans: list[list[KeySpan]] | None = None) -> torch.Tensor:
    """One Llama/Qwen2 decoder layer, the same ops as its `forward` but attention with `enable_gqa`.

    transformers' SDPA path expands the cached keys and values to every query head (`repeat_kv`,
    a copy of the layer's whole cache) whenever a mask is given and more than one token is new:
    every verify of the batched engine. SDPA's own grouped-query attention gives the same values
    bit for bit without the copy (tests/inference/engine/test_modeling.py). With `spans` (a model
    marked row-exact, an int8 target) each query attends alone to its own keys (kv/row_attention.py).
    """
    attention = layer.self_attn
    kernels = linear_kernels().linear  # module(x), on oneDNN for large row counts where it is exact

    def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if packing is None:
            return kernels(module, x)
        return packing.scatter(kernels(module, packing.gather(x)), x)

    residual = hidden
    hidden = layer.input_layernorm(hidden)
    input_shape = hidden.shape[:-1]
    head_shape = (*input_shape, -1, attention.head_dim)
    query = linear(attention.q_proj, hidden).view(head_shape)
    key = linear(attention.k_proj, hidden).view(head_shape)
    if getattr(attention, "q_norm", None) is not None:  # Qwen3: RMSNorm per head, before the rotation
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = linear(attention.v_proj, hidden).view(head_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = _rotary_function(attention)(query, key, cos, sin)
    key, value = cache_layer.update(key, value)
    if spans is not None:  # query by query over its own keys (`visible_keys`)
        output = attention_by_row(query, key, value, spans, attention.scaling, attention.num_key_value_groups > 1)
    else:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=attention.scaling,
            enable_gqa=attention.num_key_value_groups > 1)
    output = output.transpose(1, 2).contiguous().reshape(*input_shape, -1).contiguous()
    hidden = residual + linear(attention.o_proj, output)
    residual = hidden
    hidden = layer.post_attention_layernorm(hidden)
    mlp = layer.mlp  # LlamaMLP / Qwen2MLP: down(act(gate(x)) * up(x))
    if packing is not None:  # the whole MLP on the real tokens, one gather and one scatter
        packed = packing.gather(hidden)
        return residual + packing.scatter(
            kernels(mlp.down_proj, mlp.act_fn(kernels(mlp.gate_proj, packed)) * kernels(mlp.up_proj, packed)), hidden)
    return residual + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, hidden)) * linear(mlp.up_proj, hidden))


def _rotary_function(attention: torch.nn.Module):
    """The `apply_rotary_pos_emb` of the attention module's own modeling file."""
    return sys.modules[type(attention).__module__].apply_rotary_pos_emb


def _lean_logits(
    model: PreTrainedModel,
    # [1, new_tokens]
    input_ids: torch.Tensor,
    cache: DynamicCache,
    keep: int,
    # [1, 1, new_tokens, cached + new_tokens] or None
    attention_mask: torch.Tensor | None,
    # [1, new_tokens] or None
    position_ids: torch.Tensor | None,
) -> torch.Tensor:
    """The last `keep` logits rows of one sequence; [keep, vocab]."""
    hidden = _lean_hidden(model, input_ids, cache, attention_mask, position_ids)
    return linear_kernels().linear(model.lm_head, hidden[:, -keep:])[0]


def forward_batch_logits(
    model: PreTrainedModel,
    # [rows, new_tokens]
    input_ids: torch.Tensor,
    cache: DynamicCache,
    # [rows, 1, new_tokens, cached + new_tokens] additive mask (0 = may attend); None: plain causal
    attention_mask: torch.Tensor | None,
    # [rows, new_tokens] each row's own positions
    position_ids: torch.Tensor,
    logits: str = "all",
    # [rows] the index of each row's last new token (logits="last")
    last_index: torch.Tensor | None = None,
    # [rows, new_tokens] which slots hold a real token; None: every slot (see `Packing`)
    token_mask: torch.Tensor | None = None,
    # [rows, cached] each cached slot's position (a sliding window's reference); None: 0..cached-1
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Run a batch of rows (ragged underneath: the mask says what each token sees); [rows, new, vocab].

    The cache grows by `new_tokens` slots in every row. Used by the batched engine.
    logits: "all"; "last" ([rows, 1, vocab], each row's at `last_index`: a prefill's last chunk);
    "none" fills the cache only (a prefill chunk), the vocabulary projection skipped.
    """
    if supports_lean_forward(model):
        hidden = _lean_hidden(model, input_ids, cache, attention_mask, position_ids, token_mask)
    else:
        hidden = None
        attention_mask = _window_masks(model, input_ids, cache, attention_mask, position_ids, key_positions)
        output = model(input_ids=input_ids, cache=cache, attention_mask=attention_mask,
                       position_ids=position_ids, use_cache=True, logits_to_keep=1 if logits == "none" else 0)
    if logits == "none":
        return None
    if logits == "last":
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        if hidden is None:  # the model computed every position's logits: pick the last
            return output.logits[rows, last_index][:, None]
        return linear_kernels().linear(model.lm_head, hidden[rows, last_index][:, None])
    if hidden is None:
        return output.logits
    packing = Packing.of(token_mask)
    if packing is not None:  # the padding's logits are never read: the real tokens' only
        return packing.scatter(linear_kernels().linear(model.lm_head, packing.gather(hidden)), hidden)
    return linear_kernels().linear(model.lm_head, hidden)


def forward_logits(
    model: PreTrainedModel,
    token_ids: list[int],
    cache: DynamicCache,
    keep: int,
    # [1, 1, new_tokens, cached + new_tokens] additive mask, or None for plain causal
    attention_mask: torch.Tensor | None = None,
    # [1, new_tokens], or None for positions that follow the cache
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run `token_ids` through the model on top of `cache`; return the last `keep` logits rows.

    Returns [keep, vocab_size]. The cache grows by len(token_ids).
    """
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=model.device)
    if supports_lean_forward(model):
        return _lean_logits(model, input_ids, cache, keep, attention_mask, position_ids)
    attention_mask = _window_masks(model, input_ids, cache, attention_mask, position_ids)
    output = model(input_ids=input_ids, cache=cache, attention_mask=attention_mask,
                   position_ids=position_ids, use_cache=True, logits_to_keep=keep)
    return output.logits[0]


def _window_masks(
    model: PreTrainedModel,
    # [rows, new_tokens]
    input_ids: torch.Tensor,
    cache: DynamicCache,
    # [rows, 1, new_tokens, cached + new_tokens] or None (plain causal)
    attention_mask: torch.Tensor | None,
    # [rows, new_tokens] or None (the positions that follow the cache)
    position_ids: torch.Tensor | None,
    # [rows, cached] or None (0..cached-1: a cache without holes)
    key_positions: torch.Tensor | None = None,
) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """The mask(s) a sliding-window model needs on the engine's full caches (kv/windows.py).

    Always explicit for such a model, as transformers' own sliding mask assumes its own cache
    layers; any other model's mask is returned as given.
    """
    layout = model_attention_layout(model)
    if not layout.sliding:
        return attention_mask
    past = cache.get_seq_length()
    device = input_ids.device
    if position_ids is None:
        position_ids = torch.arange(past, past + input_ids.shape[1], device=device)[None]
    if key_positions is None:
        key_positions = torch.arange(past, device=device)[None].expand(position_ids.shape[0], -1)
    return windowed_masks(layout, attention_mask, position_ids.to(device), key_positions, model.dtype)


def align_vocab(
    # [num_rows, draft_vocab]
    logits: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Make draft logits as wide as the target's: cut padding columns or pad with -inf."""
    current = logits.shape[-1]
    if current == width:
        return logits
    if current > width:
        return logits[..., :width]
    pad = logits.new_full((*logits.shape[:-1], width - current), float("-inf"))
    return torch.cat((logits, pad), dim=-1)


#: What a draft reads in place of an id it has no embedding for. Any valid id does: the draft's
#: guesses after it may be worse, but every drafted token is verified by the target.
SUBSTITUTE_TOKEN_ID = 0


def draftable_ids(token_ids: list[int], draft_vocab: int,
                  substitute: int = SUBSTITUTE_TOKEN_ID) -> list[int]:
    """The ids a draft with `draft_vocab` embedding rows can read: any other id becomes `substitute`.

    A target's vocabulary may be padded past the draft's (Qwen2.5-7B has 152,064 logits, 0.5B
    151,936), so the target can emit an id the draft's embedding lacks; feeding it raises
    IndexError. The substituted position is one the draft cannot predict from, which costs
    acceptance, never exactness.
    """
    if not token_ids or (max(token_ids) < draft_vocab and min(token_ids) >= 0):
        return token_ids
    return [token if 0 <= token < draft_vocab else substitute for token in token_ids]
