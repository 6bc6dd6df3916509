"""What the test session's ``autopar.launch`` forkserver imports once, before it forks any rank
(``conftest.py`` starts it with this module preloaded).

The ranks of the real-model tests build Hugging Face models: importing ``transformers`` and the
model families' modules takes about 5 s of CPU per process, paid by every rank of every launch
when the server has not imported them (4 ranks on 2 cores: ~10 s of wall per launch). Imported
here, a forked rank finds them loaded. Only imports: no tensor op runs in the server (its
children must not inherit an initialised thread pool).
"""
from __future__ import annotations

import transformers

import autopar.testing.parity  # noqa: F401  (the workers' harness)
import examples.gpt  # noqa: F401
import examples.moe  # noqa: F401
import examples.real_models  # noqa: F401

# the configs and model classes examples/real_models.py builds (transformers imports each family
# lazily, at the first attribute access)
_FAMILIES = ("Bert", "T5", "Llama", "Mistral", "Qwen2", "GPTNeoX", "OPT", "Phi", "Phi3", "Gemma", "Mixtral", "GPT2",
             "ViT")
for _family in _FAMILIES:
    getattr(transformers, f"{_family}Config")
for _cls in ("BertForSequenceClassification", "T5ForConditionalGeneration", "LlamaForCausalLM", "MistralForCausalLM",
             "Qwen2ForCausalLM", "GPTNeoXForCausalLM", "OPTForCausalLM", "PhiForCausalLM", "Phi3ForCausalLM",
             "GemmaForCausalLM", "MixtralForCausalLM", "GPT2LMHeadModel", "ViTForImageClassification"):
    getattr(transformers, _cls)
