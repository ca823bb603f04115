"""Hugging Face's files, below the models that read and write them.

* :mod:`.gpt2`: GPT-2 folders (``config.json``, safetensors), the Hub's downloads, writing a
  folder whole, and the ``tokenizer.json`` of every family (:class:`.gpt2.Tokenizer`);
* :mod:`.llama`: Llama, Qwen2 and Qwen3 folders.

The entries are the models' own methods: ``CausalLM.from_pretrained(folder)``,
``LlamaCausalLM.from_pretrained(folder)`` and ``model.save_pretrained(folder)`` in either
tier, and :func:`npformer.interop.auto.from_pretrained` for a folder of any family.  The
functions here take the model's class (``load_folder(cls, folder)``) and import no model,
so that the models may call them.  tokenizers and huggingface_hub are imported only inside
the functions that need them.
"""
