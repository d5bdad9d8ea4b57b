"""The models the harness measures and the tests train: one module for both.

Built-in (plain torch): GPT and a zoo of common layers (MLP, LayerNorm, attention written out,
Conv+BatchNorm), small by default.

transformers (random weights from a config, never a download): the real client code.

    model = build_hf("llama", layers=2, hidden=64)        # a preset
    model = build_hf("path/to/config.json")               # the user's own architecture

Presets (HF_PRESETS): "llama" (LlamaForCausalLM), "qwen2" (Qwen2ForCausalLM, biased qkv) and
"gpt2" (GPT2LMHeadModel: tied embeddings, learned positions, dropout 0.1 by default). Sizes are
keyword overrides of the preset's small defaults; a config.json is used as it is. transformers
is imported only when an HF model is asked for.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Linear -> GELU -> Linear, 4x wide."""

    def __init__(self, d=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        """fc2(gelu(fc1(x)))."""
        return self.fc2(F.gelu(self.fc1(x)))


class LayerNormNet(nn.Module):
    """LayerNorm -> Linear -> tanh."""

    def __init__(self, d=32):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        """tanh(fc(norm(x)))."""
        return self.fc(self.norm(x)).tanh()


class SoftmaxAttention(nn.Module):
    """Attention written out (matmul, scale, causal mask, softmax), not fused SDPA."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        """Causal multi-head self-attention over x of shape (batch, time, d); same shape out."""
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    """A pre-norm transformer block: attention and MLP, each around a residual."""

    def __init__(self, d=32, heads=4, dropout=0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SoftmaxAttention(d, heads)
        self.mlp = MLP(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        """x plus attention of ln1(x), then plus the MLP of ln2 of that."""
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """The built-in GPT: token and position embeddings, `layers` Blocks (in .blocks), a final
    LayerNorm and an untied head; forward(idx) returns logits."""

    def __init__(self, vocab=64, d=32, layers=2, heads=4, max_t=16, dropout=0.0):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_t, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        """Logits (batch, time, vocab) for token ids `idx` of shape (batch, time)."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class ConvBN(nn.Module):
    """Conv2d -> BatchNorm2d -> ReLU -> mean pool -> Linear (buffers, not only parameters)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        """Logits (batch, 4) for images x of shape (batch, 3, H, W)."""
        return self.fc(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


def zoo():
    """name -> (model factory, input factory, loss)"""
    def regress(out):
        return out.float().pow(2).mean()

    def tokens():
        return torch.randint(0, 64, (2, 16))

    return {
        "mlp": (lambda: MLP(), lambda: torch.randn(4, 32), regress),
        "layernorm": (lambda: LayerNormNet(), lambda: torch.randn(4, 8, 32), regress),
        "attention": (lambda: SoftmaxAttention(), lambda: torch.randn(2, 8, 32), regress),
        "gpt": (lambda: GPT(), tokens, lambda out: out.float().logsumexp(-1).mean()),
        "conv_bn": (lambda: ConvBN(), lambda: torch.randn(2, 3, 8, 8), regress),
    }


# --- transformers models ----------------------------------------------------------------------

HF_PRESETS = ("llama", "qwen2", "gpt2")


def _hf_preset_config(preset: str, *, vocab: int, hidden: int, layers: int, heads: int,
                      kv_heads: int, seq: int, dropout: float | None):
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
    raise ValueError(f"unknown transformers preset {preset!r}; presets: {list(HF_PRESETS)}, or "
                     "the path of a config.json")


def hf_config(spec: str, *, vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4,
              kv_heads: int = 2, seq: int = 64, dropout: float | None = None):
    """The transformers config a spec names: a preset with these sizes, or a config.json."""
    import transformers

    transformers.logging.set_verbosity_error()  # a small vocab's "bos_token_id ..." chatter
    if spec in HF_PRESETS:
        return _hf_preset_config(spec, vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                                 kv_heads=kv_heads, seq=seq, dropout=dropout)
    if not os.path.isfile(spec):
        raise ValueError(f"{spec!r} is neither a transformers preset ({list(HF_PRESETS)}) nor a "
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


def is_hf_config_path(spec: str) -> bool:
    """Whether a --model value names a config.json (anything but "gpt" and the presets)."""
    return spec != "gpt" and spec not in HF_PRESETS


def hf_sizes(config) -> dict:
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


def build_hf(spec: str, **sizes):
    """A causal-LM model with random weights, in train mode."""
    import transformers

    transformers.logging.set_verbosity_error()  # no "use_cache is incompatible" chatter
    model = transformers.AutoModelForCausalLM.from_config(hf_config(spec, **sizes))
    # Training reads no KV cache, but with use_cache on (HF's default) every forward fills a
    # DynamicCache with each layer's keys and values, alive until the output is dropped: 16 MB
    # at 4x512, seq 1024. Compiled per layer, dynamo's tracing state even kept the first
    # step's cache in a reference cycle past the step (at rest +16 MB until a gc ran).
    model.config.use_cache = False
    return model.train()


def enable_hf_checkpointing(model, use_reentrant: bool) -> None:
    """HF's own activation checkpointing, as Trainer turns it on: activation_checkpointing_enable
    (transformers >= 5.2x), else its older name gradient_checkpointing_enable."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def hf_checkpointing_on(model) -> bool:
    """Whether HF's activation checkpointing is on (either name of the property)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False
