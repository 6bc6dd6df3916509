"""Fine-tune a small Hugging Face causal LM with autopar, in the plain PyTorch training loop.

    autopar run examples/train_hf.py --nproc 4        # or: torchrun --nproc-per-node 4 examples/train_hf.py

The model is built from a local config (nothing is downloaded) and trained on random token
sequences padded to a fixed length (labels of padding are -100, as in every fine-tuning batch).
Each rank reads only its shard of the data through a ``DistributedSampler``
(``batch="local"``); the optimizer, gradient clipping, LR scheduler and checkpoint helpers are
torch's own, over ``pm.parameters()`` (DTensors over the plan's mesh).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import autopar

GLOBAL_BATCH, SEQ, VOCAB = 8, 32, 256


def build_model() -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def padded_dataset(samples: int, seed: int = 0) -> TensorDataset:
    """Token sequences of random lengths, padded to SEQ: input ids, attention mask, labels (-100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (samples, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (samples,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # pad token 0
    labels = ids.masked_fill(mask == 0, -100)
    return TensorDataset(ids, mask, labels)


def main(steps: int) -> None:
    torch.manual_seed(0)
    model = build_model()
    data = padded_dataset(GLOBAL_BATCH * steps)
    ids, mask, labels = data[:GLOBAL_BATCH]
    # local batches need the global batch's shapes up front: how it is split is the plan's decision
    pm = autopar.compile(model, autopar.Cluster.local(), (ids, mask), batch="local")
    sampler = DistributedSampler(data, num_replicas=pm.data_parallel_size, rank=pm.data_parallel_rank, shuffle=False)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // pm.data_parallel_size, sampler=sampler)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    rank = dist.get_rank()
    if rank == 0:
        print(pm.plan.summary())
    for step, (ids, mask, labels) in enumerate(loader):
        logits = pm(input_ids=ids, attention_mask=mask).logits  # this rank's rows, whole over the vocabulary
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's shard), grad norm {norm.full_tensor().item():.4f}")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(pm, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        print(f"trained {steps} steps; full state dict: {len(full)} tensors, keys as model.state_dict() "
              f"(e.g. {next(iter(full))!r})")
    pm.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    main(parser.parse_args().steps)
