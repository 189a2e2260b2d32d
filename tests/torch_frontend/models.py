"""The models the frontend tests export (and the CLI test imports by name)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=20, hidden=64, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.dropout = nn.Dropout(0.1)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(self.dropout(self.act(self.fc1(x))))


class CausalSelfAttention(nn.Module):
    """GPT-2's attention, written out: a causal mask buffer, masked_fill, softmax."""

    def __init__(self, n_embd, n_head, block_size, use_sdpa=False):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.use_sdpa = n_head, n_embd, use_sdpa
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MaskedAttention(nn.Module):
    """SDPA with an attn_mask, as transformers passes one: "additive" (0 and the dtype's lowest
    value above the diagonal, built from the sequence length), "boolean" (a tril buffer sliced
    to T), "keep_all" (every key), "from_input" (an additive bias the input decides),
    "padding" (transformers' padding mask: the lowest value where a key is dropped, here the
    keys whose first feature is not positive) or "boolean_from_input" (that mask as a bool)."""

    def __init__(self, kind, dim=16, heads=2, max_tokens=16):
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("tril", torch.tril(torch.ones(max_tokens, max_tokens, dtype=torch.bool)))

    def forward(self, x):  # [B, T, C]
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        if self.kind == "additive":
            mask = torch.full((T, T), torch.finfo(x.dtype).min)
            rows = torch.arange(T)
            mask = mask.masked_fill(rows < (rows + 1).view(T, 1), 0.0)[None, None].expand(B, 1, T, T)
        elif self.kind == "boolean":
            mask = self.tril[:T, :T]
        elif self.kind == "keep_all":
            mask = torch.ones(T, T, dtype=torch.bool)
        elif self.kind == "from_input":
            mask = (x[:, None, None, :, 0] * 0.5).expand(B, 1, T, T)
        elif self.kind == "padding":
            dropped = (torch.relu(x[:, None, None, :, 0]) == 0).float()
            mask = (dropped * torch.finfo(x.dtype).min).expand(B, 1, T, T)
        else:
            mask = (torch.relu(x[:, None, None, :, 0]) != 0).expand(B, 1, T, T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.transpose(1, 2).reshape(B, T, C)


class MultiheadSelfAttention(nn.Module):
    """nn.MultiheadAttention as torchvision's ViT calls it (need_weights=False), batch first
    or sequence first; the output projection's result plus the input."""

    def __init__(self, batch_first, dim=16, heads=4):
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=batch_first)

    def forward(self, x):
        y, _ = self.attention(x, x, x, need_weights=False)
        return y + x


