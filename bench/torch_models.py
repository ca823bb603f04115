"""The PyTorch reference models of the benchmark: npformer's own
(:mod:`npformer.interop.torch_reference`, which the parity tests build too).

Each is a plain ``torch.nn.Module`` assembled from torch.nn layers, with the
attribute names :mod:`npformer.interop.pytorch` expects (tok_emb, pos_emb,
layers.<i> = ``nn.TransformerEncoderLayer(batch_first=True)``, norm, head /
lm_head; src_tok_emb, tgt_tok_emb, encoder.layers.<i>, decoder.layers.<i> =
``nn.TransformerDecoderLayer``, encoder.norm, decoder.norm, out_proj), built
from an npformer model configuration: the same dropout (none on the attention
probabilities, as in npformer; the embeddings' dropout after the positions), norm_first and
activation (npformer's "gelu_tanh" is torch's approximate="tanh"), torch's masks (True = ignore)
and pooling over valid positions.  Sinusoidal positions are npformer's table as
a non-persistent buffer (not in the state dict).  Weights move between the two
with ``npformer.interop.pytorch.load_torch_state_dict`` / ``to_torch_state_dict``.
"""
from __future__ import annotations

# The reference classes ship in the package (npformer/interop/torch_reference.py); bench and the
# parity tests use them from there.
from npformer.interop.torch_reference import torch_models


def torch_reference(cfg: dict):
    """The benchmark's PyTorch model of configuration ``cfg`` (float32)."""
    import torch

    from bench.configs import npformer_config

    return torch_models()[cfg["kind"]](npformer_config(cfg), torch.float32)


# --------------------------------------------------------------------------- the demos' update
def decays(model) -> dict:
    """{parameter name: whether weight decay touches it}, npformer's rule in PyTorch terms:
    matrices decay; biases, norm gains and embedding tables (a tied head's too) do not."""
    import torch

    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {name: p.ndim >= 2 and id(p) not in tables for name, p in model.named_parameters()}


def torch_optimizer_like(npformer_optimizer, model):
    """(optimizer, scheduler): ``torch.optim.AdamW`` or ``Adam`` with the hyperparameters
    of an npformer AdamW / Adam, weight decay on the parameters :func:`decays` names (two
    groups), and its learning-rate schedule as a ``LambdaLR`` (npformer's update t uses
    schedule(t), t from 1; LambdaLR's factor e, from 0, times a base rate of 1)."""
    import torch

    from npformer import optim

    o = npformer_optimizer
    kind = torch.optim.AdamW if isinstance(o, optim.AdamW) else torch.optim.Adam
    decay = decays(model)
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in named if decay[n]], "weight_decay": o.weight_decay},
              {"params": [named[n] for n in named if not decay[n]], "weight_decay": 0.0}]
    optimizer = kind(groups, lr=1.0, betas=(o.beta1, o.beta2), eps=o.eps)
    schedule = o.schedule if o.schedule is not None else (lambda t, lr=o.lr: lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: schedule(e + 1))


# --------------------------------------------------------------------------- nanoGPT's GPT
NANOGPT = "NPFORMER_NANOGPT"  # the environment variable naming nanoGPT's model.py folder


def nanogpt_folder(root):
    """The folder of nanoGPT's model.py: $NPFORMER_NANOGPT (a relative path is taken from
    ``root``); None where it is unset or holds no model.py (the benchmark then leaves
    nanoGPT out)."""
    import os
    from pathlib import Path

    named = os.environ.get(NANOGPT)
    if not named:
        return None
    folder = (Path(root) / named).resolve()
    return folder if (folder / "model.py").is_file() else None


def nanogpt_state_dict(reference: dict, num_layers: int) -> dict:
    """The reference LM's state dict (:func:`torch_models`' TorchLM, tied, pre-norm, the
    names torch_interop uses) under nanoGPT's names.  torch's fused in_proj (3D, D) is
    nanoGPT's c_attn (q, k, v stacked by rows, the same head split); the tied head is
    nanoGPT's lm_head = wte."""
    names = {"tok_emb.weight": "transformer.wte.weight",
             "pos_emb.weight": "transformer.wpe.weight",
             "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}
    per_layer = {"self_attn.in_proj_weight": "attn.c_attn.weight",
                 "self_attn.in_proj_bias": "attn.c_attn.bias",
                 "self_attn.out_proj.weight": "attn.c_proj.weight",
                 "self_attn.out_proj.bias": "attn.c_proj.bias",
                 "norm1.weight": "ln_1.weight", "norm1.bias": "ln_1.bias",
                 "norm2.weight": "ln_2.weight", "norm2.bias": "ln_2.bias",
                 "linear1.weight": "mlp.c_fc.weight", "linear1.bias": "mlp.c_fc.bias",
                 "linear2.weight": "mlp.c_proj.weight", "linear2.bias": "mlp.c_proj.bias"}
    for i in range(num_layers):
        names.update({f"layers.{i}.{ours}": f"transformer.h.{i}.{theirs}"
                      for ours, theirs in per_layer.items()})
    if set(reference) != set(names):
        raise ValueError(f"the reference LM's names do not map onto nanoGPT's: "
                         f"{sorted(set(reference) ^ set(names))}")
    state = {names[k]: v for k, v in reference.items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def nanogpt_model(config, folder):
    """nanoGPT's own ``GPT`` for an npformer CausalLMConfig: bias=True (npformer's
    Linear and LayerNorm layers have biases; nanoGPT's CPU baby-GPT run uses
    bias=False), exact GELU (nn.GELU), tied head, dropout as configured."""
    if not (config.norm_first and config.tie_weights and config.activation == "gelu"
            and config.positional == "learned" and config.d_ff == 4 * config.d_model):
        raise ValueError(f"nanoGPT's GPT is a pre-norm, tied, exact-GELU model with learned "
                         f"positions and a 4 D feed-forward; this configuration is not: "
                         f"{config}")
    import sys

    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    from model import GPT, GPTConfig  # nanoGPT's model.py

    return GPT(GPTConfig(block_size=config.block_size, vocab_size=config.vocab_size,
                         n_layer=config.num_layers, n_head=config.num_heads,
                         n_embd=config.d_model, dropout=config.dropout, bias=True))
