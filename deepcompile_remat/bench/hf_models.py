"""transformers models from configs, with random weights (never a download): the real client
code the tests and the measurements run on.

    model = hf_models.build("llama", layers=2, hidden=64)        # a preset
    model = hf_models.build("path/to/config.json")                 # the user's own architecture

Presets: "llama" (LlamaForCausalLM), "qwen2" (Qwen2ForCausalLM, biased qkv) and "gpt2"
(GPT2LMHeadModel: tied embeddings, learned positions, dropout 0.1 by default). Sizes are
keyword overrides of the preset's small defaults; a config.json is used as it is.
"""
from __future__ import annotations

import json
import os
from typing import Any

PRESETS = ("llama", "qwen2", "gpt2")


def _config(preset: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
            seq: int, dropout: float | None):
    import transformers

    if preset == "llama":
        return transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=seq, attention_dropout=dropout or 0.0)
    if preset == "qwen2":
        return transformers.Qwen2Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=seq, attention_dropout=dropout or 0.0)
    if preset == "gpt2":
        extra = {} if dropout is None else dict(resid_pdrop=dropout, embd_pdrop=dropout,
                                                attn_pdrop=dropout)
        return transformers.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers,
                                       n_head=heads, n_positions=seq, **extra)
    raise ValueError(f"unknown transformers preset {preset!r}; presets: {list(PRESETS)}, or "
                     "the path of a config.json")


def config_of(spec: str, *, vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, seq: int = 64, dropout: float | None = None):
    """The transformers config a spec names: a preset with these sizes, or a config.json."""
    import transformers

    transformers.logging.set_verbosity_error()  # a small vocab's "bos_token_id ..." chatter
    if spec in PRESETS:
        return _config(spec, vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                       kv_heads=kv_heads, seq=seq, dropout=dropout)
    if not os.path.isfile(spec):
        raise ValueError(f"{spec!r} is neither a transformers preset ({list(PRESETS)}) nor a "
                         "config.json file")
    with open(spec) as f:
        try:
            data: dict[str, Any] = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{spec}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{spec}: a transformers config.json must be an object with a "
                         "\"model_type\"")
    return transformers.AutoConfig.for_model(**data)


def is_config_path(spec: str) -> bool:
    """Whether a --model value names a config.json (anything but "gpt" and the presets)."""
    return spec != "gpt" and spec not in PRESETS


def sizes_of(config) -> dict:
    """A config's sizes under the model flags' names (layers, hidden, heads, vocab) and its
    longest sequence (max_seq; None where the architecture has no such limit). transformers'
    attribute maps give every architecture these names (GPT2's n_layer, n_embd, n_head, ...)."""
    sizes = {}
    for name, attr in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"),
                       ("heads", "num_attention_heads"), ("vocab", "vocab_size")):
        value = getattr(config, attr, None)
        if not isinstance(value, int):
            raise ValueError(f"{type(config).__name__} has no integer {attr}")
        sizes[name] = value
    sizes["max_seq"] = getattr(config, "max_position_embeddings", None)
    return sizes


def build(spec: str, **sizes):
    """A causal-LM model with random weights, in train mode."""
    import transformers

    transformers.logging.set_verbosity_error()  # no "use_cache is incompatible" chatter
    model = transformers.AutoModelForCausalLM.from_config(config_of(spec, **sizes))
    return model.train()


def vocab_size(model) -> int:
    return int(model.config.vocab_size)


def enable_checkpointing(model, use_reentrant: bool) -> None:
    """HF's own activation checkpointing, as Trainer turns it on: activation_checkpointing_enable
    (transformers >= 5.2x), else its older name gradient_checkpointing_enable."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_on(model) -> bool:
    """Whether HF's activation checkpointing is on (either name of the property)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
