"""Other libraries' models and files, in and out.

* :mod:`.pytorch`: npformer modules to and from ``torch.nn`` modules and state dicts;
* :mod:`.torch_reference`: the PyTorch models the parity tests and the benchmark compare with;
* :mod:`.gpt2`: Hugging Face GPT-2 folders (``config.json``, safetensors, ``tokenizer.json``);
* :mod:`.hf_llama`: Hugging Face Llama, Qwen2 and Qwen3 folders (``config.json``, safetensors).

torch and transformers are imported only inside the functions that need them.
"""