def rotate_half(x):  # LLaMA's: the two halves of each head swapped, the first negated
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class GroupedQueryAttention(nn.Module):
    """LLaMA's attention with fewer heads of keys and values than of queries
    (grouped-query attention), causal, rotary embeddings applied to q and k
    as LLaMA applies them (`rotary`): each head of keys and values repeated
    for its group of query heads as LLaMA's repeat_kv does (`repeat`:
    "expand"), with repeat_interleave, or by SDPA itself (`repeat`: "sdpa",
    PyTorch 2.5 and later: enable_gqa)."""

    def __init__(self, n_embd=64, n_head=8, n_kv_head=2, repeat="expand", rotary=True, max_tokens=32):
        super().__init__()
        self.n_head, self.n_kv_head, self.head = n_head, n_kv_head, n_embd // n_head
        self.q_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.k_proj = nn.Linear(n_embd, n_kv_head * self.head, bias=False)
        self.v_proj = nn.Linear(n_embd, n_kv_head * self.head, bias=False)
        self.o_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.repeat, self.rotary = repeat, rotary
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head, 2).float() / self.head))
        angles = torch.outer(torch.arange(max_tokens).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos_cached", angles.cos(), persistent=False)
        self.register_buffer("sin_cached", angles.sin(), persistent=False)

    def repeat_kv(self, x):  # [B, Hkv, T, D] -> [B, H, T, D], each head G times in a row
        groups = self.n_head // self.n_kv_head
        if self.repeat == "repeat_interleave":
            return x.repeat_interleave(groups, dim=1)
        B, H, T, D = x.shape
        return x[:, :, None, :, :].expand(B, H, groups, T, D).reshape(B, H * groups, T, D)

    def forward(self, x):  # [B, T, C]
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head).transpose(1, 2)
        if self.rotary:
            cos, sin = self.cos_cached[:T], self.sin_cached[:T]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.repeat == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = self.repeat_kv(k), self.repeat_kv(v)
            scores = (q @ k.transpose(2, 3)) / math.sqrt(self.head)
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = F.softmax(scores, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """A GPT-2 decoder block: pre-norm attention and MLP with residuals."""

    def __init__(self, n_embd=48, n_head=4, block_size=16, use_sdpa=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, use_sdpa)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class BlockClassifier(nn.Module):
    """The decoder block with a head, for training: logits per token."""

    def __init__(self, classes=7):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(48, classes)

    def forward(self, x):
        return self.head(self.block(x))


class CatSplit(nn.Module):
    """cat, split and chunk along the first, inner and last axes."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):  # [2, 6, 4, 8]
        a, b = x.split([2, 4], dim=1)  # [2, 2, 4, 8], [2, 4, 4, 8]
        c, d = torch.chunk(self.proj(x), 2, dim=2)  # [2, 6, 2, 8] each
        y = torch.cat([b, a.relu(), a], dim=1)  # [2, 8, 4, 8]
        z = torch.cat([d, c], dim=-2)  # [2, 6, 4, 8]
        # Indexed, not unpacked: torch 1.13's fx reads the unpacking from the
        # bytecode, which it misreads this far into a function on Python 3.11.
        halves = torch.cat([y, z], dim=1).chunk(2, dim=-1)  # [2, 14, 4, 4] each
        return torch.cat([halves[0] * 2.0, halves[1]], dim=0)  # [4, 14, 4, 4]


class Zoo(nn.Module):
    """The mappings the networks above leave out: Embedding, RMSNorm (where
    torch has it), SiLU, Sigmoid, Tanh, Hardswish, a BatchNorm no convolution
    absorbs, AvgPool2d, bmm, log_softmax, sub, div, mean, sum, a general
    permute; two inputs (integer ids, an image) and two outputs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.norm = nn.RMSNorm(16) if hasattr(nn, "RMSNorm") else nn.LayerNorm(16)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, ids, image):  # [2, 6] integers below 50, [2, 4, 8, 8]
        e = self.norm(self.embed(ids))  # [2, 6, 16]
        h = F.silu(e) * torch.sigmoid(e) - torch.tanh(e) / 2.0
        s = torch.bmm(h, h.transpose(1, 2))  # [2, 6, 6]
        p = F.log_softmax(s, dim=-1)
        c = self.bn(self.pool(F.hardswish(self.conv(image))))  # [2, 8, 4, 4]
        return p.mean(dim=-1), c.permute(0, 2, 3, 1).sum(dim=-1)  # [2, 6], [2, 4, 4]


class TwoActivations(nn.Module):
    """A submodule whose result is a tuple."""

    def forward(self, x):
        return torch.relu(x), torch.sigmoid(x)


class PlainCode(nn.Module):
    """What real models do that the fx tracer failed on (issue #43): a
    parameter read directly in forward (`F.linear(x, self.weight)`, `* self.scale`),
    `x.shape` unpacked and indexed, `x.dim()`, `x.size(0)`, a submodule's
    tuple result unpacked, and mean and sum with keepdim=True."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16) / 4)
        self.scale = nn.Parameter(torch.randn(8))
        self.pair = TwoActivations()

    def forward(self, x):  # [4, 16]
        rows, width = x.shape
        y = F.linear(x, self.weight) * self.scale * (x.shape[1] / width)
        a, b = self.pair(y)
        centred = a - a.mean(dim=-1, keepdim=True) + b.sum(-1, keepdim=True) / 8
        return centred + b * x.dim() + (y.size(0) - rows)


def plain_code():
    torch.manual_seed(0)
    return PlainCode()


class InPlace(nn.Module):
    """In-place updates whose results nobody names (fx dropped them as dead
    code, and the export was silently wrong): a tensor method, a function
    with inplace=True, a module built with inplace=True; sub_ and div_ map on
    torch.export as their pure ATen forms, which have handlers of their own."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):  # [4, 8]
        y = x * 2
        y.add_(1)
        z = y - 3
        F.relu(z, inplace=True)
        w = z * 1
        self.act(w)
        w.mul_(0.5)
        w.sub_(0.25)
        w.div_(2.0)
        return y + z + w


def in_place():
    return InPlace()


class HandWrittenNorm(nn.Module):
    """An RMSNorm as LLaMA-style code writes it (x.pow(2), torch.rsqrt), a
    norm over the last axis with torch.sqrt, and a cube: the pow, rsqrt and
    sqrt that blocked such models."""

    def __init__(self, dim=16):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = 1e-6

    def forward(self, x):  # [4, 16]
        variance = x.pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(variance + self.eps) * self.weight
        length = torch.sqrt((y * y).sum(-1, keepdim=True))
        return y / length + y ** 3


def hand_written_norm():
    torch.manual_seed(0)
    return HandWrittenNorm()


