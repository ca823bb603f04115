"""Other libraries' models and files, in and out.

* :mod:`.pytorch`: npformer modules to and from ``torch.nn`` modules and state dicts;
* :mod:`.torch_reference`: the PyTorch models the parity tests and the benchmark compare with;
* :mod:`.auto`: a Hugging Face folder of any family (GPT-2, Llama, Qwen2, Qwen3) in either
  tier, picked by its config.json's ``model_type``;
* :mod:`.peft`: LoRA adapters as PEFT's folders.

Each family's own folders are read and written by :mod:`npformer.hf`, below the models,
through the models' ``from_pretrained`` and ``save_pretrained``.

torch and transformers are imported only inside the functions that need them.
"""
