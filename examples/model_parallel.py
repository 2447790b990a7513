"""Keras 3's model parallelism on phalanx: a small transformer split by a LayoutMap, trained in a loop.

Run: phalanx launch --workers 4 examples/model_parallel.py [--steps N]
(4 workers: a 2 x 2 mesh, batch x model; 2 workers: the model axis only.)

The same names as ``keras.distribution``: a DeviceMesh of the workers, a LayoutMap whose keys
are regular expressions over ``model.named_parameters()`` names, and ModelParallelStrategy.
torch's tensor parallelism splits the layers the map names (attention and feed-forward as
torchtitan splits them); along a batch axis of more than one worker FSDP2 shards the rest.
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F

import phalanx
from phalanx.experimental import DeviceMesh, LayoutMap, ModelParallelStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

VOCAB, DIM, HEAD_DIM, SEQ, GLOBAL_BATCH = 64, 64, 16, 16, 16


class Block(nn.Module):
    """Attention (wq/wk/wv split by columns, wo by rows) and a gated MLP (w1/w3 by columns, w2 by rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w2, self.w3 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM), nn.Linear(DIM, 4 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attention_norm(x)
        # -1 heads: each worker computes the heads of its part of wq/wk/wv
        q, k, v = (w(h).view(b, s, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(attended)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h))


workers = phalanx.cluster.resolve_cluster().num_workers
mesh = DeviceMesh((workers // 2, 2), ("batch", "model"))  # model axis of 2; the rest splits the batch
layout_map = LayoutMap(mesh)
layout_map[r"blocks\.\d+\.w[qkv]\.weight"] = ("model", None)  # nn.Linear weight: out x in
layout_map[r"blocks\.\d+\.wo\.weight"] = (None, "model")
layout_map[r"blocks\.\d+\.w[13]\.weight"] = ("model", None)
layout_map[r"blocks\.\d+\.w[13]\.bias"] = ("model",)
layout_map[r"blocks\.\d+\.w2\.weight"] = (None, "model")
layout_map["output.weight"] = ("model", None)  # split by vocabulary, the logits gathered

strategy = ModelParallelStrategy(layout_map=layout_map, batch_dim_name="batch")
torch.manual_seed(0)
with strategy.scope():
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

# a learnable sequence: each token is the previous one plus one
starts = torch.randint(0, VOCAB, (args.steps, GLOBAL_BATCH, 1), generator=torch.Generator().manual_seed(1))
tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
dataset = [(t[:, :-1], t[:, 1:]) for t in tokens]


def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    per_example = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
    loss = phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss


for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(dataset)):
    loss = strategy.reduce("sum", strategy.run(train_step, args=(x, y)), axis=None)
    if strategy.is_chief and step % 5 == 0:
        print(f"step {step}: loss {loss.item():.3f}")

wq = model.blocks[0].wq.weight
print(f"worker {strategy.worker_rank}: wq {tuple(wq.shape)}, held here {tuple(wq.to_local().shape)}")
if strategy.is_chief:
    print(f"final loss {loss.item():.3f}")
strategy.close()
