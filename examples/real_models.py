"""Real architectures as users bring them, at tiny sizes, built locally (no downloads).

Hugging Face ``transformers`` models from configs (an encoder, an encoder-decoder, decoder
families with their default ``use_cache``, a vision transformer) and torchvision-style CNNs
written here (so the suite does not depend on torchvision): a ResNet with in-place residual adds
and ReLUs, a MobileNetV3 with depthwise convolutions, BatchNorm, squeeze-excitation and in-place
Hardswish, and a ConvNeXt with depthwise 7x7 convolutions and channels-last LayerNorm.

``build_real(name)`` returns ``(model, batches, loss_fn)``: the model in train mode with dropout
off (parity needs a deterministic step), global batches of ``(input, target)``.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["REAL_MODELS", "HF_MODELS", "MOE_MODELS", "CNN_MODELS", "build_real"]

VOCAB, SEQ, BATCH = 128, 16, 8
_HIDDEN = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=VOCAB,
               max_position_embeddings=64)


def _lm_loss(out, target):
    """Causal-LM loss on a Hugging Face output (its ``logits``) or a plain tensor."""
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, tuple) else out)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _cls_loss(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits, target)


def _decoder(config_name: str, model_name: str, **extra):
    import transformers

    cfg = getattr(transformers, config_name)(**{**_HIDDEN, **extra})
    return getattr(transformers, model_name)(cfg)


def _no_dropout(cfg_kwargs: dict) -> dict:
    return {**cfg_kwargs, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


class _Seq2Seq(nn.Module):
    """T5 for conditional generation called with (input_ids, decoder_input_ids): a plain
    module whose forward takes tensors, as a user's training loop would wrap it."""

    def __init__(self):
        super().__init__()
        import transformers

        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                    num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
        self.t5 = transformers.T5ForConditionalGeneration(cfg)

    def forward(self, input_ids, decoder_input_ids):
        return self.t5(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits


def _hf_model(name: str) -> nn.Module:
    import transformers

    if name == "bert":
        cfg = transformers.BertConfig(**_no_dropout(_HIDDEN), type_vocab_size=2)
        return transformers.BertForSequenceClassification(cfg)  # 2 labels by default
    if name == "t5":
        return _Seq2Seq()
    if name == "llama":
        return _decoder("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)
    if name == "mistral":
        return _decoder("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=8)
    if name == "qwen2":
        return _decoder("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2)
    if name == "gpt_neox":
        return _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_dropout=0.0, attention_dropout=0.0)
    if name == "opt":
        import transformers as t

        cfg = t.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, ffn_dim=128,
                          max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0)
        return t.OPTForCausalLM(cfg)
    if name == "phi":
        return _decoder("PhiConfig", "PhiForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    if name == "phi3":
        return _decoder("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
    if name == "gemma":
        return _decoder("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=16)
    if name == "mixtral":  # dropless top-2 of 4 experts, stacked weights, grouped matmuls (transformers 5)
        return _decoder("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    if name == "vit":
        cfg = transformers.ViTConfig(**_no_dropout({k: v for k, v in _HIDDEN.items()
                                                    if k not in ("vocab_size", "max_position_embeddings")}),
                                     image_size=16, patch_size=4, num_channels=3, num_labels=10)
        return transformers.ViTForImageClassification(cfg)
    raise ValueError(name)


# --- torchvision-style CNNs, written here -------------------------------------------------------

class _BasicBlock(nn.Module):
    """ResNet basic block as torchvision writes it: ``out += identity`` and in-place ReLUs."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNetTiny(nn.Module):
    """ResNet-18's layout (stem, four stages of two basic blocks, pooling, fc) at small widths."""

    def __init__(self, classes: int = 10, widths=(8, 16, 32, 64)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            layers.append(nn.Sequential(_BasicBlock(cin, w, 1 if i == 0 else 2), _BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class _SqueezeExcite(nn.Module):
    def __init__(self, c: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x):
        s = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return s * x


class _InvertedResidual(nn.Module):
    """MobileNetV3 block: expand 1x1, depthwise kxk, optional squeeze-excite, project 1x1."""

    def __init__(self, cin, exp, cout, k, se: bool, hs: bool, stride: int):
        super().__init__()
        act = partial(nn.Hardswish, inplace=True) if hs else partial(nn.ReLU, inplace=True)
        layers = []
        if exp != cin:
            layers += [nn.Conv2d(cin, exp, 1, bias=False), nn.BatchNorm2d(exp), act()]
        layers += [nn.Conv2d(exp, exp, k, stride, k // 2, groups=exp, bias=False), nn.BatchNorm2d(exp), act()]
        if se:
            layers.append(_SqueezeExcite(exp, max(8, exp // 4)))
        layers += [nn.Conv2d(exp, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.use_res = stride == 1 and cin == cout

    def forward(self, x):
        out = self.block(x)
        if self.use_res:
            out += x
        return out


class MobileNetV3Tiny(nn.Module):
    """MobileNetV3-small's layout (hardswish stem, inverted residuals with SE, classifier with
    Hardswish and Dropout) at small widths."""

    def __init__(self, classes: int = 10):
        super().__init__()
        cfgs = [(16, 16, 16, 3, True, False, 2), (16, 32, 24, 3, False, False, 1), (24, 48, 24, 3, False, False, 1),
                (24, 64, 40, 5, True, True, 2), (40, 96, 40, 5, True, True, 1)]
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(inplace=True),
                                      *[_InvertedResidual(*c) for c in cfgs],
                                      nn.Conv2d(40, 96, 1, bias=False), nn.BatchNorm2d(96), nn.Hardswish(inplace=True))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(96, 128), nn.Hardswish(inplace=True), nn.Dropout(0.0, inplace=True),
                                        nn.Linear(128, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class _LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW tensor (torchvision's ConvNeXt downsampling norm)."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _CNBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 0.1))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y)))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class ConvNeXtTiny(nn.Module):
    """ConvNeXt's layout (patchify stem, depthwise 7x7 blocks, LayerNorm downsampling) at small widths."""

    def __init__(self, classes: int = 10, dims=(16, 32)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 2, 2), _LayerNorm2d(dims[0], eps=1e-6))
        self.stage1 = nn.Sequential(_CNBlock(dims[0]), _CNBlock(dims[0]))
        self.down = nn.Sequential(_LayerNorm2d(dims[0], eps=1e-6), nn.Conv2d(dims[0], dims[1], 2, 2))
        self.stage2 = nn.Sequential(_CNBlock(dims[1]), _CNBlock(dims[1]))
        self.norm = nn.LayerNorm(dims[1], eps=1e-6)
        self.head = nn.Linear(dims[1], classes)

    def forward(self, x):
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean((-2, -1))))


_CNNS = {"resnet": ResNetTiny, "mobilenet_v3": MobileNetV3Tiny, "convnext": ConvNeXtTiny}
HF_MODELS = ("bert", "t5", "llama", "mistral", "qwen2", "gpt_neox", "opt", "phi", "phi3", "gemma", "vit")
MOE_MODELS = ("mixtral",)
CNN_MODELS = tuple(_CNNS)
REAL_MODELS = HF_MODELS + MOE_MODELS + CNN_MODELS


def build_real(name: str, seed: int = 0, steps: int = 4):
    """(model, batches, loss_fn) for a named real architecture; the same on every rank."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = lambda *shape: torch.randint(1, VOCAB, shape, generator=g)  # noqa: E731
    if name in _CNNS or name == "vit":
        model = _CNNS[name]() if name in _CNNS else _hf_model(name)
        batches = [(torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
                   for _ in range(steps)]
        return model.train(), batches, _cls_loss
    model = _hf_model(name).train()
    if name == "bert":
        return model, [(tokens(BATCH, SEQ), torch.randint(0, 2, (BATCH,), generator=g)) for _ in range(steps)], _cls_loss
    if name == "t5":
        return model, [((tokens(BATCH, SEQ), tokens(BATCH, SEQ)), tokens(BATCH, SEQ)) for _ in range(steps)], _lm_loss
    return model, [(tokens(BATCH, SEQ), tokens(BATCH, SEQ)) for _ in range(steps)], _lm_loss
