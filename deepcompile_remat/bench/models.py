"""GPT-style and other small models for benchmarks and tests (a zoo of common layers)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class LayerNormNet(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return self.fc(self.norm(x)).tanh()


class SoftmaxAttention(nn.Module):
    """Attention written out (matmul, scale, causal mask, softmax), not fused SDPA."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d=32, heads=4, dropout=0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SoftmaxAttention(d, heads)
        self.mlp = MLP(d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, layers=2, heads=4, max_t=16, dropout=0.0):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_t, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
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
