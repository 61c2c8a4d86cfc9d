"""The tokenizer side, run in the server process: the tokenizer (GGUF or HF), chat templates, request
normalization and validation (generate_input.py) and the TokenizerManager that talks to the scheduler."""