class TransformersStyle(nn.Module):
    """Code as transformers and torchvision write it: a Conv1D projection
    (torch.addmm(bias, x, weight), GPT-2's), with alpha, and MobileNetV3's
    hardsigmoid gate."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 24) * 0.2)
        self.bias = nn.Parameter(torch.randn(24))
        self.gate = nn.Hardsigmoid()

    def forward(self, x):  # [2, 3, 16]
        y = torch.addmm(self.bias, x.view(-1, 16), self.weight).view(2, 3, 24)
        z = torch.addmm(self.bias, x.view(-1, 16), self.weight, alpha=0.5).view(2, 3, 24)
        return y * self.gate(z * 4) + F.hardsigmoid(y)


class GlobalPool(nn.Module):
    """What stopped ShuffleNet, MNASNet (x.mean([2, 3])), EfficientNet and
    ConvNeXt (torchvision's StochasticDepth on a residual branch) on the fx
    path, and SqueezeNet and GoogLeNet (MaxPool2d with ceil_mode) on both."""

    def __init__(self):
        super().__init__()
        import torchvision.ops
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.drop = torchvision.ops.StochasticDepth(0.2, "row")
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)  # SqueezeNet's and GoogLeNet's

    def forward(self, x):  # [2, 4, 6, 6]
        y = self.pool(self.conv(x))  # [2, 8, 3, 3]; 2 x 2 without ceil_mode
        y = y + self.drop(torch.relu(y))
        return y.mean([2, 3]), y.sum((-1, -2, -3)), y.mean(dim=[-1, -2], keepdim=True)


def global_pool():
    torch.manual_seed(0)
    return GlobalPool().eval()


class Slicing(nn.Module):
    """Basic indexing as models write it: a range, a step, the last token
    (x[:, -1], BERT's pooler and GPT's head), ... and None, narrow, and a
    position table cut to the sequence (wpe(pos)[:T])."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.table = nn.Parameter(torch.randn(10, 6))

    def forward(self, x):  # [2, 5, 6]
        t = x.shape[1]
        h = x + self.table[:t]
        first = self.fc(h[:, 1:4])                         # [2, 3, 4]
        last = h[:, -1]                                    # [2, 6]
        every_other = h[..., ::2]                          # [2, 5, 3]
        column = h[:, None, 0, 2:5]                        # [2, 1, 3]
        return first.sum(-1), last * 2, every_other + column, torch.narrow(h, 2, 1, 3)


class Shuffles(nn.Module):
    """roll, repeat_interleave and F.pad as models use them (a Swin-style
    cyclic shift, grouped-query attention's repeated heads, a convolution's
    padding), around a trainable layer so that their gradients flow."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):  # [2, 4, 5, 6]
        h = self.fc(x)
        shifted = torch.roll(h, shifts=(-1, 2), dims=(1, 2))   # both axes, one negative
        flat = h.roll(7)                                       # no dims: the flattened tensor
        heads = h.repeat_interleave(2, dim=1)                  # [2, 8, 5, 6]
        padded = F.pad(h, (1, 2, 0, 1), value=0.5)             # [2, 4, 6, 9]
        cropped = F.pad(h, (-1, 1))                            # [2, 4, 5, 6]
        return shifted - flat, heads * 2, padded, cropped


class SlicedHead(nn.Module):
    """A trainable table cut to the sequence and the last token's head: the
    slice's gradient reaches the table (rows past T get none) and fc."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 6))
        self.fc = nn.Linear(6, 3)

    def forward(self, x):  # [4, 5, 6]
        h = torch.tanh(x + self.table[:x.shape[1]])
        return self.fc(h[:, -1]) + self.fc(h[:, 1:3][:, 0] * h[:, ::2][:, 1])


def sliced_head():
    torch.manual_seed(0)
    return SlicedHead()


class ShuffledHead(nn.Module):
    """A layer, then roll, repeat_interleave and F.pad, then a head: their
    gradients (slices and concatenations derived by cudagen) reach the layer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(2 * 7, 3)

    def forward(self, x):  # [4, 6]
        h = torch.roll(torch.tanh(self.fc(x)), shifts=-2, dims=1)
        h = F.pad(h.repeat_interleave(2, dim=1), (1, 1))      # [4, 14]
        return self.head(h)


def shuffled_head():
    torch.manual_seed(0)
    return ShuffledHead()


class Conversions(nn.Module):
    """dtype conversions and shape-only constructions as model code writes
    them: x.to(dtype), type_as, .half() back to float, zeros_like,
    new_ones, unflatten, and fill_ / zero_ on a scratch tensor."""

    def forward(self, x):  # [2, 12] f32
        h = x.half().to(torch.float32)                # a round trip through f16
        scratch = torch.empty_like(x)
        scratch.fill_(0.25)                           # read after the update: 0.25 everywhere
        offset = x.new_empty(2, 12).zero_()
        offset.add_(x)                                # updated after the fill: the fill stays zero
        y = h.type_as(x) + torch.zeros_like(x) + x.new_ones(2, 12) + scratch * 2 + offset
        return y.unflatten(1, (3, 4)).to(torch.float64), y.to(torch.bfloat16)


def conversions():
    return Conversions()


def slicing():
    torch.manual_seed(0)
    return Slicing()


def shuffles():
    torch.manual_seed(0)
    return Shuffles()


def transformers_style():
    torch.manual_seed(0)
    return TransformersStyle()


def zoo():
    torch.manual_seed(0)
    return randomized(Zoo())


class SmallResNet(nn.Module):
    """A ResNet in miniature, without BatchNorm: a stem with a bias, max
    pooling, a basic block whose second convolution is grouped and whose
    residual adds the block's input, a strided convolution, average and global
    pooling and a linear head. Its gradients run on cudagen's convolution and
    pooling gradient kernels. With `batchnorm`, BatchNorms after the stem and
    the block's first convolution, in eval mode: a training export keeps
    their statistics and trains their weights and biases, as PyTorch does."""

    def __init__(self, batchnorm=False):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=not batchnorm)  # a bias before a BatchNorm has no gradient in train mode
        self.stem_bn = nn.BatchNorm2d(8) if batchnorm else nn.Identity()
        self.bn1 = nn.BatchNorm2d(8) if batchnorm else nn.Identity()
        self.pool = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.smooth = nn.AvgPool2d(2, stride=1)
        self.head = nn.Linear(16, 5)

    def forward(self, x):  # [2, 3, 12, 12]
        x = self.pool(torch.relu(self.stem_bn(self.stem(x))))  # [2, 8, 6, 6]
        y = self.conv2(torch.relu(self.bn1(self.conv1(x))))
        x = torch.relu(x + self.depthwise(y))
        x = self.smooth(torch.relu(self.down(x)))  # [2, 16, 2, 2]
        x = F.adaptive_avg_pool2d(x, 1)
        return self.head(torch.flatten(x, 1))


def small_resnet(batchnorm=False):
    torch.manual_seed(0)
    return randomized(SmallResNet(batchnorm))


def mlp():
    torch.manual_seed(0)
    return MLP()


def block():
    torch.manual_seed(0)
    return Block()


def randomized(model):
    """Random BatchNorm statistics, so that folding them is tested on more than the identity."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def resnet18():
    import torchvision
    torch.manual_seed(0)
    return randomized(torchvision.models.resnet18())


def mobilenet_v2():
    import torchvision
    torch.manual_seed(0)
    return randomized(torchvision.models.mobilenet_v2())


def transformers_gpt2(vocab=64, positions=16, dim=32, layers=2, heads=2):
    """transformers' GPT2LMHeadModel from a small config (random weights, no download; its
    output projection tied to the token embedding), called on token ids: the logits."""
    import transformers
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=dim,
                                                                 n_layer=layers, n_head=heads))

    class Logits(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False, return_dict=False)[0]

    return Logits(model).eval()


class EinsumAndNorms(nn.Module):
    """Batched matrix products written with einsum (MaxViT's attention), one operand
    transposed each way, and, where torch.export shows them as ATen ops, Swin V2's cosine
    attention's F.normalize (a vector norm with a floor, clamp_min, expand_as)."""

    def __init__(self, normalize):
        super().__init__()
        self.normalize = normalize

    def forward(self, q, k):  # [B, H, T, D]
        if self.normalize:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        scores = torch.einsum("bhid,bhjd->bhij", q, k)
        return torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), k) + torch.einsum("bhji,bhjd->bhid", scores, k)


class ConstantConstructions(nn.Module):
    """What Swin's attention does on the way (torchvision 0.14 runs it on the fx path): a
    mask built by index assignment into x.new_zeros, a parameter's clone zeroed in its middle
    third through a view, F.dropout with p=0 (training left at its default, True), and
    F.normalize."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):  # [4, 6]
        mask = x.new_zeros(4, 6)
        count = 0.0
        for rows in ((0, 2), (2, 4)):
            mask[rows[0]:rows[1], 1:3] = count + 1.0
            count += 1.0
        bias = self.bias.clone()
        bias[2:4].zero_()
        y = F.dropout(x + mask + bias, p=0.0)
        return F.normalize(y, dim=-1)

